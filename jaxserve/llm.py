"""The offline API, in the style users know from vLLM:

  llm = jaxserve.LLM()                      # the default model
  outs = llm.generate(["Hi!"], jaxserve.SamplingParams(temperature=0, max_tokens=32))
  outs[0].text, outs[0].token_ids, outs[0].finish_reason
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Union

from jaxserve.batching.request import Completion
from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, SamplingParams, SchedulerConfig
from jaxserve.engine import placement
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint

Prompt = Union[str, Sequence[int]]


class LLM:
  def __init__(self, model: str | None = None, *, engine_config: EngineConfig = EngineConfig(),
               scheduler_config: SchedulerConfig = SchedulerConfig(), warmup: bool = True):
    """`model`: None (the default model), a packaged model's name, or a path (GGUF file,
    Hugging Face directory, or jaxserve checkpoint)."""
    mesh = placement.mesh_for(engine_config)
    self.model, self.tokenizer = checkpoint.load_model(model, engine_config.dtype.value, mesh,
                                                       engine_config.quantization)
    self.engine = Engine(self.model, engine_config, stop_ids=self.tokenizer.stop_ids,
                         draft=load_draft(engine_config, model, self.model, self.tokenizer))
    if warmup:
      self.engine.warmup()
    self.runner = Runner(self.engine, self.tokenizer, scheduler_config)

  def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
    """Token ids of a prompt: ids pass through; text gets the chat template when `chat`."""
    if not isinstance(prompt, str):
      return list(prompt)
    if chat:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
      return self.tokenizer.encode(text, add_bos=False)
    return self.tokenizer.encode(prompt)

  def generate(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               chat: bool = False) -> list[Completion]:
    """One Completion per prompt, in input order (.text, .token_ids, .finish_reason, and
    .logprobs: one TokenLogprobs per output token when a SamplingParams asks for logprobs > 0)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
      sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if len(sampling_params) != len(prompts):
      raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
    return self.runner.generate([(self.encode(p, chat), s)
                                 for p, s in zip(prompts, sampling_params)])


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What `load_engine` returns, and what api.server.Server's `load` gives it: a warmed-up engine
  and its tokenizer."""

  engine: Any  # jaxserve.engine.engine.Engine, or any plan.Engine.
  tokenizer: Any
  model_name: str


def load_engine(model: str | None, engine_config: EngineConfig,
                served_model_name: str | None = None) -> Loaded:
  """`jaxserve serve`'s loader: the model, its engine compiled for every bucket, its tokenizer."""
  transformer, tokenizer = checkpoint.load_model(model, engine_config.dtype.value,
                                                 placement.mesh_for(engine_config),
                                                 engine_config.quantization)
  engine = Engine(transformer, engine_config, stop_ids=tokenizer.stop_ids,
                  draft=load_draft(engine_config, model, transformer, tokenizer))
  engine.warmup()
  return Loaded(engine, tokenizer, served_model_name or transformer.cfg.name)


def load_draft(engine_config: EngineConfig, model: str | None, transformer, tokenizer):
  """The speculative draft model (SpeculativeConfig(method="draft")), or None. Named as the
  target is (`model`), it is the target itself: its weights are not loaded twice. Raises
  ValueError when its tokenizer is not the target's (a draft proposes the target's token ids)."""
  spec = engine_config.speculative
  if spec is None or spec.method != "draft":
    return None
  if spec.draft_model == model:
    return transformer
  draft, draft_tokenizer = checkpoint.load_model(spec.draft_model, engine_config.dtype.value,
                                                 None, engine_config.quantization)
  differs = vocabulary_difference(tokenizer, draft_tokenizer)
  if differs:
    raise ValueError(f"draft model {spec.draft_model!r}: its tokenizer is not the target's "
                     f"({differs}); a draft must share the target's tokenizer")
  return draft


def vocabulary_difference(a, b) -> str | None:
  """Where tokenizers a and b first differ (size, a token's spelling), or None: the same."""
  if a.vocab_size != b.vocab_size:
    return f"{a.vocab_size} tokens against {b.vocab_size}"
  for i in range(a.vocab_size):
    if a.id_to_token(i) != b.id_to_token(i):
      return f"token {i} is {a.id_to_token(i)!r} against {b.id_to_token(i)!r}"
  return None
