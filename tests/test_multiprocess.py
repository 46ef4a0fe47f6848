"""Two processes joined by `jax.distributed` on loopback, 4 fake CPU devices each, run one mesh of
8 devices, as two hosts would; their greedy tokens must equal a single process on one device."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from support.workers import MP8, PROMPTS, SHARDING_WORKER, free_port, run_worker

LAYOUTS = [[8, 1], [4, 2]]  # [tp, dp]: model split across hosts; model within, slots across.


def test_two_processes_match_one(tmp_path):
  common = dict(model=MP8, prompts=PROMPTS, steps=4)
  mp = dict(common, devices=4, layouts=LAYOUTS, coordinator=f"127.0.0.1:{free_port()}",
            num_processes=2)
  procs = [subprocess.Popen([sys.executable, str(SHARDING_WORKER),
                             json.dumps(dict(mp, process_id=i))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  single = run_worker(dict(common, devices=1, layouts=[[1, 1]]))["layouts"]["1x1"]
  outs = []
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    outs.append(json.loads(stdout.strip().splitlines()[-1]))
  assert [o["process"] for o in outs] == [0, 1]
  assert all(o["num_devices"] == 8 for o in outs)  # Each process sees the global mesh.
  for out in outs:
    for layout, run in out["layouts"].items():
      assert run["tokens"] == single["tokens"], (out["process"], layout)
      np.testing.assert_allclose(run["logprobs"], single["logprobs"], atol=1e-4)
