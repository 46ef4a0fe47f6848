"""The P/D peer link (api/kv_transfer.py's handoffs run over it): who may ask a prefill server
for pages, the decode server's channel to it, what names the model a page was computed by, and
the circuit breaker that keeps a dead or hung peer from slowing every request.

  prefill side  `PeerGate`: PrefillKV answers only on a prefill server (--kv-role prefill), and
                only to the peer credential (--kv-peer-api-key, compared in constant time); a
                prefill server bound beyond loopback refuses to start without one (ServerConfig)
  decode side   `channel`: TLS when --kv-peer-tls-ca names the CA that signed the peer's
                certificate, the credential as a bearer token; `Circuit`: after a peer failure,
                every request prefills locally for `cooldown_s` (doubling while it keeps
                failing), then one request tries the peer again
  both          `ModelIdentity`: a fingerprint of the weights (engine side, computed once) and
                of each LoRA adapter's files, sent in the handoff's header and compared: a peer
                serving other weights is refused, its pages recomputed
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import os
import time
from typing import Callable

import grpc

from jaxserve.config import LoRARequest
from jaxserve.serving.gateway import ApiError, ApiKey, Status

# The identity PrefillKV's calls run under on the prefill server: its prefix cache scopes them
# as one key's (a NUL, which no sensible keys file names a key with, keeps it apart).
PEER_KEY = ApiKey("\0kv-peer", b"")
PEER_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.UNIMPLEMENTED)


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False


def check_config(c) -> None:
  """api/server_config.ServerConfig's P/D fields; ValueError naming the one at fault."""
  if c.kv_role not in ("prefill", "decode", "both"):
    raise ValueError(f"ServerConfig.kv_role must be prefill, decode or both, got {c.kv_role!r}")
  if (c.kv_role == "decode") != (c.kv_peer is not None):
    raise ValueError("ServerConfig: a decode server (kv_role decode) needs kv_peer, the "
                     "prefill server's host:port; only a decode server takes one")
  if c.kv_peer_tls_ca is not None and c.kv_role != "decode":
    raise ValueError("ServerConfig.kv_peer_tls_ca verifies a decode server's kv_peer: only a "
                     "decode server takes one")
  if c.kv_role == "prefill" and not c.kv_peer_api_key and not is_loopback(c.host):
    raise ValueError(f"ServerConfig: a prefill server bound to {c.host} needs kv_peer_api_key "
                     "(--kv-peer-api-key), the credential its decode servers present: without "
                     "one anyone who reaches it could read its prefix cache (bind it to "
                     "127.0.0.1 to go without)")
  if not c.kv_peer_timeout_s > 0:
    raise ValueError(f"ServerConfig.kv_peer_timeout_s must be > 0, got {c.kv_peer_timeout_s}")


def _digest(key: str) -> bytes:
  return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class PeerRefused(Exception):
  """The prefill server refused the decode server (its credential, its role, its model)."""


class PeerGate:
  """A prefill server's check of each PrefillKV call."""

  def __init__(self, api_key: str | None):
    """`api_key` None: any caller (a prefill server bound to loopback only)."""
    self._digest = None if api_key is None else _digest(api_key)
    self.identity: ModelIdentity | None = None  # The server's model, once it is loaded.

  def check(self, presented: str | None) -> ApiKey:
    """The identity the call runs under; UNAUTHENTICATED unless it presented the credential."""
    if self._digest is None:
      return PEER_KEY
    if not presented or not hmac.compare_digest(_digest(presented), self._digest):
      raise ApiError(Status.UNAUTHENTICATED, "PrefillKV takes only the P/D peer credential "
                     "(the decode server's --kv-peer-api-key)")
    return PEER_KEY


def channel(address: str, tls_ca: str | None, max_message_bytes: int) -> grpc.aio.Channel:
  """The decode server's channel to its prefill server: TLS, verified against `tls_ca` (a PEM
  file), when given."""
  options = [("grpc.max_receive_message_length", max_message_bytes)]
  if tls_ca is None:
    return grpc.aio.insecure_channel(address, options=options)
  with open(tls_ca, "rb") as f:
    credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
  return grpc.aio.secure_channel(address, credentials, options=options)


class ModelIdentity:
  """What a page's bytes depend on besides the prompt: the weights, and the adapter."""

  def __init__(self, weights: str):
    self.weights = weights
    self._adapters: dict[str, str] = {}  # LoRARequest.cache_key -> its files' digest.

  def of(self, lora: LoRARequest | None) -> str:
    """The fingerprint a handoff of a request under `lora` carries (reads the adapter's files
    once: call it off the event loop the first time)."""
    if lora is None:
      return self.weights
    digest = self._adapters.get(lora.cache_key)
    if digest is None:
      digest = self._adapters[lora.cache_key] = folder_digest(lora.lora_path)
    return f"{self.weights} lora:{digest}"


def folder_digest(path: str) -> str:
  """sha256 over a folder's files (names and bytes, in name order), read in 1 MiB blocks."""
  h = hashlib.sha256()
  for name in sorted(os.listdir(path)):
    full = os.path.join(path, name)
    if not os.path.isfile(full):
      continue
    h.update(name.encode() + b"\0")
    with open(full, "rb") as f:
      for block in iter(lambda: f.read(2**20), b""):
        h.update(block)
  return h.hexdigest()[:32]


@dataclasses.dataclass
class Circuit:
  """Closed: every request asks the peer. Open (after a failure): none does until `cooldown_s`
  passes, then the next request probes it (and the others still skip it): success closes the
  circuit, failure opens it again for twice as long, up to `max_cooldown_s`."""
  cooldown_s: float = 2.0
  max_cooldown_s: float = 60.0
  clock: Callable[[], float] = time.monotonic
  _open_until: float | None = None
  _wait: float = 0.0
  _probing: bool = False

  def allow(self) -> bool:
    """Whether this request may ask the peer (the probe's, when the cooldown is over)."""
    if self._open_until is None:
      return True
    if self._probing or self.clock() < self._open_until:
      return False
    self._probing = True
    return True

  def abandon(self) -> None:
    """A request that asked the peer and left before the answer: it tells nothing."""
    self._probing = False

  def record(self, failed: bool) -> None:
    self._probing = False
    if not failed:
      self._open_until, self._wait = None, 0.0
      return
    self._wait = min(self.max_cooldown_s, self._wait * 2 or self.cooldown_s)
    self._open_until = self.clock() + self._wait
