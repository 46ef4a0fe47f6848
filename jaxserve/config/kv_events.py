"""`--kv-events-config`: where the prefix cache's events go, spelled as vLLM spells it.

The JSON object vLLM's `--kv-events-config` takes (`vllm/config/kv_events.py`), with the same
keys and defaults: `enable_kv_cache_events`, `publisher` ("zmq", or "null" for none),
`endpoint` (a ZMQ PUB address: one with `*`, `::`, `ipc://` or `inproc://` is bound, any other
connected to), `replay_endpoint` (a ROUTER address that resends missed batches, or null),
`buffer_steps` (batches kept for replay), `hwm` (the PUB socket's high-water mark),
`max_queue_size` (batches waiting for the publisher thread) and `topic`. llm-d's indexer
expects the topic `kv@<pod>@<model>`.

One key of our own, `hash_seed`: the block-hash seed (vLLM takes it from PYTHONHASHSEED, and
llm-d's `hashSeed` must equal it); by default PYTHONHASHSEED's value, else "".
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxserve.config.checks import is_int, json_type, short


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
  enable_kv_cache_events: bool = False
  publisher: str = "zmq"
  endpoint: str = "tcp://*:5557"
  replay_endpoint: str | None = None
  buffer_steps: int = 10_000
  hwm: int = 100_000
  max_queue_size: int = 100_000
  topic: str = ""
  hash_seed: str = dataclasses.field(default_factory=lambda: os.environ.get("PYTHONHASHSEED", ""))

  def __post_init__(self):
    if self.publisher not in ("zmq", "null"):
      raise ValueError(f"kv-events-config: publisher must be \"zmq\" or \"null\", "
                       f"got {short(self.publisher)}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
      value = getattr(self, name)
      if not is_int(value) or value < 1:
        raise ValueError(f"kv-events-config: {name} must be an int >= 1, got {short(value)}")
    if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
      raise ValueError(f"kv-events-config: endpoint must be a tcp://, ipc:// or inproc:// "
                       f"address, got {short(self.endpoint)}")

  @property
  def publishes(self) -> bool:
    return self.enable_kv_cache_events and self.publisher == "zmq"

  @classmethod
  def from_json(cls, text: str) -> KVEventsConfig:
    """Parses the flag's JSON object; a bad key or value is a ValueError naming it."""
    try:
      fields = json.loads(text)
    except ValueError as e:
      raise ValueError(f"kv-events-config: not JSON ({e})") from e
    if not isinstance(fields, dict):
      raise ValueError(f"kv-events-config: must be a JSON object, got {json_type(fields)}")
    for name, value in fields.items():
      if name not in _TYPES:
        raise ValueError(f"kv-events-config: unknown key {short(name)}; known: {sorted(_TYPES)}")
      _check_type(name, value)
    return cls(**fields)


_TYPES: dict[str, Any] = {"enable_kv_cache_events": (bool,), "publisher": (str,),
                          "endpoint": (str,), "replay_endpoint": (str, type(None)),
                          "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
                          "topic": (str,), "hash_seed": (str,)}


def _check_type(name: str, value: Any) -> None:
  if not isinstance(value, _TYPES[name]) or (bool not in _TYPES[name] and isinstance(value, bool)):
    want = " or ".join(json_type(t()) if t is not type(None) else "null" for t in _TYPES[name])
    raise ValueError(f"kv-events-config: {name} must be {want}, got {json_type(value)}")
