"""One prompt checked and made ready to run, on a worker (service.Service.prepare_runs calls it):
its images decoded (media.py), its ids encoded with each image's placeholder expanded
(prompt_ids.py, vision_prompts.py), its fields checked and max_tokens fitted to the context
(client_fields.py), its images placed in the ids and preprocessed. The tokenizer routes take the
same path to their ids. Each bad field is an ApiError naming it.
"""

from __future__ import annotations

import time
from typing import Any

from jaxserve.serving import client_fields
from jaxserve.serving.media import MediaLimits, MediaLoader
from jaxserve.serving.prompt_ids import PromptEncoder
from jaxserve.serving.requests import GenerateInput, Prepared, Prompt
from jaxserve.serving.vision_prompts import VisionPrompts


class PromptPreparer:

  def __init__(self, tokenizer: Any, info: Any, model_name: str, media: MediaLimits,
               disaggregated: bool = False):
    """`info`: the engine's EngineInfo; `disaggregated`: a P/D decode server (no images)."""
    self.vocab_size = info.vocab_size
    self.max_model_len = info.max_model_len
    self.vision = VisionPrompts(tokenizer, info.vision, disaggregated)
    self.media = MediaLoader(media, model_name, info.max_images)
    self.encoder = PromptEncoder(tokenizer, self.max_model_len, self.vocab_size,
                                 self.vision.expand)

  def encode(self, prompt: Prompt, truncate: bool = False, add_special_tokens: bool | None = None,
             add_generation_prompt: bool = True) -> list[int]:
    """The tokenizer routes' ids (and a pooling request's): a chat's images decoded and checked
    as for generation, each placeholder expanded for its image (a Qwen2.5-VL image's count
    follows its size)."""
    images = self.media.load(prompt.images, prompt.messages)
    return self.encoder.encode(prompt, truncate, add_special_tokens, add_generation_prompt, images)

  def prepare(self, inp: GenerateInput, lora: Any) -> Prepared:
    """Every check of one prompt but its model's (`lora`, resolved by the caller)."""
    client_fields.check_request_id(inp.request_id or "")
    chunk_tokens = client_fields.check_chunk_tokens(inp.chunk_tokens)
    fields = client_fields.checked_sampling_fields(inp.sampling, self.vocab_size)
    images = self.media.load(inp.prompt.images, inp.prompt.messages)  # Before tokenizing.
    start = time.monotonic()
    ids = self.encoder.encode(inp.prompt, inp.truncate_prompt, images=images)
    tokenize = time.monotonic() - start
    ids, max_tokens = client_fields.fit_to_context(ids, inp.max_tokens, self.max_model_len,
                                                   inp.truncate_prompt, inp.default_max_tokens)
    sampling = client_fields.sampling_params(fields, max_tokens, inp.logprobs)
    client_fields.check_bias_ids(sampling, self.vocab_size)
    spans = self.vision.place(ids, images)  # Preprocessed here, on the worker.
    return Prepared(ids, sampling, tokenize, chunk_tokens, lora, images, spans)
