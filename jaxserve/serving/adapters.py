"""The LoRA adapters a server serves, by name, as vLLM serves them: `serve --lora-modules
name=path` at start and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time; a
request's `model` field names the base model or one adapter.

A load reads the adapter's folder on a worker (`read`: the engine side's reader, which the
server is given: the front ends import no engine), then hands it to the engine thread between
two steps; an unload is refused while a queued or running request uses the adapter. Each step of
either is a clear ApiError naming the problem; a request already running is never disturbed.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Awaitable, Callable

from jaxserve.batching.stream import AsyncRunner
from jaxserve.config import LoRARequest
from jaxserve.serving.gateway import ApiError, Status, invalid


class Adapters:

  def __init__(self, runner: AsyncRunner, base_name: str,
               read: Callable[[str], Any] | None = None):
    """`read(path)`: the adapter in folder `path` as the engine takes it, or a ValueError naming
    the problem; None: this server runs no adapters."""
    self._runner = runner
    self._base = base_name
    self._read = read
    self._by_name: dict[str, LoRARequest] = {}
    self._ids = itertools.count(1)
    self._busy: set[str] = set()  # Names being loaded or unloaded.

  @property
  def enabled(self) -> bool:
    return self._read is not None

  def served(self) -> list[LoRARequest]:
    """The adapters served now, in the order they were loaded."""
    return list(self._by_name.values())

  def resolve(self, model: str) -> LoRARequest | None:
    """The adapter a request's `model` names; None for the base model (or no name). NOT_FOUND
    for any other name."""
    if not model or model == self._base:
      return None
    lora = self._by_name.get(model)
    if lora is None:
      also = f" and the LoRA adapters {sorted(self._by_name)}" if self._by_name else ""
      raise ApiError(Status.NOT_FOUND,
                     f"model {model!r} is not served here; this server runs {self._base!r}{also}")
    return lora

  async def load(self, name: Any, path: Any,
                 work: Callable[..., Awaitable[Any]]) -> LoRARequest:
    """Serves the PEFT adapter in folder `path` as model `name`; `work(fn, *args)` runs the
    read on a worker."""
    if not self.enabled:
      raise invalid("LoRA adapters are off on this server: serve with --enable-lora")
    for field, value in (("lora_name", name), ("lora_path", path)):
      if not isinstance(value, str) or not value:
        raise invalid(f"{field} must be a non-empty string, got {value!r}")
    if name == self._base or name in self._by_name or name in self._busy:
      raise invalid(f"the LoRA adapter {name!r} has already been loaded")
    if not os.path.isdir(path):
      raise ApiError(Status.NOT_FOUND, f"LoRA adapter {name!r}: no folder {path!r} on the server")
    self._busy.add(name)
    try:
      try:
        adapter = await work(self._read, path)
      except ValueError as e:
        raise invalid(str(e)) from e
      return await self.add(name, path, adapter)
    finally:
      self._busy.discard(name)

  async def add(self, name: str, path: str, adapter: Any) -> LoRARequest:
    """Serves an adapter read already (`serve --lora-modules`'s, before the first request)."""
    lora = LoRARequest(name, next(self._ids), path)
    try:
      await self._runner.on_engine(lambda: self._runner.runner.add_lora(lora, adapter))
    except ValueError as e:
      raise invalid(str(e)) from e
    self._by_name[name] = lora
    return lora

  async def unload(self, name: Any) -> None:
    """Stops serving adapter `name`: NOT_FOUND if it is not served, INVALID_ARGUMENT while a
    request uses it."""
    if not self.enabled:
      raise invalid("LoRA adapters are off on this server: serve with --enable-lora")
    lora = self._by_name.get(name) if isinstance(name, str) else None
    if lora is None:
      raise ApiError(Status.NOT_FOUND, f"the LoRA adapter {name!r} is not loaded")
    if name in self._busy:
      raise invalid(f"the LoRA adapter {name!r} is being unloaded")
    self._busy.add(name)
    try:
      try:
        await self._runner.on_engine(lambda: self._runner.runner.remove_lora(lora.lora_int_id))
      except ValueError as e:  # In use.
        raise invalid(f"the LoRA adapter {name!r} cannot be unloaded now: {e}") from e
      del self._by_name[name]
    finally:
      self._busy.discard(name)
