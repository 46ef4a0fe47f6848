"""Ablation of KV-cache layouts: capacity, fragmentation, decode speed, prefix hits, accuracy.

For each variant (layout x page size x KV dtype) on one model and one replayed mixed workload
(varied prompt and output lengths; most prompts share one of a few system prefixes):

  fit        concurrent sequences whose whole KV (prompt + output) fits in a fixed byte budget:
             the workload's sequences are allocated in order by the real page allocator (prefix
             sharing included) over the pool capacity.py's arithmetic gives for the budget. The
             contiguous layout is an allocator whose one page is a whole slot of max_len tokens.
  frag       allocated but unused token positions of the running sequences, over the engine steps
             of the replay (mean over steps; plotted over time).
  step ms    one decode step with every slot active, at equal batch and context.
  hit rate   prefix-cache hit rate of the replay (scheduler counters; 0 for contiguous: its slots
             share nothing).
  agree      greedy tokens of the replay equal, position by position, to the float32 token-major
             reference's (free-running: one early divergence changes the rest of its sequence).
  max err    max |logit| error of a teacher-forced forward against the float32 reference.

The host tier (EngineConfig.kv_offload_gib) is a dimension of its own, on a workload it is for:
a multi-turn chat (scripts/bench/offload.py's `Chat`, the `python -m scripts.bench offload`
workload) whose final prompts need 4x the device pool's pages, so a conversation's prefix is
evicted before its next turn. For a few variants, without the tier and with one that holds every
prefix:

  hit rate   prompt tokens found in the prefix cache, on the device / in host memory
  saved      prompt tokens the host tier's hits spared recomputing
  prefill    prefill tokens computed
  TTFT       mean and median time to first token (first token less arrival; a turn arrives when
             its conversation's last answer is back)
  same       greedy answers identical to the variant's without the tier

Writes results.md, fragmentation.png and summary.png into --out.
Usage: python scripts/ablate_cache_layout.py --out /tmp/ablation [--quick] [--model PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from jaxserve.batching.kv_pages import PageAllocator
from jaxserve.batching.plan import PrefillChunk, StepPlan
from jaxserve.batching.runner import Runner
from jaxserve.config import (
  AttentionBackend,
  EngineConfig,
  KVDtype,
  KVLayout,
  ModelConfig,
  SamplingParams,
  SchedulerConfig,
)
from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_spec import create_one_group
from jaxserve.loading import checkpoint
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.llama import Transformer
from jaxserve.planning import capacity

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # The root: scripts.bench.
from scripts.bench import offload  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
  layout: KVLayout
  page_size: int
  kv_dtype: KVDtype

  @property
  def name(self) -> str:
    short = {KVLayout.PAGED_TOKEN_MAJOR: "token-major", KVLayout.RAGGED: "ragged",
             KVLayout.CONTIGUOUS: "contiguous"}
    return f"{short[self.layout]}/{self.page_size} {self.kv_dtype.label}"


TM, F32 = KVLayout.PAGED_TOKEN_MAJOR, KVDtype.FLOAT32
FULL = ([Variant(TM, z, F32) for z in (16, 8, 32, 64, 128)]
        + [Variant(KVLayout.RAGGED, 16, F32), Variant(KVLayout.CONTIGUOUS, 16, F32)]
        + [Variant(TM, 16, d) for d in (KVDtype.BFLOAT16, KVDtype.INT8, KVDtype.FLOAT8_E4M3)])
QUICK = [Variant(TM, 16, F32), Variant(KVLayout.RAGGED, 16, F32),
         Variant(KVLayout.CONTIGUOUS, 16, F32), Variant(TM, 16, KVDtype.INT8)]
# The host tier's variants (a paged layout: the contiguous one has no prefix cache to offload),
# run on the bench's chat (--quick: its small one).
TIER_FULL = [Variant(TM, 16, F32), Variant(TM, 16, KVDtype.INT8)]
TIER_QUICK = [Variant(TM, 16, F32)]
TIERS = ("none", "host")


def tiny_like(vocab_size: int) -> ModelConfig:
  return ModelConfig(vocab_size=vocab_size, dim=64, num_layers=2, num_heads=6, num_kv_heads=2,
                     head_dim=16, hidden_dim=96, max_seq_len=512, name="tiny-random")


@dataclasses.dataclass(frozen=True)
class Settings:
  num_requests: int
  num_slots: int
  max_model_len: int
  prefill_bucket: int
  budget_bytes: int
  timed_steps: int


def make_workload(rng, n: int, vocab: int, max_len: int) -> list[tuple[list[int], int]]:
  """(prompt ids, output length) pairs: 3 system prefixes of 32..64 tokens, shared by ~2/3 of the
  prompts, then a private suffix of 8..96 tokens; outputs of 4..48 tokens."""
  prefixes = [list(rng.integers(100, vocab, rng.integers(32, 65))) for _ in range(3)]
  work = []
  for _ in range(n):
    prefix = prefixes[rng.integers(3)] if rng.random() < 0.67 else []
    prompt = prefix + list(rng.integers(100, vocab, rng.integers(8, 97)))
    out = int(rng.integers(4, 49))
    work.append(([int(t) for t in prompt][:max_len - out], out))
  return work


def sequences_that_fit(model_cfg, variant: Variant, work, s: Settings) -> int:
  """How many of the workload's sequences, admitted in order, fit whole in the byte budget."""
  contiguous = variant.layout is KVLayout.CONTIGUOUS
  page = s.max_model_len if contiguous else variant.page_size
  page_bytes = capacity.kv_bytes_per_conversation(model_cfg, page, page, variant.kv_dtype)
  pages = PageAllocator(1 + s.budget_bytes // page_bytes, page, not contiguous)
  fits = 0
  for prompt, out in work:
    seq = prompt + [0] * out  # The output's ids do not matter: only the prompt can be shared.
    if not pages.can_allocate(seq):
      break
    table, _ = pages.allocate(seq)
    pages.cache_pages(table, seq, 0, len(prompt) // page)
    fits += 1
  return fits


def engine_config(variant: Variant, s: Settings) -> EngineConfig:
  max_pages = -(-s.max_model_len // variant.page_size)
  return EngineConfig(num_slots=s.num_slots, page_size=variant.page_size,
                      num_pages=1 + s.num_slots * max_pages, max_model_len=s.max_model_len,
                      prefill_buckets=(s.prefill_bucket,), kv_layout=variant.layout,
                      kv_dtype=variant.kv_dtype, attention_backend=AttentionBackend.REFERENCE,
                      compilation_cache_dir=None)


def replay(model, tokenizer, variant: Variant, work, s: Settings):
  """Runs the workload through the real scheduler and engine: (outputs, unused fraction per
  step, hit rate, engine)."""
  engine = Engine(model, engine_config(variant, s))
  contiguous = variant.layout is KVLayout.CONTIGUOUS
  runner = Runner(engine, tokenizer, SchedulerConfig(max_num_batched_tokens=s.prefill_bucket,
                                                     enable_prefix_caching=not contiguous))
  reqs = [runner.new_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
          for p, n in work]
  for r in reqs:
    runner.submit(r)
  frag = []
  while runner.has_unfinished:
    runner.step()
    running = runner.scheduler.running
    used = sum(len(r.all_token_ids) for r in running)
    held = sum(s.max_model_len if contiguous else len(r.page_table) * variant.page_size
               for r in running)
    frag.append(1 - used / held if held else 0.0)
  pages = runner.scheduler.pages
  hit = pages.num_hit_tokens / max(1, pages.num_query_tokens)
  return [list(r.output_token_ids) for r in reqs], frag, hit, engine


def decode_ms(engine: Engine, s: Settings, context: int) -> float:
  """Median time of one decode step with every slot active at `context` tokens."""
  W = engine.config.max_pages_per_seq
  tables = (1 + np.arange(s.num_slots)[:, None] * W + np.arange(W)[None, :]).astype(np.int32)
  greedy = SamplingParams(temperature=0)
  for slot in range(s.num_slots):
    ids = list(range(100, 100 + context))
    chunk = PrefillChunk("t", slot, ids, 0, list(tables[slot]), True, greedy, 0, ids, ())
    engine.step(StepPlan(prefills=(chunk,)))
  width = -(-(context + s.timed_steps + 2) // engine.page_size)
  # Compiles this width.
  engine.step(StepPlan(decode_slots=tuple(range(s.num_slots)),
                       page_tables=tables[:, :width])).result()
  times = []
  for _ in range(s.timed_steps):
    t = time.perf_counter()
    engine.step(StepPlan(decode_slots=tuple(range(s.num_slots)),
                         page_tables=tables[:, :width])).result()
    times.append(time.perf_counter() - t)
  return 1e3 * float(np.median(times))


def chat_replay(model, tokenizer, variant: Variant, chat: offload.Chat) -> list[dict]:
  """The chat on `variant`, each tier on its own engine (warmed up: no compile in a TTFT): one
  row per tier."""
  chat = dataclasses.replace(chat, page_size=variant.page_size)
  messages = offload.chat_messages(tokenizer, chat)
  rows = []
  for tier in TIERS:
    config = offload.chat_config(chat, messages, model.cfg, tier, kv_layout=variant.layout,
                                 kv_dtype=variant.kv_dtype,
                                 attention_backend=AttentionBackend.REFERENCE,
                                 compilation_cache_dir=None)
    engine = Engine(model, config)
    engine.warmup()
    result = offload.run_chat(Runner(engine, tokenizer), messages, chat)
    rows.append(dict(variant=variant, tier=tier, **offload.chat_summary(result),
                     same=result["answers"] == rows[0]["answers"] if rows else True,
                     answers=result["answers"],
                     pool_ratio=offload.chat_pool_ratio(messages, chat)))
  return rows


def _forward(model, ids, layout, kv_dtype, page_size):
  n = ids.shape[0]
  pages = n // page_size
  cfg = EngineConfig(num_slots=1, page_size=page_size, num_pages=pages + 1, max_model_len=n,
                     prefill_buckets=(n,), kv_layout=layout, kv_dtype=kv_dtype)
  meta = AttentionMetadata.one_sequence(n, page_size)
  logits, _ = model(ids[None], create_one_group(model.cfg, cfg), meta, last_only=False)
  return logits[0]  # [T, V]


teacher_forced = nnx.jit(_forward, static_argnums=(2, 3, 4))


def logit_error(model, ids, variant: Variant, ref) -> float:
  got = np.asarray(teacher_forced(model, ids, variant.layout, variant.kv_dtype, variant.page_size))
  return float(np.abs(got - ref).max())


def agreement(outputs, ref_outputs) -> float:
  same = sum(a == b for o, r in zip(outputs, ref_outputs) for a, b in zip(o, r))
  return same / sum(len(r) for r in ref_outputs)


def run(args) -> tuple[list[dict], list[dict]]:
  """(the layout variants' rows, the host tier's rows)."""
  # Quick: one prefill bucket and one decode width per variant, so few compilations.
  s = (Settings(num_requests=8, num_slots=4, max_model_len=128, prefill_bucket=64,
                budget_bytes=2**19, timed_steps=5) if args.quick else
       Settings(num_requests=24, num_slots=8, max_model_len=512, prefill_bucket=128,
                budget_bytes=64 * 2**20, timed_steps=10))
  variants = QUICK if args.quick else FULL
  model, tokenizer = checkpoint.load_model(args.model)
  if args.quick and args.model is None:  # CI: a tiny random model, real tokenizer, fast compiles.
    model = Transformer(tiny_like(model.cfg.vocab_size), rngs=nnx.Rngs(0))
  work = make_workload(np.random.default_rng(0), s.num_requests, model.cfg.vocab_size,
                       s.max_model_len)
  # A longer stream from the same mix for the capacity count, so no budget holds all of it.
  fit_work = make_workload(np.random.default_rng(1), 500, model.cfg.vocab_size, s.max_model_len)
  probe_len = max(64, *(v.page_size for v in variants))  # Whole pages at every page size.
  probe = jnp.asarray((work[0][0] * 8)[:probe_len], jnp.int32)
  ref_logits = np.asarray(teacher_forced(model, probe, TM, F32, 16))
  rows, ref_outputs = [], None
  for variant in tqdm.tqdm(variants, desc="variants", unit="variant"):
    outputs, frag, hit, engine = replay(model, tokenizer, variant, work, s)
    ref_outputs = ref_outputs or outputs  # The first variant is the float32 reference.
    rows.append(dict(variant=variant, fit=sequences_that_fit(model.cfg, variant, fit_work, s),
                     frag=frag, hit=hit, step_ms=decode_ms(engine, s, context=64),
                     agree=agreement(outputs, ref_outputs),
                     err=logit_error(model, probe, variant, ref_logits),
                     kv_bytes=engine.cache.num_bytes))
  chat = offload.SMALL_CHAT if args.quick else offload.Chat()
  tier_rows = [row for variant in tqdm.tqdm(TIER_QUICK if args.quick else TIER_FULL,
                                            desc="host tier", unit="variant")
               for row in chat_replay(model, tokenizer, variant, chat)]
  write_report(pathlib.Path(args.out), rows, s, model.cfg, tier_rows, chat)
  return rows, tier_rows


def write_report(out: pathlib.Path, rows, s: Settings, model_cfg, tier_rows=(),
                 chat: offload.Chat | None = None) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out.mkdir(parents=True, exist_ok=True)
  lines = [f"# KV-cache layout ablation: {model_cfg.name}",
           f"{s.num_requests} requests, {s.num_slots} slots, max_len {s.max_model_len}, "
           f"fit budget {s.budget_bytes / 2**20:.2f} MiB, decode step at {s.num_slots} x 64 "
           "tokens.",
           "", "| variant | fit in budget | mean frag | decode step ms | prefix hit rate | "
           "greedy agree | max logit err | cache MiB |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['variant'].name} | {r['fit']} | {np.mean(r['frag']):.3f} | "
                 f"{r['step_ms']:.2f} | {r['hit']:.3f} | {r['agree']:.3f} | {r['err']:.4f} | "
                 f"{r['kv_bytes'] / 2**20:.1f} |")
  if tier_rows:
    ratio = tier_rows[0]["pool_ratio"]
    lines += ["", f"## Host tier: {chat.conversations} chats x {chat.turns} turns, "
              f"{chat.clients} clients, the final prompts' pages {ratio:.2f}x the device pool's",
              "", "| variant | tier | hit rate device / host | saved | prefill | TTFT mean s | "
              "TTFT median s | wall s | same |", "|---" * 9 + "|"]
    for r in tier_rows:
      lines.append(f"| {r['variant'].name} | {r['tier']} | {r['device_hit_rate']:.3f} / "
                   f"{r['host_hit_rate']:.3f} | {r['saved_tokens']} | {r['prefill_tokens']} | "
                   f"{r['ttft_mean_s']:.3f} | {r['ttft_median_s']:.3f} | {r['wall_s']:.1f} | "
                   f"{'yes' if r['same'] else 'NO'} |")
  (out / "results.md").write_text("\n".join(lines) + "\n")
  fig, ax = plt.subplots(figsize=(8, 4))
  for r in rows:
    ax.plot(r["frag"], label=r["variant"].name)
  ax.set(xlabel="engine step", ylabel="unused fraction of held KV", title="Internal fragmentation")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / "fragmentation.png", dpi=100)
  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  names = [r["variant"].name for r in rows]
  for ax, key, title in zip(axes, ("fit", "step_ms", "err"),
                            ("sequences in budget", "decode step (ms)", "max logit error")):
    ax.barh(names, [r[key] for r in rows])
    ax.set_title(title)
    ax.tick_params(labelsize=7)
  fig.tight_layout()
  fig.savefig(out / "summary.png", dpi=100)
  plt.close("all")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="ablation_out", help="folder for results.md and the plots")
  parser.add_argument("--quick", action="store_true",
                      help="few variants and requests (CI, < 2 min); without --model, a tiny "
                      "random model with the default model's tokenizer")
  parser.add_argument("--model", default=None,
                      help="model path or name (default: the default model)")
  args = parser.parse_args(argv)
  run(args)
  print((pathlib.Path(args.out) / "results.md").read_text())


if __name__ == "__main__":
  main()
