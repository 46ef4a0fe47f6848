"""Issue 47's hostile clients against a live decode server (`jaxserve serve` in its own process:
LoRA adapters with run-time updates, a keys file with an admin, a host tier, and a prefill peer
reached through a relay in this process), while two well-behaved clients stream greedy requests
and a third polls /health:

  - 100 gRPC Generate calls cancelled 1-80 ms after they began (the calls that, before the fix,
    killed the engine loop: their P/D lookups waited on the engine thread), and 100 adapter
    loads and unloads whose HTTP clients give up after 1-50 ms;
  - an adapter with a NaN in one lora_B, loads from outside --lora-root (a folder, a symlink,
    a `..`), a load by a tenant's key;
  - PrefillKV without the peer credential (on the prefill server) and on the decode server;
  - the relay switched to a peer serving other weights, then to one that hangs.

Throughout, every well-behaved request completes with the tokens it got before the storm,
/health answers within 100 ms, and afterwards the engine serves, every refusal and every
handoff outcome is counted in the server's metrics, and each adapter it lists unloads."""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import safetensors.numpy

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from support import hf_tiny
from support import server_harness as h
from support.server_process import ServerProcess

pytest.importorskip("peft")
import torch  # noqa: E402  (with peft)

from support.peft_lora import ADAPTERS, make_adapters  # noqa: E402

PEER_KEY = "sk-kv-peer-hostile"
SHAPES = ["--slots", "4", "--buckets", "32", "--max-model-len", "128", "--num-pages", "64",
          "--page-size", "16", "--kv-offload-gib", "0.01"]
MAX_TOKENS = 6


class Relay(jaxserve_pb2_grpc.JaxserveServicer):
  """The decode server's peer address: relays PrefillKV (with the caller's credential) to
  `target`, or, with `target` None, answers nothing for 30 s (a hung peer)."""

  def __init__(self, target: str):
    self.target = target
    self.release = threading.Event()  # Ends a hang (at the end of the module).

  def PrefillKV(self, request, context):
    if self.target is None:
      self.release.wait(30)
      return
    credential = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
    with grpc.insecure_channel(self.target) as channel:
      yield from jaxserve_pb2_grpc.JaxserveStub(channel).PrefillKV(request, metadata=credential,
                                                                   timeout=60)


def _folders(root, tokenizer):
  """base/ (a tiny Llama with the default tokenizer), other/ (its weights moved a little), and
  loras/ holding a1 (peft's) and nan (a1 with a NaN in one lora_B); outside/ holds a copy of a1
  and loras/link points to it."""
  hf = hf_tiny.build("LlamaConfig", dict(hf_tiny.SMALL, vocab_size=tokenizer.vocab_size))
  hf.save_pretrained(root / "base")
  tokenizer.save(root / "base")
  make_adapters(hf, root / "loras", ADAPTERS[:1])
  with torch.no_grad():
    torch.manual_seed(7)
    for p in hf.parameters():
      p.add_(0.05 * torch.randn_like(p))
  hf.save_pretrained(root / "other")
  tokenizer.save(root / "other")
  tensors = safetensors.numpy.load_file(root / "loras/a1/adapter_model.safetensors")
  bad = sorted(k for k in tensors if "lora_B" in k)[0]
  tensors[bad][0, 0] = np.nan
  (root / "loras/nan").mkdir()
  (root / "loras/nan/adapter_config.json").write_text(
      (root / "loras/a1/adapter_config.json").read_text())
  safetensors.numpy.save_file(tensors, root / "loras/nan/adapter_model.safetensors")
  (root / "outside").mkdir()
  for name in ("adapter_config.json", "adapter_model.safetensors"):
    (root / "outside" / name).write_bytes((root / "loras/a1" / name).read_bytes())
  (root / "loras/link").symlink_to(root / "outside")
  return bad


@pytest.fixture(scope="module")
def stage(default_model, tmp_path_factory):
  root = tmp_path_factory.mktemp("hostile")
  bad_tensor = _folders(root, default_model[1])
  peer = ["--kv-role", "prefill", "--kv-peer-api-key", PEER_KEY, *SHAPES]
  lora = ["--enable-lora", "--lora-modules", f"a1={root / 'loras/a1'}"]
  prefill = ServerProcess(str(root / "base"), [*peer, *lora], tmp_path_factory.mktemp("p"),
                          wait=False)
  other = ServerProcess(str(root / "other"), peer, tmp_path_factory.mktemp("o"), wait=False)
  prefill.wait_healthy()
  relay = Relay(prefill.grpc_address)
  relay_server = grpc.server(concurrent.futures.ThreadPoolExecutor(8))
  jaxserve_pb2_grpc.add_JaxserveServicer_to_server(relay, relay_server)
  port = relay_server.add_insecure_port("127.0.0.1:0")
  relay_server.start()
  decode = ServerProcess(str(root / "base"), [
      "--enable-lora", "--lora-modules", f"a1={root / 'loras/a1'}", "--max-cpu-loras", "8",
      "--enable-runtime-lora-updates", "--lora-root", str(root / "loras"),
      "--keys-file", h.write_keys(root / "keys.json"), "--kv-role", "decode",
      "--kv-peer", f"127.0.0.1:{port}", "--kv-peer-api-key", PEER_KEY, "--kv-peer-timeout", "2",
      *SHAPES], tmp_path_factory.mktemp("d"))
  other.wait_healthy()
  yield decode, prefill, other, relay, root, bad_tensor
  for srv in (decode, prefill, other):
    srv.stop()
  relay.release.set()
  relay_server.stop(0)


def _request(ids, model: str = "") -> pb.GenerateRequest:
  return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=MAX_TOKENS, temperature=0,
                            ignore_eos=True, model=model)


def _tokens(address: str, ids, model: str = "", key: str | None = "alice") -> list[int]:
  with grpc.insecure_channel(address) as channel:
    out = h.generate(h.stub(channel), _request(ids, model), key, timeout=120)
  assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
  return [t for m in out for t in m.token_ids]


def _http(srv, path: str, body=None, key: str | None = "ops", timeout: float = 60):
  data = None if body is None else json.dumps(body).encode()
  headers = {"Authorization": f"Bearer {h.KEYS[key]}"} if key else {}
  req = urllib.request.Request(srv.url + path, data=data, headers=headers)
  try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
      return r.status, r.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, e.read().decode()


class Background:
  """Two clients streaming greedy requests (base and a1 over fixed prompts) and one polling
  /health, until stopped: each request's tokens, and the slowest /health."""

  def __init__(self, srv, prompts, expected):
    self.srv, self.prompts, self.expected = srv, prompts, expected
    self.stop, self.done, self.wrong, self.health_s = threading.Event(), 0, [], []
    self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(2)]
    self.threads.append(threading.Thread(target=self._health))
    for t in self.threads:
      t.start()

  def _client(self, i: int) -> None:
    while not self.stop.is_set():
      for (n, model), want in self.expected.items():
        try:
          got = _tokens(self.srv.grpc_address, self.prompts[n], model)
        except Exception as e:  # pylint: disable=broad-except  (a lost request: reported)
          got = repr(e)
        self.done += 1
        if got != want:
          self.wrong.append((n, model, got, want))

  def _health(self) -> None:
    while not self.stop.is_set():
      start = time.perf_counter()
      with urllib.request.urlopen(self.srv.url + "/health", timeout=5) as r:
        assert r.status == 200
      self.health_s.append(time.perf_counter() - start)
      time.sleep(0.02)

  def end(self) -> None:
    self.stop.set()
    for t in self.threads:
      t.join(180)


def _cancelled_generates(srv, rng, n: int) -> None:
  with grpc.insecure_channel(srv.grpc_address) as channel:
    stub = h.stub(channel)
    for _ in range(n):
      ids = [int(t) for t in rng.integers(5, 4000, 40)]
      call = stub.Generate(_request(ids), metadata=h.auth())
      time.sleep(rng.uniform(0.001, 0.08))
      call.cancel()


def _abandoned_updates(srv, root, rng, n: int) -> None:
  for i in range(n):
    name = f"c{i % 5}"
    body, path = (({"lora_name": name, "lora_path": str(root / "loras/a1")}, "load")
                  if i % 2 == 0 else ({"lora_name": name}, "unload"))
    try:
      _http(srv, f"/v1/{path}_lora_adapter", body, timeout=rng.uniform(0.001, 0.05))
    except OSError:  # The client gave up: the server finishes what it began.
      pass


def test_the_server_serves_on_through_hostile_clients(stage):
  decode, prefill, other, relay, root, bad_tensor = stage
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(5, 4000, 40)] for _ in range(2)]
  expected = {(n, model): _tokens(decode.grpc_address, prompts[n], model)
              for n in range(2) for model in ("", "a1")}
  assert expected[0, ""] == _tokens(prefill.grpc_address, prompts[0], key=None)
  assert expected[0, ""] != expected[0, "a1"]
  background = Background(decode, prompts, expected)
  try:
    _cancelled_generates(decode, rng, 100)
    _abandoned_updates(decode, root, random.Random(0), 100)
    refusals = [(_http(decode, "/v1/load_lora_adapter", {"lora_name": "nan", "lora_path": str(
                    root / "loras/nan")}), 400, f"tensor {bad_tensor} holds NaN or Inf"),
                *((_http(decode, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(
                    path)}), 404, "no adapter folder") for path in (
                    root / "outside", root / "loras/link", root / "loras/a1/../../outside")),
                (_http(decode, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(
                    root / "loras/a1")}, key="alice"), 403, "admin key")]
    for (status, body), want, words in refusals:
      assert status == want and words in body, body
    with grpc.insecure_channel(prefill.grpc_address) as channel:
      for metadata in (None, h.auth()):
        with pytest.raises(grpc.RpcError) as e:
          list(h.stub(channel).PrefillKV(pb.PrefillKVRequest(token_ids=prompts[0]),
                                         metadata=metadata, timeout=30))
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(decode.grpc_address) as channel:
      with pytest.raises(grpc.RpcError) as e:
        list(h.stub(channel).PrefillKV(pb.PrefillKVRequest(token_ids=prompts[0]),
                                       metadata=((("authorization", f"Bearer {PEER_KEY}"),)),
                                       timeout=30))
      assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED
    fresh = [[int(t) for t in rng.integers(5, 4000, 40)] for _ in range(4)]
    for target, batch in ((other.grpc_address, fresh[:2]), (None, fresh[2:])):
      relay.target = target
      time.sleep(2.5)  # The circuit's first cooldown: the next handoff asks the peer again.
      for ids in batch:  # Recomputed here: the base model's tokens, as the prefill server's.
        assert _tokens(decode.grpc_address, ids) == _tokens(prefill.grpc_address, ids, key=None)
  finally:
    background.end()
  print(f"{background.done} requests beside the storm; /health: {len(background.health_s)} polls, "
        f"median {np.median(background.health_s) * 1e3:.1f} ms, "
        f"max {max(background.health_s) * 1e3:.1f} ms")
  assert not background.wrong and background.done >= 8
  # The loop only routes: a blocked loop (an adapter read or a KV copy on it) holds /health for
  # the whole load or copy, hundreds of ms each time. One poll among hundreds may meet a busy
  # 2-core machine (CI measured one at 127 ms, the next at 9.5 ms), so the tail is the 99th
  # percentile, and a second is the bound no single poll may reach.
  assert np.percentile(background.health_s, 99) < 0.05, sorted(background.health_s)[-5:]
  assert max(background.health_s) < 1.0, sorted(background.health_s)[-5:]
  outcomes = {o: decode.metric("jaxserve:kv_transfers", outcome=o)
              for o in ("ok", "model_mismatch", "deadline", "circuit_open")}
  assert all(outcomes.values()), outcomes
  rejected = {c: decode.metric("jaxserve:request_rejected", code=c)
              for c in ("invalid_argument", "not_found", "permission_denied")}
  assert all(rejected.values()), rejected
  print(f"kv_transfers {outcomes}; request_rejected {rejected}")
  status, body = _http(decode, "/v1/models")
  served = {m["id"] for m in json.loads(body)["data"] if m["parent"] is not None}
  assert "a1" in served and "nan" not in served and "x" not in served
  for name in served - {"a1"}:  # Every adapter it lists is real: each unloads.
    assert _http(decode, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
  assert _tokens(decode.grpc_address, prompts[1], "a1") == expected[1, "a1"]
  assert decode.proc.poll() is None
