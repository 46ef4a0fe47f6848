"""Speculation's pause (batching/acceptance.py), on the host alone: a scheduler with no engine
behind it, whose verified runs come back with as many proposals accepted as each test says.
A request proposes while its measured acceptance pays for the verifying step's cost, pauses
while it does not, and probes again after a back-off."""

import types

import pytest

from jaxserve.batching import acceptance
from jaxserve.batching.acceptance import MIN_RUNS, PAUSE_STEPS, Acceptance, expected_tokens
from jaxserve.batching.plan import EngineInfo
from jaxserve.batching.request import Request
from jaxserve.batching.scheduler import Scheduler
from jaxserve.config import SamplingParams, SchedulerConfig, SpeculativeConfig

K = 4
PERIOD = (1, 2, 3)  # The prompt repeats it, so prompt lookup always proposes K tokens.


def scheduler(verify_cost: float) -> Scheduler:
  spec = SpeculativeConfig(num_speculative_tokens=K, verify_cost=verify_cost)
  info = EngineInfo(num_slots=2, page_size=16, num_pages=64, max_model_len=1024,
                    max_prefill_len=64, can_share_pages=True, vocab_size=100,
                    max_prefill_seqs=4, speculative=spec.resolved("cpu"))
  return Scheduler(SchedulerConfig(), types.SimpleNamespace(info=info))


def drive(s: Scheduler, accepted, num_steps: int) -> list[bool]:
  """Runs one request for `num_steps` steps, each step's tokens back before the next is planned;
  a verified run in step i accepts accepted(i) of its proposals. Returns, for each step after the
  prompt's, whether the request verified in it."""
  req = Request("r", PERIOD * 8, SamplingParams(temperature=0, max_tokens=900), 0, 0)
  s.add(req)
  verified = []
  for i in range(num_steps):
    plan = s.schedule().plan
    n = len(req.all_token_ids)
    runs = [ch for ch in plan.prefills if ch.num_drafts]
    if runs:
      num = min(accepted(i), runs[0].num_drafts)
      s.update_verified(req, [PERIOD[(n + j) % 3] for j in range(num + 1)], num, False)
    else:  # The prompt's chunk or a decode: one token, the period's next.
      s.update([(req, PERIOD[n % 3], False)])
    if i:
      verified.append(bool(runs))
  return verified


def test_a_request_whose_proposals_are_never_accepted_pauses_and_probes_again():
  """MIN_RUNS runs measured, then no proposal for PAUSE_STEPS steps, MIN_RUNS runs that probe,
  then a pause twice as long."""
  got = drive(scheduler(2.0), lambda i: 0, 1 + 2 * MIN_RUNS + 3 * PAUSE_STEPS + MIN_RUNS)
  want = ([True] * MIN_RUNS + [False] * (PAUSE_STEPS - 1) + [True] * MIN_RUNS
          + [False] * (2 * PAUSE_STEPS - 1) + [True])
  assert got[:len(want)] == want


def test_a_request_whose_proposals_are_accepted_keeps_proposing():
  assert all(drive(scheduler(2.0), lambda i: K, 60))
  # One of K accepted: an estimated rate of 1/2, 1.94 tokens a run. That pays for a step that
  # costs 1.5 decode steps and not for one that costs 2: the cost is the config's.
  assert all(drive(scheduler(1.5), lambda i: 1, 60))
  assert not all(drive(scheduler(2.0), lambda i: 1, 60))


def test_a_request_that_turns_copy_heavy_later_proposes_again():
  """Rejected for its first 40 steps (paused twice), accepted after: once a probe sees that,
  it proposes in every step."""
  got = drive(scheduler(2.0), lambda i: 0 if i < 40 else K, 120)
  assert not all(got[:40])
  assert all(got[40 + acceptance.MAX_PAUSE_STEPS // 2:])


def test_acceptance_estimate_and_pause_lengths():
  # 1 + a + ... + a^k.
  assert expected_tokens(0.0, K) == 1.0 and expected_tokens(1.0, K) == K + 1
  assert expected_tokens(0.5, K) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
  a = Acceptance()
  a.record(0, K, 2, K, 2.0)  # Two accepted then a rejection: 2 of 3 tries.
  assert a.rate == pytest.approx(2 / 3) and a.may_propose(1)
  a.record(1, K, K, K, 2.0)  # Accepted whole: no rejection tried.
  assert a.rate == pytest.approx((2 * (1 - 1 / acceptance.WINDOW) + K)
                                 / (3 * (1 - 1 / acceptance.WINDOW) + K))
  pauses = []
  for step in range(0, 4000):
    if a.may_propose(step):
      before = a.resume_step
      a.record(step, K, 0, K, 2.0)
      if a.resume_step != before:
        pauses.append(a.resume_step - step)
  assert pauses[:5] == [PAUSE_STEPS, 2 * PAUSE_STEPS, 4 * PAUSE_STEPS, 8 * PAUSE_STEPS,
                        16 * PAUSE_STEPS]
  assert max(pauses) == acceptance.MAX_PAUSE_STEPS
  a = Acceptance()
  for step in range(MIN_RUNS):
    a.record(step, K, 0, K, 2.0)
  assert a.resume_step == MIN_RUNS - 1 + PAUSE_STEPS and not a.may_propose(MIN_RUNS)
  a.record(MIN_RUNS, K, K, K, 2.0)  # A run planned before the pause began: not counted.
  assert a.num_runs == 0 and a.rate == 1.0


def test_verify_cost_auto_is_the_platforms():
  """"auto" is resolved by the engine for its platform: on CPU each proposal's row adds to
  the step, on TPU and GPU the rows are close to free; a number is kept as given."""
  from jaxserve.config.speculative import ACCELERATOR_VERIFY_COST, CPU_VERIFY_COST_PER_PROPOSAL
  auto = SpeculativeConfig()
  assert auto.verify_cost == "auto"
  for k in (1, 4, 6):
    cpu = SpeculativeConfig(num_speculative_tokens=k).resolved("cpu")
    assert cpu.verify_cost == pytest.approx(1 + CPU_VERIFY_COST_PER_PROPOSAL * k)
  assert auto.resolved("tpu").verify_cost == ACCELERATOR_VERIFY_COST
  assert auto.resolved("gpu").verify_cost == ACCELERATOR_VERIFY_COST
  assert SpeculativeConfig(verify_cost=3).resolved("cpu").verify_cost == 3
  assert SpeculativeConfig.from_json('{"verify_cost": 1.5}').cost == 1.5
  for bad in (0.5, "high", True, None):
    with pytest.raises(ValueError, match="verify_cost"):
      SpeculativeConfig(verify_cost=bad)
