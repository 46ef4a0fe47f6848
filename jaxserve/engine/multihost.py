"""Serving on several hosts: process 0 schedules, every other process repeats its engine calls.

The engine's steps are one SPMD program over a mesh that spans all processes, so every process
must make the same jitted calls, in the same order, on the same inputs, or the collectives inside
them wait forever. Offline `generate` gets that for free (every host runs the same workload);
`serve` does not, since only process 0 takes requests. So:

  process 0    Runner -> LeaderEngine.step(plan)
                 builds the step's host arrays (Engine.step_args)
                 broadcasts a header [kind, decode rows, prefill tokens, width], then the arrays
                 runs the step (Engine.run_step)
  process 1..n follow(engine): receives the header, then arrays of the shape it names (built by
                 the engine itself: Packer.template), and runs the same step

Both broadcasts go through `multihost_utils.broadcast_one_to_all`, a jitted psum over every
device: it needs the same shapes on every process, hence the fixed-size header first. A STOP
header, sent by `LeaderEngine.stop()` once the runner has stopped, lets the followers exit.
Followers discard the sampled tokens: only process 0 reads them. Before the first call, every
process checks that all built the same engine shapes (`_check_same_engine`).

The price: each step starts with two small collectives that wait for the step before it, so the
followers' devices idle while their hosts receive and dispatch. Passing the header and arrays
through the coordination service's key-value store instead would let them queue step n+1 while
step n runs.
"""

from __future__ import annotations

import zlib

import jax
import numpy as np
from absl import logging
from jax.experimental.multihost_utils import broadcast_one_to_all, process_allgather

from jaxserve.batching.plan import StepKind, StepPlan
from jaxserve.engine.engine import Engine
from jaxserve.engine.step_args import StepArgs
from jaxserve.engine.step_future import StepFuture
from jaxserve.engine.step_shapes import StepShape

# The header's first number: 0 stops the followers, else the step kind's (batching.plan.StepKind)
# index plus one.
STOP = 0
_KINDS = list(StepKind)


# The header, [kind, Bd, Tp, W] int32: the step's StepShape, which sets every shape of the arrays
# that follow.
_HEADER_SHAPE = (4,)

_SETTINGS = ("num_slots", "page_size", "num_pages", "max_model_len", "vocab_size", "tp", "dp",
             "prefill_buckets")


def is_leader() -> bool:
  return jax.process_index() == 0


def shared_seed() -> int:
  """A random seed, the same on every process (process 0 draws it): every process must call it.
  For offline runs on several hosts, where each host builds the same requests itself and a seed
  drawn per host would make their inputs, and so their collectives, disagree."""
  drawn = np.int32(np.random.default_rng().integers(2**31 - 1))
  return int(broadcast_one_to_all(drawn))


class LeaderEngine:
  """`plan.Engine` on process 0 of several: each call is first broadcast to the followers.

  Call it from one thread at a time (the runner's): the broadcasts and the steps are collectives,
  and every process must issue them in the same order.
  """

  sleep_level = 0  # Sleep mode is one process's engine's (Engine.sleep), not broadcast.

  def __init__(self, engine: Engine):
    if not is_leader():
      raise ValueError(f"LeaderEngine runs on process 0; this is process {jax.process_index()}")
    _check_same_engine(engine)
    self.engine = engine
    self.info = engine.info
    self.num_calls = 0  # Engine steps sent to the followers.
    self._stopped = False

  def step(self, plan: StepPlan, bitmask: np.ndarray | None = None) -> StepFuture | None:
    # Engine.step builds each call's args (raising on a bad plan before anything is sent).
    return self.engine.step(plan, bitmask, run=self._run)

  def _run(self, args: StepArgs, rows: list[int], kind: StepKind, chunk_lens=()) -> StepFuture:
    shape = (args.decode_slots.shape[0], args.prefill_tokens.shape[0], args.decode_tables.shape[1])
    _send(_KINDS.index(kind) + 1, shape, args)
    self.num_calls += 1
    return self.engine.run_step(args, rows, kind, chunk_lens)

  def stop(self) -> None:
    """Tells the followers to return from `follow`. Call once no engine call can follow it."""
    if not self._stopped:
      _send(STOP, (0, 0, 0), None)
      self._stopped = True


def follow(engine: Engine) -> int:
  """Processes 1..n of `serve`: runs process 0's engine calls until it stops; returns how many
  it ran."""
  if is_leader():
    raise ValueError("follow() runs on processes 1..n; process 0 wraps its engine in LeaderEngine")
  _check_same_engine(engine)
  num_steps = 0
  while True:
    kind, *shape = (int(x) for x in broadcast_one_to_all(np.zeros(_HEADER_SHAPE, np.int32)))
    # Process 0's numpy scalars come back as 0-d arrays: the same shapes and dtypes to `jit`, so
    # no step recompiles.
    if kind == STOP:
      logging.info("follower %d: stop after %d steps", jax.process_index(), num_steps)
      return num_steps
    if not 1 <= kind <= len(_KINDS):
      raise ValueError(f"unknown engine call {kind} from process 0")
    step_kind = _KINDS[kind - 1]
    template = engine.packer.template(StepShape(*shape), step_kind)
    engine.run_step(broadcast_one_to_all(template), [], step_kind)
    num_steps += 1


def _send(kind: int, shape: tuple[int, int, int], args: StepArgs | None) -> None:
  """Process 0's side of one call. Its own args are used as they are: the broadcast is only
  for the others."""
  broadcast_one_to_all(np.array([kind, *shape], np.int32))
  if args is not None:
    broadcast_one_to_all(args)


def _check_same_engine(engine: Engine) -> None:
  """Raises on every process unless all built the same engine shapes (a flag given to one host
  only): a mismatch would otherwise hang or corrupt the first step. Every process calls it."""
  cfg, info = engine.config, engine.info
  buckets = zlib.crc32(repr(tuple(cfg.prefill_buckets)).encode()) & 0x7FFFFFFF
  mine = np.array([info.num_slots, info.page_size, info.num_pages, info.max_model_len,
                   info.vocab_size, cfg.tp, cfg.dp, buckets], np.int32)
  everyone = np.asarray(process_allgather(mine))  # [P, len(_SETTINGS)]
  differ = [f"{name} {col.tolist()}" for name, col in zip(_SETTINGS, everyone.T)
            if len(set(col)) > 1]
  if differ:
    raise ValueError(f"the processes built different engines ({'; '.join(differ)} by process): "
                     "give every host the same engine flags")
