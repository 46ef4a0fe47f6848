"""What the speculative-decoding tests (n-gram and draft) share: a run on a fresh runner."""

from __future__ import annotations

import dataclasses

from jaxserve.batching.runner import Runner
from jaxserve.config import SchedulerConfig


def warm_engine(default_model, config, draft: bool = False):
  """The default model's engine on `config`, warmed up; `draft`: the model as its own draft."""
  from jaxserve.engine.engine import Engine
  model, tokenizer = default_model
  engine = Engine(model, config, stop_ids=tokenizer.stop_ids, draft=model if draft else None)
  engine.warmup()
  return engine


def run(engine, tokenizer, prompts, sampling, k: int | None = None, config=SchedulerConfig()):
  """Completions of `prompts` on a fresh runner that speculates as the engine's config says, at
  most k tokens proposed (shorter proposals than the engine's verified runs are padded), and its
  scheduler."""
  speculative = engine.config.speculative
  if k is not None:
    speculative = dataclasses.replace(speculative, num_speculative_tokens=k)
  runner = Runner(engine, tokenizer, config)
  runner.scheduler.speculative = speculative
  return runner.generate([(p, sampling) for p in prompts]), runner.scheduler


def tokens(completions):
  return [list(c.token_ids) for c in completions]
