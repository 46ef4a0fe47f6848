"""The TPU ragged kernel's page DMAs (ragged_tpu.py): start / wait a group of copies, and the
double-buffered loop over KV chunks."""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl


def start_all(copies):
  for copy in copies:
    copy.start()


def wait_all(copies):
  for copy in copies:
    copy.wait()


def run_chunks(num_chunks, fetch, compute, carry):
  """A double-buffered loop over KV chunks: chunk c + 1's DMAs fly while chunk c is computed.

  fetch(chunk, slot) -> the chunk's copies; compute(chunk, slot, carry) -> carry.
  """

  @pl.when(num_chunks > 0)
  def _():
    start_all(fetch(0, 0))

  def body(chunk, carry):
    slot = lax.rem(chunk, 2)

    @pl.when(chunk + 1 < num_chunks)
    def _():
      start_all(fetch(chunk + 1, 1 - slot))

    wait_all(fetch(chunk, slot))
    return compute(chunk, slot, carry)

  return lax.fori_loop(0, num_chunks, body, carry)
