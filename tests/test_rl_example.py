"""scripts/rl.py, the on-policy RL example (issue 49): with a fixed seed, 30 steps of rollouts
from jaxserve, optax updates and `update_weights` raise the mean reward; the engine's logprobs
of the tokens it sampled are the trainer's forward of the same tokens, after those updates."""

import numpy as np
import pytest

from support import script_loader

STEPS = 30


@pytest.fixture(scope="module")
def trained():
  """The example's loop after STEPS steps from seed 0, and each step's results."""
  rl = script_loader.load("rl")
  loop = rl.Loop.create(seed=0)
  return rl, loop, [loop.step(i) for i in range(STEPS)]


def test_the_mean_reward_rises(trained):
  _, _, results = trained
  rewards = [r["reward"] for r in results]
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  # A random policy: 1/20 per position (the vocabulary's 20 tokens).
  assert first < 0.15, rewards
  assert last > first + 0.15, rewards
  assert all(r[p] >= 0 for r in results for p in ("rollout", "train", "update"))


def test_the_engines_logprobs_are_the_trainers_forward(trained):
  """Sampled at temperature 1 by the engine after STEPS weight updates; scored by the trainer's
  own forward of the policy: the same numbers, so the rollout is on-policy (a stale engine would
  differ by far more)."""
  rl, loop, _ = trained
  prompts, answers, outs = loop.rollout(seed=12345)
  ids, mask = rl.batch(prompts, answers, 2 * rl.PAGE)
  trainer = np.asarray(rl.token_logprobs(loop.policy, ids, mask))
  for i, (p, a, out) in enumerate(zip(prompts, answers, outs)):
    engine = [t.logprob for t in out.logprobs]
    np.testing.assert_allclose(engine, trainer[i, len(p):len(p) + len(a)], atol=1e-4)
