"""The LoRA adapters a server serves, by name, as vLLM serves them: `serve --lora-modules
name=path` at start and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` at run time; a
request's `model` field names the base model or one adapter.

Run-time loading is off unless the server is started with it (`--enable-runtime-lora-updates`,
vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), and then it is an admin's: with a keys file only a key
marked `"admin": true` may load or unload, and a folder is read only from under the server's
`--lora-root` directories (symlinks resolved first). A folder that is not there and one outside
the roots get the same answer, so a client learns nothing of the server's files.

A load reads the adapter's folder on a worker (`read`: the engine side's reader, which the
server is given: the front ends import no engine), then hands it to the engine thread between
two steps; an unload is refused while a queued or running request uses the adapter. Once begun,
a load or unload runs to its end even if its caller leaves (it is shielded), so the served names
always match the engine's adapters. Each refusal is a clear ApiError naming the problem; a
request already running is never disturbed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any, Awaitable, Callable, Sequence

from jaxserve.batching.stream import AsyncRunner
from jaxserve.config import LoRARequest
from jaxserve.serving.gateway import ApiError, Status, invalid


class Adapters:

  def __init__(self, runner: AsyncRunner, base_name: str,
               read: Callable[[str], Any] | None = None,
               runtime_roots: Sequence[str] | None = None):
    """`read(path)`: the adapter in folder `path` as the engine takes it, or a ValueError naming
    the problem; None: this server runs no adapters. `runtime_roots`: the directories run-time
    loads may read from; None: run-time loads and unloads are off."""
    self._runner = runner
    self._base = base_name
    self._read = read
    self._roots = None if runtime_roots is None else [os.path.realpath(r)
                                                      for r in runtime_roots]
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

  async def load(self, name: Any, path: Any, work: Callable[..., Awaitable[Any]],
                 admin: bool) -> LoRARequest:
    """Serves the PEFT adapter in folder `path` (under a LoRA root) as model `name`;
    `work(fn, *args)` runs the read on a worker; `admin`: the caller may change adapters."""
    self._check_runtime(admin)
    for field, value in (("lora_name", name), ("lora_path", path)):
      if not isinstance(value, str) or not value:
        raise invalid(f"{field} must be a non-empty string, got {value!r}")
    if name == self._base or name in self._by_name or name in self._busy:
      raise invalid(f"the LoRA adapter {name!r} has already been loaded")
    folder = self._confined(name, path)
    self._busy.add(name)
    return await _to_the_end(self._load(name, folder, work))

  async def _load(self, name: str, folder: str, work) -> LoRARequest:
    try:
      try:
        adapter = await work(self._read, folder)
      except ValueError as e:
        raise invalid(str(e)) from e
      return await self.add(name, folder, adapter)
    finally:
      self._busy.discard(name)

  async def add(self, name: str, path: str, adapter: Any) -> LoRARequest:
    """Serves an adapter read already (`serve --lora-modules`'s, before the first request)."""
    lora = LoRARequest(name, next(self._ids), path)
    try:
      await self._runner.add_lora(lora, adapter)
    except ValueError as e:
      raise invalid(str(e)) from e
    self._by_name[name] = lora
    return lora

  async def unload(self, name: Any, admin: bool) -> None:
    """Stops serving adapter `name`: NOT_FOUND if it is not served, INVALID_ARGUMENT while a
    request uses it."""
    self._check_runtime(admin)
    lora = self._by_name.get(name) if isinstance(name, str) else None
    if lora is None:
      raise ApiError(Status.NOT_FOUND, f"the LoRA adapter {name!r} is not loaded")
    if name in self._busy:
      raise invalid(f"the LoRA adapter {name!r} is being unloaded")
    self._busy.add(name)
    await _to_the_end(self._unload(lora))

  async def _unload(self, lora: LoRARequest) -> None:
    try:
      try:
        await self._runner.remove_lora(lora.lora_int_id)
      except ValueError as e:  # In use.
        raise invalid(f"the LoRA adapter {lora.lora_name!r} cannot be unloaded now: "
                      f"{e}") from e
      del self._by_name[lora.lora_name]
    finally:
      self._busy.discard(lora.lora_name)

  def _check_runtime(self, admin: bool) -> None:
    if not self.enabled:
      raise invalid("LoRA adapters are off on this server: serve with --enable-lora")
    if self._roots is None:
      raise ApiError(Status.PERMISSION_DENIED, "run-time LoRA updates are off on this server: "
                     "start it with --enable-runtime-lora-updates and --lora-root DIR")
    if not admin:
      raise ApiError(Status.PERMISSION_DENIED, "loading and unloading LoRA adapters needs an "
                     "admin key (\"admin\": true in the keys file)")

  def _confined(self, name: str, path: str) -> str:
    """`path` resolved, if it is a folder under a LoRA root; else NOT_FOUND, the same answer
    whether it is missing or outside the roots."""
    folder = confined(path, self._roots)
    if folder is None:
      raise ApiError(Status.NOT_FOUND, f"LoRA adapter {name!r}: no adapter folder {path!r} under "
                     "this server's LoRA roots")
    return folder


def confined(path: str, roots: Sequence[str]) -> str | None:
  """`path` resolved, if it is a folder under one of `roots` (resolved already); else None."""
  folder = os.path.realpath(path)
  if os.path.isdir(folder) and any(os.path.commonpath([folder, root]) == root for root in roots):
    return folder
  return None


async def _to_the_end(coro: Awaitable[Any]) -> Any:
  """Awaits `coro` as a task that runs to its end even if this caller is cancelled."""
  task = asyncio.ensure_future(coro)
  task.add_done_callback(lambda t: t.cancelled() or t.exception())  # Retrieved: never logged.
  return await asyncio.shield(task)
