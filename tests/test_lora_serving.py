"""LoRA adapters served as vLLM serves them: `model` names an adapter in the OpenAI API (the
official client, streaming) and over gRPC; /v1/models lists the adapters with their parent;
/v1/load_lora_adapter and /v1/unload_lora_adapter behind the API key, with their refusals by
name; an unload refused while a request uses the adapter, which goes on undisturbed; the
adapters' Prometheus info; nothing compiles after warm-up. Tokens are peft's greedy ones for each
request alone (a tiny random Llama with the default model's tokenizer, adapters peft creates)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import threading

import grpc
import openai
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.llm import Loaded, lora_reader
from jaxserve.loading import checkpoint
from jaxserve.serving.adapters import Adapters
from jaxserve.serving.gateway import ANONYMOUS, ApiError, ApiKey, Gateway, Status
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
  cfg = h.server.ServerConfig(grpc_port=0, http_port=0, keys_file=keys,
                              runtime_lora_roots=(str(root),))
  st = h.ServerThread(h.server.Server(lambda: loaded, cfg)).start()
  yield st, {name: peft_model for name, (_, peft_model) in adapters.items()}, hf, root
  st.close()


def expected_text(st, model, ids) -> str:
  return st.server.service.tokenizer.detokenize(reference(model, ids)[0])


def chat_ids(st) -> list[int]:
  return st.server.service.prompts.encode(Prompt(messages=CHAT))


def test_models_lists_the_base_and_its_adapters(served):
  st, _, _, root = served
  listed = {m.id: m for m in client(st).models.list().data}
  assert set(listed) == {"tiny-base", "a1"}
  status, card = call(st, "/v1/models/a1", key="ops")
  assert status == 200 and card["parent"] == "tiny-base" and card["root"] == str(root / "a1")
  status, card = call(st, "/v1/models/a1")  # Not an admin: the server's paths are not shown.
  assert status == 200 and card["root"] == "a1" and str(root) not in json.dumps(
      call(st, "/v1/models")[1])
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


def test_load_and_unload_behind_the_admin_key_with_refusals_by_name(served, tmp_path):
  """Loads and unloads are an admin key's (others 403, no key 401); folders outside the LoRA
  root, a link out of it and a missing folder get the same 404; then a2 loads, serves in turn
  with a1 in one slot, and unloads, compiling nothing."""
  st, peft_models, _, root = served
  a2 = {"lora_name": "a2", "lora_path": str(root / "a2")}
  load = lambda body, key="ops": call(st, "/v1/load_lora_adapter", body, "POST", key=key)
  unload = lambda body, key="ops": call(st, "/v1/unload_lora_adapter", body, "POST", key=key)
  assert load(a2, key=None)[0] == 401 and unload({"lora_name": "a1"}, key="sk-wrong")[0] == 401
  for status, body in (load(a2, key="alice"), unload({"lora_name": "a1"}, key="alice")):
    assert status == 403 and "admin key" in body["error"]["message"]
  corrupt = root / "corrupt"
  corrupt.mkdir(exist_ok=True)
  (corrupt / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
  (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
  outside = shutil.copytree(root / "a2", tmp_path / "a2-copy")
  (root / "link").unlink(missing_ok=True)
  (root / "link").symlink_to(outside)
  hidden = [load({"lora_name": "x", "lora_path": str(path)})
            for path in (root / "none", outside, root / "link", root / "a2" / ".." / "..")]
  assert {(status, body["error"]["message"].split("folder ")[0]) for status, body in hidden} == {
      (404, "LoRA adapter 'x': no adapter ")}  # Missing or not allowed: the same answer.
  refusals = [(load({"lora_name": "x", "lora_path": str(corrupt)}), 400, "safetensors"),
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


def test_reset_prefix_cache_is_an_admins_and_forgets_every_cached_page(served):
  """POST /reset_prefix_cache (vLLM's): 401 without a key, 403 for a key that is not an
  admin's; an admin's empties the cache: a prompt found cached before is computed again, to
  the same text."""
  st = served[0]
  reset = lambda key: call(st, "/reset_prefix_cache", {}, "POST", key=key)
  assert reset(None)[0] == 401
  status, body = reset("alice")
  assert status == 403 and "admin key" in body["error"]["message"]
  body = dict(model="tiny-base", prompt="one two three " * 12, max_tokens=3, temperature=0)

  def cached():
    out = call(st, "/v1/completions", body)[1]
    return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]
  first, (hit, text) = cached(), cached()
  assert hit > 0 and text == first[1]
  assert reset("ops") == (200, "")
  assert cached() == (0, text)


def test_loads_and_unloads_cancelled_at_any_point_leave_every_state_consistent(served):
  """60 loads and unloads of one folder under six names, each cancelled 0-30 ms after it began,
  while a1 streams: the stream is peft's, and afterwards the names served are exactly the
  engine's adapters; each can be unloaded."""
  st, peft_models, _, root = served
  service = st.server.service
  runner = service.runner
  work = lambda fn, *args: asyncio.get_running_loop().run_in_executor(None, fn, *args)
  rng = random.Random(0)

  async def one(i):
    name = f"c{i % 6}"
    op = (service.adapters.load(name, str(root / "a2"), work, True) if i % 2 == 0 else
          service.adapters.unload(name, True))
    task = asyncio.ensure_future(op)
    await asyncio.sleep(rng.uniform(0, 0.03))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ApiError):
      await task

  async def storm():
    await asyncio.gather(*(one(i) for i in range(60)))
    await asyncio.sleep(0.5)  # Shielded loads and unloads finish.
    engine_side = await runner.on_engine(lambda: sorted(l.lora_name for l in
                                                        runner._runner.loras.values()))
    return engine_side, sorted(a.lora_name for a in service.adapters.served())

  ids = chat_ids(st)
  stream = client(st).chat.completions.create(model="a1", messages=CHAT, max_tokens=N,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
  engine_side, served_names = asyncio.run_coroutine_threadsafe(storm(), st.loop).result(60)
  text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
  assert text == expected_text(st, peft_models["a1"], ids)
  assert engine_side == served_names and "a1" in served_names
  for name in set(served_names) - {"a1"}:
    asyncio.run_coroutine_threadsafe(service.adapters.unload(name, True), st.loop).result(60)
  assert [m.id for m in client(st).models.list().data] == ["tiny-base", "a1"]
  assert service.refusing is None


@pytest.mark.parametrize("op", ["add_lora", "remove_lora"])
def test_a_load_or_unload_whose_caller_leaves_while_the_engine_runs_it_completes(served, op,
                                                                               monkeypatch):
  """The caller cancelled while the engine thread is inside the add (or remove): it completes,
  and the served names say so."""
  st, _, _, root = served
  service = st.server.service
  inner, entered, gate = service.runner._runner, threading.Event(), threading.Event()
  real = getattr(inner, op)

  def held(*args):
    entered.set()
    gate.wait(10)
    return real(*args)

  async def cancelled_midway(start):
    task = asyncio.ensure_future(start())
    await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
    task.cancel()
    gate.set()
    with contextlib.suppress(asyncio.CancelledError):
      await task
    await asyncio.sleep(0.2)
    return [a.lora_name for a in service.adapters.served()]

  work = lambda fn, *args: asyncio.get_running_loop().run_in_executor(None, fn, *args)
  run = lambda coro: asyncio.run_coroutine_threadsafe(coro, st.loop).result(30)
  if op == "remove_lora":
    run(service.adapters.load("late", str(root / "a2"), work, True))
  monkeypatch.setattr(inner, op, held)
  start = ((lambda: service.adapters.load("late", str(root / "a2"), work, True))
           if op == "add_lora" else (lambda: service.adapters.unload("late", True)))
  names = run(cancelled_midway(start))
  monkeypatch.undo()
  assert ("late" in names) == (op == "add_lora")
  assert sorted(l.lora_name for l in inner.loras.values()) == sorted(names)
  if op == "add_lora":
    run(service.adapters.unload("late", True))


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
  status, body = call(st, "/v1/unload_lora_adapter", {"lora_name": "a1"}, "POST", key="ops")
  assert status == 400 and "in use" in body["error"]["message"]
  _, metrics = call(st, "/metrics")
  info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
  assert len(info) == 1 and 'running_lora_adapters="a1"' in info[0] and 'max_lora="1"' in info[0]
  worker.join(60)
  assert "".join(text) == st.server.service.tokenizer.detokenize(
      reference(peft_models["a1"], ids, 90)[0])
  assert [m.id for m in client(st).models.list().data] == ["tiny-base", "a1"]


def test_run_time_updates_are_off_unless_asked_and_then_an_admins():
  """Without --enable-runtime-lora-updates no one may load or unload (403 naming the flag);
  with a keys file only an admin key may; without one, the operator's opt-in lets any caller."""
  adapters = Adapters(None, "base", read=lambda path: None, runtime_roots=None)
  for call_ in (adapters.load("x", "/tmp", None, True), adapters.unload("x", True)):
    with pytest.raises(ApiError, match="--enable-runtime-lora-updates") as e:
      asyncio.run(call_)
    assert e.value.status is Status.PERMISSION_DENIED
  keys = [ApiKey("t", b"1"), ApiKey("ops", b"2", admin=True)]
  assert [Gateway(keys).may_administer(k) for k in keys] == [False, True]
  assert Gateway(None).may_administer(ANONYMOUS) and not ANONYMOUS.admin
