"""Images for the media tests: encoded files, data URLs, and a tokenizer whose chat template
renders image parts as Gemma 3's does (its official template's content loop)."""

from __future__ import annotations

import base64
import copy
import io
import struct
import zlib

import numpy as np
import PIL.Image

# Gemma 3's content handling: a string, or parts whose images render as <start_of_image>.
MM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def pixels(height: int = 17, width: int = 23, channels: int = 3, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, (height, width, channels), np.uint8)


def encode(arr: np.ndarray, fmt: str = "PNG", **options) -> bytes:
  out = io.BytesIO()
  PIL.Image.fromarray(arr).save(out, fmt, **options)
  return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
  return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb(side: int = 20_000) -> bytes:
  """A 1x1 PNG whose header (IHDR, its CRC fixed) declares side x side pixels: 70 bytes that
  would decode to gigabytes."""
  png = encode(np.zeros((1, 1, 3), np.uint8))
  ihdr = b"IHDR" + struct.pack(">II", side, side) + png[24:29]  # Width, height, then the rest.
  return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


def image_part(url: str) -> dict:
  return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict) -> list[dict]:
  return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def mm_tokenizer(tokenizer):
  """`tokenizer` (a jaxserve Tokenizer) with MM_TEMPLATE as its chat template."""
  out = copy.copy(tokenizer)
  out.chat_template = MM_TEMPLATE
  out._compiled_template = None  # pylint: disable=protected-access
  return out


def write_char_tokenizer(path, special: dict[int, str], words: dict[int, str], config: dict,
                         vocab_size: int = 256, unk: str = "<unk>") -> None:
  """A character-level tokenizer.json (every printable character one token, `special` (which
  holds `unk`) and `words` at their ids, the rest unused) and `config` as
  tokenizer_config.json, into `path`."""
  import json
  import string

  import tokenizers
  from tokenizers import AddedToken, decoders, models

  named = {**special, **words}
  free = iter(i for i in range(vocab_size) if i not in named)
  vocab = {c: next(free) for c in [*string.printable[:95], "\n"]}
  vocab.update({f"<unused{i}>": i for i in free})
  vocab.update({t: i for i, t in named.items()})
  tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token=unk))
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t in special.values()])
  tok.add_tokens([AddedToken(t, normalized=False) for t in words.values()])
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(config))


def hf_engine(path, config, stop_ids=()):
  """The engine of a Hugging Face folder (a tiny vision-language model's), warmed up."""
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint, weights

  cfg, params = weights.load_hf_dir(path)
  engine = Engine(checkpoint.build_model(cfg, params), config, stop_ids=stop_ids)
  engine.warmup()
  return engine


def hf_greedy(hf, ids: list[int], num_tokens: int, **inputs) -> tuple[list[int], list[float]]:
  """transformers' greedy tokens after prompt `ids` and their logprobs (of the raw logits:
  min_new_tokens' processor masks the end token in `scores`); `inputs`: the model's image
  inputs, as torch tensors."""
  import torch

  with torch.no_grad():
    out = hf.generate(torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                      do_sample=False, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=0, **inputs)
  tokens = out.sequences[0, len(ids):].tolist()
  logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens)]
  return tokens, logprobs


def served_chat(srv, tokenizer, pngs: list[bytes], num_tokens: int
                ) -> tuple[int, list[int], list[float]]:
  """The prompt's length, and the greedy tokens and logprobs a live server gave a chat of these
  PNG images (data URLs, through the official openai client)."""
  from support.openai_http import openai_client

  out = openai_client(srv).chat.completions.create(
      model="", messages=chat(*[image_part(data_url(p)) for p in pngs]), max_tokens=num_tokens,
      temperature=0, logprobs=True, extra_body={"ignore_eos": True})
  content = out.choices[0].logprobs.content
  return (out.usage.prompt_tokens, [tokenizer.token_to_id(c.token) for c in content],
          [c.logprob for c in content])
