"""The shapes of an engine's steps: what sets each one (`StepShape`: decode rows, prefill tokens,
table width) and every one warm-up compiles, by kind (`StepShapes`: the Packer's, which packs
each plan into one of them). Only values that set shapes live here: the buckets of the config.
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxserve.config import EngineConfig


class StepShape(NamedTuple):
  """What sets every shape of one step: decode rows Bd, prefill tokens Tp, page-table width W."""

  decode_rows: int
  prefill_tokens: int
  width: int


class StepShapes:
  """Every step shape of one engine's buckets, by kind. The Packer's base: it reads the two
  fields the Packer holds, `config` and `page_groups` (2 with window pages)."""

  config: EngineConfig
  page_groups: int

  def query_blocks(self, Tp: int, Bp: int) -> tuple[int, int]:
    """(Tb, nb) of a step of Tp prefill tokens in Bp sequences: the jnp attention reads a
    sequence's pages once per block, so blocks of 64 rows (measured on CPU: a 512-token chunk
    at 5,632 cached positions took 0.62x the time of blocks of 16). A verify bucket's chunks, at
    most k + 1 tokens each, take a block of k + 1 rows apiece: one as wide as the bucket ran
    4 x 20 query rows for 4 runs of 5 at 16 slots (profile_decode.py --verify)."""
    if Tp in self.verify_buckets():
      return self.config.speculative.num_speculative_tokens + 1, Bp
    Tb = min(64, max(Tp, 1))
    return Tb, -(-Tp // Tb) + Bp - 1 if Tp else 0  # Each sequence but the first adds at most one.

  @property
  def width(self) -> int:
    """W: every step takes whole page tables. The kernels read only each sequence's own pages;
    the jnp attention picks, on the device, the narrowest width that holds the step's longest
    sequence (model/attention.py), so no table width is a separate program. With window pages
    a row holds both tables: 2 * max_pages_per_seq."""
    return self.page_groups * self.config.max_pages_per_seq

  def shapes(self) -> list[StepShape]:
    """Every shape warm-up compiles: decode-only steps at each decode bucket; prefill-only
    steps at each prefill bucket; mixed steps at each prefill bucket with every decode row (the
    largest decode bucket)."""
    c, W = self.config, self.width
    return [StepShape(d, 0, W) for d in c.decode_batch_buckets] + [
        StepShape(d, t, W) for d in (0, c.decode_batch_buckets[-1]) for t in c.prefill_buckets]

  def scored_shapes(self) -> list[StepShape]:
    """The scoring variant's shapes: prefill only."""
    return [StepShape(0, t, self.width) for t in self.config.prefill_buckets]

  def pooled_shapes(self) -> list[StepShape]:
    """The pooling variant's shapes (with EngineConfig.pooling): prefill only."""
    return self.scored_shapes() if self.config.pooling is not None else []

  def verified_shapes(self) -> list[StepShape]:
    """The verifying variant's shapes (with EngineConfig.speculative): a verified chunk sits in
    the prefill part, so those of the steps with prefill."""
    if self.config.speculative is None:
      return []
    c = self.config
    return [shape for shape in self.shapes() if shape.prefill_tokens] + [
        StepShape(d, t, self.width) for d in (0, c.decode_batch_buckets[-1])
        for t in self.verify_buckets()]

  def verify_buckets(self) -> tuple[int, ...]:
    """Prefill parts of only verified chunks, under the smallest prefill bucket: k + 1 tokens
    (one chunk) and (k + 1) * max_prefill_seqs (all a step holds). Where compute is dear (CPU),
    a verified run padded to a prompt's bucket would cost more than its accepted tokens save."""
    c = self.config
    if c.speculative is None:
      return ()
    K1 = c.speculative.num_speculative_tokens + 1
    sizes = {K1, K1 * min(c.max_prefill_seqs, c.num_slots)}
    return tuple(sorted(b for b in sizes if b < c.prefill_buckets[0]))
