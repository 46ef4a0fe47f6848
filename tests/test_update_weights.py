"""A trainer's weights written into a running engine (issue 49, `update_weights`): the greedy
tokens and logprobs after an update are a fresh engine's on the same weights (within 1e-5), with
nothing compiled (the second update of a compiled source neither), for float and int8 weights,
on one device and under tp 2 on fake devices; no prefix cached before an update is found after
it; what does not fit is refused by name; requests in flight finish or are aborted."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.batching.request import FinishReason
from jaxserve.batching.runner import Runner
from jaxserve.compiling import compile_plan
from jaxserve.compiling.programs import UPDATE, engine_programs
from jaxserve.config import AttentionBackend, Quantization, SamplingParams, SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.llm import LLM
from jaxserve.loading import checkpoint, quantize
from jaxserve.model import quant
from jaxserve.model.llama import Transformer
from support.mock_engine import MockTokenizer
from support.tiny import TINY, TINY_ENGINE, count_compiles
from support.workers import PROMPTS, TINY8, run_worker

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
# 18 tokens: two whole pages of 8, which a second run finds in the prefix cache.
LONG = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67]
JOBS = [(LONG, GREEDY), ([2, 4, 6, 8], GREEDY)]


def weights(seed: int) -> dict:
  """A tiny model's float32 weights (numpy, the model's pure-dict layout)."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(Transformer(TINY,
                                                                          rngs=nnx.Rngs(seed)))))


STORED = {"float": lambda p: p, "int8": quantize.to_int8}


def runner(params: dict, stored: str = "float") -> Runner:
  engine = Engine(checkpoint.build_model(TINY, STORED[stored](params)), TINY_ENGINE)
  engine.warmup()
  return Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))


def run(r: Runner) -> tuple[list, np.ndarray]:
  outs = r.generate(JOBS)
  return [list(c.token_ids) for c in outs], np.array([[lp.logprob for lp in c.logprobs]
                                                      for c in outs])


@pytest.fixture(scope="module", params=["float", "int8"])
def updated(request):
  """(an engine of seed 0's weights, as `request.param` stores them, its runner having run
  JOBS twice; a fresh one's tokens and logprobs on seed 1's)."""
  r = runner(weights(0), request.param)
  run(r)
  run(r)
  return r, run(runner(weights(1), request.param))


def test_an_update_gives_a_fresh_engines_logprobs_compiling_nothing(updated):
  r, (tokens, logprobs) = updated
  assert r.scheduler.pages.num_hit_tokens > 0  # The second run found the first's pages.
  hits = r.scheduler.pages.num_hit_tokens
  with count_compiles() as counts:
    r.update_weights(weights(1))
    got_tokens, got = run(r)
  assert counts == {"trace": 0, "compile": 0}
  assert got_tokens == tokens and np.abs(got - logprobs).max() <= 1e-5
  assert r.scheduler.pages.num_hit_tokens == hits  # Pages of the old weights: none was found.
  run(r)
  assert r.scheduler.pages.num_hit_tokens > hits  # The new ones are cached as ever.


def test_the_compiled_path_on_one_device_casts_donates_and_compiles_once():
  """The way of accelerators (one program donating the old arrays), forced on this CPU: bf16
  weights cast to the engine's float32, the program compiled at the first update only."""
  r = runner(weights(0))
  new = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), weights(1))
  tokens, logprobs = run(runner(jax.tree.map(lambda x: np.asarray(x, np.float32), new)))
  old = jax.tree.leaves(r.engine.params)
  r.engine.update_weights(new, on_host=False)
  assert all(x.is_deleted() for x in old)  # Written in place.
  with count_compiles() as counts:
    r.engine.update_weights(new, on_host=False)
    r.reset_prefix_cache()
    got_tokens, got = run(r)
  assert counts == {"trace": 0, "compile": 0}
  assert got_tokens == tokens and np.abs(got - logprobs).max() <= 1e-5


@pytest.mark.parametrize("stored", ["none", "int8"])
def test_an_update_under_tp2_gives_a_fresh_engines_logprobs(stored):
  out = run_worker(dict(devices=2, update=dict(model=TINY8, tp=2, quantization=stored,
                                               prompts=PROMPTS + [LONG])))
  assert np.abs(np.array(out["logprobs"]) - np.array(out["fresh"])).max() <= 1e-5
  assert out["compiles"] == {"trace": 0, "compile": 0} and out["donated"]
  assert out["cached_tokens"] > 0 and out["hit_tokens"] == 0


def test_what_does_not_fit_is_refused_by_name_changing_nothing(updated):
  r = updated[0]
  params = r.engine.params
  bad = weights(1)
  bad["layers"]["wq"] = bad["layers"]["wq"][:, :32]
  with pytest.raises(ValueError, match=r"weight layers/wq: shape \(2, 32, 6, 16\)"):
    r.update_weights(bad)
  del bad["layers"]["wq"]
  with pytest.raises(ValueError, match="weight layers/wq is missing"):
    r.update_weights(bad)
  with pytest.raises(ValueError, match="lm_head is not a weight of this model"):
    r.update_weights({**weights(1), "lm_head": np.zeros((64, 128), np.float32)})
  with pytest.raises(ValueError, match="in_flight must be 'finish' or 'abort'"):
    r.update_weights(weights(1), in_flight="later")
  assert r.engine.params is params


def test_gguf_blocks_are_refused_by_name():
  layouts = {"w_up": quant.Layout(32, has_min=True)}
  model = Transformer(TINY, rngs=nnx.Rngs(0), quant_layouts=layouts)
  engine = Engine(model, TINY_ENGINE)
  with pytest.raises(ValueError, match="weight layers/w_up is held as GGUF blocks.*--quantization "
                                       "none or int8"):
    engine.update_weights(weights(1))


@pytest.mark.parametrize("in_flight", ["finish", "abort"])
def test_requests_in_flight_finish_on_the_old_weights_or_are_aborted(updated, in_flight):
  r = updated[0]
  r.update_weights(weights(0))
  old_tokens, _ = run(r)
  reqs = [r.new_request(*job) for job in JOBS]
  outputs = {req.request_id: [] for req in reqs}
  for req in reqs:
    r.submit(req)
  for _ in range(3):
    for out in r.step():
      outputs[out.request_id].append(out)
  r.update_weights(weights(1), in_flight)
  assert not r._requests and r.engine.sleep_level == 0
  while r.has_unfinished:  # Their last outputs come from the next step.
    for out in r.step():
      outputs[out.request_id].append(out)
  done = [req.completion(outputs[req.request_id]) for req in reqs]
  if in_flight == "finish":
    assert [list(c.token_ids) for c in done] == old_tokens
    assert {c.finish_reason for c in done} == {FinishReason.LENGTH}
  else:
    assert {c.finish_reason for c in done} == {FinishReason.ABORT}
    assert all(len(c.token_ids) < GREEDY.max_tokens for c in done)


def hf_names(params: dict) -> dict:
  """A tied Llama's weights by Hugging Face's names, torch layout [out, in]."""
  layers, out = params["layers"], {"model.embed_tokens.weight": params["embed"],
                                   "model.norm.weight": params["final_norm"]}
  for i in range(len(layers["wq"])):
    p = f"model.layers.{i}."
    out.update({
        p + "input_layernorm.weight": layers["attn_norm"][i],
        p + "post_attention_layernorm.weight": layers["mlp_norm"][i],
        **{f"{p}self_attn.{k}_proj.weight": layers[f"w{k}"][i].reshape(TINY.dim, -1).T
           for k in "qkv"},
        p + "self_attn.o_proj.weight": layers["wo"][i].reshape(-1, TINY.dim).T,
        p + "mlp.gate_proj.weight": layers["w_gate"][i].T,
        p + "mlp.up_proj.weight": layers["w_up"][i].T,
        p + "mlp.down_proj.weight": layers["w_down"][i].T})
  return out


def test_llm_takes_a_module_then_hugging_face_names(tiny_checkpoint):
  llm = LLM(str(tiny_checkpoint), engine_config=TINY_ENGINE)
  params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
  logprobs = lambda: [lp.logprob for lp in llm.generate("The sky is", params)[0].logprobs]
  first = logprobs()
  loaded = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(llm.model)))
  other = Transformer(llm.model.cfg, rngs=nnx.Rngs(1))
  llm.update_weights(other)
  # The LLM's model holds the new weights (copies: the engine's are committed, these not).
  np.testing.assert_array_equal(llm.model.embed[...], other.embed[...])
  assert np.abs(np.array(logprobs()) - first).max() > 1e-2
  with count_compiles() as counts:
    llm.update_weights(hf_names(loaded))
    again = logprobs()
  assert counts == {"trace": 0, "compile": 0}
  assert np.abs(np.array(again) - first).max() <= 1e-5
  with pytest.raises(ValueError, match="Hugging Face weight 'model.norm.weight' is missing"):
    llm.update_weights({k: v for k, v in hf_names(loaded).items() if k != "model.norm.weight"})


def test_plan_compile_compiles_the_update_program_for_a_tpu():
  """`plan --compile` lists the update program where there is one (int8 weights, not float32
  ones) and compiles it for a v5e, the old weights donated (their bytes aliased)."""
  int8 = dataclasses.replace(TINY_ENGINE, quantization=Quantization.INT8)
  assert UPDATE not in [p.name for p in engine_programs(TINY, TINY_ENGINE,
                                                        AttentionBackend.PALLAS_TPU)]
  assert engine_programs(TINY, int8, AttentionBackend.PALLAS_TPU)[-1].name == UPDATE
  [report] = compile_plan.compile_programs("v5e", TINY, int8, only=UPDATE)
  assert report["compiled"] and report["alias_bytes"] >= report["output_bytes"] - 1024


def test_an_update_program_that_does_not_fit_leaves_the_serving_plan_to_the_steps():
  """A trainer's float32 weights beside the engine's may not fit a chip that serves the model
  (Gemma 3 4B on v5e: 21.7 GB of temp): the steps size the pool and decide the fit, the
  update's failed report stays in the table; a step that fails still fails the plan."""
  step = dict(name="step", compiled=True, argument_bytes=100, temp_bytes=10, output_bytes=0,
              alias_bytes=0)
  update = dict(name=UPDATE, compiled=False, error="RESOURCE_EXHAUSTED")
  assert compile_plan._fits([step, update], 200)  # pylint: disable=protected-access
  assert not compile_plan._fits([step, update], 50)  # pylint: disable=protected-access
  assert not compile_plan._fits([{**step, "compiled": False}, update], 200)  # pylint: disable=protected-access
