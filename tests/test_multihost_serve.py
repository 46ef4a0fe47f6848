"""Multi-host `serve`: process 0 schedules and broadcasts each engine call, process 1 follows.

Two processes joined by `jax.distributed` on loopback (4 fake CPU devices each) run one [dp=2,
tp=4] mesh: the decode slots are split across the processes, so a step the follower missed, or
ran on other inputs, hangs the collectives or changes process 0's tokens. Those must equal a
lone process on one device running the same requests.
"""

from __future__ import annotations

import json
import subprocess
import sys

from support.workers import MP8, MULTIHOST_WORKER, free_port

# [prompt ids, max_tokens, repetition_penalty]: more requests than the 4 slots; prompts of 3 to
# 40 tokens, so prefill runs chunks of both buckets (40 = 24 + 16 under the 24-token budget), a
# chunk that is not a prompt's last, and decode at both widths (8 and 16 pages of 4 tokens). The
# penalties make the sampling rows (prompt mask, output counts) matter.
REQUESTS = [
    [[1, 2, 3], 6, 1.0],
    [list(range(10, 22)), 9, 1.3],
    [[(7 * i) % 128 for i in range(40)], 12, 1.0],
    [[5, 9, 17, 33, 65], 4, 1.0],
    [list(range(100, 118)), 7, 1.5],
    [[42], 10, 1.0],
]


def _launch(args: dict) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, str(MULTIHOST_WORKER), json.dumps(args)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
  try:
    stdout, stderr = proc.communicate(timeout=300)
  except subprocess.TimeoutExpired:
    proc.kill()
    stdout, stderr = proc.communicate()
    raise AssertionError(f"worker hung (a deadlocked collective?): {stderr[-4000:]}")
  assert proc.returncode == 0, stderr[-4000:]
  return json.loads(stdout.strip().splitlines()[-1])


def test_follower_runs_the_leaders_steps():
  common = dict(model=MP8, requests=REQUESTS)
  multi = dict(common, devices=4, layout=[4, 2], coordinator=f"127.0.0.1:{free_port()}",
               num_processes=2)
  procs = [_launch(dict(multi, process_id=i)) for i in range(2)]
  single = _result(_launch(dict(common, devices=1, layout=[1, 1])))
  leader, follower = (_result(p) for p in procs)

  assert [leader["process"], follower["process"]] == [0, 1]
  assert leader["num_devices"] == follower["num_devices"] == 8
  assert leader["seed"] == follower["seed"] is not None  # multihost.shared_seed
  assert leader["tokens"] == single["tokens"]
  assert [len(t) for t in single["tokens"]] == [n for _, n, _ in REQUESTS]
  assert len({tuple(t) for t in single["tokens"]}) == len(REQUESTS)  # Not one degenerate output.
  # Every call process 0 made, and no other, ran on process 1; then it stopped and exited 0.
  assert follower["num_calls"] == leader["num_calls"] > 2 * len(REQUESTS)
  for out in (leader, follower):  # Broadcast inputs are the warm-up's shapes: no step recompiled.
    after_warmup, after_serving = out["compiled"]
    # One step program per shape (Packer.shapes): decode-only at the one decode bucket (dp keeps
    # every slot: 4 rows), prefill-only and mixed at prefill buckets 16 and 32.
    assert after_serving == after_warmup == [5], out["process"]


def test_processes_with_different_engines_refuse_to_start():
  """A flag given to one host only: both processes exit with the difference named, not a hang."""
  multi = dict(model=MP8, requests=REQUESTS, devices=4, layout=[4, 2], warmup=False,
               coordinator=f"127.0.0.1:{free_port()}", num_processes=2)
  procs = [_launch(dict(multi, process_id=i, engine=dict(num_pages=128 - 32 * i)))
           for i in range(2)]
  for proc in procs:
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "the processes built different engines (num_pages [128, 96] by process)" in stderr
