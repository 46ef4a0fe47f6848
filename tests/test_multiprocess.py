"""Two processes joined by `jax.distributed` on loopback, 4 fake CPU devices each, run one mesh of
8 devices, as two hosts would; their greedy tokens must equal a single process on one device."""

from __future__ import annotations

import json
import os
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


def test_generate_on_two_processes_without_a_seed_draws_one_seed_for_all():
  """Issue 29: `jaxserve generate` on several processes with no --seed imported `multihost` from
  the wrong module (ImportError). Each process runs the command's own seed step after joining
  the job: both get one seed (process 0's draw)."""
  coordinator = f"127.0.0.1:{free_port()}"
  code = ("import sys\nfrom jaxserve.cli import main as cli\n"
          "args = cli.build_parser().parse_args(sys.argv[1:])\n"
          "cli.init_distributed(args)\nprint('seed', cli.sampling_seed(args))\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}
  procs = [subprocess.Popen(
      [sys.executable, "-c", code, "generate", "x", "--temperature", "1.0",
       "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
  seeds = []
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    seeds.append(next(line for line in stdout.splitlines() if line.startswith("seed ")))
  assert seeds[0] == seeds[1] and seeds[0] != "seed None", seeds
