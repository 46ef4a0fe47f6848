"""One request's sampling settings and stop conditions."""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, Mapping, Sequence

from jaxserve.config.checks import is_int, short
from jaxserve.config.constraint import Constraint


class LogprobsMode(enum.Enum):
  """What a sampled token's logprobs (its own and its top alternatives') are: vLLM's
  `--logprobs-mode` (vllm/config/model.py `LogprobsMode`, vllm/v1/sample/sampler.py), an engine
  setting, the same for every request. Raw: the model's distribution, before the penalties, the
  logit bias (allowed_token_ids too) and temperature; processed: the distribution the token was
  drawn from, after all of them and after top-k, top-p and min-p, whose removed tokens are
  -inf; a greedy row's processed values are those of temperature 1 and no filtering (vLLM's
  too). The logits modes report the values before the log-softmax. A constrained request's
  grammar mask comes before both (vLLM applies it before its sampler). Prompt logprobs are raw
  logprobs in every mode (vLLM's prompt tokens pass through no sampling processor)."""

  RAW_LOGPROBS = "raw_logprobs"  # vLLM's default.
  PROCESSED_LOGPROBS = "processed_logprobs"
  RAW_LOGITS = "raw_logits"
  PROCESSED_LOGITS = "processed_logits"

  @property
  def processed(self) -> bool:
    return self in (LogprobsMode.PROCESSED_LOGPROBS, LogprobsMode.PROCESSED_LOGITS)

  @property
  def logits(self) -> bool:
    return self in (LogprobsMode.RAW_LOGITS, LogprobsMode.PROCESSED_LOGITS)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request picks its tokens and when it stops. Every field is a value, never a shape."""

  temperature: float = 1.0  # 0 means greedy.
  top_k: int = 0  # 0 (or -1, vLLM's spelling, taken as 0) means off.
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
  # OpenAI's {token id: bias}, added to the logits before sampling (JSON's string keys are
  # taken); kept as sorted (id, bias) pairs, so the params stay hashable.
  logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
  allowed_token_ids: Sequence[int] | None = None  # vLLM's: only these may be sampled; None: all.
  # What the output must match (JSON schema, regex, choice, grammar); None: free text. The
  # runner masks each token to what the grammar allows (text/constraint.py, batching/runner.py).
  constraint: Constraint | None = None
  # False: this request never speculates, even on an engine with EngineConfig.speculative set.
  speculative: bool = True
  # An embedding or score request (EngineConfig.pooling): its output is the prompt's pooled
  # vector (RequestOutput.pooled); the one token it samples is nobody's.
  pooling: bool = False

  # The settings that shape each token's choice, each a per-slot device array
  # (engine/sampling_state.py). The front ends, the command line and the device state derive
  # their lists from this one.
  SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")

  # Every stop string is searched for after every token, and the text that could still become
  # one is held back from the stream: both bounds keep that work and that delay small.
  MAX_STOP_STRINGS = 64
  MAX_STOP_CHARS = 256
  MAX_STOP_TOKEN_IDS = 256
  MAX_LOGPROBS = 20  # The most top logprobs per token a request may ask for.
  MAX_LOGIT_BIAS = 300  # OpenAI's limits: 300 token ids, each biased by at most 100.
  MAX_BIAS = 100.0
  FLOAT32_MAX = 3.4028234663852886e38  # The largest float the device's sampling state holds.

  def __post_init__(self):
    check, finite = self._check, self._is_finite
    check(finite(self.temperature) and self.temperature >= 0, "temperature",
          "must be >= 0 and finite (at most 3.4e38)")
    check(is_int(self.top_k) and self.top_k >= -1, "top_k", "must be an int >= 0 (or -1: off)")
    object.__setattr__(self, "top_k", max(self.top_k, 0))
    check(finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
    check(finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
    check(finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
          "must be > 0 and finite (at most 3.4e38)")
    check(finite(self.presence_penalty) and abs(self.presence_penalty) <= 2, "presence_penalty",
          "must be in [-2, 2]")
    check(finite(self.frequency_penalty) and abs(self.frequency_penalty) <= 2, "frequency_penalty",
          "must be in [-2, 2]")
    # OpenAI and vLLM take any signed 64-bit seed; the device keeps its 64 bits as two words.
    check(self.seed is None or (is_int(self.seed) and -2**63 <= self.seed < 2**63), "seed",
          "must be None or a signed 64-bit int, in [-2**63, 2**63)")
    check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
    check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
    check(isinstance(self.speculative, bool), "speculative", "must be true or false")
    check(isinstance(self.pooling, bool) and not (self.pooling and self.prompt_logprobs),
          "pooling", "must be true or false, and not with prompt_logprobs")
    check(is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
          f"must be in [0, {self.MAX_LOGPROBS}]")
    check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs)
                                           and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS),
          "prompt_logprobs", f"must be None or in [0, {self.MAX_LOGPROBS}]")
    self._check_stops()
    self._check_bias()
    check(self.constraint is None or isinstance(self.constraint, Constraint), "constraint",
          "must be None or a Constraint")
    # A finished grammar allows only end-of-sequence tokens, which ignore_eos forbids.
    check(not (self.ignore_eos and self.constraint is not None), "ignore_eos",
          "cannot be combined with a constraint (a complete output can only end)")
    object.__setattr__(self, "stop", tuple(self.stop))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

  def _check_stops(self) -> None:
    check, n_str, n_chars, n_ids = (self._check, self.MAX_STOP_STRINGS, self.MAX_STOP_CHARS,
                                    self.MAX_STOP_TOKEN_IDS)
    check(isinstance(self.stop, (list, tuple)), "stop", "must be a list of strings")
    check(len(self.stop) <= n_str, "stop",
          f"must hold at most {n_str} strings, not {len(self.stop)}")
    for n, s in enumerate(self.stop):
      check(isinstance(s, str) and 0 < len(s) <= n_chars, f"stop[{n}]",
            f"must be a non-empty string of at most {n_chars} characters", s)
    ids = self.stop_token_ids
    check(isinstance(ids, (list, tuple)), "stop_token_ids", "must be a list of ints")
    check(len(ids) <= n_ids, "stop_token_ids", f"must hold at most {n_ids} ids, not {len(ids)}")
    for n, i in enumerate(ids):
      check(is_int(i) and i >= 0, f"stop_token_ids[{n}]", "must be an int >= 0", i)

  def _check_bias(self) -> None:
    """Vocabulary bounds are the gateway's (it knows the vocabulary): here the types and limits."""
    check, bias = self._check, self.logit_bias
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    check(isinstance(pairs, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2
                                                    for p in pairs),
          "logit_bias", "must be an object {token id: bias}")
    check(len(pairs) <= self.MAX_LOGIT_BIAS, "logit_bias",
          f"must hold at most {self.MAX_LOGIT_BIAS} token ids, not {len(pairs)}")
    normal = {}
    for key, value in pairs:
      token = int(key) if isinstance(key, str) and key.isdecimal() and len(key) < 12 else key
      check(is_int(token) and token >= 0, "logit_bias", "keys must be token ids (ints >= 0)", key)
      check(self._is_finite(value) and abs(value) <= self.MAX_BIAS, f"logit_bias[{token}]",
            f"must be a number in [-{self.MAX_BIAS:g}, {self.MAX_BIAS:g}]", value)
      normal[token] = float(value)
    object.__setattr__(self, "logit_bias", tuple(sorted(normal.items())))
    ids = self.allowed_token_ids
    if ids is not None:
      check(isinstance(ids, (list, tuple)) and len(ids) > 0, "allowed_token_ids",
            "must be a non-empty list of token ids")
      for n, i in enumerate(ids):
        check(is_int(i) and i >= 0, f"allowed_token_ids[{n}]", "must be an int >= 0", i)
      object.__setattr__(self, "allowed_token_ids", tuple(ids))

  def for_run(self, seed: int | None, max_tokens: int) -> SamplingParams:
    """A copy with its own seed and max_tokens, as one of a request's n runs, checking only
    those two: the other fields (a vocabulary-long allowed_token_ids among them) were checked
    when this one was made, and are not checked again for each run."""
    self._check(seed is None or (is_int(seed) and -2**63 <= seed < 2**63), "seed",
                "must be None or a signed 64-bit int, in [-2**63, 2**63)", seed)
    self._check(is_int(max_tokens) and 1 <= max_tokens <= self.max_tokens, "max_tokens",
                f"of a run must be in [1, {self.max_tokens}]", max_tokens)
    run = copy.copy(self)
    object.__setattr__(run, "seed", seed)
    object.__setattr__(run, "max_tokens", max_tokens)
    return run

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
