"""One request's sampling settings and stop conditions."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxserve.config.checks import is_int, short


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request picks its tokens and when it stops. Every field is a value, never a shape."""

  temperature: float = 1.0  # 0 means greedy.
  top_k: int = 0  # 0 means off.
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0  # Hugging Face style, over prompt and output tokens.
  presence_penalty: float = 0.0  # OpenAI style, over output tokens.
  frequency_penalty: float = 0.0
  seed: int | None = None
  max_tokens: int = 16
  stop: Sequence[str] = ()
  stop_token_ids: Sequence[int] = ()
  ignore_eos: bool = False
  logprobs: int = 0  # How many top logprobs to report per token (0: only the chosen token's).
  # Set: every prompt token's logprob (but the first's) and its top `prompt_logprobs`; such a
  # request skips the prefix cache, since a cached page's logprobs were never kept.
  prompt_logprobs: int | None = None

  # The settings that shape each token's choice, all per-slot device arrays (engine/sample.py).
  # The front ends, the command line and the device state derive their lists from this one.
  SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")

  # Every stop string is searched for after every token, and the text that could still become
  # one is held back from the stream: both bounds keep that work and that delay small.
  MAX_STOP_STRINGS = 64
  MAX_STOP_CHARS = 256
  MAX_STOP_TOKEN_IDS = 256
  MAX_LOGPROBS = 20  # The most top logprobs per token a request may ask for.
  FLOAT32_MAX = 3.4028234663852886e38  # The largest float the device's sampling state holds.

  def __post_init__(self):
    check, finite = self._check, self._is_finite
    check(finite(self.temperature) and self.temperature >= 0, "temperature",
          "must be >= 0 and finite (at most 3.4e38)")
    check(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an int >= 0")
    check(finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
    check(finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
    check(finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
          "must be > 0 and finite (at most 3.4e38)")
    check(finite(self.presence_penalty) and abs(self.presence_penalty) <= 2, "presence_penalty",
          "must be in [-2, 2]")
    check(finite(self.frequency_penalty) and abs(self.frequency_penalty) <= 2, "frequency_penalty",
          "must be in [-2, 2]")
    check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
          "must be None or an int in [0, 2**63)")
    check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
    check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
    check(is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
          f"must be in [0, {self.MAX_LOGPROBS}]")
    check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs)
                                           and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS),
          "prompt_logprobs", f"must be None or in [0, {self.MAX_LOGPROBS}]")
    self._check_stops()
    object.__setattr__(self, "stop", tuple(self.stop))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

  def _check_stops(self) -> None:
    check, n_str, n_chars, n_ids = (self._check, self.MAX_STOP_STRINGS, self.MAX_STOP_CHARS,
                                    self.MAX_STOP_TOKEN_IDS)
    check(isinstance(self.stop, (list, tuple)), "stop", "must be a list of strings")
    check(len(self.stop) <= n_str, "stop", f"must hold at most {n_str} strings, not {len(self.stop)}")
    for n, s in enumerate(self.stop):
      check(isinstance(s, str) and 0 < len(s) <= n_chars, f"stop[{n}]",
            f"must be a non-empty string of at most {n_chars} characters", s)
    ids = self.stop_token_ids
    check(isinstance(ids, (list, tuple)), "stop_token_ids", "must be a list of ints")
    check(len(ids) <= n_ids, "stop_token_ids", f"must hold at most {n_ids} ids, not {len(ids)}")
    for n, i in enumerate(ids):
      check(is_int(i) and i >= 0, f"stop_token_ids[{n}]", "must be an int >= 0", i)

  @classmethod
  def _is_finite(cls, x: Any) -> bool:
    # Finite as the device's float32 will hold it: 1e300 would turn into inf there. (A plain
    # comparison, unlike math.isfinite, takes a 400-digit int without an OverflowError.)
    return (isinstance(x, (int, float)) and not isinstance(x, bool)
            and -cls.FLOAT32_MAX <= x <= cls.FLOAT32_MAX)

  def _check(self, ok: bool, field: str, rule: str, value: Any = dataclasses.MISSING) -> None:
    """Raises ValueError naming `field` (a field, or one item of a list field) and its value."""
    if not ok:
      shown = short(getattr(self, field) if value is dataclasses.MISSING else value)
      raise ValueError(f"SamplingParams.{field} {rule}, got {shown}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0
