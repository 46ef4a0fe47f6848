"""The `jaxserve` command line: generate streams what the offline API returns."""

from __future__ import annotations

from jaxserve.cli import main as cli
from jaxserve.config import SamplingParams
from jaxserve.llm import LLM

FLAGS = ["--max-tokens", "6", "--buckets", "16,32", "--slots", "2", "--num-pages", "32",
         "--max-model-len", "128"]


def test_generate_streams_the_offline_result(tiny_checkpoint, capsys):
  assert cli.main(["generate", "What is a mortgage rate?", "--model", str(tiny_checkpoint), *FLAGS]) == 0
  out = capsys.readouterr()
  llm = LLM(str(tiny_checkpoint), engine_config=cli.engine_config(cli.build_parser().parse_args(
      ["generate", "x", *FLAGS])), warmup=False)
  expected = llm.generate("What is a mortgage rate?", SamplingParams(temperature=0, max_tokens=6), chat=True)[0]
  assert out.out == expected.text + "\n"
  assert "time to first token" in out.err and "tokens/s" in out.err
  assert f"[{len(expected.token_ids)} tokens, finish: {expected.finish_reason.value}" in out.err


def test_bad_flags_give_a_clear_error(tiny_checkpoint, capsys):
  assert cli.main(["generate", "x", "--model", str(tiny_checkpoint), "--top-p", "1.5", *FLAGS]) == 2
  assert "top_p" in capsys.readouterr().err


def test_unknown_model_names_the_problem(capsys):
  assert cli.main(["generate", "x", "--model", "no-such-model"]) == 2
  assert "no-such-model" in capsys.readouterr().err
