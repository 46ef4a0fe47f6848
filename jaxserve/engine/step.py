"""One engine step: every decode token and prefill chunk of a plan in one compiled program.

The host packs the plan (engine/step_args.py); this function reads each decoding slot's input
token and position from `DecodeState` on the device and writes the sampled ones back, so the
host can dispatch step n+1 before step n's tokens reach it. Logits and sampling run only at the
rows that sample: one per decode row and one per sequence whose prompt ends here.

Padding decode rows name slot Bs (out of range): they read slot Bs-1's state, write to the scratch
page, and every write back to the state drops them. Shape letters: jaxserve/model/__init__.py
(B: sequences of the step, Bd + Bp).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import LogprobsMode
from jaxserve.engine.draft import follow, propose
from jaxserve.engine.pooling import pool
from jaxserve.engine.prompt_logprobs import PromptLogprobs, score_prompt
from jaxserve.engine.sample import sample
from jaxserve.engine.sampling_state import SamplingState
from jaxserve.engine.verify import sample_verifying
from jaxserve.model.attention import AttentionMetadata, AttentionSpec
from jaxserve.model.kv_cache import SCRATCH_PAGE, KVCache
from jaxserve.model.lora import LoraRows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  tokens: jax.Array  # [Bs] int32: each slot's next input token (the last one sampled)
  positions: jax.Array  # [Bs] int32: where that token sits (= KV entries already written)
  sampling: SamplingState

  @classmethod
  def create(cls, num_slots: int, vocab_size: int) -> DecodeState:
    zeros = lambda: jnp.zeros(num_slots, jnp.int32)  # Distinct buffers: both are donated.
    return cls(zeros(), zeros(), SamplingState.create(num_slots, vocab_size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What every step returns beside the cache and the decode state; one kind of step
  (batching.plan.StepKind) fills one more field."""

  # [B, 2 + 2 * n] int32: every sequence's Sampled values in one array, one transfer.
  sampled: jax.Array
  prompt: PromptLogprobs | None = None  # [Tp]: a scoring step's prompt positions.
  verified: jax.Array | None = None  # verify.Verified.packed: a verifying step's runs.
  pooled: jax.Array | None = None  # [Bp, D] or [Bp, C] float32: a pooling step's (pooling.py).


def step(graphdef, params, cache: KVCache, state: DecodeState, args, stop_ids, *,
         attn: AttentionSpec, logprobs_mode: LogprobsMode, draft=None, lora: bool = False):
  """args: engine.step_args.StepArgs of device arrays (a scoring step's carry prefill_targets, a
  pooling step's pool_weights, a verifying step's verify_rows) -> (cache, state, StepOutput).
  draft: the draft model's graphdef (speculative method "draft", engine/draft.py); params is
  then (the target's, the draft's) and the cache holds the draft's groups too (KVCache.draft).
  lora (max_loras > 0): the model's params carry its adapters (_model). logprobs_mode: what
  sampled tokens' logprobs report."""
  Bs, Bd = state.tokens.shape[0], args.decode_slots.shape[0]
  slots = _cat(args.decode_slots, args.prefill_slots)  # [B]
  live = slots < Bs
  mine = jnp.minimum(slots, Bs - 1)  # [B]: safe to gather with.
  starts, q_lens, kv_lens, tables, tokens = _sequences(state, args, live, mine)
  samples = live & _cat(jnp.ones(Bd, bool), args.prefill_samples)  # [B]
  sampling = _take_new_settings(state.sampling, args, live, Bs)
  rows = jax.tree.map(lambda x: x[mine], sampling).plain_where_not(samples)
  if draft is not None:
    (params, draft_params), (cache, draft_cache) = params, (cache.target, cache.draft_cache)
    drafter = nnx.merge(draft, draft_params)
    if args.verify_rows is not None:  # The proposals, in place of the host's placeholders.
      at_prefill = lambda x: x[Bd:]
      tokens, args, draft_cache = propose(drafter, draft_cache, jax.tree.map(at_prefill, rows),
                                          tokens, starts[Bd:], live[Bd:], tables[Bd:], args,
                                          stop_ids, attn)
  meta = _metadata(args, live, starts, q_lens, kv_lens, tables, tokens, cache.page_size,
                   cache.num_groups)
  model, adapters = _model(graphdef, params, args, lora)
  logits, cache, extra, every = _forward(model, tokens, cache, meta, attn, args, adapters)
  if draft is not None:  # The draft sees every token the target sees.
    cache = cache.with_draft(follow(drafter, draft_cache, tokens, meta, attn))
  targets, verified = jnp.where(samples, slots, Bs), None
  if every is None:
    sampled = sample(logits, rows, kv_lens, stop_ids, args.bitmask, logprobs_mode=logprobs_mode)
    next_tokens, next_lens = sampled.tokens, kv_lens
  else:  # A verifying step: a verified chunk's sequence moves past its run.
    sampled, next_tokens, next_lens, verified, sampling = _verified(
        model, every, rows, meta, starts, kv_lens, live, args, stop_ids, sampling, targets,
        logprobs_mode)
  state = _write_back(state, sampling, next_tokens, targets, next_lens)
  return cache, state, StepOutput(pack_sampled(sampled), verified=verified, **extra)


def _model(graphdef, params, args, lora: bool) -> tuple:
  """(the model, LoraRows or None): with LoRA, params is (the model's, model.lora.LoraWeights)
  and args.lora_slots [T] each token's adapter slot."""
  if not lora:
    return nnx.merge(graphdef, params), None
  params, weights = params
  return nnx.merge(graphdef, params), LoraRows.of(weights, args.lora_slots)


def _sequences(state: DecodeState, args, live, mine):
  """-> (starts, q_lens, kv_lens [B], tables [B, Pg * W], tokens [T]): the step's sequences,
  decode rows (their input token and position read from the state) then prefill chunks.

  A verified chunk starts from its slot's state too: the token and position there are the
  outcome of its request's last step, which the host may not have yet, so a request can verify
  again in the step right after its last run (batching/speculative.py)."""
  Bs, Bd = state.tokens.shape[0], args.decode_slots.shape[0]
  read = lambda x, rows: _read(x, mine[rows], Bs)
  decode = slice(0, Bd)
  starts = _cat(jnp.where(live[:Bd], read(state.positions, decode), 0), args.prefill_starts)
  tokens = _cat(read(state.tokens, decode), args.prefill_tokens)  # [T]
  if args.verify_drafts is not None:
    fed, prefill = _fed(args, live), slice(Bd, None)  # [Bp]
    starts = _cat(starts[:Bd], jnp.where(fed, read(state.positions, prefill), starts[Bd:]))
    first = jnp.where(fed, args.verify_rows[:, 0], tokens.shape[0])  # Past T: dropped.
    tokens = tokens.at[first].set(read(state.tokens, prefill), mode="drop")
  q_lens = _cat(jnp.ones(Bd, jnp.int32), args.prefill_lens)  # [B]
  kv_lens = starts + q_lens  # [B]: where each sequence's sampled token will sit.
  tables = _cat(args.decode_tables, args.prefill_tables)  # [B, Pg * W]
  return starts, q_lens, kv_lens, tables, tokens


def _read(x, slots, Bs: int):
  """x [Bs] at `slots` [n], read through one-hot rows, not a gather: under dp the state is
  split by slot over `data`."""
  return jnp.sum(jnp.where(slots[:, None] == jnp.arange(Bs)[None, :], x[None, :], 0), 1)


def _fed(args, live):
  """[Bp]: the prefill part's verified chunks, which start from their slot's decode state."""
  return live[args.decode_slots.shape[0]:] & (args.verify_drafts[:, 0] >= 0)


def _metadata(args, live, starts, q_lens, kv_lens, tables, tokens, Z: int,
              Pg: int) -> AttentionMetadata:
  """Each token's sequence, position and cache entry (Z: page size; Pg: page groups, each with
  its own table). Padding tokens, and the tokens of padding rows, write to the scratch page."""
  cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
  T, B = tokens.shape[0], live.shape[0]
  tok = jnp.arange(T, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right", method="compare_all") - 1,
                 0, B - 1).astype(jnp.int32)
  real = (tok < cu_q_lens[-1]) & live[seq]  # [T]
  positions = jnp.where(real, starts[seq] + tok - cu_q_lens[seq], 0)  # [T]
  W = tables.shape[1] // Pg
  column = jnp.minimum(positions // Z, W - 1)
  page = jnp.stack([tables[seq, g * W + column] for g in range(Pg)])  # [Pg, T]
  page = jnp.where(real[None], page, SCRATCH_PAGE)
  rope = None  # M-RoPE's three positions (Qwen2.5-VL): the host's shifts added.
  if args.rope_shifts is not None:
    rope = positions[None, None, :] + args.rope_shifts.T[:, None, :]  # [3, 1, T]
  return AttentionMetadata(
      positions=positions[None], cache_index=page * Z + positions % Z, rope_positions=rope,
      page_tables=tables, kv_lens=jnp.where(live, kv_lens, jnp.minimum(kv_lens, 1)),
      cu_q_lens=cu_q_lens, sample_rows=jnp.maximum(cu_q_lens[1:] - 1, 0),
      block_rows=args.block_rows, block_seq=args.block_seq,
      num_decode_rows=args.decode_slots.shape[0])


def _images(meta: AttentionMetadata, args):
  """(meta with each image token's attention reaching its image's last position, and the
  model's `images`: rows [T, D], is_image [T]); (meta, None) for a model without images."""
  if args.image_until is None:
    return meta, None
  Bd = args.decode_slots.shape[0]
  until = _cat(jnp.full(Bd, -1, jnp.int32), args.image_until)  # [T]
  rows = _cat(jnp.zeros((Bd, args.image_rows.shape[1]), args.image_rows.dtype), args.image_rows)
  reach = jnp.maximum(meta.positions, until[None])  # [1, T]
  return dataclasses.replace(meta, attend_until=reach), (rows, until >= 0)


def _forward(model, tokens, cache, meta: AttentionMetadata, attn: AttentionSpec, args,
             adapters: LoraRows | None):
  """-> (logits [B, V] at the rows that sample, cache, the kind's StepOutput fields, and None);
  in a verifying step (None, cache, {}, the last layer's output [T, D] at every row)."""
  extra = {} if adapters is None else {"lora": adapters}  # Gemma 3 takes no adapters.
  meta, images = _images(meta, args)
  if images is not None:
    extra["images"] = images
  if args.prefill_targets is None and args.verify_rows is None and args.pool_weights is None:
    logits, cache = model(tokens[None], cache, meta, attn, **extra)  # [B, V]
    return logits, cache, {}, None
  # Every position's output [1, T, D], for the prompt's scores (in blocks), its pooled vector
  # or the verified runs.
  every, cache = model(tokens[None], cache, meta, attn, hidden=True, **extra)
  if args.verify_rows is not None:  # Its logits come with the verified rows' (verify.py).
    return None, cache, {}, every[0]
  logits, prefill = model.head(every[0, meta.sample_rows]), every[0, meta.num_decode_rows:]
  if args.pool_weights is not None:
    return logits, cache, {"pooled": pool(model, prefill, args.pool_weights, args.pool_ids)}, None
  return logits, cache, {"prompt": score_prompt(model.head, prefill, args.prefill_targets)}, None


def _verified(model, every, rows: SamplingState, meta: AttentionMetadata, starts, kv_lens, live,
              args, stop_ids, sampling: SamplingState, targets, logprobs_mode: LogprobsMode):
  """every [T, D] the last layer's output; rows [B, ...]; starts, kv_lens and live [B];
  targets [B] the slot each row samples for -> (Sampled [B], and tokens and kv_lens [B] with
  each verified chunk's next token and position after its accepted run, verify.Verified.packed,
  `sampling` with the accepted proposals counted in their slots' output counts). One head and
  sampler pass serves the sampled rows and the verified ones (verify.sample_verifying)."""
  Bd = args.decode_slots.shape[0]
  sampled, v = sample_verifying(model.head, every, rows, meta.positions[0], kv_lens,
                                meta.sample_rows, live, args, stop_ids, pack_sampled,
                                logprobs_mode)
  is_verified = _cat(jnp.zeros(Bd, bool), v.is_verified)  # [B]
  zeros = jnp.zeros(Bd, jnp.int32)
  tokens = jnp.where(is_verified, _cat(zeros, v.next_token), sampled.tokens)
  kv_lens = jnp.where(is_verified, _cat(zeros, starts[Bd:] + v.accepted + 1), kv_lens)
  counts = _cat(jnp.zeros((Bd, v.counts.shape[1]), jnp.int32), v.counts)
  row, hit = _writer(targets, sampling.output_counts.shape[0])
  return sampled, tokens, kv_lens, v.packed, dataclasses.replace(
      sampling, output_counts=sampling.output_counts + jnp.where(hit[:, None], counts[row], 0))


def _take_new_settings(sampling: SamplingState, args, live, Bs: int) -> SamplingState:
  """A prompt that ends here brings its request's sampling settings (a verified chunk does
  not: its slot's, on the device, count the tokens the host may not have yet)."""
  if not args.prefill_slots.shape[0]:
    return sampling
  Bd = args.decode_slots.shape[0]
  new = args.prefill_samples & live[Bd:]
  if args.verify_drafts is not None:  # A verified chunk's slot keeps its settings and counts.
    new = new & ~_fed(args, live)
  new_row, has_new = _writer(jnp.where(new, args.prefill_slots, Bs), Bs)
  return jax.tree.map(lambda x, r: _put(x, r[new_row], has_new), sampling, args.rows)


def _write_back(state: DecodeState, sampling: SamplingState, tokens, targets,
                kv_lens) -> DecodeState:
  """tokens [B] sampled; targets [B]: the slot each row samples for (Bs for none) -> the state
  with those slots' next input token, position and output counts."""
  Bs = state.tokens.shape[0]
  row, hit = _writer(targets, Bs)  # The row that samples each slot's token.
  token = tokens[row]  # [Bs]
  counts = sampling.output_counts + (hit[:, None] & (token[:, None] == jnp.arange(
      sampling.output_counts.shape[1])[None, :])).astype(jnp.int32)
  return DecodeState(
      tokens=_put(state.tokens, token, hit), positions=_put(state.positions, kv_lens[row], hit),
      sampling=dataclasses.replace(sampling, output_counts=counts))


def _cat(decode_part, prefill_part):
  """The decode rows, then the prefill part; either may be empty (a static shape)."""
  if not decode_part.shape[0]:
    return prefill_part
  if not prefill_part.shape[0]:
    return decode_part
  return jnp.concatenate([decode_part, prefill_part])


def _writer(targets, Bs: int):
  """targets [B] (a slot per row, Bs for none; no slot twice) -> (row [Bs], hit [Bs]): the row that
  writes each slot, and whether one does. Updates of the per-slot state are gathers from the
  rows plus a select, never a scatter: the state is split by slot over `data`, and a scatter's
  out-of-range 'drop' index is not dropped once XLA partitions it into per-device indices."""
  match = targets[:, None] == jnp.arange(Bs)[None, :]  # [B, Bs]
  return jnp.argmax(match, axis=0), jnp.any(match, axis=0)


def _put(x, new, hit):
  """x [Bs, ...] with row s replaced by new[s] where hit[s]."""
  return jnp.where(hit.reshape((-1,) + (1,) * (x.ndim - 1)), new.astype(x.dtype), x)


def pack_sampled(s) -> jax.Array:
  """Sampled [B, ...] -> [B, 2 + 2 * n] int32: tokens, logprob bits, top ids, top logprob bits."""
  bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.concatenate([s.tokens[:, None], bits(s.logprobs)[:, None], s.top_ids,
                          bits(s.top_logprobs)], axis=1)
