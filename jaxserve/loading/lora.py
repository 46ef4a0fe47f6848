"""PEFT LoRA adapters as `save_pretrained` writes them (a folder of `adapter_config.json` and
`adapter_model.safetensors`) read into numpy and checked against the base model's config.

A tensor is `base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj..down_proj}.lora_{A|B}
.weight`: A [r, I], B [O, r] (torch's [out, in]). What comes back is A [L, I, r] and B [L, r, O]
per target, scaling folded into B, zeros for layers the adapter leaves alone. Every problem is
a ValueError naming it; nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re

import numpy as np
from safetensors.numpy import load_file

from jaxserve.config import LoraConfig, ModelConfig
from jaxserve.config.lora import TARGETS, target_dims

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight")


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
  """One adapter's weights on the host: target (our weight name) -> (A [L, I, r], B [L, r, O])
  float32, B times the scaling. Targets the adapter does not have are absent. `digest`: the
  sha256 of its two files, which names its content (two folders of the same files share one
  host copy in the engine)."""

  config: LoraConfig
  weights: dict[str, tuple[np.ndarray, np.ndarray]]
  digest: str = ""

  @property
  def rank(self) -> int:
    return self.config.r


def load_adapter(path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
  """The adapter in folder `path` for a base model of `cfg`, of rank at most `max_rank`."""
  path = pathlib.Path(path)
  config = read_config(path)
  if config.r > max_rank:
    raise ValueError(f"LoRA adapter {path}: rank {config.r} is more than max_lora_rank "
                     f"{max_rank}")
  tensors = _read_tensors(path)
  _check_finite(tensors, path)
  found = _by_target(tensors, path, cfg.num_layers)
  dims = target_dims(cfg)
  weights = {}
  for target, layers in found.items():
    I, O = dims[target]
    a = np.zeros((cfg.num_layers, I, config.r), np.float32)
    b = np.zeros((cfg.num_layers, config.r, O), np.float32)
    for i, pair in layers.items():
      a_rI, b_Or = _checked(pair, (I, O), config.r, f"{path}: layer {i} {target}")
      a[i], b[i] = a_rI.T, b_Or.T * config.scaling
      if not np.isfinite(b[i]).all():
        raise ValueError(f"LoRA adapter {path}: layer {i} {target}'s lora_B times the scaling "
                         f"{config.scaling:g} is not finite in float32")
    weights[target] = (a, b)
  return LoraAdapter(config, weights, _digest(path))


def _digest(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  for name in (CONFIG, WEIGHTS):
    h.update((path / name).read_bytes())
  return h.hexdigest()


def _check_finite(tensors: dict[str, np.ndarray], path) -> None:
  """A NaN or Inf in any tensor is refused by the tensor's name: one would reach every row of
  every step it runs in."""
  for key, value in tensors.items():
    if not np.isfinite(np.asarray(value, np.float32)).all():
      raise ValueError(f"LoRA adapter {path}: tensor {key} holds NaN or Inf values")


def read_config(path: pathlib.Path) -> LoraConfig:
  file = path / CONFIG
  if not file.is_file():
    raise ValueError(f"LoRA adapter {path}: no {CONFIG} (a PEFT adapter folder holds {CONFIG} "
                     f"and {WEIGHTS})")
  try:
    d = json.loads(file.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"LoRA adapter {file}: not readable JSON ({e})") from None
  if not isinstance(d, dict):
    raise ValueError(f"LoRA adapter {file}: not a JSON object")
  return LoraConfig.from_dict(d, f"LoRA adapter {file}")


def _read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  file = path / WEIGHTS
  if not file.is_file():
    also = " (adapter_model.bin is not read: save with safe_serialization)" if (
        path / "adapter_model.bin").exists() else ""
    raise ValueError(f"LoRA adapter {path}: no {WEIGHTS}{also}")
  try:
    return load_file(file)
  except Exception as e:  # safetensors raises its own error types for a damaged file.
    raise ValueError(f"LoRA adapter {file}: not a readable safetensors file ({e})") from None


def _by_target(tensors: dict[str, np.ndarray], path, num_layers: int) -> dict:
  """target -> layer -> {"A": ..., "B": ...}; any other tensor refused by name."""
  found, unknown = {}, []
  for key, value in tensors.items():
    m = _KEY.fullmatch(key)
    if m is None or m.group(2) not in TARGETS or int(m.group(1)) >= num_layers:
      unknown.append(key)
      continue
    layer, target = int(m.group(1)), TARGETS[m.group(2)]
    found.setdefault(target, {}).setdefault(layer, {})[m.group(3)] = value
  if unknown:
    raise ValueError(f"LoRA adapter {path}: tensors jaxserve cannot apply to this base model "
                     f"({len(unknown)}): {sorted(unknown)[:4]} (LoRA A/B on "
                     f"{', '.join(TARGETS)} of layers 0..{num_layers - 1} only)")
  if not found:
    raise ValueError(f"LoRA adapter {path}: {WEIGHTS} holds no LoRA tensors")
  return found


def _checked(pair: dict, dims: tuple[int, int], r: int, where: str):
  """(A [r, I], B [O, r]) float32, or a ValueError naming the shape that does not fit."""
  if set(pair) != {"A", "B"}:
    raise ValueError(f"LoRA adapter {where}: lora_A and lora_B come in pairs, found only "
                     f"lora_{''.join(pair)}")
  (I, O), a, b = dims, pair["A"], pair["B"]
  if a.shape != (r, I) or b.shape != (O, r):
    raise ValueError(f"LoRA adapter {where}: lora_A {list(a.shape)} and lora_B "
                     f"{list(b.shape)} do not fit the base model (expected [{r}, {I}] and "
                     f"[{O}, {r}] at rank {r})")
  return a.astype(np.float32), b.astype(np.float32)
