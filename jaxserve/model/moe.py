"""A mixture-of-experts SwiGLU MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k
experts, and every expert runs as one grouped matmul over the tokens sorted by expert
(`jax.lax.ragged_dot`). No token is dropped: there is no capacity factor, so a step's output
does not depend on which other tokens share it (batched, chunked or alone, the same tokens).

Shape letters: the key in jaxserve/model/__init__.py (Ex, Ek, Fe, M are this module's).

Expert parallelism: on a mesh, the experts are split over the `expert` axis and each expert's
hidden columns over `model`. Every device holds the step's tokens (the packed token axis is never
split), runs only the rows routed to its own experts on its own columns, and one psum over both
axes adds the pieces up: the all-reduce the dense MLP's row-split w_down needs anyway, so expert
parallelism costs no extra collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.model import axes


def route(h_TD, router_DEx, k: int, norm_topk: bool):
  """Softmax over every expert, then the top k (both Qwen3-MoE and Mixtral route this way);
  with `norm_topk` the k weights are renormalised to sum to 1 (Mixtral always, Qwen3-MoE as its
  config says). -> (weights [T, Ek] float32, experts [T, Ek] int32)."""
  logits = (h_TD @ router_DEx).astype(jnp.float32)  # [T, Ex]
  weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)  # [T, Ek] each
  if norm_topk:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, experts


def experts_mlp(h_TD, weights_TEk, experts_TEk, w_gate, w_up, w_down, mesh: Mesh | None):
  """h [T, D] -> [T, D]: each token's experts' SwiGLU outputs, summed by routing weight.
  w_gate, w_up [Ex, D, Fe], w_down [Ex, Fe, D]."""
  if mesh is None:
    return _local_experts(h_TD, weights_TEk, experts_TEk, w_gate, w_up, w_down, 0)
  split = tuple(a for a in (axes.EXPERT, axes.MODEL) if a in mesh.axis_names)
  expert = axes.EXPERT if axes.EXPERT in mesh.axis_names else None
  model = axes.MODEL if axes.MODEL in mesh.axis_names else None

  def shard(h, weights, experts, w_gate, w_up, w_down):
    first = jax.lax.axis_index(expert) * w_gate.shape[0] if expert else 0
    out = _local_experts(h, weights, experts, w_gate, w_up, w_down, first)
    return jax.lax.psum(out, split)

  cols, rows = P(expert, None, model), P(expert, model, None)
  return jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), cols, cols, rows),
                       out_specs=P(), check_vma=False)(
                           h_TD, weights_TEk, experts_TEk, w_gate, w_up, w_down)


def _local_experts(h_TD, weights_TEk, experts_TEk, w_gate, w_up, w_down, first):
  """The contribution of experts first .. first + Ex - 1 (the ones w_gate holds): the routed
  rows are sorted by expert, rows of other devices' experts last, and each expert's run of rows
  is one group of the ragged matmuls; the other rows are left out of every group."""
  T, Ek = experts_TEk.shape
  num_local = w_gate.shape[0]
  local = experts_TEk.reshape(-1) - first  # [M]
  mine = (local >= 0) & (local < num_local)
  group = jnp.where(mine, local, num_local)  # Other devices' rows: a group past the last.
  order = jnp.argsort(group, stable=True)  # [M] routed rows by expert
  sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)  # [Ex]
  tokens = order // Ek  # [M] the token of each sorted row
  x_MD = h_TD[tokens]
  gate = jax.lax.ragged_dot(x_MD, w_gate, sizes)  # [M, Fe]
  up = jax.lax.ragged_dot(x_MD, w_up, sizes)
  y_MD = jax.lax.ragged_dot((jax.nn.silu(gate) * up).astype(h_TD.dtype), w_down, sizes)
  scale = weights_TEk.reshape(-1)[order][:, None]  # [M, 1]
  # Rows in no group are not computed: whatever they hold is dropped, never multiplied by 0.
  y_MD = jnp.where(mine[order][:, None], y_MD.astype(jnp.float32) * scale, 0.0)
  return jnp.zeros((T, h_TD.shape[1]), jnp.float32).at[tokens].add(y_MD).astype(h_TD.dtype)
