"""Clients nobody on the project wrote, run as their users run them, against a served default
model: lm-eval's `local-completions` (each task kind, tokenized_requests both ways, batches of
4 prompts per request) and guidellm. Marked `external_clients` and deselected by default: the
packages live in their own virtual environment (docs/contributing.md, "External clients"),
since installing them beside jaxserve's would downgrade some of its dependencies."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig, SamplingParams

pytestmark = [pytest.mark.external_clients, pytest.mark.real_model]

VENV = pathlib.Path(os.environ.get("JAXSERVE_CLIENTS_VENV", ".venv-clients")).absolute()
ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=128, max_model_len=512,
                      prefill_buckets=(32, 64), compilation_cache_dir=None)
LOGLIKELIHOOD = [{"context": "The capital of France is", "continuation": " Paris"},
                 {"context": "Two plus two equals", "continuation": " four"},
                 {"context": "The sun rises in the", "continuation": " east"},
                 {"context": "Water is made of hydrogen and", "continuation": " oxygen"},
                 {"context": "A week has seven", "continuation": " days"}]
CHOICE = [{"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red"],
           "label": 0},
          {"question": "How many legs does a dog have?", "choices": ["two", "four", "six"],
           "label": 1},
          {"question": "Which animal says moo?", "choices": ["cat", "duck", "cow"], "label": 2}]
GENERATE = [{"question": "Q: What is 2 + 3?\nA:", "answer": " 5"},
            {"question": "Q: Name the opposite of hot.\nA:", "answer": " cold"}]
TASKS = {
    "jaxserve_ll": ("loglikelihood", LOGLIKELIHOOD,
                    {"doc_to_text": "{{context}}", "doc_to_target": "{{continuation}}",
                     "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]}),
    "jaxserve_mc": ("multiple_choice", CHOICE,
                    {"doc_to_text": "Question: {{question}}\nAnswer:",
                     "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
                     "metric_list": [{"metric": "acc"}]}),
    "jaxserve_gen": ("generate_until", GENERATE,
                     {"doc_to_text": "{{question}}", "doc_to_target": "{{answer}}",
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
                      "metric_list": [{"metric": "exact_match"}]}),
}


def _client(name: str) -> str:
  path = VENV / "bin" / name
  if not path.exists():
    pytest.fail(f"{path} is missing: set up the clients' venv as docs/contributing.md's "
                "'External clients' says")
  return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  from jaxserve.api import server
  from jaxserve.llm import LLM, Loaded
  from support import server_harness as h

  llm = LLM(None, engine_config=ENGINE)
  loaded = Loaded(llm.engine, llm.tokenizer, "smollm2")
  srv = h.ServerThread(server.Server(lambda: loaded, server.ServerConfig(grpc_port=0, http_port=0)))
  srv.start()
  yield srv, llm
  srv.close()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
  """The default model's tokenizer as a Hugging Face directory (lm-eval counts context tokens
  with it), made from the GGUF: nothing is downloaded."""
  import transformers

  from jaxserve.loading import pull

  path = pull.gguf_path()
  out = tmp_path_factory.mktemp("hf_tokenizer")
  transformers.AutoTokenizer.from_pretrained(str(path.parent),
                                             gguf_file=path.name).save_pretrained(out)
  return out


def _write_tasks(root: pathlib.Path) -> None:
  for name, (kind, docs, fields) in TASKS.items():
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = {"task": name, "dataset_path": "json", "output_type": kind, "test_split": "test",
              "dataset_kwargs": {"data_files": {"test": str(data)}}, **fields}
    (root / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML.


def _samples(out_dir: pathlib.Path, task: str) -> list[dict]:
  (path,) = out_dir.rglob(f"samples_{task}_*.jsonl")
  return [json.loads(line) for line in path.read_text().splitlines()]


def _loglikelihood(llm, context: list[int], whole: list[int]) -> float:
  """The engine's own log-likelihood of `whole`'s tokens after `context`."""
  (ref,) = llm.generate([whole], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
  return sum(lp.logprob for lp in ref.prompt_logprobs[len(context):])


@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_runs_every_task_kind(served, hf_tokenizer, tmp_path, tokenized):
  srv, llm = served
  _write_tasks(tmp_path)
  args = ",".join([f"base_url={srv.http_url}/v1/completions", "model=smollm2",
                   f"tokenizer={hf_tokenizer}", "tokenizer_backend=huggingface",
                   f"tokenized_requests={tokenized}", "max_length=512", "num_concurrent=1"])
  env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ""}
  run = subprocess.run(
      [_client("lm_eval"), "--model", "local-completions", "--model_args", args,
       "--tasks", ",".join(TASKS), "--include_path", str(tmp_path), "--batch_size", "4",
       "--output_path", str(tmp_path / "out"), "--log_samples"],
      capture_output=True, text=True, timeout=1200, env=env)
  print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
  assert run.returncode == 0, run.stderr[-3000:]
  (results,) = (tmp_path / "out").rglob("results_*.json")
  results = json.loads(results.read_text())["results"]
  assert set(TASKS) <= set(results)
  # Each continuation's log-likelihood is what the engine itself gives the same tokens.
  for sample in _samples(tmp_path / "out", "jaxserve_ll"):
    doc = sample["doc"]
    context = llm.tokenizer.encode(doc["context"])
    whole = context + llm.tokenizer.encode(doc["continuation"], add_bos=False)
    got = float(sample["resps"][0][0][0])
    assert abs(got - _loglikelihood(llm, context, whole)) < 1e-3, (doc, got)
  # The multiple-choice score is the engine's: each choice's log-likelihood is the engine's own,
  # and the accuracy is that of the choices they rank first.
  num_right = 0
  for sample in _samples(tmp_path / "out", "jaxserve_mc"):
    doc = sample["doc"]
    context = llm.tokenizer.encode(f"Question: {doc['question']}\nAnswer:")
    want = [_loglikelihood(llm, context, context + llm.tokenizer.encode(" " + c, add_bos=False))
            for c in doc["choices"]]
    got = [float(resp[0][0]) for resp in sample["resps"]]
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-3, (doc, got, want)
    num_right += max(range(len(want)), key=want.__getitem__) == doc["label"]
  assert results["jaxserve_mc"]["acc,none"] == pytest.approx(num_right / len(CHOICE))
  assert len(_samples(tmp_path / "out", "jaxserve_gen")) == len(GENERATE)


def test_guidellm_benchmarks_the_server(served, hf_tokenizer, tmp_path):
  """guidellm's openai_http backend with its default pre-flight check (GET /health, then
  /v1/models), a few synthetic requests one at a time; every one succeeds."""
  srv, _ = served
  report = tmp_path / "report.json"
  env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
  run = subprocess.run(
      [_client("guidellm"), "run",
       "--backend", f"kind=openai_http,target={srv.http_url},model=smollm2",
       "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
       "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=4",
       "--tokenizer", f"kind=huggingface_auto,model={hf_tokenizer}",
       "--output", f"kind=json,path={report}", "--disable-console-interactive"],
      capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
  assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
  text = report.read_text()
  assert '"successful"' in text and report.stat().st_size > 0
