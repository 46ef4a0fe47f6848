"""Prefix keys of the KV pages: a full page is keyed by SHA-256 of its parent page's key and its
token ids, so one key names the whole prefix up to that page (kv_pages.PageAllocator finds
cached pages by it). The hash is cryptographic because pages are shared across tenants: with
Python's hash() a crafted collision would let one prompt reuse another's KV (the class of
vLLM's CVE-2025-25183).

A request's cache salt (vLLM's `cache_salt`) is mixed into its first page's key: only requests
with the same salt share pages, whatever their tokens. So is its LoRA adapter (`lora`, the
adapter's LoRARequest.cache_key): KV computed under one adapter is never another's, nor the base
model's. Imports no jax.
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import numpy as np

_ROOT_HASH = bytes(32)  # The parent key of a sequence's first page.


def page_hash(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
  """SHA-256 of the parent's 32-byte key, then the ids as little-endian int32s."""
  return hashlib.sha256(parent + np.asarray(token_ids, "<i4").tobytes()).digest()


def root_key(cache_salt: str | None, lora: str | None = None) -> bytes:
  """The parent key of a sequence's first page: zeros, or a salt's own; then an adapter's."""
  key = _ROOT_HASH
  if cache_salt:
    key = hashlib.sha256(b"cache_salt\0" + _utf8(cache_salt)).digest()
  if lora:
    key = hashlib.sha256(b"lora\0" + key + _utf8(lora)).digest()
  return key


def _utf8(s: str) -> bytes:
  return s.encode("utf-8", "surrogatepass")


def prefix_keys(token_ids: Sequence[int], page_size: int, cache_salt: str | None = None,
                lora: str | None = None) -> Iterator[tuple[bytes, tuple[int, ...]]]:
  """(key, tokens) of each full page of `token_ids` but the one holding the last token, lazily."""
  parent = root_key(cache_salt, lora)
  for i in range((len(token_ids) - 1) // page_size):
    tokens = tuple(token_ids[i * page_size:(i + 1) * page_size])
    parent = page_hash(parent, tokens)
    yield parent, tokens
