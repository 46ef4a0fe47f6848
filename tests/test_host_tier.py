"""The prefix cache's host tier on the mock engine, whose copies move pages' token ids: every
token as the reference's, prefixes the device pool cannot hold served from host memory, and
nothing left held. On the real engine: every token's logprob within 1e-5 of a run without the
tier, and a run whose copy left one page's load out fails that comparison."""

import dataclasses

import jax
import msgpack
import numpy as np
import pytest

from jaxserve.batching import kv_events, kv_handoff
from jaxserve.batching.kv_events import EventMirror, KVEventLog
from jaxserve.batching.kv_pages import PageAllocator
from jaxserve.batching.runner import Runner
from jaxserve.config import AttentionBackend, EngineConfig, KVDtype, SamplingParams, SchedulerConfig
from jaxserve.config.engine import window_pages_per_seq
from jaxserve.engine.engine import Engine
from jaxserve.engine.resolve import engine_config_for
from jaxserve.loading import checkpoint, weights
from support import hf_tiny
from support.mock_engine import (
  MockEngine,
  MockTokenizer,
  assert_all_free,
  reference_generate,
  weighted_sum,
)
from support.tiny import TINY_ENGINE, count_compiles, host_tier_gib

PAGE, SLOTS = 4, 2


def chat(runner, num_chats=4, turns=4, new_tokens=6, max_tokens=5):
  """A multi-turn workload, round robin over `num_chats` conversations: each turn's prompt is
  the last turn's prompt and answer and a few new tokens. Checks each answer against the
  reference; returns the runner's scheduler."""
  history = [[(7 * c + j) % 90 + 1 for j in range(10)] for c in range(num_chats)]
  for turn in range(turns):
    for c in range(num_chats):
      prompt = history[c] + [(11 * c + 3 * turn + j) % 90 + 1 for j in range(new_tokens)]
      out = runner.generate([(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                     ignore_eos=True))])[0]
      assert list(out.token_ids) == reference_generate(prompt, max_tokens, weighted_sum)
      history[c] = prompt + list(out.token_ids)
  assert_all_free(runner.scheduler)
  return runner.scheduler


def runner(num_host_pages=0, window=None, num_pages=16):
  """14 usable pages of 4: one conversation's context (up to 54 tokens) at a time."""
  kw = {}
  if window:
    kw = dict(window=window, num_window_pages=1 + SLOTS * window_pages_per_seq(window, PAGE, 8))
  engine = MockEngine(num_slots=SLOTS, page_size=PAGE, num_pages=num_pages, max_model_len=64,
                      max_prefill_len=8, next_token=weighted_sum, num_host_pages=num_host_pages,
                      **kw)
  return Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=8))


@pytest.mark.parametrize("window", [None, 6], ids=["pages", "window-pages"])
def test_a_host_tier_serves_the_prefixes_the_device_pool_evicted(window):
  without, with_tier = chat(runner(window=window)), chat(runner(64, window=window))
  pages = with_tier.pages
  assert pages.host.num_used > 0 and pages.num_host_hit_tokens > 0
  assert with_tier.num_prefill_tokens * 3 <= without.num_prefill_tokens, (
      with_tier.num_prefill_tokens, without.num_prefill_tokens)
  assert without.pages.num_hit_tokens < pages.num_hit_tokens - pages.num_host_hit_tokens / 2


@pytest.mark.parametrize("window", [None, 6], ids=["pages", "window-pages"])
def test_reset_prefix_cache_forgets_device_and_host_pages_and_refuses_while_pages_are_held(
    window):
  r = runner(64, window=window)
  batches = []  # One a flush: a step's, then the reset's.
  r.scheduler.pages.events = KVEventLog(batches.append)
  prompt = [(5 * j) % 90 + 1 for j in range(30)]
  once = lambda: r.generate([(prompt, SamplingParams(temperature=0, max_tokens=4))])[0]
  first = once()
  chat(r, num_chats=3, turns=2)  # Some of prompt's pages are evicted to the host tier.
  groups = r.scheduler.pools.groups
  assert r.scheduler.pages.host.num_used > 0
  assert all(g.num_cached_pages for g in groups)
  held = r.new_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
  r.submit(held)
  r.step()  # Admitted: its pages are held.
  assert not r.reset_prefix_cache() and all(g.num_cached_pages for g in groups)
  r.abort(held.request_id)
  while r.has_unfinished:
    r.step()
  mirror = EventMirror(page_size=PAGE)
  for ops in batches:
    mirror.events(ops)
  num_batches = len(batches)
  assert r.reset_prefix_cache() and len(batches) == num_batches + 1
  for g in groups:
    assert g.num_cached_pages == 0 and g.num_free_pages == g.num_usable_pages
    assert g.host.num_used == 0
  removed = mirror.events(batches[-1])  # Every page the reset forgot.
  assert {e[0] for e in removed} == {"BlockRemoved"}
  assert {e[-1] for e in removed} == {"GPU", "CPU"}
  hits = r.scheduler.pages.num_hit_tokens
  assert list(once().token_ids) == list(first.token_ids)
  assert r.scheduler.pages.num_hit_tokens == hits  # Computed again: nothing was found.


def test_a_full_host_tier_evicts_its_least_recent_and_stays_exact():
  tiny = chat(runner(3))  # 3 host pages: most saves evict another.
  assert tiny.pages.host.num_evictions > 0 and tiny.pages.host.num_used == 3


def test_saves_and_host_evictions_are_events_of_medium_cpu():
  pages = PageAllocator(num_pages=3, page_size=2, host_slots=1)  # 2 usable pages.
  ops = []
  pages.events = KVEventLog(ops.extend)
  mirror = EventMirror(page_size=2)
  a, _ = pages.allocate([1, 2, 3])
  pages.cache_pages(a, [1, 2, 3], 0, 1)
  pages.free(a)  # Page a[0] cached, evictable.
  b, _ = pages.allocate([5, 6, 7, 8])  # Both pages: a[0] is evicted, saved to the host.
  pages.cache_pages(b, [5, 6, 7, 8], 0, 2)
  pages.free(b)
  pages.allocate([9, 9, 9, 9])  # b's pages evicted, tail first: each saved over the last.
  pages.events.flush()
  events = mirror.events(ops)
  kinds = [(e[0], e[-1]) for e in events]
  assert kinds == [("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "GPU"),
                   ("BlockStored", "GPU"), ("BlockRemoved", "CPU"), ("BlockStored", "CPU"),
                   ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU"), ("BlockStored", "CPU"),
                   ("BlockRemoved", "GPU")], kinds
  assert events[1][1] == events[0][1] and events[4][1] == events[1][1]  # The same block.
  assert msgpack.unpackb(msgpack.packb(events)) == events
  saves, loads = pages.take_copies()
  assert saves == [(a[0], 0), (b[1], 0), (b[0], 0)] and loads == []


def test_a_host_hit_is_loaded_into_a_fresh_page_and_pinned_while_the_plan_builds():
  pages = PageAllocator(num_pages=4, page_size=2, host_slots=2)  # 3 usable pages.
  t, _ = pages.allocate([1, 2, 3, 4, 5])
  pages.cache_pages(t, [1, 2, 3, 4, 5], 0, 2)
  pages.free(t)
  u, _ = pages.allocate([7, 7, 7, 7, 7])  # All 3 pages: t's two cached ones saved.
  pages.free(u)
  saves, _ = pages.take_copies()
  assert sorted(s for _, s in saves) == [0, 1]
  hits = pages.match_prefix([1, 2, 3, 4, 6])
  assert len(hits) == 2 and all(h.on_host for h in hits)
  assert pages.can_allocate([1, 2, 3, 4, 6], hits=hits)
  table, num_cached = pages.allocate([1, 2, 3, 4, 6], hits=hits)
  assert num_cached == 4 and pages.num_host_hit_tokens == 4
  saves, loads = pages.take_copies()
  assert [slot for slot, _ in loads] == [h.slot for h in hits]
  assert [page for _, page in loads] == table[:2]
  assert not saves  # u's pages have no keys: nothing to save, and the pinned slots stay.
  hit = pages.find_hit(pages.key_of(table[0]), (1, 2))
  assert not hit.on_host and hit.page == table[0]  # On the device again.


# The real engine: the copies are programs, the pages real KV.

GEMMA_ENGINE = EngineConfig(num_slots=2, page_size=4, num_pages=40, max_model_len=64,
                            prefill_buckets=(16,), compilation_cache_dir=None)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
  """Gemma 3 with window pages: a tiny random model that transformers saved."""
  pytest.importorskip("transformers")
  path = tmp_path_factory.mktemp("tiny_gemma3")
  hf_tiny.build("Gemma3TextConfig", hf_tiny.GEMMA3, norms=(-0.5, 0.5)).save_pretrained(path)
  return checkpoint.build_model(*weights.load_hf_dir(path))

def engine_chat(engine: Engine, vocab: int, num_chats=4, turns=3):
  """The multi-turn workload on a warmed-up engine, with a fresh Runner: (every answer's tokens
  and their logprobs and top 5's, the scheduler, the compiles and traces while it ran)."""
  run = Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))
  history = [[(7 * c + j) % vocab for j in range(12)] for c in range(num_chats)]
  answers = []
  # The top 5's logprobs too: a random tiny model's chosen token is often certain (logprob 0,
  # blind to any change), the runners-up's are not.
  sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
  with count_compiles() as counts:
    for turn in range(turns):
      prompts = [history[c] + [(11 * c + 5 * turn + j) % vocab for j in range(9)]
                 for c in range(num_chats)]
      outs = run.generate([(p, sampling) for p in prompts])
      answers += [(list(o.token_ids), [(lp.logprob, *lp.top_logprobs) for lp in o.logprobs])
                  for o in outs]
      history = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
  assert_all_free(run.scheduler)
  return answers, run.scheduler, counts


def warm(model, config) -> Engine:
  engine = Engine(model, config)
  engine.warmup()
  return engine


def same(got, want) -> bool:
  """Every token the same, and its logprobs within 1e-5 (and 1e-6 of their size: a runner-up's
  logprob of -30 is 4e-6 from the next float32)."""
  return all(g[0] == w[0] and np.allclose(g[1], w[1], rtol=1e-6, atol=1e-5)
             for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", ["float32", "int8-kv", "gemma3-window-pages"])
def test_every_logprob_is_the_same_with_and_without_the_host_tier(kind, tiny_model, request,
                                                                  monkeypatch):
  """And the comparison sees a wrong page: the same run, with one page's load left out of a
  copy (that device page keeps what it held), is no longer the plain run's."""
  if kind == "gemma3-window-pages":
    model = request.getfixturevalue("tiny_gemma3")
    config = dataclasses.replace(GEMMA_ENGINE, num_pages=17)  # 16 usable pages of 4.
  else:
    model = tiny_model
    config = dataclasses.replace(TINY_ENGINE, num_pages=9, num_slots=2,  # 8 usable pages of 8.
                                 prefill_buckets=(16,),
                                 kv_dtype=KVDtype.INT8 if kind == "int8-kv" else None)
  config = engine_config_for(config, AttentionBackend.REFERENCE)
  vocab = model.cfg.vocab_size
  plain, without, _ = engine_chat(warm(model, config), vocab)
  tiered = warm(model, dataclasses.replace(
      config, kv_offload_gib=host_tier_gib(model.cfg, config, 64)))
  answers, with_tier, counts = engine_chat(tiered, vocab)
  assert same(answers, plain)
  assert counts["compile"] == 0 and counts["trace"] == 0, counts
  pages = with_tier.pages
  assert pages.num_host_hit_tokens > 0 and pages.host.num_used > 0
  assert with_tier.num_prefill_tokens < without.num_prefill_tokens
  if kind == "gemma3-window-pages":
    assert with_tier.window_pages.host.num_used > 0
  copy, skipped = tiered.host_kv.copy, []

  def skip_one_load(cache, saves, loads):
    if any(loads) and not skipped:
      g = next(g for g, group in enumerate(loads) if group)
      skipped.append(loads[g][0])
      loads = (*loads[:g], loads[g][1:], *loads[g + 1:])
    return copy(cache, saves, loads)
  monkeypatch.setattr(tiered.host_kv, "copy", skip_one_load)
  # A fresh engine's pages (the run would allocate the pages it did before, holding that KV).
  tiered.cache = jax.tree.map(jax.numpy.zeros_like, tiered.cache)
  assert not same(engine_chat(tiered, vocab)[0], plain) and skipped


def test_an_import_the_store_refuses_leaves_no_slot_that_could_be_found():
  class Refusing:  # The engine's side of kv_handoff.PageStore, refusing a page's size.
    def write(self, group, slots, pages):
      raise ValueError("a page of group 0 is 8 bytes, got 3")

  scheduler = runner(16).scheduler
  tokens = list(range(1, 14))  # 3 full pages of 4 before the one holding the last token.
  pages = [kv_handoff.Page(0, i, b"bad") for i in range(3)]
  assert kv_handoff.import_prefix(scheduler, Refusing(), tokens, pages) == 0
  assert scheduler.pages.host.num_used == 0 and scheduler.pools.match(tokens) == []


def test_pages_a_decode_server_imports_are_events_with_the_hashes_a_router_computes():
  class Store:  # The engine's side of kv_handoff.PageStore: takes every page.
    def write(self, group, slots, pages):
      pass

  scheduler = runner(3).scheduler  # 3 host pages: the second prompt's import evicts one.
  ops = []
  scheduler.pages.events = KVEventLog(ops.extend)
  first, second = list(range(1, 14)), list(range(50, 59))  # 3 and 2 full pages before the last.
  for tokens in first, second:
    pages = [kv_handoff.Page(0, i, b"") for i in range(len(tokens) // PAGE)]
    assert kv_handoff.import_prefix(scheduler, Store(), tokens, pages, cache_salt="s") == (
        len(tokens) - 1) // PAGE
  scheduler.pages.events.flush()
  events = EventMirror(page_size=PAGE).events(ops)
  router = [kv_events.prompt_hashes(t, PAGE, cache_salt="s") for t in (first, second)]
  stored = [e[1] for e in events if e[0] == "BlockStored"]
  assert all(e[-1] == "CPU" for e in events), events
  assert stored == [[h] for h in router[0][:3] + router[1][:2]], (stored, router)
  removed = [h for e in events if e[0] == "BlockRemoved" for h in e[1]]
  assert len(removed) == 2 and set(removed) <= set(router[0][:3]), removed
