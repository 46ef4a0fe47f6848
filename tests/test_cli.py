"""The `jaxserve` command line: generate streams what the offline API returns."""

from __future__ import annotations

import pytest

from jaxserve.cli import flags
from jaxserve.cli import main as cli
from jaxserve.config import AttentionBackend, KVDtype, SamplingParams
from jaxserve.llm import LLM

# The shapes of support/server_harness.py's ENGINE (pages of 16, the default): the programs of
# the tiny checkpoint's session engine, which the persistent compilation cache already holds.
FLAGS = ["--max-tokens", "6", "--buckets", "32", "--slots", "4", "--num-pages", "40",
         "--max-model-len", "128"]


def test_generate_streams_the_offline_result(tiny_checkpoint, capsys):
  assert cli.main(["generate", "What is a mortgage rate?", "--model", str(tiny_checkpoint),
                   *FLAGS]) == 0
  out = capsys.readouterr()
  llm = LLM(str(tiny_checkpoint), engine_config=cli.engine_config(cli.build_parser().parse_args(
      ["generate", "x", *FLAGS])), warmup=False)
  expected = llm.generate("What is a mortgage rate?", SamplingParams(temperature=0, max_tokens=6),
                          chat=True)[0]
  assert out.out == expected.text + "\n"
  assert "time to first token" in out.err and "tokens/s" in out.err
  assert f"[{len(expected.token_ids)} tokens, finish: {expected.finish_reason.value}" in out.err


def test_bad_flags_give_a_clear_error(tiny_checkpoint, capsys):
  assert cli.main(["generate", "x", "--model", str(tiny_checkpoint), "--top-p", "1.5", *FLAGS]) == 2
  assert "top_p" in capsys.readouterr().err


def test_unknown_model_names_the_problem(capsys):
  assert cli.main(["generate", "x", "--model", "no-such-model"]) == 2
  assert "no-such-model" in capsys.readouterr().err


def test_quantized_kv_on_the_pallas_backend_fails_before_the_model_loads(capsys):
  assert cli.main(["generate", "x", "--model", "no-such-model", "--kv-dtype", "float16",
                   "--attention", "pallas", *FLAGS]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jaxserve: error: kv_dtype float16") and "--attention reference" in err
  assert "no-such-model" not in err  # Refused at the flags, before any model is looked up.


def test_serve_refuses_quantized_kv_on_the_pallas_backend_before_serving(capsys):
  argv = ["serve", "--model", "no-such-model", "--kv-dtype", "float16", "--attention",
          "pallas_tpu", "--grpc-port", "0", "--http-port", "-1", *FLAGS[2:]]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "jaxserve: error: kv_dtype float16 does not run on the Pallas attention backend" in err


def test_kv_dtype_flag_checks_against_the_platforms_default_backend():
  parse = lambda *extra: cli.build_parser().parse_args(["serve", *FLAGS[2:], *extra])
  args = parse("--kv-dtype", "float16")
  with pytest.raises(ValueError, match="not float16"):
    flags.engine_config(args, "tpu")  # TPU/GPU default to the Pallas kernels.
  assert flags.engine_config(args, "cpu").kv_dtype is KVDtype.FLOAT16  # CPU: reference.
  # 8-bit KV runs on the kernels, in pages of 32 unless --page-size says otherwise.
  for label in ("int8", "float8_e4m3", "float8_e5m2"):
    config = flags.engine_config(parse("--kv-dtype", label), "tpu")
    assert (config.kv_dtype.label, config.page_size) == (label, 32)
  given = parse("--kv-dtype", "int8", "--page-size", "64")
  assert flags.engine_config(given, "gpu").page_size == 64
  assert flags.engine_config(parse(), "gpu").page_size == 16
  config = flags.engine_config(parse("--kv-dtype", "int8", "--attention", "reference"), "gpu")
  assert (config.kv_dtype, config.attention_backend) == (KVDtype.INT8, AttentionBackend.REFERENCE)


def test_serve_takes_vllms_lora_flags(capsys):
  parse = lambda *extra: cli.build_parser().parse_args(["serve", *FLAGS[2:], *extra])
  args = parse("--enable-lora", "--lora-modules", "a=/tmp/a", '{"name": "b", "path": "/tmp/b"}',
               "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "8")
  assert args.lora_modules == [("a", "/tmp/a"), ("b", "/tmp/b")]
  config = flags.engine_config(args, "cpu")
  assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (4, 32, 8)
  assert flags.engine_config(parse("--enable-lora"), "cpu").max_loras == 1  # vLLM's default.
  # Host copies: vLLM's default (max_loras), or enough for every --lora-modules adapter.
  assert flags.engine_config(parse("--enable-lora", "--max-loras", "2"), "cpu").max_cpu_loras == 2
  three = parse("--enable-lora", "--lora-modules", "a=/a", "b=/b", "c=/c")
  assert flags.engine_config(three, "cpu").max_cpu_loras == 3
  # Run-time loads: off unless asked, and then only from under --lora-root.
  server_config = lambda *extra: cli._server_config(parse("--enable-lora", *extra))
  assert server_config("--lora-root", "/x").runtime_lora_roots is None
  on = server_config("--enable-runtime-lora-updates", "--lora-root", "/x", "--lora-root", "/y")
  assert on.runtime_lora_roots == ("/x", "/y")
  with pytest.raises(ValueError, match=r"need at least one directory .* \(--lora-root DIR\)"):
    server_config("--enable-runtime-lora-updates")
  assert flags.engine_config(parse(), "cpu").max_loras == 0
  with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
    flags.engine_config(parse("--lora-modules", "a=/tmp/a"), "cpu")
  with pytest.raises(SystemExit):
    parse("--enable-lora", "--lora-modules", "no-path")
  assert "--lora-modules takes name=path" in capsys.readouterr().err


def test_serve_takes_the_host_tier_and_pd_role_flags(capsys):
  parse = lambda *extra: cli.build_parser().parse_args(["serve", *FLAGS[2:], *extra])
  assert flags.engine_config(parse(), "cpu").kv_offload_gib == 0
  assert flags.engine_config(parse("--kv-offload-gib", "2.5"), "cpu").kv_offload_gib == 2.5
  # A P/D role's pages travel through the host tier: 1 GiB unless given.
  assert flags.engine_config(parse("--kv-role", "prefill"), "cpu").kv_offload_gib == 1.0
  argv = ["serve", "--model", "no-such-model", "--kv-role", "decode", "--grpc-port", "0",
          "--http-port", "-1", *FLAGS[2:]]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert "jaxserve: error: ServerConfig: a decode server (kv_role decode) needs kv_peer" in err


def test_a_prefill_server_beyond_loopback_needs_the_peer_credential():
  """PrefillKV would answer anyone who reaches it; on loopback only, it may go without."""
  argv = ["serve", "--model", "no-such-model", "--kv-role", "prefill", *FLAGS[2:]]
  parse = lambda *extra: cli.build_parser().parse_args([*argv, *extra])
  with pytest.raises(ValueError, match=r"a prefill server bound to 0.0.0.0 needs kv_peer_api_key "
                     r"\(--kv-peer-api-key\)"):
    cli._server_config(parse("--host", "0.0.0.0"))
  for args in (parse("--host", "0.0.0.0", "--kv-peer-api-key", "sk-peer"), parse()):
    assert cli._server_config(args).kv_role == "prefill"
  assert cli._server_config(parse("--kv-peer-tls-ca", "ca.pem", "--kv-peer-timeout", "2",
                                  "--kv-role", "decode", "--kv-peer", "10.0.0.2:50061"))\
      .kv_peer_timeout_s == 2
  with pytest.raises(ValueError, match="kv_peer_tls_ca verifies a decode server's kv_peer"):
    cli._server_config(parse("--kv-peer-tls-ca", "ca.pem"))
