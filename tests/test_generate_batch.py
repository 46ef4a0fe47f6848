"""scripts/generate_batch.py on a tiny random model with SmolLM2's tokenizer: input order, resume
after an interruption, bad lines, progress output, and the memory-fraction pool size."""

import json
import pathlib

import pytest

from jaxserve.planning import capacity
from support import script_loader

ROOT = pathlib.Path(__file__).resolve().parents[1]
gb = script_loader.load("generate_batch")

ENGINE_FLAGS = ["--slots", "2", "--page-size", "8", "--num-pages", "40", "--max-model-len", "128",
                "--buckets", "32", "--progress-interval", "0"]


def write_jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read_jsonl(path):
  return [json.loads(t) for t in path.read_text().splitlines()]


def run(ckpt, inp, out, *extra):
  return gb.main([str(inp), str(out), "--model", str(ckpt), "--ignore-eos", *ENGINE_FLAGS, *extra])


# Descending max_tokens with 2 slots: the first lines finish last, so input order needs the sort.
ROWS = [{"id": f"r{i}", "prompt": f"Request number {i} says hello", "max_tokens": n}
        for i, n in enumerate([12, 9, 6, 3, 2])]


def test_results_come_back_in_input_order_with_their_own_budgets(tiny_checkpoint, tmp_path, capsys):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  chat = {"id": 7, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
  write_jsonl(inp, ROWS + [chat])
  assert run(tiny_checkpoint, inp, out, "--token-ids") == 0
  records = read_jsonl(out)
  assert [r["id"] for r in records] == ["r0", "r1", "r2", "r3", "r4", 7]
  assert [r["completion_tokens"] for r in records] == [12, 9, 6, 3, 2, 4]
  assert all(r["finish_reason"] == "length" and "error" not in r for r in records)
  assert [r["line"] for r in records] == [1, 2, 3, 4, 5, 6]
  # Greedy, so each text and token list must equal the offline API's for the same prompt.
  llm = gb.LLM(str(tiny_checkpoint),
               engine_config=gb.cli.engine_config(gb.build_parser().parse_args(
                   ["x", "y", *ENGINE_FLAGS])))
  expected = llm.generate([r["prompt"] for r in ROWS],
                          [gb.SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                             ignore_eos=True)
                           for r in ROWS])
  for rec, c in zip(records, expected):
    assert rec["token_ids"] == list(c.token_ids) and rec["text"] == c.text
    assert rec["prompt_tokens"] == len(c.prompt_token_ids)
  chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat["messages"]),
                                  add_bos=False)
  assert records[5]["prompt_tokens"] == len(chat_ids)
  for r in records:
    t = r["timings"]
    assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["e2e_s"]
  err = capsys.readouterr().err
  # Progress lines count requests and tokens; the last one has all of them: 12+9+6+3+2+4 = 36.
  assert err.splitlines()[-2].startswith("[6/6 requests] 36 tokens, ")
  assert "tokens/s" in err and "6 requests, 0 errors, 0 skipped" in err
  assert "mean time to first token" in err


def test_an_interrupted_run_resumes_without_redoing_work(tiny_checkpoint, tmp_path, monkeypatch):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_jsonl(inp, ROWS)
  real_update = gb.Progress.update

  def interrupt_after_two(self, num_done=0, num_tokens=0, force=False):
    real_update(self, num_done, num_tokens, force)
    if self.num_done == 2:
      raise KeyboardInterrupt  # Ctrl-C right after the second request was written.

  monkeypatch.setattr(gb.Progress, "update", interrupt_after_two)
  assert run(tiny_checkpoint, inp, out) == 130
  monkeypatch.setattr(gb.Progress, "update", real_update)
  first = read_jsonl(out)
  # Appended in completion order: r0 (12 tokens) and r1 (9) took the two slots, r1 finished first.
  assert [r["id"] for r in first] == ["r1", "r0"]
  with open(out, "a") as f:
    f.write('{"id": "r0", "te')  # A write cut off by the interruption.
  assert run(tiny_checkpoint, inp, out) == 0
  final = read_jsonl(out)
  assert [r["id"] for r in final] == ["r0", "r1", "r2", "r3", "r4"]
  # The two finished before the interruption are kept as they were (timings included).
  assert final[0] == first[1] and final[1] == first[0]
  # A complete run re-run does nothing and keeps the file.
  before = out.read_text()
  assert run(tiny_checkpoint, inp, out) == 0
  assert out.read_text() == before


def test_bad_lines_get_an_error_and_the_run_goes_on(tiny_checkpoint, tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_jsonl(inp, [
      {"id": "ok1", "prompt": "Hello there", "max_tokens": 3},
      "{not json",
      {"id": "typo", "prompt": "x", "max_token": 3},
      {"id": "cold", "prompt": "x", "temperature": -1},
      {"id": "long", "prompt": "x", "max_tokens": 500},  # More than --max-model-len 128.
      {"id": "none"},
      "",  # Blank lines are skipped, not errors.
      {"id": "ok1", "prompt": "again"},
      {"id": "ids", "prompt_token_ids": [1, 2, 99999999]},
      {"id": "ok2", "prompt_token_ids": [1, 2, 3], "max_tokens": 2},
      {"id": "stops", "prompt": "x", "stop_token_ids": 5},
  ])
  assert run(tiny_checkpoint, inp, out) == 0
  by_line = {r["line"]: r for r in read_jsonl(out)}
  assert sorted(by_line) == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
  assert by_line[1]["completion_tokens"] == 3 and "error" not in by_line[1]
  assert by_line[10]["completion_tokens"] == 2 and by_line[10]["prompt_tokens"] == 3
  assert by_line[2]["id"] is None and "not valid JSON" in by_line[2]["error"]
  assert "max_token" in by_line[3]["error"]
  assert "temperature" in by_line[4]["error"]
  assert "context window" in by_line[5]["error"]
  assert "exactly one of" in by_line[6]["error"]
  assert "duplicate id" in by_line[8]["error"]
  assert "prompt_token_ids" in by_line[9]["error"]
  assert "stop_token_ids" in by_line[11]["error"]
  # The error lines count as done: a rerun skips all ten and writes nothing new.
  before = out.read_text()
  assert run(tiny_checkpoint, inp, out) == 0
  assert out.read_text() == before


def test_memory_fraction_sizes_the_pool_from_total_memory(tiny_checkpoint):
  """--memory-fraction reaches the engine, which sizes its pool at start-up (on CPU, from RAM)."""
  args = gb.build_parser().parse_args(["x", "y", "--model", str(tiny_checkpoint),
                                       "--page-size", "8", "--memory-fraction", "0.001"])
  llm = gb.LLM(args.model, engine_config=gb.cli.engine_config(args), warmup=False)
  cfg = llm.model.cfg
  assert (cfg.dim, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (64, 2, 2, 16)
  meminfo = dict(line.split(":") for line in open("/proc/meminfo"))
  memory = int(meminfo["MemTotal"].split()[0]) * 1024
  # float32 KV: 2 (K, V) * 2 layers * 2 heads * 16 * 4 B = 512 B per token, 4096 B per page.
  expected = (int(memory * 0.001) - cfg.num_params * 4) // 4096
  assert llm.engine.num_pages == llm.engine.config.num_pages == expected
  assert llm.engine.cache.num_bytes == expected * 4096
  assert llm.runner.scheduler.pages.num_usable_pages == expected - 1  # Page 0 is scratch.
  assert capacity.kv_bytes_per_token(cfg, capacity.KVDtype.FLOAT32) == 512
  with pytest.raises(ValueError, match="not both"):
    gb.cli.engine_config(gb.build_parser().parse_args(
        ["x", "y", "--num-pages", "64", "--memory-fraction", "0.5"]))



def test_a_line_carries_its_constraint(tiny_checkpoint, tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"], "additionalProperties": False}
  write_jsonl(inp, [
      {"id": "json", "prompt": "x", "max_tokens": 20, "ignore_eos": False,
       "constraint": {"json_schema": schema}},
      {"id": "choice", "prompt": "x", "max_tokens": 8, "ignore_eos": False,
       "constraint": {"choice": ["yes", "no"]}},
      {"id": "bad", "prompt": "x", "max_tokens": 8, "ignore_eos": False,
       "constraint": {"regex": "(("}},
      {"id": "kind", "prompt": "x", "max_tokens": 8, "ignore_eos": False,
       "constraint": {"xml": "<a/>"}},
  ])
  assert run(tiny_checkpoint, inp, out) == 0
  by_id = {r["id"]: r for r in read_jsonl(out)}
  assert json.loads(by_id["json"]["text"])["n"] in range(10)
  assert by_id["choice"]["text"] in ("yes", "no")
  assert "regex constraint is invalid" in by_id["bad"]["error"]
  assert "constraint kind must be one of" in by_id["kind"]["error"]


def test_logprobs_are_written_one_per_output_token_when_asked(tiny_checkpoint, tmp_path):
  """--logprobs 2 for every line but one that sets its own 0; greedy (the flags' default), so
  each chosen token is its own most likely one."""
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  write_jsonl(inp, [{"id": "a", "prompt": "Hello there", "max_tokens": 5},
                    {"id": "b", "prompt": "General Kenobi", "max_tokens": 3, "logprobs": 3},
                    {"id": "none", "prompt": "Hi", "max_tokens": 2, "logprobs": 0}])
  assert run(tiny_checkpoint, inp, out, "--token-ids", "--logprobs", "2") == 0
  a, b, none = read_jsonl(out)
  for record, num_top in ((a, 2), (b, 3)):
    entries = record["logprobs"]
    assert len(entries) == record["completion_tokens"] == len(record["token_ids"])
    assert [e["token_id"] for e in entries] == record["token_ids"]
    for e in entries:
      assert len(e["top"]) == num_top and e["top"][0]["token_id"] == e["token_id"]
      assert e["logprob"] == pytest.approx(e["top"][0]["logprob"]) and e["logprob"] <= 0
      assert [t["logprob"] for t in e["top"]] == sorted((t["logprob"] for t in e["top"]),
                                                        reverse=True)
  assert "logprobs" not in none and none["completion_tokens"] == 2
