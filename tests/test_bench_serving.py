"""`python -m scripts.bench serving` (scripts/bench/serving.py) against a real server (tiny model)
on loopback for a few seconds."""

from __future__ import annotations

import json
import pathlib

import pytest

from support import script_loader, server_harness

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script():
  return script_loader.load("bench.serving")


@pytest.fixture
def workload(tmp_path):
  items = [{"prompt_token_ids": list(range(100 + i, 110 + 2 * i)), "max_tokens": 3 + i}
           for i in range(6)]
  path = tmp_path / "w.jsonl"
  path.write_text("".join(json.dumps(item) + "\n" for item in items))
  return path, sum(item["max_tokens"] for item in items)


@pytest.mark.parametrize("mode", [["--request-rate", "20"], ["--concurrency", "3"]])
def test_reports_latencies_and_throughput(srv, workload, tmp_path, mode):
  path, num_tokens = workload
  out = tmp_path / "summary.json"
  bench = load_script()
  assert bench.main_serving(["--address", srv.grpc_address, "--workload", str(path),
                             "--json", str(out), *mode]) == 0
  s = json.loads(out.read_text())
  assert s["requests"] == 6 and s["failed"] == 0
  # End of sequence is ignored: every request streams its whole budget.
  assert s["output_token_throughput"] * s["wall_s"] == pytest.approx(num_tokens)
  for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
    row = s[metric]
    assert 0 < row["p50"] <= row["p90"] <= row["p99"]
  assert s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
  assert server_harness.idle(srv.scheduler)


def test_failures_are_counted_not_hidden(srv, tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"prompt_token_ids": [5] * 10, "max_tokens": 100000}) + "\n")
  bench = load_script()
  out = tmp_path / "summary.json"
  assert bench.main_serving(["--address", srv.grpc_address, "--workload", str(path),
                             "--json", str(out)]) == 1
  s = json.loads(out.read_text())
  assert s["failed"] == 1 and s["errors"] and s["errors"][0].startswith("INVALID_ARGUMENT")
