"""Prefill/decode disaggregation between two OS processes: `jaxserve serve --kv-role prefill` and
`jaxserve serve --kv-role decode --kv-peer ...`, for a plain engine, one with int8 KV and one
with window pages (Gemma 3). The decode server's greedy tokens are those of one engine alone,
its prompts' full pages came from the prefill server, neither side holds a page of either pool
(the KV pool, Gemma 3's window pool) afterwards or
compiled a program after its warm-up, and once the prefill server is killed the decode server
still answers, recomputing."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, KVDtype, SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint, weights
from support import hf_tiny
from support import server_harness as h
from support.server_process import ServerProcess

PAGE, MAX_TOKENS = 16, 8
FLAGS = ["--slots", "1", "--buckets", "32", "--max-model-len", "128", "--num-pages", "40",
         "--page-size", str(PAGE), "--kv-offload-gib", "0.01"]
KINDS = {"plain": ("tiny_checkpoint", None), "int8-kv": ("tiny_checkpoint", KVDtype.INT8),
         "gemma3-window-pages": ("gemma3_checkpoint", None)}


@pytest.fixture(scope="module")
def gemma3_checkpoint(tmp_path_factory, smol):
  """A tiny random Gemma 3 (window 8: window pages at 16-token pages) with SmolLM2's tokenizer."""
  pytest.importorskip("transformers")
  hf_dir = tmp_path_factory.mktemp("gemma3_hf")
  config = dict(hf_tiny.GEMMA3, vocab_size=smol.vocab_size, max_position_embeddings=256)
  hf_tiny.build("Gemma3TextConfig", config, norms=(-0.5, 0.5)).save_pretrained(hf_dir)
  path = tmp_path_factory.mktemp("gemma3_ckpt") / "tiny-gemma3"
  checkpoint.save(path, *weights.load_hf_dir(hf_dir), smol)
  return path


def reference(path: str, kv_dtype, prompts) -> list[list[int]]:
  """One engine of the servers' shapes, alone, in this process."""
  model, tokenizer = h.load(path)
  config = EngineConfig(num_slots=1, page_size=PAGE, num_pages=40, max_model_len=128,
                        prefill_buckets=(32,), kv_dtype=kv_dtype)
  runner = Runner(Engine(model, config, tokenizer.stop_ids), tokenizer)
  done = runner.generate([(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
                          for p in prompts])
  return [list(c.token_ids) for c in done]


def answers(address: str, prompts) -> list[list[int]]:
  with grpc.insecure_channel(address) as channel:
    stub = h.stub(channel)
    return [[t for m in h.generate(stub, pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=p), max_tokens=MAX_TOKENS, temperature=0.0), None, timeout=300)
             for t in m.token_ids] for p in prompts]


def usage(server: ServerProcess, pools: list[str]) -> list[float]:
  """Each pool's gauge (1 = every page held), which the server must report."""
  with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
    text = r.read().decode()
  assert all(f"{pool} " in text for pool in pools), pools
  return [server.metric(pool) for pool in pools]


@pytest.mark.parametrize("kind", KINDS)
def test_a_handoff_between_two_processes_gives_one_engines_tokens(kind, request,
                                                                 tmp_path_factory):
  fixture, kv_dtype = KINDS[kind]
  path = str(request.getfixturevalue(fixture))
  flags = FLAGS + (["--kv-dtype", kv_dtype.label] if kv_dtype else [])
  rng = np.random.default_rng(7)
  prompts = [[int(t) for t in rng.integers(5, 4000, n)] for n in (75, 101, 90)]
  want = reference(path, kv_dtype, prompts)  # Its programs then load from the compile cache.
  prefill = ServerProcess(path, flags + ["--kv-role", "prefill"],
                          tmp_path_factory.mktemp(f"prefill-{kind}"))
  decode = None
  try:
    decode = ServerProcess(path, flags + ["--kv-role", "decode", "--kv-peer",
                                          prefill.grpc_address],
                           tmp_path_factory.mktemp(f"decode-{kind}"))
    warm = {server: server.metric("jaxserve:xla_compiles") for server in (prefill, decode)}
    assert all(warm.values())  # Each warm-up compiled (or loaded) its programs.
    assert answers(decode.grpc_address, prompts[:2]) == want[:2]
    full_pages = sum((len(p) - 1) // PAGE for p in prompts[:2])
    assert decode.metric("jaxserve:kv_transfers", outcome="ok") == 2
    assert decode.metric("jaxserve:prefix_cache_host_hits") == PAGE * full_pages
    pools = ["jaxserve:kv_cache_usage_perc"] + (
        ["jaxserve:kv_window_usage_perc"] if kind == "gemma3-window-pages" else [])
    for server in (prefill, decode):  # Nothing held: every page of both pools free or cached.
      assert usage(server, pools) == [0] * len(pools)
      assert server.metric("jaxserve:xla_compiles") == warm[server]  # None after warm-up.
    prefill.stop()  # The decode server goes on alone, recomputing.
    assert answers(decode.grpc_address, prompts[2:]) == want[2:]
    assert decode.metric("jaxserve:kv_transfers", outcome="unavailable") == 1
    assert usage(decode, pools) == [0] * len(pools)
    assert decode.metric("jaxserve:xla_compiles") == warm[decode]
  finally:
    prefill.stop()
    if decode is not None:
      decode.stop()
