"""The sharded and multi-process runs: worker scripts run in subprocesses, since their fake CPU
devices (`--xla_force_host_platform_device_count`) must be set before jax is imported."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]
SHARDING_WORKER = TESTS / "sharding_worker.py"
MULTIHOST_WORKER = TESTS / "multihost_worker.py"
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 3, 50, 60, 61, 62, 2], [5]]
# 8 heads over 4 KV heads, MLP 96 and vocabulary 128: every split up to tp=4 divides.
TINY8 = dict(vocab_size=128, dim=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16,
             hidden_dim=96, max_seq_len=256, name="tiny8")
# 8 KV heads, so tp=8 splits the model across both processes and its all-reduces cross them.
MP8 = dict(vocab_size=128, dim=64, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=16,
           hidden_dim=96, max_seq_len=256, name="mp8")


def run_worker(args: dict, timeout: float = 600) -> dict:
  """The sharding worker's JSON result (its last stdout line) for `args`."""
  proc = subprocess.run([sys.executable, str(SHARDING_WORKER), json.dumps(args)],
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
