"""What the speculative-decoding tests (n-gram and draft) share: a run on a fresh runner."""

from __future__ import annotations

from jaxserve.batching.runner import Runner
from jaxserve.config import SchedulerConfig, SpeculativeConfig


def run(engine, tokenizer, prompts, sampling, speculative: SpeculativeConfig,
        config=SchedulerConfig()):
  """Completions of `prompts` on a fresh runner that speculates as `speculative` says (proposals
  shorter than the engine's verified runs are padded), and its scheduler."""
  runner = Runner(engine, tokenizer, config)
  runner.scheduler.speculative = speculative
  return runner.generate([(p, sampling) for p in prompts]), runner.scheduler


def tokens(completions):
  return [list(c.token_ids) for c in completions]
