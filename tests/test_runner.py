"""The engine loop on the mock engine: tokens checked against `reference_generate` (the model
applied to its own output, no paging, no batching) or worked out by hand."""

import collections

import pytest

from jaxserve.batching.request import FinishReason, RequestRejected, RequestStatus
from jaxserve.batching.runner import Runner
from jaxserve.config import SamplingParams, SchedulerConfig
from support.mock_engine import MockEngine, MockTokenizer, reference_generate, weighted_sum

_ENGINE_ARGS = ("num_slots", "page_size", "num_pages", "max_model_len", "max_prefill_len",
                "next_token")


def make_runner(checked, tokenizer=None, **kwargs):
  engine = MockEngine(**{k: kwargs.pop(k) for k in _ENGINE_ARGS if k in kwargs})
  runner = Runner(engine, tokenizer or MockTokenizer(), SchedulerConfig(**kwargs))
  return checked(runner)


def run(runner):
  """Steps until idle; every output, grouped by request id."""
  outs = collections.defaultdict(list)
  while runner.has_unfinished:
    for out in runner.step():
      assert not outs[out.request_id] or not outs[out.request_id][-1].finished
      outs[out.request_id].append(out)
  return outs


def tokens(outs):
  return [t for o in outs for t in o.token_ids]


def greedy(max_tokens, **kwargs):
  return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def test_generate_returns_results_in_input_order(checked):
  r = make_runner(checked, num_slots=2)
  prompts = [[5, 6, 7], [100], [40, 41, 42, 43, 44, 45], [7]]
  lengths = [9, 2, 5, 1]
  results = r.generate([(p, greedy(n)) for p, n in zip(prompts, lengths)])
  for p, n, res in zip(prompts, lengths, results):
    expected = reference_generate(p, n)
    assert list(res.token_ids) == expected
    assert res.text == "".join(f" t{t}" for t in expected)
    assert res.finish_reason is FinishReason.LENGTH and list(res.prompt_token_ids) == p


def test_overlap_dispatches_the_next_step_before_reading_tokens(checked):
  r = make_runner(checked, num_slots=1)
  req = r.add_request([5, 6, 7], greedy(3))
  outs = run(r)
  rid = req.request_id
  assert r.engine.events == [
      ("prefill", rid, 0, 3),
      ("decode", (0,)),  # Step 2 is on its way before step 1's token is read.
      ("result", "step:1"),  # One engine call per step: step 1 is the prefill.
      ("decode", (0,)),
      ("result", "step:2"),
      ("result", "step:3"),  # max_tokens is a count: no decode is wasted on it.
  ]
  assert tokens(outs[rid]) == [8, 9, 10]


def test_a_token_sampled_after_the_finish_is_discarded_unread(checked):
  r = make_runner(checked, num_slots=1)
  req = r.add_request([996], greedy(10))  # 997, 998, 999 = eos
  outs = run(r)
  assert tokens(outs[req.request_id]) == [997, 998, 999]
  assert outs[req.request_id][-1].finish_reason is FinishReason.STOP
  # The third decode was dispatched before eos was seen; its token is never read.
  assert r.engine.num_decode_steps == 3
  assert [e for e in r.engine.events if e[0] == "result"] == [
      ("result", "step:1"), ("result", "step:2"), ("result", "step:3")]
  assert r.engine.events[-1] == ("free", 0)


def test_eos_ignore_eos_and_stop_token_ids(checked):
  r = make_runner(checked)
  eos = r.add_request([995], greedy(10))
  ignore = r.add_request([995], greedy(7, ignore_eos=True))
  stop_id = r.add_request([995], greedy(10, stop_token_ids=[997]))
  outs = run(r)
  assert tokens(outs[eos.request_id]) == [996, 997, 998, 999]
  assert "".join(o.text for o in outs[eos.request_id]) == " t996 t997 t998"  # No eos text.
  assert (eos.finish_reason, eos.stop_reason) == (FinishReason.STOP, 999)
  assert tokens(outs[ignore.request_id]) == [996, 997, 998, 999, 0, 1, 2]
  assert ignore.finish_reason is FinishReason.LENGTH
  assert tokens(outs[stop_id.request_id]) == [996, 997]
  assert (stop_id.finish_reason, stop_id.stop_reason) == (FinishReason.STOP, 997)
  assert all(q.status is RequestStatus.FINISHED for q in (eos, ignore, stop_id))


_PIECES = {10: "Hel", 11: "lo", 12: " wo", 13: "rl", 14: "d<", 15: "en", 16: "d>", 17: "!!"}


def test_stop_string_split_across_tokens_never_reaches_the_client(checked):
  r = make_runner(checked, tokenizer=MockTokenizer(_PIECES))
  req = r.add_request([9], greedy(20, stop=["<end>"]))
  outs = run(r)[req.request_id]
  # Text after each token: "Hel", "Hello", "Hello wo", "Hello worl", "Hello world<",
  # "Hello world<en", "Hello world<end>". The last 4 characters (len("<end>") - 1) are held back.
  assert [o.text for o in outs] == ["", "H", "ell", "o ", "wo", "rl", "d"]
  assert tokens(outs) == [10, 11, 12, 13, 14, 15, 16]
  assert (req.finish_reason, req.stop_reason) == (FinishReason.STOP, "<end>")


@pytest.mark.parametrize("stop, text, reason", [
    (["world", "lo w"], "Hel", FinishReason.STOP),  # The earliest match wins.
    (["wor!"], "Hello world<end>!!", FinishReason.LENGTH),  # "wor" held, then released.
    (["d"], "Hello worl", FinishReason.STOP),
])
def test_stop_strings(checked, stop, text, reason):
  r = make_runner(checked, tokenizer=MockTokenizer(_PIECES))
  req = r.add_request([9], greedy(8, stop=stop))
  outs = run(r)[req.request_id]
  assert "".join(o.text for o in outs) == text
  assert req.finish_reason is reason


def test_context_window_boundary(checked):
  r = make_runner(checked, max_model_len=16, num_pages=64)
  with pytest.raises(RequestRejected, match="context window of 16"):
    r.add_request(list(range(13)), greedy(4))
  req = r.add_request(list(range(12)), greedy(4))  # Exactly fills the window.
  outs = run(r)[req.request_id]
  assert tokens(outs) == [12, 13, 14, 15] and len(req.all_token_ids) == 16
  assert req.finish_reason is FinishReason.LENGTH


def test_rejected_requests_are_never_queued(checked):
  r = make_runner(checked, num_pages=5, page_size=4)  # 4 pages: 16 KV positions.
  with pytest.raises(RequestRejected, match="needs 5 KV pages"):
    r.add_request(list(range(10)), greedy(8))
  with pytest.raises(RequestRejected, match="empty"):
    r.add_request([], greedy(8))
  assert not r.has_unfinished
  with pytest.raises(RequestRejected):  # generate checks everything before running anything.
    r.generate([([1], greedy(2)), (list(range(10)), greedy(8))])
  assert not r.has_unfinished and r.engine.events == []


def test_fcfs_fairness(checked):
  r = make_runner(checked, num_slots=2)
  reqs = [r.add_request([10 * i], greedy(4)) for i in range(6)]
  run(r)
  admitted = [q.timings.admitted for q in reqs]
  finished = [q.timings.finish for q in reqs]
  assert admitted == sorted(admitted) and finished == sorted(finished)
  # Pairs share a batch: the second pair is admitted only after the first pair finished.
  assert reqs[2].timings.admitted >= reqs[1].timings.finish


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_greedy_requests_produce_exactly_their_unpreempted_tokens(checked,
                                                                            prefix_caching):
  # 12 pages of 4 = 48 KV positions; four requests each grow to 25 tokens (7 pages).
  r = make_runner(checked, num_slots=4, num_pages=13, next_token=weighted_sum,
                  enable_prefix_caching=prefix_caching)
  prompts = [[3 + i, 1, 4, 1, 5, 9] for i in range(4)]
  results = r.generate([(p, greedy(19)) for p in prompts])
  assert r.scheduler.num_preemptions >= 1
  for p, res in zip(prompts, results):
    assert list(res.token_ids) == reference_generate(p, 19, weighted_sum)
  # Recompute: the engine prefilled more than the prompts.
  assert r.engine.num_prefill_tokens > sum(map(len, prompts))


def test_prefix_cache_hits_skip_prefill_and_lru_eviction_forgets(checked):
  r = make_runner(checked, num_pages=9, next_token=weighted_sum)  # 8 pages of 4.
  shared = list(range(100, 112))  # 3 full pages.
  a = r.generate([(shared + [1, 2], greedy(3))])[0]
  shared_pages = r.engine.chunks[0].page_table[:3]
  writes = r.engine.page_writes.copy()
  before = r.engine.num_prefill_tokens
  b_prompt = shared + [7]
  b = r.generate([(b_prompt, greedy(3))])[0]
  assert b.num_cached_tokens == 12 and a.num_cached_tokens == 0
  assert r.engine.num_prefill_tokens - before == 1  # Only the token after the shared prefix.
  assert r.engine.chunks[-1].page_table[:3] == shared_pages
  assert (r.engine.page_writes[list(shared_pages)] == writes[list(shared_pages)]).all()
  assert list(b.token_ids) == reference_generate(b_prompt, 3, weighted_sum)  # Read cached KV.
  assert r.scheduler.num_cached_tokens == 12
  # A prompt that needs all 8 pages evicts every cached one.
  r.generate([(list(range(500, 528)), greedy(4))])
  assert r.scheduler.pages.num_evictions > 0
  before = r.engine.num_prefill_tokens
  again = r.generate([(b_prompt, greedy(3))])[0]
  assert again.num_cached_tokens == 0 and r.engine.num_prefill_tokens - before == 13
  assert again.token_ids == b.token_ids


def test_a_prefix_is_shared_within_the_step_that_writes_it(checked):
  r = make_runner(checked, next_token=weighted_sum)
  shared = list(range(100, 112))
  results = r.generate([(shared + [1], greedy(2)), (shared + [2], greedy(2))])
  # The first request's chunk is registered as soon as it is planned; the second, admitted
  # later in the same plan, reuses its 3 pages (the engine runs the chunks in order).
  assert [c.num_cached_tokens for c in results] == [0, 12]
  assert r.engine.num_prefill_tokens == 13 + 1
  for p, res in zip((shared + [1], shared + [2]), results):
    assert list(res.token_ids) == reference_generate(p, 2, weighted_sum)


def test_a_block_is_cached_only_once_its_kv_is_written(checked):
  r = make_runner(checked, next_token=weighted_sum)
  a = r.generate([([1, 2, 3, 4, 5, 6], greedy(2))])[0]
  # Two full pages of tokens, but the last sampled token's KV was never written: only the
  # first page may be reused (reading position 7 would trip the mock's unwritten check).
  prompt = [1, 2, 3, 4, 5, 6, *a.token_ids, 50]
  b = r.generate([(prompt, greedy(2))])[0]
  assert b.num_cached_tokens == 4
  assert list(b.token_ids) == reference_generate(prompt, 2, weighted_sum)


def test_chunked_prefill_interleaves_with_decode(checked):
  r = make_runner(checked, max_prefill_len=4, max_num_batched_tokens=4, next_token=weighted_sum,
                  max_model_len=64)
  short = r.add_request([1, 2, 3], greedy(12))
  r.step()
  long_prompt = list(range(200, 218))
  long = r.add_request(long_prompt, greedy(3))
  outs = run(r)
  kinds = [e[0] if e[0] != "prefill" or e[1] == short.request_id else "long"
           for e in r.engine.events if e[0] in ("prefill", "decode")]
  # 18 tokens in chunks of 4: 5 prefill steps, each beside a decode of `short`.
  # Within a step the runner dispatches prefill chunks, then the decode.
  assert kinds[:11] == ["prefill"] + ["long", "decode"] * 5
  assert kinds.count("long") == 5
  assert tokens(outs[short.request_id]) == reference_generate([1, 2, 3], 12, weighted_sum)
  assert tokens(outs[long.request_id]) == reference_generate(long_prompt, 3, weighted_sum)


def test_abort_in_every_state(checked):
  r = make_runner(checked, num_slots=2, max_prefill_len=4, max_num_batched_tokens=4)
  decoding = r.add_request([1, 2, 3], greedy(50))
  prefilling = r.add_request(list(range(20, 32)), greedy(4))
  waiting = r.add_request([7], greedy(4))
  r.step()  # decoding: its whole prompt; prefilling: 1 token (the budget left).
  r.step()  # decoding: a decode in flight; prefilling: 4 more tokens.
  assert prefilling.is_prefilling and decoding.num_pending_tokens == 1
  assert waiting.status is RequestStatus.WAITING
  assert r.abort(waiting.request_id) and r.abort(prefilling.request_id)
  assert r.abort(decoding.request_id)
  assert not r.abort(decoding.request_id) and not r.abort("nope")
  outs = r.step()
  assert {(o.request_id, o.finish_reason) for o in outs} == {
      (q.request_id, FinishReason.ABORT) for q in (waiting, prefilling, decoding)}
  assert all(o.token_ids == () for o in outs)
  assert r.step() == [] and not r.has_unfinished
  assert all(q.status is RequestStatus.ABORTED for q in (waiting, prefilling, decoding))
  assert run(r) == {}
  # A finished request cannot be aborted.
  done = r.generate([([5], greedy(1))])[0]
  assert not r.abort(done.request_id)


def test_seeds_are_drawn_when_unset(checked):
  r = make_runner(checked)
  r.add_request([1], SamplingParams(max_tokens=1))
  r.add_request([1], SamplingParams(max_tokens=1))
  r.add_request([1], SamplingParams(max_tokens=1, seed=42))
  run(r)
  seeds = [c.seed for c in r.engine.chunks]
  assert seeds[2] == 42 and seeds[0] != seeds[1]
  assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)


def test_timings_and_request_ids(checked):
  r = make_runner(checked)
  req = r.add_request([1, 2], greedy(5), request_id="mine")
  with pytest.raises(ValueError, match="already in use"):
    r.add_request([1, 2], greedy(5), request_id="mine")
  outs = run(r)["mine"]
  t = req.timings
  assert t.arrival <= t.admitted <= t.first_token == t.token_times[0] <= t.finish
  assert len(t.token_times) == 5 and t.token_times == sorted(t.token_times)
  assert outs[-1].timings is t and t.time_to_first_token >= 0
