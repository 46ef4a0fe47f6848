"""What a request passes before it reaches the queue: its API key and its key's rate limits (the
checks that turn client fields into a prompt and `SamplingParams` are in client_fields.py).

Both front ends (gRPC in api/grpc_api.py, HTTP in api/http_api.py) raise `ApiError`s from here and
map the one `Status` to their own codes, so a bad field reads the same in either.

Keys file (JSON); a limit left out or 0 is no limit:

  {"keys": [{"key": "sk-alice-...", "name": "alice",
             "requests_per_minute": 60, "tokens_per_minute": 20000},
            {"key": "sk-ops-...", "name": "ops", "admin": true}]}

An admin key may also load and unload LoRA adapters (when the server allows run-time updates)
and sees their folders in /v1/models.

A request counts once, however many choices (`n`, `best_of`, several prompts) it asks for, and
it is counted before any work is done on it: a key over its requests per minute is refused
before its body is even read. Tokens per minute count prompt plus completion tokens, as usage
reports them: each prompt once, every choice's completion. Once the prompts are tokenized, the
request reserves its prompts plus every choice's max_tokens over a sliding minute, and each
choice hands back what it did not use when it ends, so a key never goes over its limit, even
with many long requests in flight. A request refused before it is answered (a bad field, a full
queue, its own tokens over the limit) is refunded: it counts as no request. A request that did
not set max_tokens (chat's default: the rest of the context window, as in vLLM) is not refused
for the window it might use: each of its choices is cut to an equal share of what the key has
left (finish reason "length" there).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import hmac
import json
import pathlib
import threading
import time
from typing import Callable, Sequence

from jaxserve.config import short

WINDOW_S = 60.0  # The limits are per minute.
MAX_MESSAGE_CHARS = 1000  # gRPC sends the message in a trailer, which has a size limit.


class Status(enum.Enum):
  INVALID_ARGUMENT = "invalid_argument"
  NOT_FOUND = "not_found"  # A model this server does not serve (OpenAI and vLLM: 404).
  UNAUTHENTICATED = "unauthenticated"
  PERMISSION_DENIED = "permission_denied"  # A key without the right: admin endpoints.
  RESOURCE_EXHAUSTED = "resource_exhausted"
  UNAVAILABLE = "unavailable"  # Warming up or draining.
  FAILED_PRECONDITION = "failed_precondition"  # Not in the engine's state (asleep already).
  INTERNAL = "internal"


class ApiError(Exception):

  def __init__(self, status: Status, message: str):
    if len(message) > MAX_MESSAGE_CHARS:  # It quotes a client's value, which may be megabytes.
      message = message[:MAX_MESSAGE_CHARS] + "..."
    super().__init__(message)
    self.status = status
    self.message = message


def invalid(message: str) -> ApiError:
  return ApiError(Status.INVALID_ARGUMENT, message)


@dataclasses.dataclass(frozen=True)
class ApiKey:
  name: str
  digest: bytes = dataclasses.field(repr=False)  # sha256 of the key: the key itself is not kept.
  requests_per_minute: int = 0  # 0: no limit.
  tokens_per_minute: int = 0
  admin: bool = False  # May change what the server runs (LoRA adapters) and see its paths.


ANONYMOUS = ApiKey("anonymous", b"")
PREFIX_CACHE_SCOPES = ("key", "global")  # Every caller, when the server has no keys file.


def _digest(key: str) -> bytes:
  return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def one_key(key: str) -> ApiKey:
  """vLLM's --api-key: the server's one key, with no limits, an admin's."""
  if not key:
    raise ValueError("--api-key must not be empty")
  return ApiKey("api-key", _digest(key), admin=True)


def load_keys(path: str | pathlib.Path) -> list[ApiKey]:
  """Reads a keys file; raises ValueError naming the entry and field that is wrong."""
  try:
    entries = json.loads(pathlib.Path(path).read_text())["keys"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path}: want a JSON object {{\"keys\": [...]}} ({e})") from e
  keys, seen = [], set()
  for n, entry in enumerate(entries):
    where = f"{path}: keys[{n}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not entry["key"]:
      raise ValueError(f"{where}.key must be a non-empty string")
    if not isinstance(entry.get("name"), str) or not entry["name"]:
      raise ValueError(f"{where}.name must be a non-empty string")
    limits = [entry.get(f) or 0 for f in ("requests_per_minute", "tokens_per_minute")]
    for field, value in zip(("requests_per_minute", "tokens_per_minute"), limits):
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}.{field} must be an int >= 0, got {value!r}")
    if not isinstance(entry.get("admin", False), bool):
      raise ValueError(f"{where}.admin must be true or false, got {entry['admin']!r}")
    digest = _digest(entry["key"])
    if digest in seen:
      raise ValueError(f"{where} repeats a key")
    seen.add(digest)
    keys.append(ApiKey(entry["name"], digest, *limits, entry.get("admin", False)))
  return keys


@dataclasses.dataclass(eq=False)  # Compared by identity: `Lease.refund` removes this one.
class _Charge:
  """One admitted request's share of its key's last minute."""
  time: float
  tokens: int  # Reserved at admission; corrected to the tokens used as its runs end.


class Lease:
  """One request's share of its key's minute, however many choices (runs) it has: one request,
  its prompts' tokens once, and each run's max_tokens until that run ends and `settle`s what it
  used. A request refused before its answer began is taken out whole (`refund`): it counts as
  no request and no tokens. Thread-safe: a worker reserves, the event loop settles."""

  def __init__(self, gateway: Gateway | None, key: ApiKey, charge: _Charge | None = None):
    self._gateway = gateway  # None: the key has no limits.
    self.key = key
    self._charge = charge
    self._num_open_runs = 1
    self.max_tokens = 0  # The first run's, after admit or reserve: either may have cut it.

  def reserve(self, num_prompt_tokens: int, max_tokens: Sequence[int],
              can_shorten: bool = False) -> list[int]:
    """Prices the request at its prompts' tokens plus every run's max_tokens, now that they are
    known; returns each run's max_tokens. Raises RESOURCE_EXHAUSTED naming the limit (the
    request stays charged until `refund`). `can_shorten`: the client never set max_tokens, so
    each run is cut to an equal share of the tokens the key has left (at least 1), rather than
    the request being refused for a window it may never use."""
    max_tokens = list(max_tokens)
    if self._charge is None:
      self.max_tokens = max_tokens[0]
      return max_tokens
    with self._gateway.lock:
      max_tokens = self._gateway.price(self.key, self._charge, num_prompt_tokens, max_tokens,
                                       can_shorten)
      self._num_open_runs = len(max_tokens)
    self.max_tokens = max_tokens[0]
    return max_tokens

  def settle(self, num_completion_tokens: int, max_tokens: int | None = None) -> None:
    """One run ended having produced `num_completion_tokens` of its `max_tokens` (None: the
    first run's): the rest goes back to the key. Calls past the number of runs count for
    nothing."""
    if self._charge is None:
      return
    with self._gateway.lock:
      if self._num_open_runs > 0:
        self._charge.tokens -= (self.max_tokens if max_tokens is None else max_tokens) - \
            num_completion_tokens
        self._num_open_runs -= 1

  def refund(self) -> None:
    """Takes the request back out of its key's minute (it counts as no request)."""
    if self._charge is None:
      return
    with self._gateway.lock:
      usage = self._gateway.usage(self.key)
      if self._charge in usage:  # Not yet a minute old.
        usage.remove(self._charge)
      self._charge = None


class Gateway:

  def __init__(self, keys: Sequence[ApiKey] | None = None,
               clock: Callable[[], float] = time.monotonic, prefix_cache_scope: str | None = None):
    """`keys` None: no authentication and no limits. `prefix_cache_scope`: "key" (each key's
    requests share cached pages only with that key's: the default with keys) or "global"."""
    self.keys = list(keys) if keys is not None else None
    self.prefix_cache_scope = prefix_cache_scope or ("key" if keys is not None else "global")
    if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
      raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, "
                       f"got {short(prefix_cache_scope)}")
    self.lock = threading.Lock()  # Over `_usage`: leases are priced on worker threads.
    self._clock = clock
    self._usage: dict[str, collections.deque[_Charge]] = collections.defaultdict(collections.deque)

  def cache_salt(self, key: ApiKey, requested: str | None) -> str | None:
    """The salt a request of `key` runs under: the one it asked for, and under the "key" scope
    its key's name first, so no salt a client sends can reach another key's pages."""
    if self.prefix_cache_scope == "global" or key is ANONYMOUS:
      return requested
    return f"key:{key.name}" + ("" if requested is None else f"\0{requested}")

  def may_administer(self, key: ApiKey) -> bool:
    """Whether `key` may change what the server runs: an admin key, or anyone on a server
    without keys (whose run-time updates its operator turned on)."""
    return key.admin or self.keys is None

  def authenticate(self, presented: str | None) -> ApiKey:
    """The key `presented` (the bearer token) names; raises UNAUTHENTICATED."""
    if self.keys is None:
      return ANONYMOUS
    if not presented:
      raise ApiError(Status.UNAUTHENTICATED, "missing API key: send 'authorization: Bearer <key>'")
    # Every key is compared, each in constant time, so the time taken tells nothing about which
    # key (or how much of one) matched. Digests also hide the keys' lengths.
    digest, match = _digest(presented), None
    for key in self.keys:
      if hmac.compare_digest(digest, key.digest):
        match = key
    if match is None:
      raise ApiError(Status.UNAUTHENTICATED, "invalid API key")
    return match

  def admit(self, key: ApiKey, num_prompt_tokens: int | None = None, max_tokens: int = 0,
            can_shorten: bool = False) -> Lease:
    """Charges one request to `key`; raises RESOURCE_EXHAUSTED naming the limit it would pass.

    `num_prompt_tokens` None: the request's tokens are not known yet (it is admitted before any
    work is done on it): it is refused only when the key has no request or no token left this
    minute, and `Lease.reserve` prices it once they are known. Otherwise it is priced at once,
    as one run of `max_tokens` (see Lease.reserve for `can_shorten`).
    """
    lease = Lease(None, key)
    if not (key.requests_per_minute or key.tokens_per_minute):
      lease.reserve(num_prompt_tokens or 0, [max_tokens])
      return lease
    with self.lock:
      now = self._clock()
      usage = self.usage(key)
      while usage and usage[0].time <= now - WINDOW_S:
        usage.popleft()
      rpm, tpm = key.requests_per_minute, key.tokens_per_minute
      if rpm and len(usage) >= rpm:
        raise ApiError(Status.RESOURCE_EXHAUSTED,
                       f"key {key.name!r} is over its limit of {rpm} requests per minute; retry "
                       f"in {usage[0].time + WINDOW_S - now:.0f} s")
      if num_prompt_tokens is None and tpm and sum(c.tokens for c in usage) >= tpm:
        raise ApiError(Status.RESOURCE_EXHAUSTED,
                       f"key {key.name!r} has no tokens left of its limit of {tpm} tokens per "
                       f"minute; retry in {usage[0].time + WINDOW_S - now:.0f} s")
      charge = _Charge(now, 0)
      if num_prompt_tokens is not None:
        max_tokens = self.price(key, charge, num_prompt_tokens, [max_tokens], can_shorten)[0]
      usage.append(charge)
    lease = Lease(self, key, charge)
    lease.max_tokens = max_tokens
    return lease

  def usage(self, key: ApiKey) -> collections.deque[_Charge]:
    """The charges of `key`'s last minute, oldest first (hold `lock`)."""
    return self._usage[key.name]

  def price(self, key: ApiKey, charge: _Charge, num_prompt_tokens: int, max_tokens: list[int],
            can_shorten: bool) -> list[int]:
    """Sets `charge` to the prompt plus every run's max_tokens, within the key's tokens per
    minute; returns the runs' max_tokens (hold `lock`)."""
    tpm, num_runs = key.tokens_per_minute, len(max_tokens)
    used = sum(c.tokens for c in self.usage(key) if c is not charge)
    left = max(tpm - used, 0)
    if tpm and can_shorten:
      share = (left - num_prompt_tokens) // num_runs
      if share < 1:
        runs = f" for each of its {num_runs} choices" if num_runs > 1 else ""
        raise ApiError(Status.RESOURCE_EXHAUSTED,
                       f"the prompt ({num_prompt_tokens} tokens) and one output token{runs} do "
                       f"not fit in the {left} tokens key {key.name!r} has left of its limit of "
                       f"{tpm} tokens per minute")
      max_tokens = [min(m, share) for m in max_tokens]
    need = num_prompt_tokens + sum(max_tokens)
    if tpm and used + need > tpm:
      runs = f"{num_runs} x " if num_runs > 1 else ""
      raise ApiError(Status.RESOURCE_EXHAUSTED,
                     f"prompt ({num_prompt_tokens}) plus {runs}max_tokens ({max(max_tokens)}) "
                     f"is {need} tokens; key {key.name!r} has {left} of its limit of {tpm} "
                     "tokens per minute left")
    charge.tokens = need
    return max_tokens
