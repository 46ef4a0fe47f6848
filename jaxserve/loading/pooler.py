"""A pooling model's settings (`serve --task embed|rerank`, `LLM(task=...)`): how its hidden
states are pooled, and what the front ends do with the result.

Read from sentence-transformers' files where the model has them (`modules.json`: a Normalize
module or none; `1_Pooling/config.json`: last-token, mean or CLS pooling) and from its
config.json (`matryoshka_dimensions`, or `is_matryoshka`: any length). Without them, a decoder's
defaults: last-token pooling, normalized, as Qwen3-Embedding. A reranker is read at the last
token: its "no" and "yes" logits (Qwen3-Reranker's labels)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jaxserve.batching.pooled import Pooler
from jaxserve.config import EngineConfig, PoolingConfig, PoolingMode
from jaxserve.config.pooling import Task

RERANK_LABELS = ("no", "yes")  # In this order: Pooler.score reads "no" first.
# 1_Pooling/config.json's flags, by the mode each names.
_POOLING_FLAGS = {"pooling_mode_lasttoken": PoolingMode.LAST,
                  "pooling_mode_mean_tokens": PoolingMode.MEAN,
                  "pooling_mode_cls_token": PoolingMode.CLS}


def for_task(task: Task | str, model: str | None, dim: int, tokenizer,
             config: EngineConfig) -> tuple[EngineConfig, Pooler | None]:
  """(the engine config with its pooling steps, the Pooler) for `task`; (config, None) to
  generate. `model`: the model's path (its sentence-transformers files are read when it is a
  folder), `dim` its hidden size. Raises ValueError naming the problem."""
  task = _task(task)
  if task is Task.GENERATE:
    return config, None
  folder = pathlib.Path(model) if model and pathlib.Path(model).is_dir() else None
  if task is Task.RERANK:
    ids = tuple(_label_id(tokenizer, label) for label in RERANK_LABELS)
    return (dataclasses.replace(config, pooling=PoolingConfig(PoolingMode.LAST, ids)),
            Pooler(task, dim, normalize=False))
  mode, normalize = _sentence_transformers(folder)
  pooler = Pooler(task, dim, normalize, _matryoshka(folder))
  return dataclasses.replace(config, pooling=PoolingConfig(mode)), pooler


def _task(task: Task | str) -> Task:
  if isinstance(task, Task):
    return task
  if task not in {t.value for t in Task}:
    raise ValueError(f"task must be one of {[t.value for t in Task]}, got {task!r}")
  return Task(task)


def _label_id(tokenizer, label: str) -> int:
  ids = tokenizer.encode(label, add_bos=False)
  if len(ids) != 1:
    raise ValueError(f"a reranker needs {label!r} to be one token of its vocabulary; this "
                     f"tokenizer makes it {len(ids)}")
  return ids[0]


def _sentence_transformers(folder: pathlib.Path | None) -> tuple[PoolingMode, bool]:
  """(pooling mode, normalize) from the model's sentence-transformers files, or the decoder
  defaults (last token, normalized) without them."""
  modules = _json(folder, "modules.json")
  if modules is None:
    return PoolingMode.LAST, True
  normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
  pooling = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")),
                 None)
  flags = _json(folder, f"{pooling}/config.json") if pooling else None
  modes = [mode for flag, mode in _POOLING_FLAGS.items() if (flags or {}).get(flag)]
  if flags is not None and len(modes) != 1:
    raise ValueError(f"{folder}/{pooling}/config.json: jaxserve pools by one of "
                     f"{sorted(_POOLING_FLAGS)}, this model asks for {len(modes)}")
  return (modes[0] if modes else PoolingMode.LAST), normalize


def _matryoshka(folder: pathlib.Path | None) -> tuple[int, ...] | None:
  """The lengths the model's embeddings may be cut to: config.json's matryoshka_dimensions, any
  (None) where is_matryoshka is set, else none (())."""
  cfg = _json(folder, "config.json") or {}
  if cfg.get("matryoshka_dimensions"):
    return tuple(int(d) for d in cfg["matryoshka_dimensions"])
  return None if cfg.get("is_matryoshka") else ()


def _json(folder: pathlib.Path | None, name: str):
  if folder is None or not (folder / name).is_file():
    return None
  return json.loads((folder / name).read_text())
