"""`python -m scripts.bench offload`: a multi-turn chat whose prefixes need 4x the device KV pool,
without and with the prefix cache's host tier, each in a fresh process; its workload (`Chat`,
`run_chat`) is scripts/ablate_cache_layout.py's too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time

from . import harness


@dataclasses.dataclass(frozen=True)
class Chat:
  """A multi-turn chat workload's shape, after vLLM's benchmarks/multi_turn scaled to a CPU: each
  conversation opens with a long message (notes pasted in to discuss), then short follow-ups;
  each turn's prompt is the conversation so far (its earlier prompts and answers, in the chat
  template) and the new message. `clients` users send at once, each the next ready turn, round
  robin over the conversations, as soon as an answer comes back: a conversation's prefix waits
  in the cache while the other conversations' turns pass through the pool."""

  conversations: int = 18  # 4x the pool and 4 clients: the running requests' pages fit in it.
  turns: int = 6
  clients: int = 4  # Requests in flight: also the engine's slots.
  opening_words: int = 60  # ~100 tokens with the system prompt and the template.
  follow_up_words: int = 10  # ~25 tokens with the template.
  answer_tokens: int = 12  # Every answer's length: greedy, end-of-sequence ignored.
  page_size: int = 16
  pool_ratio: float = 4.0  # The final prompts' pages over the device pool's usable pages.
  seed: int = 0


# A small chat that still runs every part (host saves and loads, and pool contention), compiling
# few programs (one prefill bucket): `offload --small`, the ablation's --quick, the tests.
SMALL_CHAT = Chat(conversations=8, turns=3, clients=2, opening_words=8, follow_up_words=4,
                  answer_tokens=4)


def chat_messages(tokenizer, chat: Chat) -> list[list[list[int]]]:
  """Per conversation, per turn, the ids the turn adds to the conversation: the chat template of
  the opening message (its system prompt included), then for each follow-up the end of the last
  answer, the message and the assistant's header. Ids, not re-encoded text, so every turn's
  prompt extends the last one's exactly, as a server's prefix cache needs."""
  from .peers import WORDS

  rng = random.Random(chat.seed)
  words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
  user = lambda text: {"role": "user", "content": text}
  mark = "ANSWERMARK"  # Where the last answer's ids go: the follow-up's ids are what comes after.
  out = []
  for c in range(chat.conversations):
    opening = f"My notes, part {c + 1}: {words(chat.opening_words)}. What stands out?"
    turns = [tokenizer.encode(tokenizer.apply_chat_template([user(opening)]), add_bos=False)]
    for _ in range(1, chat.turns):
      text = tokenizer.apply_chat_template([
          user("hi"), {"role": "assistant", "content": mark},
          user(f"Say more about {words(chat.follow_up_words)}?")])
      turns.append(tokenizer.encode(text.split(mark, 1)[1], add_bos=False))
    out.append(turns)
  return out


def chat_prompt_lens(messages, chat: Chat) -> list[int]:
  """Each conversation's last prompt's length: every message and every answer but the last."""
  return [sum(map(len, turns)) + (len(turns) - 1) * chat.answer_tokens for turns in messages]


def chat_pools(messages, chat: Chat) -> tuple[int, int, int]:
  """(num_pages, host pages, max_model_len) for the workload: a device pool (scratch page
  included) whose usable pages the final prompts need `pool_ratio` times over (never too small
  for the longest request), and a host tier that holds every conversation whole."""
  lens, page = chat_prompt_lens(messages, chat), chat.page_size
  longest = -(-(max(lens) + chat.answer_tokens) // page)
  usable = max(int(sum(-(-n // page) for n in lens) // chat.pool_ratio), longest)
  host = sum(-(-(n + chat.answer_tokens) // page) for n in lens)
  return 1 + usable, host, longest * page


def chat_pool_ratio(messages, chat: Chat) -> float:
  """The final prompts' pages over the device pool's usable pages (`chat_pools`')."""
  pages = sum(-(-n // chat.page_size) for n in chat_prompt_lens(messages, chat))
  return pages / (chat_pools(messages, chat)[0] - 1)


def chat_config(chat: Chat, messages, model_cfg, tier: str, **fields):
  """The EngineConfig the chat runs on: `chat.clients` slots, the pools `chat_pools` sizes
  (`tier` "host": with the host tier, else without), the default prefill buckets up to the
  first that holds the longest request; `fields` set the rest (the ablation's KV layout and
  dtype)."""
  from jaxserve.config import EngineConfig

  num_pages, host_pages, max_len = chat_pools(messages, chat)
  default = EngineConfig.prefill_buckets
  buckets = tuple(b for b in default if b < max_len) + tuple(b for b in default if b >= max_len)[:1]
  config = EngineConfig(num_slots=chat.clients, page_size=chat.page_size, num_pages=num_pages,
                        max_model_len=max_len, prefill_buckets=buckets, **fields)
  if tier == "host":
    config = dataclasses.replace(config, kv_offload_gib=host_gib(model_cfg, config, host_pages))
  return config


def host_gib(model_cfg, config, num_pages: int) -> float:
  """The kv_offload_gib that buys `num_pages` host pages for `config`'s cache."""
  import jax

  from jaxserve.engine import host_kv, kv_spec

  cache = jax.eval_shape(lambda: kv_spec.create(model_cfg, config))
  return (num_pages + 1) * host_kv.page_bytes(cache) / 2**30


def run_chat(runner, messages, chat: Chat) -> dict:
  """Runs the conversations through `runner`, `chat.clients` requests in flight: a turn is sent
  (its arrival stamped) once its conversation's last answer is back. Time to first token is each
  request's first token less its arrival. Returns the answers, each request's TTFT, the wall time
  and the scheduler's and page allocator's counters."""
  from jaxserve.config import SamplingParams

  sampling = SamplingParams(temperature=0, max_tokens=chat.answer_tokens, ignore_eos=True)
  pending = [(c, t) for t in range(len(messages[0])) for c in range(len(messages))]
  history = [[] for _ in messages]
  answers = [[] for _ in messages]
  in_flight, tokens, ttft = {}, {}, []
  start = time.perf_counter()
  while pending or in_flight:
    busy = {c for c, _ in in_flight.values()}
    for c, t in list(pending):  # The next turn of each idle conversation, in order.
      if len(in_flight) == chat.clients:
        break
      if c not in busy:
        busy.add(c)
        pending.remove((c, t))
        history[c] += messages[c][t]
        req = runner.new_request(history[c], sampling)
        runner.submit(req)
        in_flight[req.request_id], tokens[req.request_id] = (c, req), []
    for out in runner.step():
      tokens[out.request_id] += out.token_ids
      if out.finished:
        c, req = in_flight.pop(out.request_id)
        ttft.append(req.timings.time_to_first_token)
        answers[c].append(tokens.pop(out.request_id))
        history[c] += answers[c][-1]
        if len(ttft) % len(messages) == 0:
          print(f"{len(ttft)} of {len(pending) + len(in_flight) + len(ttft)} requests, "
                f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
  wall = time.perf_counter() - start
  s, pages = runner.scheduler, runner.scheduler.pages
  host_kv = getattr(runner.engine, "host_kv", None)
  return {"wall_s": wall, "requests": len(ttft), "ttft_s": ttft,
          "prefill_tokens": s.num_prefill_tokens, "cached_tokens": s.num_cached_tokens,
          "decode_tokens": s.num_decode_tokens, "preemptions": s.num_preemptions,
          "query_tokens": pages.num_query_tokens, "hit_tokens": pages.num_hit_tokens,
          "host_hit_tokens": pages.num_host_hit_tokens, "evictions": pages.num_evictions,
          "host_pages_used": pages.host.num_used if pages.host else 0,
          "pages_saved": host_kv.num_saved if host_kv else 0,
          "pages_loaded": host_kv.num_loaded if host_kv else 0, "answers": answers}


def chat_summary(r: dict) -> dict:
  """The figures the reports give for one run_chat result."""
  q = max(1, r["query_tokens"])
  return {"prefill_tokens": r["prefill_tokens"],
          "device_hit_rate": (r["hit_tokens"] - r["host_hit_tokens"]) / q,
          "host_hit_rate": r["host_hit_tokens"] / q, "saved_tokens": r["host_hit_tokens"],
          "ttft_mean_s": statistics.fmean(r["ttft_s"]),
          "ttft_median_s": statistics.median(r["ttft_s"]), "wall_s": r["wall_s"]}


OFFLOAD_TIERS = ("none", "host")


def run_offload(tier: str, chat: Chat, model: str | None) -> dict:
  """One tier's pass over the chat workload, in this process."""
  from jaxserve.batching.runner import Runner
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint

  transformer, tokenizer = checkpoint.load_model(model)
  messages = chat_messages(tokenizer, chat)
  config = chat_config(chat, messages, transformer.cfg, tier)
  engine = Engine(transformer, config, stop_ids=tokenizer.stop_ids)
  start = time.perf_counter()
  engine.warmup()  # Every program, the copies' too: no compile lands in a TTFT.
  warmup = time.perf_counter() - start
  result = run_chat(Runner(engine, tokenizer), messages, chat)
  lens = chat_prompt_lens(messages, chat)
  return {"tier": tier, "warmup_s": warmup, "num_pages": config.num_pages,
          "host_pages": 0 if engine.host_kv is None else engine.host_kv.num_slots,
          "final_prompt_pages": sum(-(-n // chat.page_size) for n in lens),
          "pool_ratio": chat_pool_ratio(messages, chat),
          "final_prompt_tokens": [min(lens), max(lens)], "load_avg": os.getloadavg()[0],
          **result}


def main_offload(argv=None) -> int:
  """The prefix cache's host tier (EngineConfig.kv_offload_gib) on a multi-turn chat whose
  prefixes need 4x the device pool: `none` (evicted pages are dropped) and `host` (saved to host
  memory, copied back on a hit), each in its own fresh process, on the default model:

    python -m scripts.bench offload
    python -m scripts.bench offload --small --model PATH   # SMALL_CHAT: proves it runs

  The workload (`Chat`): 18 conversations of 6 turns, a ~100-token opening (system prompt
  included) and ~25-token follow-ups in the chat template, 12-token greedy answers, so the last
  prompts are ~290 tokens; 4 clients (the engine's 4 slots) each send the next ready turn, round
  robin over the conversations, as an answer comes back. The device pool is a quarter of the
  final prompts' pages, so a conversation's prefix is evicted before its next turn; the host tier
  holds them all. The rest is the engine's defaults (pages of 16 tokens, prefill buckets 32 to
  512, a 512-token prefill budget a step), and both tiers warm up first, so no compile lands in
  a TTFT. Reported per tier:
  prefill tokens computed, prefix hit rate on the device and from host memory, prompt tokens the
  host tier saved recomputing, mean and median time to first token (first token less arrival),
  wall time; then none / host for prefill tokens, TTFT and wall time, and whether the greedy
  answers are identical. Only the ratios mean much on a loaded machine.
  """
  p = harness.parser("offload", main_offload.__doc__)
  for field in dataclasses.fields(Chat):
    p.add_argument(_flag(field.name), type=float if field.type == "float" else int,
                   default=field.default)
  p.add_argument("--small", action="store_true", help="SMALL_CHAT's shape for the flags not given")
  p.add_argument("--model", default=None, help="model path or name (default: the default model)")
  p.add_argument("--tiers", default=",".join(OFFLOAD_TIERS),
                 help="the tiers to run in order, each in a fresh process (the ratios need both)")
  p.add_argument("--child", choices=OFFLOAD_TIERS, default=None, help=argparse.SUPPRESS)
  argv = sys.argv[1:] if argv is None else argv
  if "--small" in argv:
    p.set_defaults(**dataclasses.asdict(SMALL_CHAT))
  args = p.parse_args(argv)
  chat = Chat(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Chat)})
  if args.child:
    print(json.dumps(run_offload(args.child, chat, args.model)), flush=True)
    return 0
  flags = chat_flags(chat) + (["--model", args.model] if args.model else [])
  runs = {}
  for tier in args.tiers.split(","):
    runs[tier] = harness.fresh("offload", ["--child", tier, *flags])
    print(json.dumps({k: v for k, v in runs[tier].items() if k not in ("answers", "ttft_s")}),
          file=sys.stderr, flush=True)
  print(offload_report(chat, runs))
  return 0


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def chat_flags(chat: Chat) -> list[str]:
  """The command's flags that give `chat`."""
  return [x for f in dataclasses.fields(Chat) for x in (_flag(f.name), str(getattr(chat, f.name)))]


def offload_report(chat: Chat, runs: dict[str, dict]) -> str:
  """The markdown table of the tiers' runs, the none / host ratios, and the answers' check."""
  first = next(iter(runs.values()))
  lines = [f"{chat.conversations} conversations x {chat.turns} turns, {chat.clients} clients, "
           f"{chat.answer_tokens}-token answers, final prompts "
           f"{first['final_prompt_tokens'][0]}-{first['final_prompt_tokens'][1]} tokens; their "
           f"pages / the device pool's usable pages: {first['final_prompt_pages']} / "
           f"{first['num_pages'] - 1} = {first['pool_ratio']:.2f}; host tier "
           f"{max(r['host_pages'] for r in runs.values())} pages; load average at each end: "
           + ", ".join(f"{t} {r['load_avg']:.1f}" for t, r in runs.items()),
           "", "| tier | prefill tokens | hit rate device / host | tokens saved | TTFT mean s | "
           "TTFT median s | wall s | preemptions | host pages used |", "|---|---|---|---|---|---|"
           "---|---|---|"]
  for tier, r in runs.items():
    m = chat_summary(r)
    lines.append(f"| {tier} | {m['prefill_tokens']} | {m['device_hit_rate']:.3f} / "
                 f"{m['host_hit_rate']:.3f} | {m['saved_tokens']} | {m['ttft_mean_s']:.3f} | "
                 f"{m['ttft_median_s']:.3f} | {m['wall_s']:.1f} | {r['preemptions']} | "
                 f"{r['host_pages_used']} |")
  if {"none", "host"} <= runs.keys():
    none, host = chat_summary(runs["none"]), chat_summary(runs["host"])
    same = runs["none"]["answers"] == runs["host"]["answers"]
    ratio = lambda k: f"{none[k] / host[k]:.2f}x"
    lines += ["", f"none / host: prefill tokens {ratio('prefill_tokens')}, mean TTFT "
              f"{ratio('ttft_mean_s')}, median TTFT {ratio('ttft_median_s')}, wall "
              f"{ratio('wall_s')}",
              f"greedy answers identical: {'yes' if same else 'NO'}"]
  return "\n".join(lines)


COMMANDS = {"offload": main_offload}
