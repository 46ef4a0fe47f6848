"""The gRPC server on loopback, serving the tiny random model: streams checked against the offline
Runner on the same engine, chunking, logprobs against a dense forward pass, cancel, every error
code, API keys and rate limits, reflection, metrics and the per-request log line."""

import logging
import math
import urllib.request

import grpc
import jax
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
  ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.config import SamplingParams, SchedulerConfig
from support import server_harness as h
from support.server_harness import generate, wait_idle
from support.tiny import dense_logits

SEEDED = dict(temperature=1.0, repetition_penalty=5.0)  # The tiny model repeats itself without.
CHAT = [{"role": "user", "content": "Name three colours."}]
MAX_QUEUE_LEN = 4


def _cases(tokenizer):
  """(request, prompt ids, sampling) triples the offline runner can run too."""
  chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_bos=False)
  chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
  ids = [17, 4000, 923, 77, 31000, 5]
  return [
      (pb.GenerateRequest(text="The quick brown fox", max_tokens=20, seed=11, **SEEDED),
       tokenizer.encode("The quick brown fox"), SamplingParams(max_tokens=20, seed=11, **SEEDED)),
      (pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=17, seed=2**40 + 3, **SEEDED),
       ids, SamplingParams(max_tokens=17, seed=2**40 + 3, **SEEDED)),
      (pb.GenerateRequest(chat=chat, max_tokens=9, temperature=0.0, frequency_penalty=1.5),
       chat_ids, SamplingParams(max_tokens=9, temperature=0.0, frequency_penalty=1.5)),
  ]


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
  """The offline runner's completions for _cases, on the engine the server will use."""
  engine, tokenizer = h.warm_engine(str(tiny_checkpoint))
  cases = _cases(tokenizer)
  return cases, h.offline(engine, tokenizer, [(ids, sp) for _, ids, sp in cases])


@pytest.fixture(scope="module")
def srv_options(offline):  # The offline reference first: it shares the engine with the server.
  return dict(keys=True, scheduler=SchedulerConfig(max_queue_len=MAX_QUEUE_LEN))


@pytest.fixture(scope="module")
def channel(srv):
  with grpc.insecure_channel(srv.grpc_address) as ch:
    yield ch


@pytest.fixture
def stub(channel):
  return h.stub(channel)


def error_of(stub, req, key="alice") -> grpc.RpcError:
  with pytest.raises(grpc.RpcError) as e:
    generate(stub, req, key)
  return e.value


def test_streams_match_the_offline_runner(stub, offline, srv):
  cases, completions = offline
  calls = [stub.Generate(req, metadata=h.auth()) for req, _, _ in cases]  # All in flight at once.
  for call, (_, ids, sampling), done in zip(calls, cases, completions):
    msgs = list(call)
    assert [t for m in msgs for t in m.token_ids] == list(done.token_ids)
    assert "".join(m.text for m in msgs) == done.text
    assert len(msgs) == len(done.token_ids)  # chunk_tokens unset: a message per token.
    assert [m.finish_reason for m in msgs[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(msgs) - 1)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len({m.request_id for m in msgs}) == 1
    last = msgs[-1]
    assert ((last.usage.prompt_tokens, last.usage.completion_tokens)
            == (len(ids), sampling.max_tokens))
    t = last.timings
    assert 0 < t.time_to_first_token <= t.total
    # The first token's wait is tokenizing, queueing and prefilling (plus handing between threads).
    assert t.tokenize + t.queue + t.prefill <= t.time_to_first_token + 1e-6
  wait_idle(srv)


def test_chunk_tokens_groups_tokens_per_message(stub):
  req = pb.GenerateRequest(text="Once upon a time", max_tokens=12, seed=5, ignore_eos=True,
                           **SEEDED)
  singles = generate(stub, req)
  req.chunk_tokens = 5
  chunks = generate(stub, req)
  assert [len(m.token_ids) for m in chunks] == [5, 5, 2]
  assert [t for m in chunks for t in m.token_ids] == [t for m in singles for t in m.token_ids]
  assert "".join(m.text for m in chunks) == "".join(m.text for m in singles)
  assert [m.finish_reason for m in chunks] == [0, 0, pb.FINISH_REASON_LENGTH]


def test_logprobs_match_a_dense_forward_pass(stub, tiny_checkpoint):
  ids = [17, 4000, 923, 77, 31000, 5]
  msgs = generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=3,
                                           temperature=0.0, logprobs=3))
  first = msgs[0].logprobs[0]
  model, _ = h.load(str(tiny_checkpoint))
  expected = np.asarray(jax.nn.log_softmax(dense_logits(model, ids)[-1]))  # [V]
  order = np.argsort(-expected)[:3]
  assert first.token_id == msgs[0].token_ids[0] == order[0]  # Greedy picks the top one.
  assert [t.token_id for t in first.top] == list(order)
  np.testing.assert_allclose([t.logprob for t in first.top], expected[order], atol=1e-4)
  np.testing.assert_allclose(first.logprob, expected[order[0]], atol=1e-4)
  assert all(len(m.logprobs) == len(m.token_ids) for m in msgs)
  only_chosen = generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=2,
                                                  temperature=0.0, logprobs=0))
  assert [len(m.logprobs[0].top) for m in only_chosen] == [0, 0]
  np.testing.assert_allclose(only_chosen[0].logprobs[0].logprob, first.logprob, atol=1e-6)
  assert not generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                               max_tokens=1))[0].logprobs


def test_cancel_mid_stream_frees_the_slot_and_blocks(stub, srv):
  wait_idle(srv)
  decoded_before = srv.scheduler.num_decode_tokens
  call = stub.Generate(pb.GenerateRequest(text="Count to a thousand:", max_tokens=110,
                                          ignore_eos=True, **SEEDED), metadata=h.auth())
  for _ in range(3):
    next(call)
  assert srv.scheduler.running  # Still going.
  call.cancel()
  wait_idle(srv)
  # Aborted soon after the cancel, not run to max_tokens.
  assert srv.scheduler.num_decode_tokens - decoded_before < 60
  # The engine keeps serving.
  assert (generate(stub, h.text_request("Hi", max_tokens=2))[-1].finish_reason
          == pb.FINISH_REASON_LENGTH)


ids_of = lambda ids: dict(token_ids=pb.TokenIds(ids=ids))


@pytest.mark.parametrize("fields, named", [
    (dict(text="Hi", temperature=-1.0), "temperature"),
    (dict(text="Hi", top_p=0.0), "top_p"),
    (dict(text="Hi", top_k=-2), "top_k"),
    (dict(text="Hi", presence_penalty=3.0), "presence_penalty"),
    (dict(text="Hi", max_tokens=0), "max_tokens"),
    (dict(text="Hi", logit_bias={3: 500.0}), "logit_bias[3]"),
    (dict(text="Hi", logprobs=21), "logprobs"),
    (dict(text="Hi", chunk_tokens=100_000), "chunk_tokens"),
    (dict(text=""), "prompt"),
    (dict(), "prompt"),
    (dict(**ids_of([5, 49152])), "token_ids[1]"),
    (dict(**ids_of([5, -1])), "token_ids[1]"),
    (dict(**ids_of(list(range(1, 126))), max_tokens=4), "context window"),
    (dict(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])),
     "messages[0]"),
])
def test_a_bad_field_is_invalid_argument_naming_it(stub, fields, named):
  e = error_of(stub, pb.GenerateRequest(**fields))
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert named in e.details()


def test_another_model_is_not_found(stub):
  e = error_of(stub, pb.GenerateRequest(text="Hi", model="gpt-4"))
  assert e.code() == grpc.StatusCode.NOT_FOUND and "model 'gpt-4'" in e.details()


def test_a_negative_seed_and_top_k_minus_one_are_taken(stub):
  msgs = generate(stub, pb.GenerateRequest(text="Hi", seed=-12, top_k=-1, max_tokens=2,
                                           ignore_eos=True))
  assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_logit_bias_and_allowed_token_ids_over_grpc(stub):
  biased = generate(stub, pb.GenerateRequest(text="Hi", max_tokens=4, temperature=0.0,
                                             ignore_eos=True, logit_bias={321: 100.0}))
  assert [t for m in biased for t in m.token_ids] == [321] * 4
  allowed = generate(stub, pb.GenerateRequest(text="Hi", max_tokens=6, seed=3, ignore_eos=True,
                                              allowed_token_ids=[7, 8]))
  assert set(t for m in allowed for t in m.token_ids) <= {7, 8}


def test_truncation_keeps_the_prompts_last_tokens(stub):
  prompt = list(range(1, 201))  # 200 tokens: more than the 128-token window.
  msgs = generate(stub, pb.GenerateRequest(**ids_of(prompt), max_tokens=8, temperature=0.0,
                                           truncate_prompt=True))
  assert msgs[-1].usage.prompt_tokens == 128 - 8
  assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_request_id_in_use_is_refused(stub):
  req = pb.GenerateRequest(text="Hi", max_tokens=60, ignore_eos=True, request_id="mine")
  first = stub.Generate(req, metadata=h.auth())
  assert next(first).request_id == "mine"
  e = error_of(stub, req)
  assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "mine" in e.details()
  first.cancel()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer sk-wrong"),),
                                      (("authorization", "sk-alice-0123456789"),),
                                      (("authorization", "Bearer sk-alice-012345678"),)])
def test_a_missing_or_wrong_key_is_unauthenticated(stub, metadata):
  for call in (lambda: list(stub.Generate(h.text_request("Hi", max_tokens=1), metadata=metadata)),
               lambda: stub.Tokenize(pb.TokenizeRequest(text="Hi"), metadata=metadata),
               lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)):
    with pytest.raises(grpc.RpcError) as e:
      call()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_requests_per_minute_limit(stub):
  for _ in range(2):  # bob may send 2 a minute.
    assert generate(stub, h.text_request("Hi", max_tokens=1), "bob")[-1].finish_reason
  e = error_of(stub, h.text_request("Hi", max_tokens=1), "bob")
  assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "2 requests per minute" in e.details() and "bob" in e.details()
  assert generate(stub, h.text_request("Hi", max_tokens=1), "alice")  # Others are not limited.


def test_tokens_per_minute_limit_counts_prompt_and_completion(stub):
  # carol may use 60 tokens a minute; admission reserves prompt + max_tokens.
  prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens.
  done = generate(stub, pb.GenerateRequest(**ids_of(prompt), max_tokens=30, ignore_eos=True,
                                           stop_token_ids=[]), "carol")
  assert done[-1].usage.completion_tokens == 30  # 40 used, 20 left.
  e = error_of(stub, pb.GenerateRequest(**ids_of(prompt), max_tokens=11), "carol")  # 21 > 20
  assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "tokens per minute" in e.details() and "20" in e.details()
  # A request that stops early hands back what it did not use: 10 + 1 used of 20 reserved.
  stopped = generate(stub, pb.GenerateRequest(**ids_of(prompt), max_tokens=10, temperature=0.0,
                                              stop_token_ids=[_greedy_first(stub, prompt)]),
                     "carol")
  assert stopped[-1].usage.completion_tokens == 1
  assert generate(stub, pb.GenerateRequest(**ids_of(prompt[:2]), max_tokens=7), "carol")  # 9 <= 9


def _greedy_first(stub, prompt):
  return generate(stub, pb.GenerateRequest(**ids_of(prompt), max_tokens=1,
                                           temperature=0.0))[0].token_ids[0]


def test_a_full_queue_is_resource_exhausted(stub, srv):
  wait_idle(srv)
  req = pb.GenerateRequest(text="Go on and on", max_tokens=100, ignore_eos=True, **SEEDED)
  calls = [stub.Generate(req, metadata=h.auth()) for _ in range(3 * MAX_QUEUE_LEN)]
  codes = []
  for call in calls:
    try:
      next(call)
      codes.append(grpc.StatusCode.OK)
    except grpc.RpcError as e:
      codes.append(e.code())
      assert "queue is full" in e.details()
  for call in calls:
    call.cancel()
  # 4 slots run, 4 requests may wait: at least the other 4 are refused.
  assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 3 * MAX_QUEUE_LEN - 2 * MAX_QUEUE_LEN
  assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
  wait_idle(srv)


def test_tokenize_and_model_info(stub, offline):
  (_, ids, _), _, (_, chat_ids, _) = offline[0]
  assert list(stub.Tokenize(pb.TokenizeRequest(text="The quick brown fox"),
                            metadata=h.auth()).token_ids) == list(ids)
  chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
  assert list(stub.Tokenize(pb.TokenizeRequest(chat=chat), metadata=h.auth()).token_ids) == chat_ids
  info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=h.auth())
  assert (info.name, info.max_model_len, info.num_slots, list(info.prefill_buckets)) == (
      "tiny", 128, 4, [32])
  assert info.vocab_size == 49152 and info.has_chat_template


def test_reflection_lists_and_describes_the_service(channel):
  db = ProtoReflectionDescriptorDatabase(channel)
  services = set(db.get_services())
  assert {"jaxserve.v1.Jaxserve", "grpc.health.v1.Health"} <= services
  from google.protobuf.descriptor_pool import DescriptorPool
  service = DescriptorPool(db).FindServiceByName("jaxserve.v1.Jaxserve")
  generate_method = service.methods_by_name["Generate"]
  assert generate_method.server_streaming and not generate_method.client_streaming
  assert generate_method.input_type.fields_by_name["chunk_tokens"].number == 18


def test_reflection_v1_lists_and_describes_the_service_too(channel):
  """grpcurl asks grpc.reflection.v1 first; its messages are v1alpha's under another package."""
  call = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                               request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                               response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
  listed, described, v1_file = call(iter([
      reflection_pb2.ServerReflectionRequest(list_services=""),
      reflection_pb2.ServerReflectionRequest(file_containing_symbol="jaxserve.v1.Jaxserve"),
      reflection_pb2.ServerReflectionRequest(
          file_containing_symbol="grpc.reflection.v1.ServerReflection")]), timeout=10)
  names = {s.name for s in listed.list_services_response.service}
  assert {"jaxserve.v1.Jaxserve", "grpc.reflection.v1.ServerReflection",
          "grpc.reflection.v1alpha.ServerReflection"} <= names
  files = [descriptor_pb2.FileDescriptorProto.FromString(b)
           for b in described.file_descriptor_response.file_descriptor_proto]
  assert "jaxserve.v1" in {f.package for f in files}
  v1 = descriptor_pb2.FileDescriptorProto.FromString(
      v1_file.file_descriptor_response.file_descriptor_proto[0])
  assert v1.package == "grpc.reflection.v1" and v1.service[0].name == "ServerReflection"


def _scrape(srv) -> dict[tuple[str, tuple], float]:
  text = urllib.request.urlopen(srv.http_url + "/metrics", timeout=10).read().decode()
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_show_the_request(stub, srv):
  wait_idle(srv)
  before = _scrape(srv)
  prompt = list(range(1000, 1040))  # 40 tokens: two full 16-token pages, then 8.
  first = generate(stub, pb.GenerateRequest(**ids_of(prompt), max_tokens=5, ignore_eos=True))
  again = generate(stub, pb.GenerateRequest(**ids_of(prompt), max_tokens=5, ignore_eos=True))
  wait_idle(srv)
  after = _scrape(srv)
  delta = lambda name, labels=(): after[(name, labels)] - before.get((name, labels), 0.0)
  assert delta("jaxserve:prompt_tokens_total") == 80
  assert delta("jaxserve:generation_tokens_total") == 10
  assert delta("jaxserve:request_success_total", (("finished_reason", "length"),)) == 2
  for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
               "request_queue_time_seconds", "request_prefill_time_seconds"):
    assert delta(f"jaxserve:{name}_count") == 2
  assert delta("jaxserve:time_per_output_token_seconds_count") == 8  # 4 gaps per request.
  # The second request found the first's two full pages in the prefix cache.
  assert (first[-1].usage.cached_prompt_tokens, again[-1].usage.cached_prompt_tokens) == (0, 32)
  assert delta("jaxserve:prefix_cache_queries_total") == 80
  assert delta("jaxserve:prefix_cache_hits_total") == 32
  assert after[("jaxserve:num_requests_running", ())] == 0
  assert after[("jaxserve:num_requests_waiting", ())] == 0
  assert after[("jaxserve:kv_cache_usage_perc", ())] == 0  # Cached pages are evictable: free.
  assert ("jaxserve:num_preemptions_total", ()) in after
  assert before[("jaxserve:xla_compiles_total", ())] > 0  # The warm-up's.
  assert delta("jaxserve:xla_compiles_total") == 0  # And none for a request.


def test_the_log_line_breaks_down_the_wait_without_the_prompt(stub, caplog):
  caplog.set_level(logging.INFO, logger="absl")
  secret = "zebra-umbrella-secret"
  msgs = generate(stub, h.text_request(f"Tell me about {secret}", max_tokens=3))
  rid = msgs[-1].request_id
  h.wait_until(lambda: any(rid in r.getMessage() for r in caplog.records), 5)
  (line,) = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
  for part in ("key=alice", "reason=length", "completion_tokens=3", "queue=", "prefill=", "ttft=",
               f"prompt_tokens={msgs[-1].usage.prompt_tokens}"):
    assert part in line
  assert all(secret not in r.getMessage() for r in caplog.records)
  assert math.isfinite(msgs[-1].timings.queue)
