"""LoRA adapters against peft: tiny random Llama and Qwen3 models built by transformers from a
config, adapters created by peft itself (random A and B, init_lora_weights=False) and saved as
PEFT writes them, loaded by jaxserve. Greedy tokens and their logprobs for batches that mix the
base model and several adapters equal peft's for each request alone; so after an adapter is
removed and added again, and after LRU eviction (more adapters than slots); nothing compiles
after warm-up; a prefix cached under one adapter is never another's; bad adapters are refused by
name."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import numpy as np
import pytest
import safetensors.numpy

from jaxserve.batching.request import RequestRejected
from jaxserve.batching.runner import Runner
from jaxserve.config import (
  AttentionBackend,
  EngineConfig,
  LoRARequest,
  SamplingParams,
  SchedulerConfig,
  SpeculativeConfig,
)
from jaxserve.engine.engine import Engine
from jaxserve.llm import LLM, lora_config
from jaxserve.loading import checkpoint, quantize, weights
from jaxserve.loading.lora import load_adapter
from support import hf_tiny
from support.mock_engine import MockTokenizer
from support.tiny import count_compiles
from support.workers import run_worker

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
from support.peft_lora import ADAPTERS, ALL, N, make_adapters, reference  # noqa: E402 (peft)

FAMILIES = {"llama": ("LlamaConfig", hf_tiny.SMALL), "qwen3": hf_tiny.FAMILIES["qwen3"]}
# Two adapter slots for three adapters: the third waits for a slot, then evicts one.
ENGINE = EngineConfig(num_slots=4, page_size=4, num_pages=64, max_model_len=64,
                      prefill_buckets=(16,), compilation_cache_dir=None,
                      attention_backend=AttentionBackend.REFERENCE, max_loras=2,
                      max_lora_rank=16)
GREEDY = SamplingParams(temperature=0, max_tokens=N, logprobs=1)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request, tmp_path_factory):
  """(transformers model, adapters by name, a warm engine with max_loras=2, its model config)."""
  root = tmp_path_factory.mktemp(request.param)
  hf = hf_tiny.build(*FAMILIES[request.param])
  hf.save_pretrained(root / "base")
  cfg, params = weights.load_hf_dir(root / "base")
  engine = Engine(checkpoint.build_model(cfg, params), ENGINE)
  engine.warmup()
  return hf, make_adapters(hf, root), engine, cfg


def runner_of(engine, adapters, cfg) -> Runner:
  runner = Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))
  for lora, _ in adapters.values():
    runner.add_lora(lora, load_adapter(lora.lora_path, cfg, ENGINE.max_lora_rank))
  return runner


def check(results, jobs, hf, adapters):
  """Each result's tokens are its request's reference alone, each logprob within 1e-3."""
  for result, (prompt, name) in zip(results, jobs):
    tokens, logprobs = reference(hf if name is None else adapters[name][1], prompt)
    assert list(result.token_ids) == tokens, name
    assert np.allclose([lp.logprob for lp in result.logprobs], logprobs, atol=1e-3), name


def test_mixed_batches_match_peft_alone(setup, checked):
  """Base and adapter rows batched (prefills chunked, decodes together), three adapters over two
  slots: one waits, one is evicted; then an adapter removed and added again; nothing compiles."""
  hf, adapters, engine, cfg = setup
  runner = checked(runner_of(engine, adapters, cfg))
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(0, hf_tiny.VOCAB, n)] for n in (23, 6, 11, 9, 14, 5)]
  first = list(zip(prompts, [None, "a1", "a2", "a1", None, "a2"]))
  second = list(zip(prompts, ["a3", "a1", "a3", None, "a2", "a3"]))
  lora = lambda name: None if name is None else adapters[name][0]
  with count_compiles() as counts:
    one = runner.generate([(p, GREEDY, lora(n)) for p, n in first])
    two = runner.generate([(p, GREEDY, lora(n)) for p, n in second])
    assert runner.remove_lora(adapters["a1"][0].lora_int_id)
    a1 = adapters["a1"][0]
    runner.add_lora(a1, load_adapter(a1.lora_path, cfg, ENGINE.max_lora_rank))
    three = runner.generate([(p, GREEDY, lora(n)) for p, n in first])
  assert counts == {"trace": 0, "compile": 0}
  assert runner.scheduler.loras.num_evictions >= 2
  check(one, first, hf, adapters)
  check(two, second, hf, adapters)
  check(three, first, hf, adapters)


def test_adapters_over_int8_base_weights_run_as_over_their_float_values(tmp_path, checked):
  """The delta is float beside a quantized base projection: int8 weights with adapters give the
  tokens (and logprobs within 1e-3) of the same adapters over those weights dequantized."""
  hf = hf_tiny.build(*FAMILIES["llama"])
  hf.save_pretrained(tmp_path / "base")
  cfg, params = weights.load_hf_dir(tmp_path / "base")
  adapters = make_adapters(hf, tmp_path, ADAPTERS[:2])
  jobs = [([3, 17, 99, 5, 42, 7, 8, 1, 2], name) for name in (None, "a1", "a2")]
  outs = []
  for stored in (quantize.to_int8(params), quantize.to_float(quantize.to_int8(params))):
    engine = Engine(checkpoint.build_model(cfg, stored), ENGINE)
    engine.warmup()
    runner = checked(runner_of(engine, adapters, cfg))
    outs.append(runner.generate([(p, GREEDY, n and adapters[n][0]) for p, n in jobs]))
  assert quantize.is_quantized(quantize.to_int8(params))
  for q, f in zip(*outs):
    assert q.token_ids == f.token_ids
    assert np.allclose([x.logprob for x in q.logprobs], [x.logprob for x in f.logprobs],
                       atol=1e-3)
  assert outs[0][1].token_ids != outs[0][0].token_ids  # The adapters do change the tokens.


def test_a_prefix_cached_under_one_adapter_is_never_anothers(setup, checked):
  """One 20-token prompt under the base model, a1, a2, then a1 again: only the last finds
  cached pages (a1's own), and every output is its own adapter's."""
  hf, adapters, engine, cfg = setup
  runner = checked(runner_of(engine, adapters, cfg))
  prompt = [int(t) for t in np.random.default_rng(1).integers(0, hf_tiny.VOCAB, 20)]
  jobs = [(prompt, name) for name in (None, "a1", "a2", "a1")]
  results = [runner.generate([(prompt, GREEDY, None if n is None else adapters[n][0])])[0]
             for _, n in jobs]
  assert [r.num_cached_tokens for r in results[:3]] == [0, 0, 0]
  assert results[3].num_cached_tokens == 16  # Its 4 whole pages but the last token's.
  check(results, jobs, hf, adapters)


def test_ngram_proposals_are_verified_under_each_requests_adapter(tmp_path, checked):
  """n-gram speculation with adapters: prompts that repeat themselves get proposals, verified
  in the step under the request's own adapter; every token is peft's alone."""
  hf = hf_tiny.build(*FAMILIES["llama"])
  hf.save_pretrained(tmp_path / "base")
  cfg, params = weights.load_hf_dir(tmp_path / "base")
  adapters = make_adapters(hf, tmp_path, ADAPTERS[:2])
  spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                           disable_by_batch_size=None)
  engine = Engine(checkpoint.build_model(cfg, params), dataclasses.replace(ENGINE,
                                                                           speculative=spec))
  engine.warmup()
  runner = checked(runner_of(engine, adapters, cfg))
  rng = np.random.default_rng(2)
  jobs = [(list(map(int, rng.integers(0, hf_tiny.VOCAB, 4))) * 4, name)
          for name in (None, "a1", "a2", "a1")]
  with count_compiles() as counts:
    results = runner.generate([(p, GREEDY, n and adapters[n][0]) for p, n in jobs])
  assert counts == {"trace": 0, "compile": 0}
  assert runner.scheduler.spec_stats.num_drafts > 0
  check(results, jobs, hf, adapters)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_batches_under_tp2_match_peft_alone(tmp_path, family):
  """Two fake CPU devices, tp 2 (sharding_worker.py): three adapters over two slots, mixed with
  the base model; each request's tokens and logprobs are peft's alone, and the row-parallel
  targets' A is split over the devices."""
  hf = hf_tiny.build(*FAMILIES[family])
  hf.save_pretrained(tmp_path / "base")
  adapters = make_adapters(hf, tmp_path)
  rng = np.random.default_rng(4)
  prompts = [[int(t) for t in rng.integers(0, hf_tiny.VOCAB, n)] for n in (13, 6, 9, 17, 5)]
  jobs = list(zip(prompts, [None, "a1", "a2", "a3", "a1"]))
  spec = dict(base=str(tmp_path / "base"), tp=2, steps=N, jobs=jobs,
              adapters=[[name, lora.lora_int_id, lora.lora_path]
                        for name, (lora, _) in adapters.items()])
  out = run_worker(dict(devices=2, lora=spec))
  assert out["num_evictions"] >= 1
  I = hf.config.num_attention_heads * hf.config.head_dim
  assert out["wo_a_shard_rows"] == [I // 2, I // 2]
  for (prompt, name), tokens, logprobs in zip(jobs, out["tokens"], out["logprobs"]):
    want, want_logprobs = reference(hf if name is None else adapters[name][1], prompt)
    assert tokens == want, name
    assert np.allclose(logprobs, want_logprobs, atol=1e-3), name


def test_preempted_adapter_requests_recompute_under_their_adapter(tmp_path, checked):
  """A pool of 13 usable pages of 4 for four requests of 13 + 8 tokens (5-6 pages each; three
  run at once, the third adapter waiting for a slot): they are preempted as they grow, give up
  their adapter slots, and are recomputed under their own adapters: every token is peft's
  alone."""
  hf = hf_tiny.build(*FAMILIES["llama"])
  hf.save_pretrained(tmp_path / "base")
  cfg, params = weights.load_hf_dir(tmp_path / "base")
  adapters = make_adapters(hf, tmp_path)
  engine = Engine(checkpoint.build_model(cfg, params), dataclasses.replace(ENGINE, num_pages=14))
  engine.warmup()
  runner = checked(runner_of(engine, adapters, cfg))
  rng = np.random.default_rng(5)
  jobs = [(list(map(int, rng.integers(0, hf_tiny.VOCAB, 13))), name)
          for name in ("a1", "a2", None, "a3")]
  results = runner.generate([(p, GREEDY, n and adapters[n][0]) for p, n in jobs])
  assert runner.scheduler.num_preemptions > 0
  check(results, jobs, hf, adapters)


def test_a_request_for_an_adapter_not_added_is_refused(setup):
  hf, adapters, engine, cfg = setup
  runner = Runner(engine, MockTokenizer())
  with pytest.raises(RequestRejected, match="'a1' .* is not loaded"):
    runner.new_request([1, 2, 3], GREEDY, lora=adapters["a1"][0])


def test_removing_an_adapter_in_use_is_refused(setup, checked):
  hf, adapters, engine, cfg = setup
  runner = checked(runner_of(engine, adapters, cfg))
  a1 = adapters["a1"][0]
  req = runner.new_request([1, 2, 3], GREEDY, lora=a1)
  runner.submit(req)
  runner.step()
  with pytest.raises(ValueError, match="in use by 1 requests"):
    runner.remove_lora(a1.lora_int_id)
  while runner.has_unfinished:
    runner.step()
  assert runner.remove_lora(a1.lora_int_id)


def test_adapters_past_max_cpu_loras_are_refused_until_one_is_removed(setup):
  hf, adapters, engine, cfg = setup
  limited = copy.copy(engine)  # The same compiled engine, its limit as max_cpu_loras=2 sets it.
  limited.info = dataclasses.replace(engine.info, max_cpu_loras=2)
  runner = Runner(limited, MockTokenizer())
  (a1, _), (a2, _), (a3, _) = (adapters[name] for name in ("a1", "a2", "a3"))
  read = lambda lora: load_adapter(lora.lora_path, cfg, ENGINE.max_lora_rank)
  runner.add_lora(a1, read(a1))
  runner.add_lora(a2, read(a2))
  with pytest.raises(ValueError, match="2 adapters are loaded already"):
    runner.add_lora(a3, read(a3))
  runner.add_lora(a2, read(a2))  # The same adapter again is no new one.
  assert runner.remove_lora(a1.lora_int_id)
  runner.add_lora(a3, read(a3))
  assert set(runner.loras) == {a2.lora_int_id, a3.lora_int_id}
  with pytest.raises(ValueError, match="max_cpu_loras"):
    EngineConfig(max_loras=2, max_cpu_loras=1)


def test_an_engine_without_lora_refuses_adapter_requests(tmp_path):
  hf = hf_tiny.build(*FAMILIES["llama"])
  hf.save_pretrained(tmp_path)
  engine = Engine(checkpoint.build_model(*weights.load_hf_dir(tmp_path)),
                  EngineConfig(**{**ENGINE.__dict__, "max_loras": 0}))
  with pytest.raises(ValueError, match="LoRA is off"):
    engine.add_lora(1, None)
  req = Runner(engine, MockTokenizer()).new_request([1, 2], GREEDY)
  req.lora = LoRARequest("x", 1)
  with pytest.raises(RequestRejected, match="runs no adapters"):
    Runner(engine, MockTokenizer()).scheduler.add(req)


@pytest.mark.parametrize("kwargs", [
    dict(max_loras=-1), dict(max_lora_rank=0), dict(max_loras=2, dp=2),
    dict(max_loras=1, speculative=SpeculativeConfig(method="draft", draft_model="x"))])
def test_lora_engine_configs_it_cannot_run_are_refused(kwargs):
  with pytest.raises(ValueError, match="max_lora|LoRA"):
    EngineConfig(**kwargs)


@pytest.mark.parametrize("args", [("", 1), ("x", 0), ("x", True)])
def test_lora_requests_are_checked(args):
  with pytest.raises(ValueError, match="lora_name|lora_int_id"):
    LoRARequest(*args)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """(transformers Llama, its jaxserve config, a folder for adapters)."""
  root = tmp_path_factory.mktemp("bad")
  hf = hf_tiny.build(*FAMILIES["llama"])
  hf.save_pretrained(root / "base")
  return hf, weights.load_hf_dir(root / "base")[0], root


@pytest.mark.parametrize("kwargs, message", [
    (dict(r=16, target_modules=["q_proj"]), "rank 16 is more than max_lora_rank 8"),
    (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(r=4, target_modules=["q_proj", "embed_tokens"]),
     r"target_modules \['embed_tokens'\] are not supported"),
    (dict(r=4, target_modules="lm_head"), "tensors jaxserve cannot apply .*lm_head"),
    (dict(r=4, target_modules=["q_proj"], use_dora=True), "use_dora"),
])
def test_adapters_it_cannot_run_are_refused_by_name(base, kwargs, message):
  hf, cfg, root = base
  name = f"bad{abs(hash(message))}"
  lora, _ = make_adapters(hf, root, [(name, kwargs)])[name]
  with pytest.raises(ValueError, match=message):
    load_adapter(lora.lora_path, cfg, max_rank=8)


def test_missing_corrupt_or_misshapen_adapter_files_are_refused(base):
  hf, cfg, root = base
  with pytest.raises(ValueError, match="no adapter_config.json"):
    load_adapter(root / "nowhere", cfg, 8)
  lora, _ = make_adapters(hf, root, [("good", dict(r=4, target_modules=ALL))])["good"]
  load_adapter(lora.lora_path, cfg, 8)  # As saved, it loads.
  small = dict(FAMILIES["llama"][1], hidden_size=32, intermediate_size=48)
  other, _ = make_adapters(hf_tiny.build("LlamaConfig", small), root,
                           [("other", dict(r=4, target_modules=ALL))])["other"]
  misfit = r"layer 0 w_\w+: lora_A \[4, \d+\] and lora_B \[\d+, 4\] do not fit the base model"
  with pytest.raises(ValueError, match=misfit):
    load_adapter(other.lora_path, cfg, 8)
  tensors = root / "good" / "adapter_model.safetensors"
  tensors.write_bytes(tensors.read_bytes()[:100])
  with pytest.raises(ValueError, match="not a readable safetensors file"):
    load_adapter(lora.lora_path, cfg, 8)
  tensors.unlink()
  with pytest.raises(ValueError, match="no adapter_model.safetensors"):
    load_adapter(lora.lora_path, cfg, 8)
  (root / "good" / "adapter_config.json").write_text(json.dumps({"r": "8"}))
  with pytest.raises(ValueError, match="r must be an int"):
    load_adapter(lora.lora_path, cfg, 8)


def test_llm_generate_takes_lora_requests_as_vllms(default_model, tmp_path):
  """LLM(..., enable_lora=True, max_loras=1).generate(texts, params, lora_request=[...]): one
  adapter slot for two adapters and the base model, each text's tokens peft's alone. Then
  update_lora(a1, a2's folder) while a2 holds the slot (a1's host copy replaced), compiling
  nothing: a1's id gives a2's logprobs (within 1e-5); update_lora(a1) reads a1's folder again;
  once a1 is removed, update_lora refuses it by name."""
  tokenizer = default_model[1]
  hf = hf_tiny.build("LlamaConfig", dict(hf_tiny.SMALL, vocab_size=tokenizer.vocab_size))
  hf.save_pretrained(tmp_path / "base")
  tokenizer.save(tmp_path / "base")
  adapters = make_adapters(hf, tmp_path, ADAPTERS[:2])
  llm = LLM(str(tmp_path / "base"), engine_config=dataclasses.replace(ENGINE, max_loras=0),
            enable_lora=True, max_loras=1)
  assert (llm.engine.config.max_loras, llm.engine.config.max_lora_rank) == (1, 16)
  texts = ["Roses are red", "The sky is", "Once upon a time"]
  loras = [None, adapters["a1"][0], adapters["a2"][0]]
  params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1)
  results = llm.generate(texts, params, lora_request=loras)
  results += llm.generate(texts[:1], params, lora_request=adapters["a2"][0])
  assert llm.list_loras() == {1, 2}
  for text, lora, result in zip(texts + texts[:1], loras + loras[2:], results):
    model = hf if lora is None else adapters[lora.lora_name][1]
    tokens, logprobs = reference(model, llm.encode(text))
    assert list(result.token_ids) == tokens
    assert np.allclose([lp.logprob for lp in result.logprobs], logprobs, atol=1e-3)
  a1 = adapters["a1"][0]
  lps = lambda result: np.array([lp.logprob for lp in result.logprobs])
  with count_compiles() as counts:
    llm.update_lora(a1, adapters["a2"][0].lora_path)
    swapped = llm.generate(texts[:1], params, lora_request=a1)[0]
  assert counts == {"trace": 0, "compile": 0}
  assert swapped.token_ids == results[3].token_ids  # texts[0] under a2.
  assert np.abs(lps(swapped) - lps(results[3])).max() <= 1e-5
  llm.update_lora(a1)
  back = llm.generate(texts[1:2], params, lora_request=a1)[0]
  assert back.token_ids == results[1].token_ids
  assert np.abs(lps(back) - lps(results[1])).max() <= 1e-5
  assert llm.remove_lora(1) and llm.list_loras() == {2}
  with pytest.raises(ValueError, match=r"LoRA adapter 'a1' \(id 1\) is not added"):
    llm.update_lora(a1)
  with pytest.raises(ValueError, match="need enable_lora"):
    lora_config(EngineConfig(), False, 2, None)


def test_non_finite_adapters_are_refused_by_tensor_and_scaling(base):
  """A NaN in one lora_B, an Inf in one lora_A, and an infinite lora_alpha: each refused, naming
  what is not finite."""
  hf, cfg, root = base
  lora, _ = make_adapters(hf, root, [("nan", dict(r=4, target_modules=["q_proj"]))])["nan"]
  folder = root / "nan"
  tensors = safetensors.numpy.load_file(folder / "adapter_model.safetensors")
  for part, value in (("lora_B", np.nan), ("lora_A", np.inf)):
    bad = {k: v.copy() for k, v in tensors.items()}
    name = next(k for k in sorted(bad) if part in k)
    bad[name][0, 0] = value
    safetensors.numpy.save_file(bad, folder / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=f"tensor {re.escape(name)} holds NaN or Inf"):
      load_adapter(folder, cfg, 8)
  safetensors.numpy.save_file(tensors, folder / "adapter_model.safetensors")
  config = json.loads((folder / "adapter_config.json").read_text())
  (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("inf")}))
  with pytest.raises(ValueError, match="lora_alpha must be a finite number"):
    load_adapter(folder, cfg, 8)


def test_a_non_finite_slot_leaves_base_rows_and_other_adapters_exact(setup, checked):
  """a2's host copy forced to hold a NaN in B (past the loader's check) and slot 2's A forced to
  NaN on the device: base rows and a1's rows batched with them still equal peft's; unloading an
  adapter zeros its slot."""
  hf, adapters, engine, cfg = setup
  runner = checked(runner_of(engine, {k: adapters[k] for k in ("a1", "a2")}, cfg))
  a1, a2 = adapters["a1"][0], adapters["a2"][0]
  copies = engine.loras._copies[engine.loras._key_of[a2.lora_int_id]][0]
  copies["wq"][1][0, 0, 0] = np.nan
  prompts = [[5, 9, 2, 7, 1, 3], [8, 8, 1, 4], [2, 6, 6]]
  jobs = [(prompts[0], None), (prompts[1], "a1"), (prompts[2], "a2")]
  with count_compiles() as counts:
    out = runner.generate([(p, GREEDY, n and adapters[n][0]) for p, n in jobs])
  slot = runner.scheduler.loras.slot_of(a2.lora_int_id)
  weights = engine.loras.weights  # Committed as the steps want them: .at[] keeps that.
  poisoned = {t: x.at[:, slot].set(np.nan) for t, x in weights.a.items()}
  engine.loras.weights = dataclasses.replace(weights, a=poisoned)
  with count_compiles() as more:
    again = runner.generate([(p, GREEDY, n and adapters[n][0]) for p, n in jobs])
    assert runner.remove_lora(a2.lora_int_id)
  assert counts == more == {"trace": 0, "compile": 0}
  check(out[:2], jobs[:2], hf, adapters)
  check(again[:2], jobs[:2], hf, adapters)
  for x in (*engine.loras.weights.a.values(), *engine.loras.weights.b.values()):
    assert not np.asarray(x[:, slot]).any()  # Zeros, NaN gone.
  assert runner.remove_lora(a1.lora_int_id)


def test_one_host_copy_per_adapter_content_at_its_own_rank(setup):
  """The same folder under two names is one host copy, kept at the adapter's rank (a3: 4, the
  slots' 16), and goes when its last name does."""
  hf, adapters, engine, cfg = setup
  path = adapters["a3"][0].lora_path
  twins = [LoRARequest("a3-twin", 8, path), LoRARequest("a3-twin2", 9, path)]
  runner = Runner(engine, MockTokenizer())
  adapter = load_adapter(path, cfg, ENGINE.max_lora_rank)
  # The module's engine may hold a3 already (another test's runner added it): then no new copy.
  before, new = engine.loras.num_host_copies, adapter.digest not in engine.loras._copies
  for lora in twins:
    runner.add_lora(lora, adapter)
  key = engine.loras._key_of[8]
  assert engine.loras._key_of[9] == key and engine.loras.num_host_copies == before + new
  a, b = next(iter(engine.loras._copies[key][0].values()))
  assert a.shape[-1] == b.shape[-2] == 4
  runner.remove_lora(8)
  assert engine.loras.num_host_copies == before + new
  runner.remove_lora(9)
  assert engine.loras.num_host_copies == before


def test_update_lora_gives_the_new_weights_in_the_slot_forgetting_its_prefixes(setup, checked):
  """Runner.update_lora(a1, a2's weights) while a1 sits in a device slot, compiling nothing:
  a1's id then gives a2's tokens and logprobs (those of a2 added as itself, within 1e-5; peft's
  a2, within 1e-3), no prefix cached under a1 before is found, and a1's weights written back
  give peft's a1 again. An adapter not added is refused by name."""
  hf, adapters, engine, cfg = setup
  runner = checked(runner_of(engine, adapters, cfg))
  (a1, _), (a2, _) = adapters["a1"], adapters["a2"]
  read = lambda lora: load_adapter(lora.lora_path, cfg, ENGINE.max_lora_rank)
  prompt = [int(t) for t in np.random.default_rng(6).integers(0, hf_tiny.VOCAB, 20)]
  under = lambda lora: runner.generate([(prompt, GREEDY, lora)])[0]
  want = under(a2)
  assert under(a1).num_cached_tokens == 0 and under(a1).num_cached_tokens == 16
  assert runner.scheduler.loras.slot_of(a1.lora_int_id) is not None
  with count_compiles() as counts:
    runner.update_lora(a1, read(a2))
    got = under(a1)
  assert counts == {"trace": 0, "compile": 0}
  assert got.num_cached_tokens == 0  # a1's old pages are gone.
  assert got.token_ids == want.token_ids
  assert np.abs(np.array([x.logprob for x in got.logprobs])
                - [x.logprob for x in want.logprobs]).max() <= 1e-5
  check([got], [(prompt, "a2")], hf, adapters)
  assert under(a1).num_cached_tokens == 16  # Its new pages are cached as ever.
  runner.update_lora(a1, read(a1))
  check([under(a1), under(a2)], [(prompt, "a1"), (prompt, "a2")], hf, adapters)
  with pytest.raises(ValueError, match=r"LoRA adapter 'a9' \(id 9\) is not added"):
    runner.update_lora(LoRARequest("a9", 9, a2.lora_path), read(a2))
