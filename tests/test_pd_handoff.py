"""Prefill/decode disaggregation between two servers of the tiny checkpoint in this process: a
decode server (kv_role decode) that brings each prompt's KV pages from a prefill server over
gRPC. Its answers are a lone server's, every token's logprob within 1e-5 (a handoff that left
one page's bytes out fails that comparison), and every fault of the handoff (a corrupt page, a
stream cut short, a peer that dies mid-stream, errs, hangs, or computes other pages, a decode
host tier too small) only costs the pages that did not come: they are recomputed, and no page
stays held on either side. The link: PrefillKV answers only a prefill server's peer credential,
a decode server checks its peer at start, and TLS carries the faulty decode server's pages."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import shutil
import subprocess
import threading
import time

import grpc
import jax
import numpy as np
import pytest

from jaxserve import llm
from jaxserve.api import kv_link, kv_transfer, server
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from jaxserve.config import AttentionBackend, LoRARequest, SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.engine.fingerprint import weights_fingerprint
from jaxserve.engine.resolve import engine_config_for
from support import server_harness as h
from support.tiny import count_compiles, host_tier_gib

MAX_TOKENS = 8
PEER_KEY = "sk-kv-peer-0123"  # The P/D credential: no tenant's key.
TIMEOUT_S = 3.0  # The faulty decode server's deadline on a handoff.


def _engine(path: str, num_host_pages: int) -> Engine:
  """The served engine's shapes (its steps load from the compilation cache), and a host tier."""
  model, tokenizer = h.load(path)
  config = engine_config_for(h.ENGINE, AttentionBackend.REFERENCE)
  config = dataclasses.replace(config, kv_offload_gib=host_tier_gib(model.cfg, config,
                                                                    num_host_pages))
  engine = Engine(model, config, tokenizer.stop_ids)
  engine.warmup()
  return engine


class FaultyPeer(jaxserve_pb2_grpc.JaxserveServicer):
  """A prefill server's stand-in that relays the real one's PrefillKV (the caller's credential
  too), with a fault: `mode` "corrupt" flips a byte of page `at`, "cut" ends the stream before
  it, "die" fails the call with UNAVAILABLE there (what a prefill server that dies mid-stream
  looks like); "error" fails at once with INTERNAL, "hang" answers nothing for longer than the
  deadline; "model" and "layout" send a header of another model's fingerprint, page layout."""

  def __init__(self, target: str):
    self.stub = jaxserve_pb2_grpc.JaxserveStub(grpc.insecure_channel(target))
    self.mode, self.at = None, 2

  def PrefillKV(self, request, context):
    if self.mode == "error":
      context.abort(grpc.StatusCode.INTERNAL, "the prefill server failed")
    if self.mode == "hang":
      time.sleep(TIMEOUT_S + 1)
      return
    credential = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
    for i, msg in enumerate(self.stub.PrefillKV(request, metadata=credential, timeout=60)):
      if i == 0 and self.mode == "model":
        msg.model = "another checkpoint"
      if i == 0 and self.mode == "layout":
        msg.layout[0] = msg.layout[0].replace("float32", "bfloat16")
      if i == self.at + 1:  # Message 0 is the header.
        if self.mode == "cut":
          return
        if self.mode == "die":
          context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill server went away")
        if self.mode == "corrupt":
          msg.data = bytes([msg.data[0] ^ 1]) + msg.data[1:]
      yield msg


def tls_pair(folder) -> tuple[str, str]:
  """A self-signed (cert, key) for 127.0.0.1."""
  cert, key = folder / "cert.pem", folder / "key.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                  "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                  "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key),
                  "-out", str(cert)], check=True, capture_output=True)
  return str(cert), str(key)


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
  """A prefill server with tenants of its own (API keys, so prefix caching is scoped by key)
  and the peer credential; two decode servers that present it: `decode` straight to it, and
  `faulty` (a host tier of 3 pages) through `FaultyPeer` over TLS, a relay that is not yet
  serving when `faulty` starts (its check at start finds no peer: it starts all the same)."""
  if shutil.which("openssl") is None:
    pytest.skip("needs the openssl command")
  path = str(tiny_checkpoint)
  tokenizer = h.load(path)[1]
  folder = tmp_path_factory.mktemp("pd")
  prefill = h.serve(_engine(path, 64), tokenizer, kv_role="prefill", keys_file=h.write_keys(
      folder / "keys.json"), kv_peer_api_key=PEER_KEY)
  peer = FaultyPeer(prefill.grpc_address)
  relay = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
  jaxserve_pb2_grpc.add_JaxserveServicer_to_server(peer, relay)
  cert, key = tls_pair(folder)
  with open(cert, "rb") as c, open(key, "rb") as k:
    relay_port = relay.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(k.read(), c.read())]))
  decode = h.serve(_engine(path, 64), tokenizer, kv_role="decode", kv_peer=prefill.grpc_address,
                   kv_peer_api_key=PEER_KEY)
  faulty = h.serve(_engine(path, 3), tokenizer, kv_role="decode", kv_peer_api_key=PEER_KEY,
                   kv_peer=f"127.0.0.1:{relay_port}", kv_peer_tls_ca=cert,
                   kv_peer_timeout_s=TIMEOUT_S)
  relay.start()
  yield prefill, decode, faulty, peer
  for srv in (prefill, decode, faulty):
    srv.close()
  relay.stop(0)


@pytest.fixture(autouse=True)
def closed_circuits(servers):
  """Each test starts with a relay that relays, and both decode servers asking their peer."""
  yield
  servers[3].mode = None
  for srv in servers[1:3]:
    srv.server.service.kv_peer.circuit.record(failed=False)


def prompts(seed: int, n: int = 3) -> list[list[int]]:
  """Prompts of 70-110 tokens (4-6 full pages of 16) that no other test sends."""
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(5, 4000, int(rng.integers(70, 110)))] for _ in range(n)]


def answers(srv, token_ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
  """Each prompt's greedy tokens and their logprobs."""
  with grpc.insecure_channel(srv.grpc_address) as channel:
    stub = h.stub(channel)
    out = []
    for ids in token_ids:
      msgs = h.generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), logprobs=1,
                                                 max_tokens=MAX_TOKENS, temperature=0.0), None)
      out.append(([t for m in msgs for t in m.token_ids],
                  [lp.logprob for m in msgs for lp in m.logprobs]))
  return out


def reference(tiny_checkpoint, token_ids) -> list[tuple[list[int], list[float]]]:
  engine, tokenizer = h.reference_engine(str(tiny_checkpoint))
  sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
  done = h.offline(engine, tokenizer, [(ids, sampling) for ids in token_ids])
  return [(list(c.token_ids), [lp.logprob for lp in c.logprobs]) for c in done]


def same(got, want) -> bool:
  """Every token the reference's, and its logprob within 1e-5."""
  return all(g[0] == w[0] and len(g[1]) == len(w[1]) and np.allclose(g[1], w[1], rtol=0,
                                                                      atol=1e-5)
             for g, w in zip(got, want, strict=True))


def outcomes(srv, outcome: str) -> float:
  """The decode server's count of handoffs that ended in `outcome`."""
  value = srv.server.metrics.registry.get_sample_value("jaxserve:kv_transfers_total",
                                                       {"outcome": outcome})
  return value or 0


def assert_nothing_held(*servers):
  for srv in servers:
    h.wait_idle(srv)
    pages = srv.scheduler.pages
    assert all(pages.ref_count(p) == 0 for p in range(pages.num_pages))


def test_the_decode_server_answers_as_one_server_from_the_prefill_servers_pages(
    servers, tiny_checkpoint):
  prefill, decode, _, _ = servers
  ids = prompts(1)
  want = reference(tiny_checkpoint, ids)
  before = decode.scheduler.num_prefill_tokens
  with count_compiles() as counts:
    got = answers(decode, ids)
  assert same(got, want)
  assert counts["compile"] == 0, counts
  peer = decode.server.service.kv_peer
  full_pages = sum((len(p) - 1) // 16 for p in ids)
  assert peer.num_pages == full_pages and outcomes(decode, "ok") == 3
  assert decode.scheduler.pages.num_host_hit_tokens == 16 * full_pages
  # The decode server computed only each prompt's last partial page (and its output).
  assert decode.scheduler.num_prefill_tokens - before == sum(len(p) for p in ids) - 16 * full_pages
  assert prefill.scheduler.num_prefill_tokens >= sum(len(p) for p in ids)
  assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("mode, outcome, seed", [("corrupt", "corrupt", 2),
                                                 ("cut", "incomplete", 3),
                                                 ("die", "unavailable", 4)])
def test_a_faulty_handoff_recomputes_what_did_not_arrive(servers, tiny_checkpoint, mode, outcome,
                                                         seed):
  prefill, _, faulty, peer = servers
  peer.mode, peer.at = mode, 2
  ids = prompts(seed, 1)
  want = reference(tiny_checkpoint, ids)
  before, hits = outcomes(faulty, outcome), faulty.scheduler.pages.num_host_hit_tokens
  assert same(answers(faulty, ids), want)
  assert outcomes(faulty, outcome) == before + 1
  # The two pages before the fault were taken (the host tier holds 3), the rest recomputed.
  assert faulty.scheduler.pages.num_host_hit_tokens - hits == 2 * 16
  assert_nothing_held(prefill, faulty)


def test_a_host_tier_too_small_takes_what_it_can(servers, tiny_checkpoint):
  prefill, _, faulty, peer = servers
  peer.mode = None
  ids = prompts(5, 1)  # 4-6 pages into a host tier of 3.
  want = reference(tiny_checkpoint, ids)
  hits = faulty.scheduler.pages.num_host_hit_tokens
  assert same(answers(faulty, ids), want)
  assert faulty.scheduler.pages.num_host_hit_tokens - hits == 3 * 16
  assert outcomes(faulty, "host_tier_full") == 1
  assert_nothing_held(prefill, faulty)


def test_a_follow_up_brings_only_the_pages_the_decode_server_lacks(servers, tiny_checkpoint):
  prefill, decode, _, _ = servers
  first = prompts(6, 1)[0][:40]
  answer = answers(decode, [first])[0]
  follow_up = first + answer[0] + [int(t) for t in np.random.default_rng(9).integers(5, 4000,
                                                                                        40)]
  peer, transfers = decode.server.service.kv_peer, outcomes(decode, "ok")
  pages_before = peer.num_pages
  assert same(answers(decode, [follow_up]), reference(tiny_checkpoint, [follow_up]))
  # Its first turn's pages are the decode server's own: only the new full pages travelled.
  assert peer.num_pages - pages_before == (len(follow_up) - 1) // 16 - (len(first) - 1) // 16
  assert outcomes(decode, "ok") == transfers + 1
  answers(decode, [follow_up])  # Every full page cached here: no handoff at all.
  assert outcomes(decode, "ok") == transfers + 1 and peer.num_pages - pages_before > 0
  assert_nothing_held(prefill, decode)


def prefill_kv(srv, ids: list[int], key: str | None = PEER_KEY, salt: str = "") -> list:
  """Every message of one PrefillKV call to `srv`, presenting `key`."""
  with grpc.insecure_channel(srv.grpc_address) as channel:
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    return list(h.stub(channel).PrefillKV(pb.PrefillKVRequest(token_ids=ids, cache_salt=salt),
                                          metadata=metadata, timeout=60))


@pytest.mark.parametrize("key", [None, "sk-wrong", h.KEYS["alice"]],
                         ids=["missing", "wrong", "a-tenants-key"])
def test_prefill_kv_answers_only_the_peer_credential(servers, key):
  prefill = servers[0]
  with pytest.raises(grpc.RpcError) as e:
    prefill_kv(prefill, prompts(10, 1)[0], key)
  assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
  assert "peer credential" in e.value.details()


def test_prefill_kv_is_refused_on_a_server_that_is_not_a_prefill_server(servers):
  decode = servers[1]  # It keeps a host tier, and its pages, as a prefill server would.
  with pytest.raises(grpc.RpcError) as e:
    prefill_kv(decode, prompts(11, 1)[0])
  assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
  assert "--kv-role prefill" in e.value.details()


def test_a_peers_salt_cannot_reach_a_tenants_cached_pages(servers):
  """The tenant alice's prompt is cached under her key's scope; a PrefillKV that names her
  scoped salt runs under the peer's own scope: it recomputes the prompt, hits nothing."""
  prefill = servers[0]
  ids = prompts(12, 1)[0]
  with grpc.insecure_channel(prefill.grpc_address) as channel:
    h.generate(h.stub(channel), pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=1,
                                                   temperature=0.0), "alice")
  h.wait_idle(prefill)
  pages = prefill.scheduler.pages
  hits, computed = pages.num_hit_tokens, prefill.scheduler.num_prefill_tokens
  msgs = prefill_kv(prefill, ids, salt="key:alice")  # What the gateway salts alice's with.
  assert msgs[0].num_pages == (len(ids) - 1) // 16  # It answered: the right credential.
  assert pages.num_hit_tokens == hits
  assert prefill.scheduler.num_prefill_tokens - computed == len(ids)
  prefill_kv(prefill, ids, salt="key:alice")  # Its own scope's pages it does reuse.
  assert pages.num_hit_tokens - hits == 16 * ((len(ids) - 1) // 16)


def test_a_handoff_that_skipped_one_page_would_fail_the_comparison(servers, tiny_checkpoint,
                                                                   monkeypatch):
  """The mutation the logprob comparison exists for: the decode server's import leaves one
  page's bytes out (its host slot keeps what it held), and the answers are no longer the
  reference's."""
  decode = servers[1]
  store = decode.server.service.runner.page_store
  write = store.write

  def skip_second_page(group, slots, pages):
    write(group, slots[:1] + slots[2:], pages[:1] + pages[2:])
  monkeypatch.setattr(store, "write", skip_second_page)
  ids = prompts(13, 1)
  got = answers(decode, ids)
  assert outcomes(decode, "ok") > 0
  assert not same(got, reference(tiny_checkpoint, ids))


@pytest.mark.parametrize("mode, outcome, seed", [("model", "model_mismatch", 14),
                                                 ("layout", "layout", 15),
                                                 ("error", "rpc_error", 16)])
def test_a_peer_of_other_pages_or_an_error_costs_only_a_local_prefill(servers, tiny_checkpoint,
                                                                      mode, outcome, seed):
  prefill, _, faulty, peer = servers
  peer.mode = mode
  ids = prompts(seed, 1)
  want = reference(tiny_checkpoint, ids)
  before, hits = outcomes(faulty, outcome), faulty.scheduler.pages.num_host_hit_tokens
  assert same(answers(faulty, ids), want)
  assert outcomes(faulty, outcome) == before + 1
  assert faulty.scheduler.pages.num_host_hit_tokens == hits  # Not one page taken.
  assert_nothing_held(prefill, faulty)


def test_a_hung_peer_costs_one_deadline_then_is_skipped_until_it_answers(servers,
                                                                       tiny_checkpoint):
  _, _, faulty, peer = servers
  circuit = faulty.server.service.kv_peer.circuit
  now = [0.0]
  circuit.clock = lambda: now[0]
  try:
    peer.mode = "hang"
    ids = prompts(17, 3)
    want = reference(tiny_checkpoint, ids)
    counts = {o: outcomes(faulty, o) for o in ("deadline", "circuit_open", "host_tier_full")}
    start = time.monotonic()
    assert same(answers(faulty, ids[:1]), want[:1])
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 3
    start = time.monotonic()
    assert same(answers(faulty, ids[1:2]), want[1:2])  # The circuit is open: no wait at all.
    assert time.monotonic() - start < TIMEOUT_S
    assert outcomes(faulty, "deadline") == counts["deadline"] + 1
    assert outcomes(faulty, "circuit_open") == counts["circuit_open"] + 1
    peer.mode, now[0] = None, circuit.cooldown_s  # It answers again; the cooldown is over.
    assert same(answers(faulty, ids[2:]), want[2:])
    # The peer's pages came (more than the host tier of 3 holds: it took what it could).
    assert outcomes(faulty, "host_tier_full") == counts["host_tier_full"] + 1
  finally:
    circuit.clock = time.monotonic


def test_pages_go_into_the_host_tier_a_batch_at_a_time_as_they_arrive(servers, tiny_checkpoint,
                                                                     monkeypatch):
  decode = servers[1]
  peer = decode.server.service.kv_peer
  page = decode.server.service.runner.page_store.page_nbytes(0)
  monkeypatch.setattr(kv_transfer, "MAX_BUFFER_BYTES", 2 * page)
  peer.max_buffered_bytes, pages = 0, peer.num_pages
  ids = prompts(18, 1)
  assert same(answers(decode, ids), reference(tiny_checkpoint, ids))
  assert peer.num_pages - pages == (len(ids[0]) - 1) // 16 >= 4
  assert peer.max_buffered_bytes == 2 * page  # Never more than two of them in memory.


def test_the_weights_fingerprint_names_the_weights_not_their_placement(servers):
  prefill, decode = servers[:2]
  engines = [srv.server.service.runner._runner.engine for srv in (prefill, decode)]
  assert engines[0].page_store.fingerprint() == engines[1].page_store.fingerprint()
  params = engines[0].params
  assert weights_fingerprint(params) == engines[0].page_store.fingerprint()
  tuned = jax.tree.map(lambda x: x * 1.01 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
                       else x, params)
  assert weights_fingerprint(tuned) != weights_fingerprint(params)


def start_refused(engine, tokenizer, **config) -> str:
  """Starts a decode server of `engine` (not used: its start stops before the engine is) that
  must fail its check at start; the error's text."""
  cfg = server.ServerConfig(grpc_port=0, http_port=None, kv_role="decode", **config)
  st = h.ServerThread(server.Server(lambda: llm.Loaded(engine, tokenizer, "tiny"), cfg))
  with pytest.raises(kv_link.PeerRefused) as e:
    st.start()
  st.close()
  return str(e.value)


@pytest.mark.parametrize("key", [None, "sk-wrong"], ids=["missing", "wrong"])
def test_a_decode_server_whose_credential_its_peer_refuses_does_not_start(servers, key):
  prefill, decode = servers[:2]
  engine = decode.server.service.runner._runner.engine
  error = start_refused(engine, decode.server.service.tokenizer, kv_peer=prefill.grpc_address,
                        kv_peer_api_key=key)
  assert f"the prefill server at {prefill.grpc_address} refused this decode server" in error
  assert "UNAUTHENTICATED" in error


def test_a_decode_server_whose_peer_is_no_prefill_server_does_not_start(servers):
  decode = servers[1]
  error = start_refused(decode.server.service.runner._runner.engine,
                        decode.server.service.tokenizer, kv_peer=decode.grpc_address,
                        kv_peer_api_key=PEER_KEY)
  assert "UNIMPLEMENTED" in error and "--kv-role prefill" in error


def test_an_adapter_is_named_by_its_files(tmp_path):
  """A handoff under an adapter carries its folder's digest: another folder under the same
  name, or the same name reloaded from changed files, is another model."""
  identity = kv_link.ModelIdentity("weights")
  (tmp_path / "adapter_config.json").write_text("{}")
  (tmp_path / "adapter_model.safetensors").write_bytes(b"1")
  first = identity.of(LoRARequest("a", 1, str(tmp_path)))
  assert identity.of(None) == "weights" and first.startswith("weights lora:")
  (tmp_path / "adapter_model.safetensors").write_bytes(b"2")
  assert identity.of(LoRARequest("a", 1, str(tmp_path))) == first  # Read once, when first used.
  assert identity.of(LoRARequest("a", 2, str(tmp_path))) != first  # Reloaded: read again.


def test_the_prefill_servers_engine_thread_only_dispatches_the_copies(servers, tiny_checkpoint,
                                                                      monkeypatch):
  """The pages' bytes are read on a worker, not between two of the prefill server's steps."""
  prefill, decode = servers[:2]
  store = prefill.server.service.runner.page_store
  threads = []

  def recording(method):
    def dispatch(group, pages):
      read = method(group, pages)
      threads.append(("dispatch", threading.current_thread().name))
      return lambda: threads.append(("read", threading.current_thread().name)) or read()
    return dispatch
  for name in ("export", "read"):
    monkeypatch.setattr(store, name, recording(getattr(store, name)))
  ids = prompts(19, 1)
  assert same(answers(decode, ids), reference(tiny_checkpoint, ids))
  assert {t for kind, t in threads if kind == "dispatch"} == {"jaxserve-runner"}
  reads = [t for kind, t in threads if kind == "read"]
  assert reads and "jaxserve-runner" not in reads
