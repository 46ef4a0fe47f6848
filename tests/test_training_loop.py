"""The engine inside a training loop (issue 49): `sleep` frees what it says, counted from
`jax.live_arrays()`, refuses what it must, and `wake_up` gives back the same greedy tokens with
nothing compiled; pause in vLLM's three modes loses no request: each one paused, or submitted
while paused or asleep, ends with the tokens and logprobs of a run without the pause (a tiny
random Llama). The served controls are tested in test_http_routes.py."""

import gc

import jax
import pytest
from flax import nnx

from jaxserve.batching.request import FinishReason, PauseMode
from jaxserve.batching.runner import Runner
from jaxserve.config import KVDtype, SamplingParams, SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.llm import LLM
from jaxserve.model.llama import Transformer
from jaxserve.planning import capacity
from support.mock_engine import MockTokenizer
from support.tiny import TINY, TINY_ENGINE, count_compiles

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [([3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67], GREEDY),
           ([2, 4, 6, 8], GREEDY)]


def live_bytes() -> int:
  gc.collect()
  return sum(x.nbytes for x in jax.live_arrays())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_what_it_says_and_wake_up_gives_the_same_tokens(level):
  # A model of its own: level 2 deletes the weights the engine shares with it.
  model = Transformer(TINY, rngs=nnx.Rngs(0))
  engine = Engine(model, TINY_ENGINE)
  engine.warmup()
  runner = Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))
  tokens = lambda: [list(c.token_ids) for c in runner.generate(PROMPTS)]
  before, again = tokens(), tokens()
  assert runner.scheduler.pages.num_hit_tokens > 0  # The second run found the first's pages.
  want = engine.cache.num_bytes
  if level == 2:
    want += sum(x.nbytes for x in jax.tree.leaves(engine.params))
  # What `jaxserve plan` counts for these pages and weights (CapacityPlan.sleep_bytes).
  kv = capacity.kv_bytes_per_token(TINY, KVDtype.FLOAT32) * engine.info.page_size
  assert want == kv * engine.info.num_pages + (level == 2) * capacity.weight_bytes(
      TINY, capacity.WeightDtype.FLOAT32)
  live = live_bytes()
  assert runner.sleep(level) == want and live - live_bytes() == want
  with pytest.raises(RuntimeError, match="asleep"):
    runner.step()
  with pytest.raises(ValueError, match="asleep already"):
    runner.sleep(1)
  hits = runner.scheduler.pages.num_hit_tokens
  with count_compiles() as counts:
    runner.wake_up()
    assert tokens() == before == again
  assert counts == {"trace": 0, "compile": 0}
  assert runner.scheduler.pages.num_hit_tokens == hits  # The KV is gone: nothing was found.


def test_sleep_refuses_a_bad_level_and_a_running_request(engine):
  runner = new_runner(engine)
  with pytest.raises(ValueError, match="sleep level must be 1"):
    engine.sleep(3)
  runner.submit(runner.new_request(*PROMPTS[0]))
  runner.step()  # Admitted: it holds pages now.
  with pytest.raises(ValueError, match="1 requests are running"):
    runner.sleep(1)
  assert engine.sleep_level == 0 and engine.cache is not None
  runner.abort(runner.scheduler.running[0].request_id)
  runner.step()


# Pause and resume (vLLM's pause_generation modes), offline: the caller steps the runner.

# 6 requests for 4 slots; logprobs too: the tiny model's greedy tokens are all alike, their
# logprobs (of each prompt's own context) are not.
TRACED = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
LOAD = [([5 + i, 9, 2 * i + 1, 7, 3] * (2 + i % 3), TRACED) for i in range(6)]
LATE = [([4, 8, 15, 16, 23, 42], TRACED), ([1, 2, 3], TRACED)]  # Submitted while paused.


@pytest.fixture(scope="module")
def engine(tiny_model):
  """One engine for the pause tests (each runner its own scheduler and prefix cache)."""
  return Engine(tiny_model, TINY_ENGINE)


@pytest.fixture(scope="module")
def reference(engine):
  """What each of LOAD + LATE gives without a pause: a fresh runner's."""
  runner = new_runner(engine)
  return [trace(c.token_ids, c.logprobs, approx=True) for c in runner.generate(LOAD + LATE)]


def new_runner(engine) -> Runner:
  return Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))


def submit(runner, prompts) -> list[str]:
  return [runner.add_request(*p).request_id for p in prompts]


def run(runner, outputs: dict, steps: int | None = None) -> None:
  """Steps `steps` times, or while step() has anything to do; each output by request."""
  for _ in range(steps) if steps is not None else iter(lambda: runner.can_step, False):
    for out in runner.step():
      outputs.setdefault(out.request_id, []).append(out)


def trace(token_ids, logprobs, approx: bool = False) -> tuple:
  """The tokens, and each one's top 2 (ids, and logprobs within 1e-4 of the reference's)."""
  values = [v for lp in logprobs for v in lp.top_logprobs]
  return (list(token_ids), [lp.top_ids for lp in logprobs],
          pytest.approx(values, abs=1e-4) if approx else values)


def traces(outputs: dict, ids) -> list[tuple]:
  return [trace([t for out in outputs[i] for t in out.token_ids],
                [lp for out in outputs[i] for lp in out.logprobs]) for i in ids]


def test_keep_freezes_every_request_and_resume_goes_on_to_the_same_tokens(engine, reference):
  runner, outputs = new_runner(engine), {}
  ids = submit(runner, LOAD)
  run(runner, outputs, steps=4)
  runner.pause(PauseMode.KEEP)
  run(runner, outputs, steps=1)  # The step in flight comes back; nothing new is dispatched.
  frozen = [len(r.all_token_ids) for r in runner.scheduler.running]
  late = submit(runner, LATE)  # Queues.
  assert frozen and not runner.can_step and runner.has_unfinished
  run(runner, outputs, steps=3)
  assert [len(r.all_token_ids) for r in runner.scheduler.running] == frozen
  assert not set(late) & set(outputs)
  runner.resume()
  run(runner, outputs)
  assert traces(outputs, ids + late) == reference


def test_wait_lets_the_running_finish_and_admits_no_other_until_resume(engine, reference):
  runner, outputs = new_runner(engine), {}
  ids = submit(runner, LOAD)
  while len(runner.scheduler.running) < 4:
    run(runner, outputs, steps=1)
  running = {r.request_id for r in runner.scheduler.running}
  assert len(runner.scheduler.waiting) == 2
  runner.pause(PauseMode.WAIT)
  late = submit(runner, LATE)
  with pytest.raises(RuntimeError, match="paused"):
    runner.generate(PROMPTS)
  run(runner, outputs)  # Until nothing may run.
  assert set(outputs) == running and all(outputs[i][-1].finished for i in running)
  assert len(runner.scheduler.waiting) == 4 and not runner.scheduler.running
  runner.resume()
  run(runner, outputs)
  assert traces(outputs, ids + late) == reference


def test_abort_then_sleep_at_once_ends_every_request_and_those_after_run_after_wake_up(
    engine, reference):
  """vLLM's sleep: pause(ABORT) and sleep between two steps, a step still in flight (stale:
  its requests are gone); the aborts' last outputs come out while the engine sleeps."""
  runner, outputs = new_runner(engine), {}
  ids = submit(runner, LOAD)
  run(runner, outputs, steps=3)
  runner.pause(PauseMode.ABORT)
  assert runner.sleep(1) > 0 and not runner.can_step
  for out in runner.take_outbox():
    outputs.setdefault(out.request_id, []).append(out)
  assert [outputs[i][-1].finish_reason for i in ids] == [FinishReason.ABORT] * len(ids)
  late = submit(runner, LATE)
  runner.wake_up()
  run(runner, outputs)
  assert all(i not in outputs for i in late) and not runner.scheduler.running
  runner.resume()
  run(runner, outputs)
  assert traces(outputs, late) == reference[len(LOAD):]
  assert not runner.has_unfinished


def test_sleep_after_a_wait_keeps_the_queued_requests_for_after_wake_up(engine, reference):
  runner, outputs = new_runner(engine), {}
  ids = submit(runner, LOAD)
  run(runner, outputs, steps=2)
  runner.pause(PauseMode.WAIT)
  with pytest.raises(ValueError, match="3 requests are running"):
    runner.sleep(1)
  run(runner, outputs)
  assert runner.sleep(1) > 0
  late = submit(runner, LATE)  # Queued while asleep.
  assert not runner.can_step
  runner.wake_up()
  runner.resume()
  run(runner, outputs)
  assert traces(outputs, ids + late) == reference


def test_llm_sleep_and_wake_up_keep_its_model_and_text(tiny_checkpoint):
  llm = LLM(str(tiny_checkpoint), engine_config=TINY_ENGINE)
  params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
  before = llm.generate("The sky is", params)[0].text
  assert llm.sleep(2) > 0 and llm.reset_prefix_cache()
  llm.wake_up()
  assert llm.generate("The sky is", params)[0].text == before
  # The model object's weights are the engine's again, alive.
  assert all(not x.is_deleted() for x in jax.tree.leaves(nnx.state(llm.model)))
