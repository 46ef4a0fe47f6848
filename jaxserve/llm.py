"""The offline API, in the style users know from vLLM:

  llm = jaxserve.LLM()                      # the default model
  outs = llm.generate(["Hi!"], jaxserve.SamplingParams(temperature=0, max_tokens=32))
  outs[0].text, outs[0].token_ids, outs[0].finish_reason
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any, Callable, Sequence, Union

import numpy as np
from flax import nnx

from jaxserve.batching import mm_prompts, pooled
from jaxserve.batching.request import Completion
from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, LoRARequest, SamplingParams, SchedulerConfig
from jaxserve.config.pooling import Task
from jaxserve.engine import compiles, placement
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint, quantize
from jaxserve.loading import lora as lora_loading
from jaxserve.loading import weights as hf_weights
from jaxserve.loading.pooler import for_task

# Text, token ids, or vLLM's dict with images: {"prompt" or "prompt_token_ids": ...,
# "multi_modal_data": {"image": an image or a list}} (batching/mm_prompts.py).
Prompt = Union[str, Sequence[int], Mapping[str, Any]]


class LLM:
  def __init__(self, model: str | None = None, *, engine_config: EngineConfig = EngineConfig(),
               scheduler_config: SchedulerConfig = SchedulerConfig(), warmup: bool = True,
               enable_lora: bool = False, max_loras: int | None = None,
               max_lora_rank: int | None = None, task: str = "generate",
               logprobs_mode: str | None = None):
    """`model`: None (the default model), a packaged model's name, or a path (GGUF file,
    Hugging Face directory, or jaxserve checkpoint). `enable_lora`: serve LoRA adapters, up to
    `max_loras` at once on the device (vLLM's default 1) of rank up to `max_lora_rank` (16);
    more adapters than that take turns (batching/lora_slots.py). `task`: "generate", or a
    pooling model's "embed" (`embed`) or "rerank" (`score`), as vLLM's (loading/pooler.py).
    `logprobs_mode`: vLLM's, what logprobs report (config.LogprobsMode's names; None:
    engine_config's)."""
    engine_config = lora_config(engine_config, enable_lora, max_loras, max_lora_rank)
    if logprobs_mode is not None:
      engine_config = dataclasses.replace(engine_config, logprobs_mode=logprobs_mode)
    mesh = placement.mesh_for(engine_config)
    self.model, self.tokenizer = checkpoint.load_model(model, engine_config.dtype.value, mesh,
                                                       engine_config.quantization)
    engine_config, self.pooler = for_task(task, model, self.model.cfg.dim, self.tokenizer,
                                          engine_config)
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
               chat: bool = False,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
               ) -> list[Completion]:
    """One Completion per prompt, in input order (.text, .token_ids, .finish_reason, and
    .logprobs: one TokenLogprobs per output token when a SamplingParams asks for logprobs > 0).
    `lora_request`: the adapter every prompt runs under, or one per prompt (None: the base
    model); an adapter not added yet is read from its lora_path first (add_lora). A prompt
    with images needs a vision-language model (a ValueError names a text-only one)."""
    if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
      sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if len(sampling_params) != len(prompts):
      raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
    if lora_request is None or isinstance(lora_request, LoRARequest):
      lora_request = [lora_request] * len(prompts)
    if len(lora_request) != len(prompts):
      raise ValueError(f"{len(lora_request)} lora_requests for {len(prompts)} prompts")
    for lora in lora_request:
      if lora is not None and lora.lora_int_id not in self.runner.loras:
        self.add_lora(lora)
    return self.runner.generate([_request(*self._prompt(p, chat), s, lora)
                                 for p, s, lora in zip(prompts, sampling_params, lora_request)])

  def _prompt(self, prompt: Prompt, chat: bool) -> tuple[list[int], tuple]:
    """(token ids, images.ImageSpans placed in them)."""
    if not isinstance(prompt, Mapping):
      return self.encode(prompt, chat), ()
    cfg = self.model.cfg
    return mm_prompts.read(prompt, cfg.vision, cfg.name, lambda text: self.encode(text, chat),
                           lambda i: self.tokenizer.id_to_token(i))

  def add_lora(self, lora: LoRARequest) -> bool:
    """Reads adapter `lora` from its lora_path (a PEFT adapter folder) and makes it available;
    raises ValueError naming the problem (LoRA off, a missing or corrupt file, shapes or a rank
    that do not fit). True, as vLLM's."""
    if not self.engine.config.max_loras:
      raise ValueError(f"LoRA adapter {lora.lora_name!r}: LoRA is off; build the LLM with "
                       "enable_lora=True")
    self.runner.add_lora(lora, lora_reader(self.model.cfg, self.engine.config)(lora.lora_path))
    return True

  def remove_lora(self, lora_id: int) -> bool:
    """Forgets an adapter (its device slot and host copy); False if it was not added."""
    return self.runner.remove_lora(lora_id)

  def list_loras(self) -> set[int]:
    return set(self.runner.loras)

  def sleep(self, level: int = 1) -> int:
    """vLLM's sleep mode: level 1 frees the KV cache, level 2 the weights too (kept in host
    memory); the device bytes freed. `generate` refuses until `wake_up`."""
    return self.runner.sleep(level)

  def wake_up(self) -> None:
    """Back from `sleep`: the same weights, an empty KV cache, nothing compiled again."""
    self.runner.wake_up()
    self._share_weights()

  def update_weights(self, weights, in_flight: str = "finish") -> None:
    """A trainer's weights in place of the engine's, compiling no step again (an int8 engine
    quantizes them again; GGUF blocks are refused): an nnx.Module of the model's family (built
    with `jaxserve.model`), its nnx.State or pure dict (any float dtype, anywhere: a weight
    already as the engine holds it is taken without a copy), or a mapping of Hugging Face names
    to arrays. `in_flight`: the requests of a runner shared with others either "finish" on the
    old weights first or "abort". The prefix cache is forgotten (no KV computed with the old
    weights is read again); `self.model` holds the new weights too. ValueError, changing
    nothing, naming a weight that is missing, extra or misshaped."""
    if isinstance(weights, nnx.Module):
      weights = nnx.state(weights)
    if isinstance(weights, nnx.State):
      weights = nnx.to_pure_dict(weights)
    elif isinstance(weights, Mapping) and any(isinstance(k, str) and "." in k for k in weights):
      weights = hf_weights.hf_params(self.model.cfg, weights)
    self.runner.update_weights(weights, in_flight)
    self._share_weights()

  def update_lora(self, lora: LoRARequest, adapter=None, in_flight: str = "finish") -> None:
    """New weights for an added adapter: `adapter` a PEFT folder's path, or its weights
    (loading.lora.LoraAdapter); None: read again from lora.lora_path. The prefix cache is
    forgotten."""
    if adapter is None or isinstance(adapter, (str, os.PathLike)):
      adapter = lora_reader(self.model.cfg, self.engine.config)(adapter or lora.lora_path)
    self.runner.update_lora(lora, adapter, in_flight)

  def _share_weights(self) -> None:
    """self.model's arrays are the engine's again (unless the engine runs its own unrolled
    copy)."""
    if not self.engine.config.unroll_layers:
      nnx.update(self.model, self.engine.params[0] if self.engine.spec.draft
                 else self.engine.params)

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prefix page, on the device and in the host tier, as vLLM's: no KV
    computed before is reused. True (between `generate` calls no request holds pages)."""
    return self.runner.reset_prefix_cache()

  def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None,
            normalize: bool | None = None) -> list[np.ndarray]:
    """An embedding model's (task "embed") vector of each prompt, float32, in input order: cut
    to `dimensions` (Matryoshka) and normalized as the model's are (or as `normalize` says)."""
    return [self._pooler(Task.EMBED).embedding(row, dimensions, normalize)
            for row in self._pooled(prompts)]

  def score(self, query: str, documents: str | Sequence[str],
            instruction: str | None = None) -> list[float]:
    """Each document's relevance to `query`: a reranker's (task "rerank") probability of "yes"
    on its prompt (pooled.rerank_prompt, `instruction` in it), or an embedding model's cosine
    similarity of the two embeddings."""
    documents = [documents] if isinstance(documents, str) else list(documents)
    if self.pooler is not None and self.pooler.task is Task.RERANK:
      rows = self._pooled([pooled.rerank_prompt(query, d, instruction) for d in documents])
      return [self.pooler.score(row) for row in rows]
    q, *docs = self.embed([query, *documents])
    return [pooled.cosine(q, d) for d in docs]

  def _pooler(self, task: Task) -> pooled.Pooler:
    if self.pooler is None or self.pooler.task is not task:
      raise ValueError(f"{task.value} needs LLM(task={task.value!r}); this LLM's task is "
                       f"{'generate' if self.pooler is None else self.pooler.task.value!r}")
    return self.pooler

  def _pooled(self, prompts: Prompt | Sequence[Prompt]) -> list[np.ndarray]:
    """Each prompt's pooled row (RequestOutput.pooled), prompts checked first."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    pooled.check_inputs(prompts)
    params = SamplingParams(max_tokens=1, pooling=True)
    return [c.pooled for c in self.runner.generate([(self.encode(p), params) for p in prompts])]


def _request(ids: list[int], images: tuple, sampling: SamplingParams, lora) -> tuple:
  """Runner.generate's tuple."""
  return (ids, sampling, lora, images)


def lora_config(config: EngineConfig, enable_lora: bool, max_loras: int | None,
                max_lora_rank: int | None) -> EngineConfig:
  """`config` with LLM's LoRA arguments in (vLLM's defaults: 1 adapter of rank up to 16)."""
  if not enable_lora:
    if max_loras or max_lora_rank:
      raise ValueError("max_loras and max_lora_rank need enable_lora=True")
    return config
  return dataclasses.replace(config, max_loras=max_loras or config.max_loras or 1,
                             max_lora_rank=max_lora_rank or config.max_lora_rank)


def lora_reader(cfg, config: EngineConfig):
  """read(path) -> the PEFT adapter at `path` as the engine takes it, or a ValueError (or
  FileNotFoundError) naming the problem."""
  return functools.partial(lora_loading.load_adapter, cfg=cfg, max_rank=config.max_lora_rank)


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What `load_engine` returns, and what api.server.Server's `load` gives it: a warmed-up engine
  and its tokenizer."""

  engine: Any  # jaxserve.engine.engine.Engine, or any plan.Engine.
  tokenizer: Any
  model_name: str
  # With LoRA on: read_lora(path) reads an adapter's folder (serving/adapters.py), and the
  # adapters served from the start, (name, path, adapter) each (`serve --lora-modules`).
  read_lora: Callable[[str], Any] | None = None
  lora_modules: tuple[tuple[str, str, Any], ...] = ()
  num_compiles: Callable[[], int] = compiles.num_compiles  # The process's XLA compiles.
  pooler: pooled.Pooler | None = None  # A pooling model's (`serve --task embed|rerank`).
  # read_weights(folder): /update_weights_from_disk's reader (serving/weights_from_disk.py).
  read_weights: Callable[[str], Any] | None = None


def load_engine(model: str | None, engine_config: EngineConfig,
                served_model_name: str | None = None,
                lora_modules: Sequence[tuple[str, str]] = (), task: str = "generate") -> Loaded:
  """`jaxserve serve`'s loader: the model, its engine compiled for every bucket, its tokenizer,
  and the LoRA adapters (name, path) it serves from the start, each read (a ValueError naming
  the problem) before any compile. `task`: LLM's."""
  transformer, tokenizer = checkpoint.load_model(model, engine_config.dtype.value,
                                                 placement.mesh_for(engine_config),
                                                 engine_config.quantization)
  engine_config, pooler = for_task(task, model, transformer.cfg.dim, tokenizer, engine_config)
  if lora_modules and not engine_config.max_loras:
    raise ValueError("LoRA modules need LoRA on (--enable-lora)")
  read = lora_reader(transformer.cfg, engine_config) if engine_config.max_loras else None
  modules = tuple((name, path, read(path)) for name, path in lora_modules)
  engine = Engine(transformer, engine_config, stop_ids=tokenizer.stop_ids,
                  draft=load_draft(engine_config, model, transformer, tokenizer))
  engine.warmup()
  return Loaded(engine, tokenizer, served_model_name or transformer.cfg.name, read, modules,
                pooler=pooler, read_weights=read_weights)


def read_weights(folder: str) -> dict:
  """The weights of a Hugging Face safetensors folder or a jaxserve checkpoint, float, in the
  model's layout (what update_weights takes; it names a weight that does not fit)."""
  return quantize.to_float(checkpoint.read_source(folder)[1])


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
