"""The host side of one engine step: a `StepPlan` packed into the arrays of one compiled call.

One step runs every decode token and every prefill chunk of a plan in one program, on one flat
token axis:

  tokens    [0, Bd)        one decode row per decoding slot, then padding rows (slot Bs) up to
                           Bd, a decode batch bucket (0 when nothing decodes)
            [Bd, Bd + Tp)  the prefill chunks back to back, then padding, Tp a prefill bucket
                           (or, for verified chunks alone, a smaller verify bucket)
  sequences [0, Bd)        the decode rows, one each
            [Bd, Bd + Bp)  the prefill chunks, Bp = min(Tp, Bs, max_prefill_seqs)

A plan holds at most one chunk per request (the scheduler's plans fit one call), so a slot is
never two sequences. The jnp attention (model/attention.py) reads each prefill sequence's pages
once per query block of Tb of its own tokens: `block_rows` [nb, Tb] lists each block's packed
rows (T for none) and `block_seq` [nb] its sequence; every sequence starts a fresh block, so
nb = ceil(Tp / Tb) + Bp - 1 holds any packing (a verify bucket: Tb = k + 1, nb = Bp). A
verified chunk (speculative decoding, engine/verify.py) is packed like a prompt's chunk;
`verify_rows` names its positions, and the step puts the slot's own token and position (its
decode state) at the first.
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from jaxserve.batching.plan import PrefillChunk, StepKind, StepPlan
from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine.images import image_args, rope_args
from jaxserve.engine.pooling import pooling_args
from jaxserve.engine.sampling_state import SamplingRow, SamplingState
from jaxserve.engine.step_shapes import StepShape, StepShapes
from jaxserve.engine.verify import verify_args
from jaxserve.model.kv_cache import SCRATCH_PAGE


class StepArgs(NamedTuple):
  """The host arrays of one step (see engine/step.py)."""

  decode_slots: np.ndarray  # [Bd] int32: the decoding slots, then Bs as padding
  decode_tables: np.ndarray  # [Bd, W] int32
  prefill_tokens: np.ndarray  # [Tp] int32
  prefill_slots: np.ndarray  # [Bp] int32 (Bs: padding)
  prefill_starts: np.ndarray  # [Bp] int32: position of each sequence's first new token
  prefill_lens: np.ndarray  # [Bp] int32
  prefill_samples: np.ndarray  # [Bp] bool: the chunk ends its prompt, so a token is sampled
  prefill_tables: np.ndarray  # [Bp, W] int32
  block_rows: np.ndarray  # [nb, Tb] int32: packed token rows of each query block (T: none)
  block_seq: np.ndarray  # [nb] int32: the sequence of each block
  rows: SamplingState  # [Bp, ...] numpy: the sampling settings of the sequences that sample
  # [Tp] int32: the prompt token after each packed position, in a step that scores them (prompt
  # logprobs; prefill-only, at the widest table); None in every other step.
  prefill_targets: np.ndarray | None = None
  # [Bd + Bp, ceil(V/32)] int32: the tokens each sequence may sample (constrained decoding); all
  # ones for a free one. Always set (Packer.pack, Packer.template): a fixed input of every step.
  bitmask: np.ndarray | None = None
  # In a step that verifies proposals (speculative decoding), else None: [Bp, k + 1] int32, the
  # packed rows of each prefill sequence's last k + 1 positions (a verified chunk's, its last
  # row repeated when it is shorter; any rows for the others), and [Bp, k] int32 its proposals
  # (-1: none, which no token equals).
  verify_rows: np.ndarray | None = None
  verify_drafts: np.ndarray | None = None
  # With LoRA (EngineConfig.max_loras > 0), else None: [Bd + Tp] int32, each token's adapter
  # slot (0: the base model, and every padding token).
  lora_slots: np.ndarray | None = None
  # In a pooling step (EngineConfig.pooling), else None: [Bp, Tp] float32, each prefill
  # sequence's weight on each packed row (engine/pooling.py), and [C] int32 the reranker's
  # logit ids (PoolingConfig.logit_ids; [0] for an embedding model, whose rows are D wide).
  pool_weights: np.ndarray | None = None
  pool_ids: np.ndarray | None = None
  # A vision-language model's every step, else None: [Tp, D] float32, each prefill row's image
  # soft token (zeros for text), and [Tp] int32 the last position of its image (-1: text).
  image_rows: np.ndarray | None = None
  image_until: np.ndarray | None = None
  # An M-RoPE model's every step (Qwen2.5-VL), else None: [Bd + Tp, 3] int32, each row's three
  # rotary positions less its position (batching/mrope.py): a decode row's slot's delta.
  rope_shifts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Packer(StepShapes):
  """Packs plans for one engine's buckets (StepShapes: the shapes it packs them into)."""

  config: EngineConfig
  vocab_size: int
  slot_page_tables: np.ndarray | None  # The contiguous layout's own tables, else None.
  page_groups: int = 1  # 2 with window pages: each sequence's table, then its window table.
  image_dim: int = 0  # A vision-language model's D: every step takes image rows. 0: none.
  merge_size: int = 0  # An M-RoPE model's (Qwen2.5-VL's) patch merge: rope shifts. 0: none.

  def pack(self, plan: StepPlan, bitmask: np.ndarray | None = None, soft_tokens=None,
           rope_deltas: np.ndarray | None = None) -> tuple[StepArgs, list[int]]:
    """(args, rows): rows[i] is the sequence whose token is the plan's i-th sample (its decode
    slots in order, then its prompts that end in this step). bitmask [samples, ceil(V/32)]: row i
    the plan's i-th sample's allowed tokens (None: all free). soft_tokens(image) -> [Mi, D]: the
    encoder's (engine/images.py), for plans with images; rope_deltas its M-RoPE deltas."""
    c = self.config
    chunks, decodes = list(plan.prefills), list(plan.decode_slots)
    self._check(chunks, decodes)
    num_tokens = sum(len(ch.token_ids) for ch in chunks)
    buckets = c.prefill_buckets
    if chunks and all(ch.num_drafts for ch in chunks):
      buckets = self.verify_buckets() + buckets
    Tp = _bucket(buckets, num_tokens) if chunks else 0
    W = self.width
    if chunks:  # A step with prefill runs every decode row or none (`shapes()`).
      Bd = c.decode_batch_buckets[-1] if decodes else 0
    else:
      Bd = _bucket(c.decode_batch_buckets, len(decodes))
    rows = self._decode_rows(decodes, Bd)
    if c.dp > 1:
      samples = [int(s) for s in decodes]  # Row i is slot i.
    else:
      samples = list(range(len(decodes)))
    args = StepArgs(rows, self._tables(rows, plan.page_tables, W),
                    *self._prefill(chunks, Bd, Tp, W))
    samples += [Bd + j for j, ch in enumerate(chunks) if ch.is_last and not ch.num_drafts]
    Bp = args.prefill_slots.shape[0]
    args = args._replace(bitmask=self._bitmask(Bd + Bp, samples, bitmask))
    if plan.kind is StepKind.SCORING:
      args = args._replace(prefill_targets=_prompt_targets(chunks, Tp))
    if plan.kind is StepKind.VERIFYING:
      args = args._replace(**verify_args(chunks, Bd, Bp, c.speculative.num_speculative_tokens))
    if plan.kind is StepKind.POOLING:
      args = args._replace(**pooling_args(c.pooling, chunks, Bp, Tp))
    if c.max_loras:
      args = args._replace(lora_slots=_lora_slots(plan, rows, Tp))
    return args._replace(**image_args(chunks, Tp, self.image_dim, soft_tokens,
                                      both_ways=not self.merge_size),
                         **rope_args(chunks, rows, Tp, rope_deltas, self.merge_size)), samples

  def _bitmask(self, B: int, samples: list[int], bitmask: np.ndarray | None) -> np.ndarray:
    """[B, ceil(V/32)]: row samples[i] is bitmask's row i (pack's), every other row all ones."""
    mask = self._all_allowed(B)
    if bitmask is None:
      return mask
    if bitmask.shape != (len(samples), mask.shape[1]) or bitmask.dtype != np.int32:
      raise ValueError(f"bitmask must be int32 [{len(samples)}, {mask.shape[1]}] (one row per "
                       f"sample), got {bitmask.dtype} {list(bitmask.shape)}")
    mask = mask.copy()
    mask[samples] = bitmask
    return mask

  def _check(self, chunks: Sequence[PrefillChunk], decodes: Sequence[int]) -> None:
    """Raises ValueError for a plan that does not fit one call (the scheduler makes none)."""
    c = self.config
    if not chunks and not decodes:
      raise ValueError("an empty plan: nothing to run")
    if len(chunks) > c.max_prefill_seqs:
      raise ValueError(f"a step of {len(chunks)} prompts: at most {c.max_prefill_seqs} "
                       "(EngineConfig.max_prefill_seqs)")
    if len({ch.slot for ch in chunks}) != len(chunks):
      raise ValueError("a step holds two prefill chunks of one slot: one chunk per sequence")
    lens = [len(ch.token_ids) for ch in chunks]
    if any(n <= 0 for n in lens) or sum(lens) > c.prefill_buckets[-1]:
      raise ValueError(f"a step of prefill chunks of {lens} tokens: each at least 1, at most "
                       f"{c.prefill_buckets[-1]} in all (the largest prefill bucket)")
    scored = [ch.prompt_logprob_targets is not None for ch in chunks]
    if any(scored) and (decodes or not all(scored)):
      raise ValueError("a step that scores prompt positions holds only chunks that ask for it")
    pooled = [ch.pool_len > 0 for ch in chunks]
    if any(pooled) and (decodes or not all(pooled)):
      raise ValueError("a step that pools prompt positions holds only chunks that ask for it")

  def template(self, shape: StepShape, kind: StepKind = StepKind.PLAIN) -> StepArgs:
    """Arrays of `shape` for a `kind` step that run nothing but padding (warm-up, and
    multihost's receive buffers)."""
    Bd, Tp, W = shape
    rows = np.full(Bd, self.config.num_slots, np.int32)
    targets = np.zeros(Tp, np.int32) if kind is StepKind.SCORING else None
    args = StepArgs(rows, np.full((Bd, W), SCRATCH_PAGE, np.int32), *self._prefill([], Bd, Tp, W),
                    prefill_targets=targets)
    if kind is StepKind.VERIFYING:
      args = args._replace(**verify_args([], Bd, args.prefill_slots.shape[0],
                                          self.config.speculative.num_speculative_tokens))
    if kind is StepKind.POOLING:
      Bp = args.prefill_slots.shape[0]
      args = args._replace(**pooling_args(self.config.pooling, [], Bp, Tp))
    if self.config.max_loras:
      args = args._replace(lora_slots=np.zeros(Bd + Tp, np.int32))
    args = args._replace(**image_args([], Tp, self.image_dim, None),
                         **rope_args([], rows, Tp, None, self.merge_size))
    return args._replace(bitmask=self._all_allowed(Bd + args.prefill_slots.shape[0]))

  def _all_allowed(self, B: int) -> np.ndarray:
    """[B, ceil(V/32)] int32 of all ones (every token allowed), one kept per B: a step without
    constrained rows builds no mask."""
    cache = self.__dict__.setdefault("_ones", {})  # Frozen dataclass: a cache beside the fields.
    if B not in cache:
      cache[B] = np.full((B, -(-self.vocab_size // 32)), -1, np.int32)
      cache[B].flags.writeable = False
    return cache[B]

  def _decode_rows(self, decodes: Sequence[int], Bd: int) -> np.ndarray:
    Bs = self.config.num_slots
    if not Bd:
      return np.zeros(0, np.int32)
    if self.config.dp > 1:  # Slots are split over devices by position: row i must be slot i.
      live = set(decodes)
      return np.array([s if s in live else Bs for s in range(Bs)], np.int32)
    rows = np.full(Bd, Bs, np.int32)
    rows[:len(decodes)] = decodes
    return rows

  def _tables(self, rows: np.ndarray, page_tables: np.ndarray | None, W: int) -> np.ndarray:
    """[Bd, W]: each decode row's table; padding rows an all-scratch one."""
    Bs = self.config.num_slots
    tables = np.full((Bs + 1, W), SCRATCH_PAGE, np.int32)
    if self.slot_page_tables is not None:
      tables[:-1] = self.slot_page_tables[:, :W]
    elif page_tables is not None:
      w = min(W, page_tables.shape[1])
      tables[:page_tables.shape[0], :w] = page_tables[:, :w]
    return tables[rows]

  def _prefill(self, chunks: Sequence[PrefillChunk], Bd: int, Tp: int, W: int) -> tuple:
    """The prefill part's arrays; block rows and sequences are absolute (after the Bd decode
    rows), and empty block entries point past the token axis (Bd + Tp), where writes drop."""
    Bs = self.config.num_slots
    Bp = min(Tp, Bs, self.config.max_prefill_seqs)
    Tb, nb = self.query_blocks(Tp, Bp)
    tokens = np.zeros(Tp, np.int32)
    slots, starts = np.full(Bp, Bs, np.int32), np.zeros(Bp, np.int32)
    lens, samples = np.zeros(Bp, np.int32), np.zeros(Bp, bool)
    tables = np.full((Bp, W), SCRATCH_PAGE, np.int32)
    block_rows, block_seq = np.full((nb, Tb), Bd + Tp, np.int32), np.full(nb, Bd, np.int32)
    defaults = SamplingRow.from_params(SamplingParams(), 0, (), (), self.vocab_size)
    new_rows = [defaults] * Bp
    at, block = 0, 0
    for j, ch in enumerate(chunks):
      n = len(ch.token_ids)
      tokens[at:at + n] = ch.token_ids
      slots[j], starts[j], lens[j], samples[j] = ch.slot, ch.start_pos, n, ch.is_last
      table = self._table_row(ch)
      w = min(W, len(table))
      tables[j, :w] = table[:w]
      for lo in range(0, n, Tb):
        hi = min(n, lo + Tb)
        block_rows[block, :hi - lo] = Bd + at + np.arange(lo, hi)
        block_seq[block] = Bd + j
        block += 1
      if ch.is_last and not ch.num_drafts:  # A verified chunk's slot keeps its own (step.py).
        new_rows[j] = SamplingRow.from_params(ch.sampling, ch.seed, ch.prompt_token_ids,
                                              ch.output_token_ids, self.vocab_size)
      at += n
    rows = _stack_rows(new_rows, self.vocab_size)
    return (tokens, slots, starts, lens, samples, tables, block_rows, block_seq, rows)

  def _table_row(self, ch: PrefillChunk) -> np.ndarray:
    if self.slot_page_tables is not None:
      return self.slot_page_tables[ch.slot]
    if self.page_groups == 1:
      return np.asarray(ch.page_table, np.int32)
    W = self.config.max_pages_per_seq
    row = np.full(2 * W, SCRATCH_PAGE, np.int32)
    row[:len(ch.page_table)], row[W:W + len(ch.window_table)] = ch.page_table, ch.window_table
    return row


def _prompt_targets(chunks: Sequence[PrefillChunk], Tp: int) -> np.ndarray:
  """[Tp] int32: each chunk's prompt logprob targets at its tokens' places (a scoring step)."""
  targets = np.zeros(Tp, np.int32)
  at = 0
  for ch in chunks:
    targets[at:at + len(ch.prompt_logprob_targets)] = ch.prompt_logprob_targets
    at += len(ch.token_ids)
  return targets


def _lora_slots(plan: StepPlan, rows: np.ndarray, Tp: int) -> np.ndarray:
  """[Bd + Tp] int32: each decode row's adapter slot (rows: its decode slots, Bs padding),
  then each prefill token's; 0 (the base model) for padding."""
  of_slot = dict(zip(plan.decode_slots, plan.decode_loras))
  out = np.zeros(len(rows) + Tp, np.int32)
  out[:len(rows)] = [of_slot.get(s, 0) for s in rows.tolist()]
  at = len(rows)
  for ch in plan.prefills:
    out[at:at + len(ch.token_ids)] = ch.lora_slot
    at += len(ch.token_ids)
  return out


def _bucket(buckets: Sequence[int], n: int) -> int:
  return next(b for b in buckets if b >= n)


def _stack_rows(rows: Sequence[SamplingRow], vocab_size: int) -> SamplingState:
  if not rows:
    empty = SamplingRow.from_params(SamplingParams(), 0, (), (), vocab_size).values
    return SamplingState(**{k: np.zeros((0,) + np.shape(v), np.asarray(v).dtype)
                            for k, v in empty.items()})
  return SamplingState(**{k: np.stack([np.asarray(r.values[k]) for r in rows])
                          for k in rows[0].values})
