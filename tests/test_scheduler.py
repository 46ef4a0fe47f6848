"""The scheduler on its own: plans worked out by hand from token counters.

Tokens are applied by hand right after each plan (no engine); the runner tests cover the overlap.
"""

import dataclasses
import itertools
import sys

import numpy as np
import pytest

from jaxserve.batching.request import QueueFull, Request, RequestRejected, RequestStatus
from jaxserve.batching.scheduler import Scheduler
from jaxserve.config import QueuePolicy, SamplingParams, SchedulerConfig
from support.mock_engine import MockEngine

_ids = itertools.count()


def make(prompt_len, max_tokens=4, priority=0, first=None):
  """A request; prompts differ unless `first` (the first token, then +1 each) is given."""
  seq = next(_ids)
  first = 10_000 + 1000 * seq if first is None else first
  return Request(f"r{seq}", tuple(range(first, first + prompt_len)),
                 SamplingParams(max_tokens=max_tokens), seed=0, arrival_seq=seq, priority=priority)


def sched(checked, num_slots=4, num_pages=17, max_prefill_len=64, max_model_len=64, **config):
  engine = MockEngine(num_slots=num_slots, page_size=4, num_pages=num_pages,
                      max_model_len=max_model_len, max_prefill_len=max_prefill_len)
  return checked(Scheduler(SchedulerConfig(**config), engine))


def step(s, token=1):
  """One plan, then every sampled token applied at once and finished requests retired."""
  out = s.schedule()
  sampled = [r for c, r in zip(out.plan.prefills, out.prefill_requests) if c.is_last]
  s.update([(r, token, r.num_output_tokens + 1 == r.sampling.max_tokens)
            for r in sampled + list(out.decode_requests)])
  return out


def drain(s, limit=200):
  for _ in range(limit):
    if not s.has_unfinished:
      return
    step(s)
  raise AssertionError("did not drain")


def chunks(out):
  return [(c.request_id, c.start_pos, len(c.token_ids), c.is_last) for c in out.plan.prefills]


def test_rejects_what_can_never_run(checked):
  s = sched(checked, num_pages=9)  # 8 usable pages of 4 tokens: 32 KV positions.
  with pytest.raises(RequestRejected, match="empty"):
    s.check(0, SamplingParams())
  with pytest.raises(RequestRejected, match="context window of 64"):
    s.check(60, SamplingParams(max_tokens=5))  # 65 > 64
  s.check(28, SamplingParams(max_tokens=5))  # 33 tokens: the last one needs no KV -> 8 pages.
  with pytest.raises(RequestRejected, match="needs 9 KV pages"):
    s.check(29, SamplingParams(max_tokens=5))
  with pytest.raises(RequestRejected):
    s.add(make(61))
  assert not s.waiting


def test_queue_length_is_capped(checked):
  s = sched(checked, max_queue_len=2)
  s.add(make(3))
  s.add(make(3))
  with pytest.raises(QueueFull):
    s.add(make(3))
  drain(s)


def test_admits_in_arrival_order_up_to_the_free_slots(checked):
  s = sched(checked, num_slots=2)
  reqs = [make(3) for _ in range(4)]
  for r in reqs:
    s.add(r)
  out = step(s)
  assert [c.request_id for c in out.plan.prefills] == [reqs[0].request_id, reqs[1].request_id]
  assert [c.slot for c in out.plan.prefills] == [0, 1]
  assert [r.status for r in reqs] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING] * 2
  # Each finishes after 4 tokens: the prefill's + 3 decodes; slot 0 is then refilled first.
  for _ in range(3):
    out = step(s)
    assert out.plan.decode_slots == (0, 1) and not out.plan.prefills
  out = step(s)
  assert out.plan.free_slots == (0, 1)
  assert [(c.request_id, c.slot) for c in out.plan.prefills] == [
      (reqs[2].request_id, 0), (reqs[3].request_id, 1)]
  drain(s)


def test_fcfs_head_of_line_blocks_later_smaller_requests(checked):
  s = sched(checked, num_pages=9, max_prefill_len=32, max_num_batched_tokens=64)  # 8 pages.
  first = make(16, max_tokens=9)  # 4 pages for the prompt, grows to 6.
  big = make(20, max_tokens=4, first=100)  # 5 pages: does not fit beside `first`.
  small = make(2, max_tokens=2, first=200)  # Would fit, but arrived after `big`.
  for r in (first, big, small):
    s.add(r)
  step(s)
  assert first.status is RequestStatus.RUNNING
  assert big.status is small.status is RequestStatus.WAITING
  while first.status is RequestStatus.RUNNING:
    assert small.status is RequestStatus.WAITING
    step(s)
  step(s)
  assert big.status is RequestStatus.RUNNING and small.status is RequestStatus.RUNNING
  drain(s)


def test_priority_policy_admits_lower_numbers_first_fcfs_within(checked):
  s = sched(checked, num_slots=1, policy=QueuePolicy.PRIORITY)
  reqs = [make(2, max_tokens=1, priority=p) for p in (5, 1, 5, 0, 1)]
  for r in reqs:
    s.add(r)
  order = []
  while s.has_unfinished:
    out = step(s)
    order += [c.request_id for c in out.plan.prefills]
  assert order == [reqs[i].request_id for i in (3, 1, 4, 0, 2)]


def test_reserve_pages_hold_back_admission_while_others_run(checked):
  s = sched(checked, num_pages=9, reserve_pages=3)  # 8 pages.
  a, b = make(12, max_tokens=2), make(8, max_tokens=2)  # 3 pages, 2 pages
  s.add(a)
  s.add(b)
  step(s)
  # a took 3 pages (5 free). b needs 2 + 3 reserve = 5 <= 5: admitted too.
  assert b.status is RequestStatus.RUNNING
  drain(s)
  s2 = sched(checked, num_pages=9, reserve_pages=4)
  a, b = make(12, max_tokens=2), make(8, max_tokens=2)
  s2.add(a)
  s2.add(b)
  step(s2)
  assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING  # 2 + 4 > 5
  drain(s2)


def test_alone_a_request_may_use_the_reserve(checked):
  s = sched(checked, num_pages=9, reserve_pages=6)  # 8 pages, 6 reserved.
  r = make(12, max_tokens=2)  # 3 pages > 8 - 6, but nothing else runs.
  s.add(r)
  step(s)
  assert r.status is RequestStatus.RUNNING
  drain(s)


def test_chunked_prefill_interleaves_with_decode(checked):
  s = sched(checked, max_prefill_len=16, max_num_batched_tokens=16, max_model_len=64)
  short = make(3, max_tokens=20)
  s.add(short)
  step(s)  # short prefilled; decodes from the next step on.
  long = make(40, max_tokens=4, first=100)
  s.add(long)
  plans = [step(s) for _ in range(3)]
  lid = long.request_id
  # One chunk a request a step: the budget is the step's (the engine's largest bucket).
  assert [chunks(p) for p in plans] == [
      [(lid, 0, 16, False)],
      [(lid, 16, 16, False)],
      [(lid, 32, 8, True)]]
  assert all(p.plan.decode_slots == (short.slot,) for p in plans)  # short never stalls.
  assert plans[1].plan.prefills[0].token_ids == tuple(range(116, 132))
  out = step(s)
  assert set(out.plan.decode_slots) == {short.slot, long.slot}
  assert s.num_prefill_tokens == 43
  s.abort(short)
  drain(s)


def test_prefill_budget_is_shared_in_queue_order(checked):
  s = sched(checked, max_prefill_len=10, max_num_batched_tokens=10)
  a, b = make(6), make(6)
  s.add(a)
  s.add(b)
  out = step(s)
  assert chunks(out) == [(a.request_id, 0, 6, True), (b.request_id, 0, 4, False)]
  out = step(s)
  assert chunks(out) == [(b.request_id, 4, 2, True)]
  drain(s)


def test_a_step_prefills_at_most_the_engines_prompts_per_step(checked):
  """EngineInfo.max_prefill_seqs (the step's sequence axis): the budget would take all four
  short prompts at once; two go per step, in arrival order."""
  engine = MockEngine(num_slots=4, page_size=4, num_pages=17, max_model_len=64, max_prefill_len=8)
  engine.info = dataclasses.replace(engine.info, max_prefill_seqs=2)
  s = checked(Scheduler(SchedulerConfig(max_num_batched_tokens=64), engine))
  reqs = [make(3) for _ in range(4)]
  for r in reqs:
    s.add(r)
  assert [c[0] for c in chunks(step(s))] == [r.request_id for r in reqs[:2]]
  out = step(s)
  assert [c[0] for c in chunks(out)] == [r.request_id for r in reqs[2:]]
  assert len(out.decode_requests) == 2  # The first two decode meanwhile.
  drain(s)


def test_decode_page_tables(checked):
  s = sched(checked, num_slots=4, max_model_len=64)  # At most 16 pages per sequence.
  a, b = make(3, max_tokens=30), make(13, max_tokens=30, first=50)
  s.add(a)
  s.add(b)
  step(s)
  out = step(s)
  # a: 4 tokens -> 1 page; b: 14 tokens -> 4 pages; every table is whole (16 pages wide).
  tables = out.plan.page_tables
  assert tables.shape == (4, 16) and tables.dtype == np.int32
  assert list(tables[a.slot]) == a.page_table + [0] * 15
  assert list(tables[b.slot]) == b.page_table + [0] * 12
  assert not tables[2:].any()
  for _ in range(3):
    out = step(s)
  assert out.plan.page_tables.shape == (4, 16)  # b: 17 tokens -> 5 pages.
  assert len(b.page_table) == 5 and list(out.plan.page_tables[b.slot]) == b.page_table + [0] * 11
  s.abort(a)
  s.abort(b)


def test_grows_one_block_when_decode_crosses_a_boundary(checked):
  s = sched(checked)
  r = make(3, max_tokens=10)
  s.add(r)
  step(s)  # Prompt 3 tokens in 1 page; token 4 sampled (its KV not written yet).
  assert len(r.page_table) == 1
  step(s)  # Writes position 3 (still page 0), samples token 5.
  assert len(r.page_table) == 1
  step(s)  # Writes position 4: a second page.
  assert len(r.page_table) == 2
  assert s.pages.num_free_pages == 16 - 2
  drain(s)


def test_stops_decoding_at_max_tokens(checked):
  s = sched(checked)
  r = make(3, max_tokens=3)
  s.add(r)
  out = s.schedule()
  # Tokens never applied (as if all were in flight): one from prefill, then two decodes, no more.
  assert s.schedule().plan.decode_slots == (0,)
  assert s.schedule().plan.decode_slots == (0,)
  assert s.schedule().plan.is_empty and r.num_pending_tokens == 3
  s.update([(r, 7, False), (r, 8, False), (r, 9, True)])
  assert r.output_token_ids == [7, 8, 9] and out.plan.prefills[0].is_last


def test_preemption_frees_the_newest_and_recomputes_prompt_plus_output(checked):
  s = sched(checked, num_slots=2, num_pages=7, enable_prefix_caching=False)  # 6 pages of 4.
  old, new = make(8, max_tokens=12), make(8, max_tokens=12, first=50)  # 2 pages each.
  s.add(old)
  s.add(new)
  step(s, token=900)
  # Each needs a 3rd page at its 9th position, a 4th at its 13th: 8 pages > 6.
  while new.status is RequestStatus.RUNNING:
    step(s, token=900 + old.num_output_tokens)
  assert new.num_preemptions == 1 and old.num_preemptions == 0
  assert new.page_table == [] and new.slot is None and new.num_pending_tokens == 0
  assert s.waiting.peek() is new
  assert len(old.page_table) == 4
  generated = new.output_token_ids
  # Sampled positions 8..12; writing position 12 needed a 4th page, and `old` got it.
  assert len(generated) == 5
  while old.status is RequestStatus.RUNNING:
    step(s)
  out = step(s)
  # Re-admitted: prefills its prompt plus the tokens it had generated, in chunks of 8.
  sent = [t for c in out.plan.prefills for t in c.token_ids]
  assert sent == list(range(50, 58)) + generated, sent
  last = out.plan.prefills[-1]
  assert last.is_last and list(last.output_token_ids) == generated
  assert list(last.prompt_token_ids) == list(range(50, 58))
  drain(s)
  assert new.num_output_tokens == 12


def test_priority_preemption_picks_the_lowest_priority_even_if_older(checked):
  s = sched(checked, num_slots=2, num_pages=7, policy=QueuePolicy.PRIORITY)
  low, high = make(8, max_tokens=12, priority=9), make(8, max_tokens=12, priority=0, first=50)
  s.add(low)
  s.add(high)
  while low.num_preemptions == 0:
    assert high.num_preemptions == 0
    step(s)
  assert high.status is RequestStatus.RUNNING and low.status is RequestStatus.WAITING
  drain(s)


def test_a_lone_request_that_outgrows_the_pool_is_preempted_only_by_itself(checked):
  s = sched(checked, num_slots=2, num_pages=4)  # 3 pages: 12 positions.
  r = make(4, max_tokens=9)  # 12 KV positions at most: fits alone.
  s.add(r)
  drain(s)
  assert r.num_preemptions == 0 and r.num_output_tokens == 9


def test_static_batching_waits_for_the_whole_group(checked):
  s = sched(checked, num_slots=2, static_batching=True, max_num_batched_tokens=4)
  a, b, c = make(4, max_tokens=1), make(4, max_tokens=6), make(4, max_tokens=1)
  for r in (a, b, c):
    s.add(r)
  out = step(s)  # Both a and b join the group, though the budget only covers a's prefill.
  assert a.status is RequestStatus.FINISHED and b.status is RequestStatus.RUNNING
  assert chunks(out) == [(a.request_id, 0, 4, True)]
  while b.status is RequestStatus.RUNNING:
    assert c.status is RequestStatus.WAITING  # a's slot stays idle until b is done.
    step(s)
  step(s)
  assert c.status is RequestStatus.FINISHED
  s2 = sched(checked, num_slots=2, max_num_batched_tokens=8)
  a, b, c = make(4, max_tokens=1), make(4, max_tokens=6), make(4, max_tokens=1)
  for r in (a, b, c):
    s2.add(r)
  step(s2)
  step(s2)  # Continuous batching refills a's slot at once.
  assert c.status is RequestStatus.FINISHED and b.status is RequestStatus.RUNNING
  drain(s2)


def test_prefix_cache_skips_cached_blocks_at_admission(checked):
  s = sched(checked)
  a = make(10, max_tokens=1, first=0)
  s.add(a)
  drain(s)
  b = make(10, max_tokens=1, first=0)  # Same prompt.
  s.add(b)
  out = step(s)
  # Pages [0..3] [4..7] cached; the page with the last token is prefilled again.
  assert chunks(out) == [(b.request_id, 8, 2, True)]
  assert b.num_cached_tokens == 8 and s.num_cached_tokens == 8
  assert s.num_prefill_tokens == 10 + 2
  drain(s)


def test_abort_frees_in_every_state(checked):
  s = sched(checked, num_slots=1, max_num_batched_tokens=4, max_prefill_len=4)
  running, prefilling, waiting = make(3, max_tokens=20), make(12), make(3)
  s.add(running)
  step(s)
  s.add(prefilling)
  s.add(waiting)
  step(s)
  s.abort(waiting)
  assert waiting.status is RequestStatus.ABORTED and len(s.waiting) == 1
  s.abort(running)
  out = step(s)
  assert out.plan.free_slots == (0,) and chunks(out) == [(prefilling.request_id, 0, 4, False)]
  s.abort(prefilling)
  assert prefilling.status is RequestStatus.ABORTED
  out = step(s)
  assert out.plan.free_slots == (0,) and out.plan.is_empty


def test_cached_tokens_count_the_first_admission_only_never_more_than_the_prompt(checked):
  """A preempted request comes back to its own cached pages (prompt and outputs): those hits
  spare recompute (the scheduler counts them) but are no prompt tokens the cache held."""
  s = sched(checked, num_slots=2, num_pages=7)  # 6 pages of 4: not enough for both.
  a, b = make(4, max_tokens=16), make(4, max_tokens=16)
  s.add(a)
  s.add(b)
  drain(s)
  assert b.num_preemptions >= 1 and s.num_cached_tokens > 0  # Its re-admission hit its pages.
  assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
  c = make(9, max_tokens=1, first=a.prompt_token_ids[0])  # a's first 4 tokens are cached.
  s.add(c)
  drain(s)
  assert c.num_cached_tokens == 4


def test_a_constrained_request_sits_out_while_its_last_token_is_in_flight(checked):
  """As the runner overlaps steps (plan n+1 before step n's tokens are read): the free request
  decodes every step, the constrained one (a grammar set) every other step, and only once its
  previous token has arrived, since its mask is made from it."""
  s = sched(checked)
  free, constrained = make(3, max_tokens=6), make(3, max_tokens=6)
  constrained.grammar = object()  # The scheduler only asks whether there is one.
  s.add(free)
  s.add(constrained)
  in_flight, decoded = None, []
  for _ in range(8):
    out = s.schedule()  # Planned before the previous step's tokens are applied.
    decoded.append([r.request_id for r in out.decode_requests])
    if in_flight is not None:
      s.update([(r, 1, False) for r in in_flight])
    in_flight = [r for c, r in zip(out.plan.prefills, out.prefill_requests) if c.is_last]
    in_flight += list(out.decode_requests)
    assert constrained not in out.decode_requests or constrained.num_pending_tokens == 1
  assert ([constrained.request_id in d for d in decoded[1:7]]
          == [False, True, False, True, False, True])
  assert all(free.request_id in d for d in decoded[1:6])
  for r in (free, constrained):
    s.abort(r)


def test_prompts_to_score_get_prefill_only_plans_taking_turns_with_the_rest(checked):
  """The step that scores prompt positions is a prefill-only variant: a request asking for
  prompt logprobs prefills in plans of its own (no decodes, no other prompts), every other step,
  so decodes keep going in between; the mock engine asserts every plan fits one call."""
  s = sched(checked, max_prefill_len=8, max_num_batched_tokens=8)
  talker = make(3, max_tokens=12)
  s.add(talker)
  step(s)
  scored = make(20, max_tokens=2, first=500)
  scored.sampling = dataclasses.replace(scored.sampling, prompt_logprobs=1)
  plain = make(4, max_tokens=2, first=700)
  s.add(scored)
  s.add(plain)
  kinds = []
  for _ in range(6):
    out = step(s)
    targets = [c.prompt_logprob_targets is not None for c in out.plan.prefills]
    assert not any(targets) or (all(targets) and not out.plan.decode_slots)
    kinds.append("score" if any(targets) else "decode" if out.plan.decode_slots else "-")
  # The scoring prompt (20 tokens in chunks of 8) takes turns with the decoding one; the
  # plain prompt behind it in the queue is admitted after it (queue order), in an ordinary plan.
  assert kinds == ["score", "decode", "score", "decode", "score", "decode"]
  # Its 20 prompt tokens in three scoring plans, then its first decode beside the others.
  assert scored.num_computed_tokens == 21 and plain.status is RequestStatus.FINISHED
  drain(s)


def test_static_batching_admits_the_group_whole_and_prefills_it_in_plans_that_fit(checked):
  engine = MockEngine(num_slots=4, page_size=4, num_pages=17, max_model_len=64, max_prefill_len=8)
  engine.info = dataclasses.replace(engine.info, max_prefill_seqs=2)
  s = checked(Scheduler(SchedulerConfig(static_batching=True, max_num_batched_tokens=64), engine))
  reqs = [make(3, max_tokens=2) for _ in range(4)]
  for r in reqs:
    s.add(r)
  out = step(s)
  assert all(r.status is RequestStatus.RUNNING for r in reqs)  # The whole group.
  assert [c[0] for c in chunks(out)] == [r.request_id for r in reqs[:2]]
  out = step(s)
  assert [c[0] for c in chunks(out)] == [r.request_id for r in reqs[2:]]
  drain(s)


def test_aborting_10000_queued_requests_costs_a_constant_each(checked):
  """Counts the Python lines run by the aborts (not wall time): a bounded number per abort,
  whatever the queue's length. Removal that scans or re-heapifies the queue runs thousands of
  lines per abort, and the tracer stops it at the first abort over the bound."""
  s = sched(checked, max_queue_len=20_000)
  reqs = [make(3) for _ in range(10_000)]
  for req in reqs:
    s.add(req)
  bound, lines = 40 * len(reqs), 0

  def tracer(frame, event, arg):
    nonlocal lines
    if event == "line":
      lines += 1
      if lines > bound:
        raise AssertionError(f"aborts ran more than {bound} lines")
    return tracer

  sys.settrace(tracer)
  try:
    for req in reqs[::2] + reqs[1::2]:  # Every other one first: live and dead entries mix.
      s.abort(req)
  finally:
    sys.settrace(None)
  assert len(s.waiting) == 0 and not s.has_unfinished and s.waiting.peek() is None
  assert all(r.status is RequestStatus.ABORTED for r in reqs)
  assert len(s.waiting._heap) <= 16  # The dead entries went with the compactions.
  # The queue still orders what comes after.
  late, early = make(3, priority=0), make(3)
  s.add(late)
  s.add(early)
  assert s.waiting.peek() is late and s.waiting.pop() is late and s.waiting.pop() is early


def test_a_removed_request_can_be_queued_again_and_keeps_its_place(checked):
  s = sched(checked)
  a, b, c = make(3), make(3), make(3)
  for req in (a, b, c):
    s.waiting.push(req)
  assert s.waiting.remove(b) and not s.waiting.remove(b)
  s.waiting.push(b)  # As a preemption does: back in with its arrival number.
  assert list(s.waiting) == [a, b, c] and len(s.waiting) == 3
  assert [s.waiting.pop() for _ in range(3)] == [a, b, c]
