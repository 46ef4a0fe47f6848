"""Where the model's logical axes go on a device mesh: the rules of tensor and data parallelism.

The mesh has two axes, `data` (dp) and `model` (tp). Weights are split Megatron-style over
`model`: attention by heads (wq/wk/wv by output head, wo by input head) and the MLP by its hidden
columns (w_gate/w_up by column, w_down by row), so each layer needs one all-reduce after attention
and one after the MLP; the embedding (and tied head) is split by vocabulary. The KV cache is split
by KV head over `model`, so each device holds only the K/V of its own heads. Decode slots are split
over `data`. A mixture of experts (model/moe.py) splits its experts over a third axis, `expert`
(ep, present only when ep > 1), and each expert's hidden columns over `model`. Everything else
is replicated, and XLA's SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

import types
from typing import Sequence

from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig

DATA, MODEL, EXPERT = "data", "model", "expert"

# Logical axis name (the model's parameters, the KV cache) -> mesh axis. Absent names are
# replicated.
RULES = types.MappingProxyType({
    "heads": MODEL, "kv_heads": MODEL, "mlp": MODEL, "vocab": MODEL, "slots": DATA,
    # The ragged KV layout's page-row lanes: one group of lanes per device's KV heads.
    "kv_lanes": MODEL,
    "expert": EXPERT, "expert_mlp": MODEL})

# Axes that must divide evenly: splitting heads unevenly would split a GQA group across devices.
# The vocabulary falls back to replicated instead (an odd vocab size is common: 32001, 50257).
MUST_DIVIDE = ("kv_heads", "heads", "mlp", "expert", "expert_mlp")


def check_divisible(cfg: ModelConfig, tp: int, dp: int, num_slots: int, ep: int = 1) -> None:
  """Raises ValueError, naming the flag to change, when the model cannot be split this way."""
  if ep > 1 and cfg.num_experts % ep:
    raise ValueError(f"--ep {ep} does not divide {cfg.name}'s {cfg.num_experts} experts"
                     if cfg.num_experts else f"--ep {ep}: {cfg.name} has no experts to split")
  if cfg.num_experts and cfg.expert_hidden_dim % tp:
    raise ValueError(f"--tp {tp} does not divide {cfg.name}'s expert hidden dim "
                     f"{cfg.expert_hidden_dim}")
  sizes = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "mlp": cfg.hidden_dim}
  for name in ("kv_heads", "heads", "mlp"):
    if sizes[name] % tp:
      divisors = [d for d in range(1, cfg.num_kv_heads + 1)
                  if not (cfg.num_heads % d or cfg.num_kv_heads % d or cfg.hidden_dim % d)]
      raise ValueError(f"--tp {tp} does not divide {cfg.name}'s {sizes[name]} {name}; "
                       f"tensor parallelism splits whole heads, so tp must be one of {divisors}")
  if num_slots % dp:
    raise ValueError(f"--dp {dp} does not divide the {num_slots} decode slots")


def logical_to_mesh(spec: Sequence[str | None], shape: Sequence[int], mesh) -> P:
  """P('layers', 'embed', 'heads', ...) -> P(None, None, 'model', ...), by RULES."""
  axes = []
  for name, size in zip(spec, shape):
    axis = RULES.get(name)
    if axis not in mesh.shape:  # No `expert` axis when ep is 1: the experts stay whole.
      axis = None
    if axis is not None and size % mesh.shape[axis]:
      if name in MUST_DIVIDE:
        raise ValueError(f"axis {name!r} of size {size} does not split over "
                         f"{mesh.shape[axis]} devices")
      axis = None
    axes.append(axis)
  return P(*axes)


def cache_spec(axes: Sequence[str], only_model: bool = False) -> P:
  """The KV cache's spec, from its logical axis names: by KV head over `model` and, for a layout
  with a slot axis, by slot over `data` (`only_model`: the KV-head split alone)."""
  return P(*(RULES.get(n) if not only_model or RULES.get(n) == MODEL else None for n in axes))
