"""Speculative decoding: a cheap proposer guesses the next k tokens, and one step of the model
verifies all of them at once (batching/speculative.py proposes, engine/verify.py verifies)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# "ngram": prompt lookup on the host; "draft": a smaller model with the target's tokenizer, run
# k times inside the step (engine/draft.py).
METHODS = ("ngram", "draft")
AUTO = "auto"
# disable_by_batch_size "auto" on CPU: max_prefill_seqs' default, the verified chunks one step
# may take. Past it only some slots verify while every slot pays for the larger step, whose cost
# on XLA:CPU grows with its rows; measured in BENCHMARKS.md ("Speculative decoding"). On TPU and
# GPU a decode step is memory-bound and the extra rows are close to free: no limit.
CPU_DISABLE_BY_BATCH_SIZE = 4
# verify_cost "auto": what a step verifying k proposals (k + 1 rows) costs against a one-row
# decode step. On CPU each row adds about this much (the default model, one slot, the CPU
# kernels: 1.44x at k = 4, 1.83x at k = 6; BENCHMARKS.md, "Speculative decoding"). On TPU and
# GPU a decode step is memory-bound and the extra rows are close to free (not measured: no
# chip), so there only proposals that are hardly ever accepted pause.
CPU_VERIFY_COST_PER_PROPOSAL = 0.15
ACCELERATOR_VERIFY_COST = 1.05


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """vLLM's `--speculative-config` keys. `num_speculative_tokens` (k) sets a shape: each
  speculating sequence is verified as a chunk of up to k + 1 tokens."""

  method: str = "ngram"  # Prompt lookup: propose what followed the last n tokens before.
  num_speculative_tokens: int = 4
  prompt_lookup_min: int = 2  # The shortest n-gram that may match.
  prompt_lookup_max: int = 4  # The longest, tried first.
  # Method "draft": the draft model (a packaged model's name or a path, as --model takes).
  draft_model: str | None = None
  # No proposals in a step while more than this many requests run (vLLM's key): where a step's
  # cost grows with its rows (CPU), verified runs cost more than they save in a large batch.
  # None: speculate at any batch size. "auto": the engine's platform decides (`resolved`).
  disable_by_batch_size: int | str | None = AUTO
  # A step verifying k proposals costs this many one-row decode steps (>= 1): a request stops
  # proposing while its measured acceptance yields fewer tokens a verified run than that
  # (batching/acceptance.py). "auto": the engine's platform decides (`resolved`).
  verify_cost: float | str = AUTO

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"SpeculativeConfig.method must be one of {list(METHODS)}, got "
                       f"{self.method!r}")
    if self.method == "draft" and not (isinstance(self.draft_model, str) and self.draft_model):
      raise ValueError('SpeculativeConfig(method="draft") needs draft_model: the name or path '
                       f"of a smaller model with the same tokenizer, got {self.draft_model!r}")
    if self.method != "draft" and self.draft_model is not None:
      raise ValueError(f"SpeculativeConfig.draft_model is for method \"draft\", not "
                       f"{self.method!r}")
    for field in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"SpeculativeConfig.{field} must be an int >= 1, got {value!r}")
    size = self.disable_by_batch_size
    if size not in (None, AUTO) and (not isinstance(size, int) or isinstance(size, bool)
                                     or size < 1):
      raise ValueError("SpeculativeConfig.disable_by_batch_size must be an int >= 1, None or "
                       f"{AUTO!r}, got {size!r}")
    cost = self.verify_cost
    if cost != AUTO and (not isinstance(cost, (int, float)) or isinstance(cost, bool)
                         or not cost >= 1):
      raise ValueError(f"SpeculativeConfig.verify_cost must be a number >= 1 or {AUTO!r}, got "
                       f"{cost!r}")
    if self.num_speculative_tokens > 16:
      raise ValueError("SpeculativeConfig.num_speculative_tokens must be at most 16, got "
                       f"{self.num_speculative_tokens}")
    if self.prompt_lookup_min > self.prompt_lookup_max:
      raise ValueError(f"SpeculativeConfig.prompt_lookup_min ({self.prompt_lookup_min}) must be "
                       f"at most prompt_lookup_max ({self.prompt_lookup_max})")

  @property
  def max_batch_size(self) -> int | None:
    """The most running requests a step may speculate with; None: any number ("auto" not
    resolved is none: only an engine knows its platform)."""
    size = self.disable_by_batch_size
    return size if isinstance(size, int) else None

  @property
  def cost(self) -> float:
    """verify_cost as a number ("auto" not resolved: the CPU's, the dearest)."""
    return self._cpu_cost() if self.verify_cost == AUTO else float(self.verify_cost)

  def _cpu_cost(self) -> float:
    return 1 + CPU_VERIFY_COST_PER_PROPOSAL * self.num_speculative_tokens

  def resolved(self, platform: str) -> SpeculativeConfig:
    """The "auto" settings made numbers for `platform` (jax.default_backend()'s name):
    disable_by_batch_size CPU_DISABLE_BY_BATCH_SIZE on CPU, None elsewhere; verify_cost
    1 + CPU_VERIFY_COST_PER_PROPOSAL * k on CPU, ACCELERATOR_VERIFY_COST elsewhere."""
    cpu = platform == "cpu"
    size, cost = self.disable_by_batch_size, self.verify_cost
    if size == AUTO:
      size = CPU_DISABLE_BY_BATCH_SIZE if cpu else None
    if cost == AUTO:
      cost = self._cpu_cost() if cpu else ACCELERATOR_VERIFY_COST
    return dataclasses.replace(self, disable_by_batch_size=size, verify_cost=cost)

  @classmethod
  def from_json(cls, text: str) -> SpeculativeConfig:
    """The `--speculative-config` flag's JSON object; unknown keys are refused by name."""
    try:
      fields: Any = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
      raise ValueError("--speculative-config must be a JSON object, e.g. "
                       '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**fields)
