"""XLA programs compiled in this process, counted from the first import of the engine: what the
server's `jaxserve:xla_compiles` reports. After warm-up no request may add one (a recompile is a
stall of seconds); a program loaded from the persistent compilation cache counts as well."""

from __future__ import annotations

import jax

from jaxserve.compat import BACKEND_COMPILE_EVENT  # jax.monitoring's event for one compile.

_count = [0]


def _listen(event: str, duration: float, **_) -> None:
  if event == BACKEND_COMPILE_EVENT:
    _count[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


def num_compiles() -> int:
  return _count[0]
