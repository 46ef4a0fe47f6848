"""scripts/bench/peers.py (`python -m scripts.bench peers`): the shipped workload, the report
arithmetic, and the jaxserve part in --quick mode on a tiny random model (a peer that is not
installed is reported as skipped); how llama.cpp is loaded where its weight repack crashes."""

import json
import pathlib
import re

import pytest

from jaxserve.loading import pull
from jaxserve.text.tokenizer import Tokenizer
from support import script_loader

ROOT = pathlib.Path(__file__).resolve().parents[1]
bp = script_loader.load("bench.peers")
ps = script_loader.load("bench.peers_systems")


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_gguf(pull.gguf_path(pull.DEFAULT_MODEL))


def test_the_shipped_workload_is_the_generators_output(tokenizer):
  shipped = bp.read_workload(bp.WORKLOAD)
  assert shipped == bp.make_workload(tokenizer, seed=0)
  assert len(shipped) == 64 and len({r["id"] for r in shipped}) == 64
  for r in shipped:
    assert 16 <= len(r["prompt_token_ids"]) <= 256 and 16 <= r["max_tokens"] <= 256
    assert r["ignore_eos"] is True and r["temperature"] == 0
    # The prompt is word-list text: every whole word but the last (maybe cut) is from the list.
    words = re.findall(r"[a-z]+", tokenizer.detokenize(r["prompt_token_ids"]).lower())
    assert set(words[:-1]) <= set(bp.WORDS)
  # Spread over the ranges, not bunched at one end.
  lens = sorted(len(r["prompt_token_ids"]) for r in shipped)
  assert lens[0] < 64 and lens[-1] > 200
  assert bp.make_workload(tokenizer, seed=1) != shipped


def test_the_shipped_workload_runs_in_generate_batch():
  # Its lines use only fields generate_batch.py accepts, so that script can replay the work.
  gb = script_loader.load("generate_batch")
  for i, line in enumerate(bp.WORKLOAD.read_text().splitlines(), start=1):
    parsed = gb.parse_line(line, i)
    assert parsed.prompt_field == "prompt_token_ids" and parsed.overrides["ignore_eos"] is True


def run(system, wall, ttft, outputs):
  return bp.Run(system, wall, 100, 50, ttft, 100, (0.0, 0.0, 0.0), outputs)


def test_report_takes_the_median_round_and_computes_the_ratios():
  ours = [run("jaxserve", w, 1.0, [[1, 2, 3, 4], [5, 6]]) for w in (12.0, 10.0, 11.0)]
  peer = [run("transformers", w, 4.0, [[1, 2, 9, 4], [5, 6]]) for w in (30.0, 50.0, 40.0)]
  report = bp.summarize({"jaxserve": ours, "transformers": peer}, {"llama.cpp": "not installed"})
  j, t = report["systems"]["jaxserve"], report["systems"]["transformers"]
  assert j["wall_s"] == 11.0 and t["wall_s"] == 40.0  # Medians of the rounds.
  assert t["rounds_wall_s"] == [30.0, 50.0, 40.0]
  assert t["generated_tokens_per_s"] == 100 / 40 and t["prompt_tokens_per_s"] == 50 / 40
  assert t["jaxserve_speedup"] == 40 / 11 and t["jaxserve_ttft_ratio"] == 1 / 4
  # Request 1 agrees for 2 of 4 tokens, request 2 for 2 of 2: (0.5 + 1) / 2.
  assert t["token_agreement_with_jaxserve"] == 0.75
  table = bp.markdown(report)
  assert "| transformers | 40.0 | 2.5 | 1.2 | 4.00 | 3.64x | 0.25 | 75% |" in table
  assert "| llama.cpp | skipped: not installed |" in table


def test_quick_mode_runs_jaxserve_and_skips_a_missing_peer(tiny_checkpoint, tmp_path, monkeypatch,
                                                           tokenizer):
  def missing():
    raise ImportError("No module named 'llama_cpp'")

  monkeypatch.setattr(ps, "import_llama_cpp", missing)  # As on a machine without it.
  out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
  # The shapes of support/server_harness.py's ENGINE: programs the compilation cache holds.
  assert bp.main(["--quick", "--systems", "jaxserve,llama.cpp",
                  "--jaxserve-model", str(tiny_checkpoint), "--slots", "4", "--buckets", "32",
                  "--max-model-len", "128", "--num-pages", "40",
                  "--json", str(out_json), "--markdown", str(out_md)]) == 0
  report = json.loads(out_json.read_text())
  work = bp.make_workload(tokenizer, 0, num_requests=4, prompt_lens=(8, 32), max_tokens=(4, 16))
  j = report["systems"]["jaxserve"]
  assert j["generated_tokens"] == j["decoded_tokens"] == sum(r["max_tokens"] for r in work)
  assert j["prompt_tokens"] == sum(len(r["prompt_token_ids"]) for r in work)
  assert 0 < j["mean_ttft_s"] < j["wall_s"]
  assert j["generated_tokens_per_s"] == pytest.approx(j["generated_tokens"] / j["wall_s"])
  assert list(report["systems"]) == ["jaxserve"]
  assert "not installed" in report["skipped"]["llama.cpp"]
  assert "--install-llama-cpp" in report["skipped"]["llama.cpp"]
  md = out_md.read_text()
  assert (md.startswith("| system | wall s |") and "| jaxserve |" in md
          and "| llama.cpp | skipped" in md)


STAND_INS = {  # A llama_cpp package for the probe's throwaway process: how its load ends.
    "crashes": "import os, signal\nclass Llama:\n  def __init__(self, **kw):\n"
               "    os.kill(os.getpid(), signal.SIGSEGV)\n",
    "loads": "class Llama:\n  def __init__(self, **kw): pass\n"
             "  def generate(self, ids, **kw): yield 7\n",
    "fails": "raise ImportError('no llama here')\n"}


@pytest.mark.parametrize("kind", list(STAND_INS))
def test_llama_cpp_is_loaded_without_its_repack_where_the_repack_crashes(kind, tmp_path,
                                                                         monkeypatch):
  # As llama-cpp-python 0.3.36 does on the Xeon with AMX (exit -11 repacking Q4_1): the probe's
  # process dies by a signal, and llama.cpp is then loaded with use_extra_bufts = False.
  (tmp_path / "llama_cpp").mkdir()
  (tmp_path / "llama_cpp" / "__init__.py").write_text(STAND_INS[kind])
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  if kind == "fails":
    with pytest.raises(RuntimeError, match="no llama here"):
      ps.repack_mode(tmp_path / "model.gguf")
    return
  mode, why = ps.repack_mode(tmp_path / "model.gguf")
  assert (mode, "SIGSEGV" in why) == ((ps.NO_REPACK, True) if kind == "crashes"
                                      else (ps.REPACK, False))


def test_the_repack_setting_reaches_llama_cpps_model_parameters():

  class Params:
    use_extra_bufts = True

  class Lib:
    class llama_cpp:
      llama_model_default_params = Params

  for mode, want in ((ps.NO_REPACK, False), (ps.REPACK, True)):
    with ps._model_params(Lib, mode):
      assert Lib.llama_cpp.llama_model_default_params().use_extra_bufts is want
  assert Lib.llama_cpp.llama_model_default_params is Params  # Restored after.
