"""Prefix keys of the KV pages: a full page is keyed by SHA-256 of its parent page's key and its
token ids, so one key names the whole prefix up to that page (kv_pages.PageAllocator finds
cached pages by it). The hash is cryptographic because pages are shared across tenants: with
Python's hash() a crafted collision would let one prompt reuse another's KV (the class of
vLLM's CVE-2025-25183).

A request's cache salt (vLLM's `cache_salt`) is mixed into its first page's key: only requests
with the same salt share pages, whatever their tokens. So is its LoRA adapter (`lora`, the
adapter's LoRARequest.cache_key): KV computed under one adapter is never another's, nor the base
model's. A page that holds an image's tokens has the image's content hash in its key too (the
request's `extras`, one per page: images.page_extras), as vLLM's multimodal hashing does: two
prompts of the same tokens and different images never share that page, nor (the keys chain) any
page after it; the same image twice does. Imports no jax.
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import numpy as np

_ROOT_HASH = bytes(32)  # The parent key of a sequence's first page.


def page_hash(parent: bytes, token_ids: tuple[int, ...], images: Sequence[str] = ()) -> bytes:
  """SHA-256 of the parent's 32-byte key, then the ids as little-endian int32s, then (a page of
  image tokens) the images' content hashes."""
  ids = np.asarray(token_ids, "<i4").tobytes()
  extra = b"images\0" + "".join(images).encode() if images else b""
  return hashlib.sha256(parent + ids + extra).digest()


def page_extra(extras: Sequence[tuple[str, ...]], i: int) -> tuple[str, ...]:
  """Page i's image hashes (images.page_extras; () none)."""
  return extras[i] if i < len(extras) else ()


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
                lora: str | None = None, extras: Sequence[tuple[str, ...]] = ()
                ) -> Iterator[tuple[bytes, tuple[int, ...]]]:
  """(key, tokens) of each full page of `token_ids` but the one holding the last token, lazily.
  `extras`: each page's image hashes (images.page_extras)."""
  parent = root_key(cache_salt, lora)
  for i in range((len(token_ids) - 1) // page_size):
    tokens = tuple(token_ids[i * page_size:(i + 1) * page_size])
    parent = page_hash(parent, tokens, page_extra(extras, i))
    yield parent, tokens
