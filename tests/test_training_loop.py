"""The engine inside a training loop (issue 49): `sleep` frees what it says, counted from
`jax.live_arrays()`, refuses what it must, and `wake_up` gives back the same greedy tokens with
nothing compiled (a tiny random Llama)."""

import gc

import jax
import pytest
from flax import nnx

from jaxserve.batching.runner import Runner
from jaxserve.config import SamplingParams, SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.llm import LLM
from jaxserve.model.llama import Transformer
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


def test_sleep_refuses_a_bad_level_and_an_unfinished_request(tiny_model):
  engine = Engine(tiny_model, TINY_ENGINE)
  runner = Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))
  with pytest.raises(ValueError, match="sleep level must be 1"):
    engine.sleep(3)
  runner.submit(runner.new_request(*PROMPTS[0]))
  with pytest.raises(ValueError, match="1 requests are unfinished"):
    runner.sleep(1)
  assert engine.sleep_level == 0 and engine.cache is not None


def test_llm_sleep_and_wake_up_keep_its_model_and_text(tiny_checkpoint):
  llm = LLM(str(tiny_checkpoint), engine_config=TINY_ENGINE)
  params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
  before = llm.generate("The sky is", params)[0].text
  assert llm.sleep(2) > 0 and llm.reset_prefix_cache()
  llm.wake_up()
  assert llm.generate("The sky is", params)[0].text == before
  # The model object's weights are the engine's again, alive.
  assert all(not x.is_deleted() for x in jax.tree.leaves(nnx.state(llm.model)))
