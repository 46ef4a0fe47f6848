"""`POST /update_weights_from_disk` (SGLang's name and body, issue 49): a trainer that saves its
weights to disk has the server take them, as `LLM.update_weights` takes arrays.

Off unless the server is started with `--weights-root DIR`, and then an admin's (http_admin.py
checks the key): a folder (a Hugging Face safetensors folder or a jaxserve checkpoint, whose
orbax `params/` are read) is read only from under those directories, symlinks resolved first; a
folder that is not there and one outside the roots get the same answer (NOT_FOUND). The folder
is read on a worker thread (`read`: the engine side's reader, which the server is given: the
front ends import no engine), then the weights go in on the engine thread between two steps
(`AsyncRunner.update_weights`): the running requests finish on the old weights first, or are
aborted (`in_flight`), and the prefix cache is forgotten. A weight that does not fit is refused
by name, changing nothing.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from jaxserve.serving.adapters import confined
from jaxserve.serving.gateway import ApiError, Status, invalid


class WeightsFromDisk:

  def __init__(self, runner: Any, read: Callable[[str], Any] | None,
               roots: Sequence[str] = ()):
    """`runner`: the AsyncRunner; `read(folder)`: the weights in the model's layout, or a
    ValueError naming the problem (None: this server cannot read weights); `roots`: where
    reads are allowed (none: the route is off)."""
    self._runner, self._read = runner, read
    self._roots = [os.path.realpath(r) for r in roots]

  async def update(self, body: dict, work: Callable) -> str:
    """Takes the weights of body["model_path"] (`work(fn, *args)` runs fn on a worker); the
    message of the answer."""
    if not self._roots or self._read is None:
      raise ApiError(Status.PERMISSION_DENIED, "weight updates from disk are off on this server: "
                     "start it with --weights-root DIR")
    path, in_flight = body.get("model_path"), body.get("in_flight", "finish")
    if not isinstance(path, str) or not path:
      raise invalid("model_path must be a folder's path (a string)")
    if in_flight not in ("finish", "abort"):
      raise invalid(f"in_flight must be 'finish' or 'abort', got {in_flight!r}")
    folder = confined(path, self._roots)
    if folder is None:
      raise ApiError(Status.NOT_FOUND, f"no weights folder {path!r} under this server's weight "
                     "roots")
    try:
      params = await work(self._read, folder)
    except (ValueError, OSError) as e:
      raise invalid(f"weights in {path!r}: {e}") from None
    try:
      await self._runner.update_weights(params, in_flight)
    except ValueError as e:  # A weight that does not fit, named; nothing changed.
      raise invalid(f"weights in {path!r}: {e}") from None
    return f"weights updated from {path}"
