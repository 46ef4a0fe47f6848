"""LoRA adapters served as vLLM serves them: `model` names an adapter in the OpenAI API (the
official client, streaming) and over gRPC; /v1/models lists the adapters with their parent;
/v1/load_lora_adapter and /v1/unload_lora_adapter behind the API key, with their refusals by
name; an unload refused while a request uses the adapter, which goes on undisturbed; the
adapters' Prometheus info; nothing compiles after warm-up. Tokens are peft's greedy ones for each
request alone (a tiny random Llama with the default model's tokenizer, adapters peft creates)."""

from __future__ import annotations

import json
import threading

import grpc
import openai
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.llm import Loaded, lora_reader
from jaxserve.loading import checkpoint
from jaxserve.serving.requests import Prompt
from support import hf_tiny
from support import server_harness as h
from support.openai_http import call
from support.openai_http import openai_client as client
from support.tiny import count_compiles

pytest.importorskip("peft")
from support.peft_lora import ADAPTERS, N, make_adapters, reference  # noqa: E402 (needs peft)

# One adapter slot: two adapters take turns in it.
ENGINE = EngineConfig(num_slots=4, page_size=8, num_pages=96, max_model_len=128,
                      prefill_buckets=(32, 64), compilation_cache_dir=None, max_loras=1,
                      max_lora_rank=16)
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
  """(server thread, the peft models by adapter name, the base transformers model), serving
  adapter a1 from the start (`--lora-modules`); a2 is on disk, for the load endpoint."""
  root = tmp_path_factory.mktemp("lora_serving")
  tokenizer = default_model[1]
  hf = hf_tiny.build("LlamaConfig", dict(hf_tiny.SMALL, vocab_size=tokenizer.vocab_size))
  hf.save_pretrained(root / "base")
  tokenizer.save(root / "base")
  adapters = make_adapters(hf, root, ADAPTERS[:2])
  model, tokenizer = checkpoint.load_model(str(root / "base"))
  engine = Engine(model, ENGINE, stop_ids=tokenizer.stop_ids)
  engine.warmup()
  read = lora_reader(model.cfg, ENGINE)
  a1 = adapters["a1"][0].lora_path
  loaded = Loaded(engine, tokenizer, "tiny-base", read, (("a1", a1, read(a1)),))
  keys = h.write_keys(root / "keys.json")
  cfg = h.server.ServerConfig(grpc_port=0, http_port=0, keys_file=keys)
  st = h.ServerThread(h.server.Server(lambda: loaded, cfg)).start()
  yield st, {name: peft_model for name, (_, peft_model) in adapters.items()}, hf, root
  st.close()


def expected_text(st, model, ids) -> str:
  return st.server.service.tokenizer.detokenize(reference(model, ids)[0])


def chat_ids(st) -> list[int]:
  return st.server.service.encode(Prompt(messages=CHAT))


def test_models_lists_the_base_and_its_adapters(served):
  st, _, _, root = served
  listed = {m.id: m for m in client(st).models.list().data}
  assert set(listed) == {"tiny-base", "a1"}
  status, card = call(st, "/v1/models/a1")
  assert status == 200 and card["parent"] == "tiny-base" and card["root"] == str(root / "a1")
  status, body = call(st, "/v1/models/nope")
  assert status == 404 and "'a1'" in body["error"]["message"]


def test_a_streamed_chat_under_an_adapter_is_the_adapters_greedy_output(served):
  st, peft_models, hf, _ = served
  ids = chat_ids(st)
  for model, ref in (("a1", peft_models["a1"]), ("tiny-base", hf)):
    stream = client(st).chat.completions.create(
        model=model, messages=CHAT, max_tokens=N, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {c.model for c in chunks} == {model}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        expected_text(st, ref, ids))


def test_grpc_names_the_adapter_in_model(served):
  st, peft_models, _, _ = served
  ids = chat_ids(st)
  with grpc.insecure_channel(st.grpc_address) as channel:
    req = pb.GenerateRequest(model="a1", token_ids=pb.TokenIds(ids=ids), max_tokens=N,
                             temperature=0, ignore_eos=True)
    tokens = [t for out in h.generate(h.stub(channel), req) for t in out.token_ids]
  assert tokens == reference(peft_models["a1"], ids)[0]


def test_load_and_unload_behind_the_key_with_refusals_by_name(served, tmp_path):
  st, peft_models, _, root = served
  a2 = {"lora_name": "a2", "lora_path": str(root / "a2")}
  load = lambda body, key="alice": call(st, "/v1/load_lora_adapter", body, "POST", key=key)
  unload = lambda body, key="alice": call(st, "/v1/unload_lora_adapter", body, "POST", key=key)
  assert load(a2, key=None)[0] == 401 and unload({"lora_name": "a1"}, key="sk-wrong")[0] == 401
  (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
  (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors")
  refusals = [(load({"lora_name": "x", "lora_path": str(tmp_path / "none")}), 404, "no folder"),
              (load({"lora_name": "x", "lora_path": str(tmp_path)}), 400, "safetensors"),
              (load({"lora_name": "a1", "lora_path": a2["lora_path"]}), 400, "already"),
              (load({"lora_name": "x"}), 400, "lora_path"),
              (unload({"lora_name": "nope"}), 404, "not loaded")]
  for (status, body), want, words in refusals:
    assert status == want and words in body["error"]["message"], body
  with count_compiles() as counts:
    assert load(a2) == (200, "Success: LoRA adapter 'a2' added successfully.")
    ids = chat_ids(st)
    for name in ("a2", "a1", "a2"):  # Two adapters, one slot: each loads in turn.
      out = client(st).chat.completions.create(model=name, messages=CHAT, max_tokens=N,
                                               temperature=0, extra_body={"ignore_eos": True})
      assert out.model == name
      assert out.choices[0].message.content == expected_text(st, peft_models[name], ids)
    assert unload({"lora_name": "a2"}) == (200, "Success: LoRA adapter 'a2' removed "
                                                "successfully.")
  assert counts == {"trace": 0, "compile": 0}
  with pytest.raises(openai.NotFoundError, match="a2"):
    client(st).chat.completions.create(model="a2", messages=CHAT, max_tokens=2)
  assert {m.id for m in client(st).models.list().data} == {"tiny-base", "a1"}


def test_an_adapter_in_use_is_not_unloaded_and_its_request_goes_on(served):
  st, peft_models, _, _ = served
  ids = chat_ids(st)
  started, text = threading.Event(), []

  def stream():
    for chunk in client(st).chat.completions.create(
        model="a1", messages=CHAT, max_tokens=90, temperature=0, stream=True,
        extra_body={"ignore_eos": True}):
      started.set()
      text.append(chunk.choices[0].delta.content or "" if chunk.choices else "")

  worker = threading.Thread(target=stream)
  worker.start()
  assert started.wait(60)
  status, body = call(st, "/v1/unload_lora_adapter", {"lora_name": "a1"}, "POST")
  assert status == 400 and "in use" in body["error"]["message"]
  _, metrics = call(st, "/metrics")
  info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
  assert len(info) == 1 and 'running_lora_adapters="a1"' in info[0] and 'max_lora="1"' in info[0]
  worker.join(60)
  assert "".join(text) == st.server.service.tokenizer.detokenize(
      reference(peft_models["a1"], ids, 90)[0])
  assert [m.id for m in client(st).models.list().data] == ["tiny-base", "a1"]
