"""scripts/load_test.py's rounds against a real server on loopback (tiny model): 32 clients at once,
with cancels, short deadlines and two clients that stop reading their streams.

Every request ends with its full output or a status, the stalled streams hold back neither the
others nor the engine (their requests finish and free their pages while the streams are still
open), every page is free after each round, and each completed output equals that of the same
request run alone."""

from __future__ import annotations

import asyncio
import pathlib
import random

import grpc
import pytest

from support import script_loader
from support import server_harness as h

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_STALLED = 2
ARGS = ["--clients", "32", "--rounds", "2", "--cancel-frac", "0.25", "--deadline-frac", "0.25",
        "--stall-frac", str(NUM_STALLED / 32), "--deadline-min-s", "0.01",
        "--deadline-max-s", "0.3",
        "--max-prompt-tokens", "24", "--min-tokens", "4", "--max-tokens", "40", "--timeout-s", "30",
        "--idle-timeout-s", "10", "--stall-window-bytes", "256"]


@pytest.fixture(scope="module")
def lt():
  return script_loader.load("load_test")


def run_alone(address: str, request) -> list[int]:
  with grpc.insecure_channel(address) as channel:
    return [t for m in h.generate(h.stub(channel), request, None, 30) for t in m.token_ids]


def test_faulty_clients_neither_hang_nor_leak(lt, srv):
  args, serve_args = lt.parse_args(ARGS)
  assert not serve_args
  pool, rng, reference = lt.prompt_pool(args), random.Random(args.seed), {}
  released = []

  def on_others_done():
    # The engine finishes the stalled requests and frees their pages; their handlers are
    # still blocked writing to the streams nobody reads.
    released.append(h.wait_until(lambda: h.idle(srv.scheduler)
                             and srv.server.service.num_active == NUM_STALLED))

  metrics = lt.scrape(srv.http_url + "/metrics")
  outcomes = []
  for index in (1, 2):
    specs = lt.round_specs(pool, args, rng)
    results, _ = asyncio.run(lt.run_round(srv.grpc_address, specs, args, on_others_done))
    lt.check_repeats(results, reference)
    row = lt.summarize(index, results, 0.0)
    metrics = lt.after_round(row, metrics, srv.http_url + "/metrics", None, args)
    assert row["failures"] == [] and row["idle_s"] is not None
    assert h.idle(srv.scheduler)
    assert released[-1], "a stalled stream held its request in the engine, or its handler ended"
    check_outcomes(lt, results)
    outcomes += [(r.spec.fault, r.outcome, len(r.tokens)) for r in results]

  F, O = lt.Fault, lt.Outcome
  assert any(f is F.CANCEL and o is O.CANCELLED and n > 0 for f, o, n in outcomes)  # Mid-stream.
  assert any(f is F.CANCEL and o is O.CANCELLED and n == 0 for f, o, n in outcomes)  # Before any.
  assert any(o is O.DEADLINE for _, o, _ in outcomes)
  assert sum(o is O.COMPLETED for _, o, _ in outcomes) >= 32
  for key, tokens in reference.items():  # Greedy (even keys) and seeded samples (odd keys).
    assert run_alone(srv.grpc_address, pool[key]) == tokens, key


def check_outcomes(lt, results) -> None:
  """Each fault ends as it should: the plain and stalled ones complete, the others may too."""
  F, O = lt.Fault, lt.Outcome
  allowed = {F.NONE: {O.COMPLETED}, F.STALL: {O.COMPLETED}, F.CANCEL: {O.CANCELLED, O.COMPLETED},
             F.DEADLINE: {O.DEADLINE, O.COMPLETED}}
  for r in results:
    assert r.outcome in allowed[r.spec.fault], (r.spec.fault, r.outcome, r.code)
    if r.outcome is O.CANCELLED:
      assert r.code == "CANCELLED" and len(r.tokens) == r.spec.cancel_after
  ends = [r.end for r in results if r.spec.fault is not F.STALL]
  stalled = [r for r in results if r.spec.fault is F.STALL]
  assert len(stalled) == NUM_STALLED and all(r.resumed >= max(ends) for r in stalled)
