"""Qwen3, Mistral (a window on every layer), Qwen3-MoE and Mixtral against transformers: a tiny
random model of each, built offline from its family's config scaled down
(`AutoModelForCausalLM.from_config`, saved as safetensors) and loaded by jaxserve. Logits at every
position, and greedy tokens through the scheduler (batched, chunked, a prefix hit, preempted)
with no compile after warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.batching.runner import Runner
from jaxserve.config import (
  AttentionBackend,
  EngineConfig,
  ModelFamily,
  SamplingParams,
  SchedulerConfig,
  readers,
)
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint, weights
from support import hf_tiny
from support.mock_engine import MockTokenizer
from support.tiny import count_compiles
from support.workers import PROMPTS, run_worker

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = hf_tiny.VOCAB
FAMILIES = hf_tiny.FAMILIES
# Its router's weights not renormalised (Qwen3-MoE's default): only the logits test needs it.
UNNORMED = ("Qwen3MoeConfig", dict(FAMILIES["qwen3_moe"][1], norm_topk_prob=False))
ENGINE = EngineConfig(num_slots=4, page_size=4, num_pages=17, max_model_len=64,
                      prefill_buckets=(16,), compilation_cache_dir=None,
                      attention_backend=AttentionBackend.REFERENCE)


def save_tiny(name: str, path):
  """The transformers model of family `name` (or "unnormed"), saved in `path`."""
  hf = hf_tiny.build(*FAMILIES.get(name, UNNORMED))
  hf.save_pretrained(path)
  return hf


def load_tiny(name: str, tmp_path_factory):
  """(name, transformers model, jaxserve model) for family `name` (or "unnormed")."""
  path = tmp_path_factory.mktemp(name)
  hf = save_tiny(name, path)
  cfg, params = weights.load_hf_dir(path)
  return name, hf, checkpoint.build_model(cfg, params)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
  return load_tiny(request.param, tmp_path_factory)


def test_config_and_parameter_count(family):
  name, hf, model = family
  cfg = model.cfg
  expected = {"qwen3": ModelFamily.QWEN3, "mistral": ModelFamily.MISTRAL,
              "qwen3_moe": ModelFamily.QWEN3_MOE, "mixtral": ModelFamily.MIXTRAL,
              "phi3": ModelFamily.PHI3}[name]
  assert cfg.family is expected
  params = nnx.to_pure_dict(nnx.state(model))
  assert cfg.num_params == sum(x.size for x in jax.tree.leaves(params))  # The planner's count.
  assert cfg.num_params == sum(p.numel() for p in hf.parameters())
  if cfg.num_experts:
    assert cfg.num_active_params < cfg.num_params
    assert cfg.norm_topk == hf.config.to_dict().get("norm_topk_prob", True)
  assert cfg.local_layers == ((True,) * 2 if name in ("mistral", "phi3") else ())


def test_logits_match_transformers_at_every_position(family):
  """40 tokens: Mistral's positions past its 8-token window see only their window; the experts
  see every routing the 40 tokens pick."""
  hf_tiny.assert_logits_match(*family[1:])


def test_unnormalised_router_logits_match_transformers(tmp_path_factory):
  """Qwen3-MoE with norm_topk_prob false: the top-k softmax weights are used as they are."""
  _, hf, model = load_tiny("unnormed", tmp_path_factory)
  assert not model.cfg.norm_topk
  hf_tiny.assert_logits_match(hf, model)


def test_greedy_through_the_scheduler_match_transformers(family, checked):
  """Four prompts batched, one prefilled in chunks of 16, 17 pages of 4 for four requests that
  grow to 5-8 pages each (so some are preempted and recomputed), then a prompt that shares the
  first one's 16 leading tokens (a prefix hit): transformers' greedy tokens, no compile after
  warm-up."""
  _, hf, model = family
  engine = Engine(model, ENGINE)
  assert (len(engine.cache.groups) == 2) == any(model.cfg.local_layers)
  engine.warmup()
  runner = checked(Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16)))
  rng = np.random.default_rng(1)
  prompts = [[int(i) for i in rng.integers(0, VOCAB, n)] for n in (23, 6, 11, 9)]
  params = SamplingParams(temperature=0, max_tokens=12)
  with count_compiles() as counts:
    first = runner.generate([(p, params) for p in prompts])
    shared = prompts[0][:16] + [5, 6, 7]
    second = runner.generate([(shared, params)])
  assert counts == {"trace": 0, "compile": 0}
  assert runner.scheduler.num_preemptions >= 1
  assert runner.scheduler.num_cached_tokens > 0
  for prompt, result in zip(prompts + [shared], first + second):
    assert list(result.token_ids) == hf_tiny.greedy(hf, prompt, 12)


def test_unknown_family_is_refused_by_name():
  with pytest.raises(ValueError, match="'DeepseekV3ForCausalLM'.*deepseek_v3.*jaxserve serves"):
    readers.from_hf({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})


def test_expert_parallel_tokens_match_one_device(tmp_path):
  """Qwen3-MoE (8 experts, top 3; Mixtral runs the same experts code) on 4 fake CPU devices:
  experts split over `expert` (--ep 2), and over `expert` with each expert's columns over
  `model` (--tp 2 --ep 2), give the one-device greedy tokens and logprobs; each device holds
  half the experts."""
  save_tiny("qwen3_moe", tmp_path)
  layouts = [[1, 1], [1, 1, {"ep": 2}], [2, 1, {"ep": 2}]]
  runs = run_worker(dict(devices=4, model={"hf_dir": str(tmp_path)}, prompts=PROMPTS, steps=6,
                         layouts=layouts))["layouts"]
  one = runs["1x1"]
  for layout in ("1x1-ep2", "2x1-ep2"):
    assert runs[layout]["tokens"] == one["tokens"]
    np.testing.assert_allclose(runs[layout]["logprobs"], one["logprobs"], atol=1e-4)
  # The experts are most of the weights: halved on each device by ep 2, quartered with tp 2.
  assert runs["1x1-ep2"]["param_bytes_device0"] < 0.8 * one["param_bytes_device0"]
  assert runs["2x1-ep2"]["param_bytes_device0"] < runs["1x1-ep2"]["param_bytes_device0"]


@pytest.mark.parametrize("name, total, active, kv_per_token", [
    ("qwen3-8b", 8.2e9, 8.2e9, 144 * 2**10),  # Its model card: 8.2B.
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 96 * 2**10),  # 30.5B in total, 3.3B activated.
    ("mixtral-8x7b", 46.7e9, 12.9e9, 128 * 2**10)])  # Mistral AI: 46.7B, 12.9B a token.
def test_planner_knows_the_published_sizes(name, total, active, kv_per_token):
  """Total and active parameters within 2% of what each model's publisher states (the count is
  the tiny models' exact one, test_config_and_parameter_count); KV per token in bfloat16."""
  from jaxserve.config import KVDtype
  from jaxserve.planning import capacity
  from jaxserve.planning.known_models import KNOWN_MODELS

  m = KNOWN_MODELS[name]
  assert abs(m.num_params / total - 1) < 0.02 and abs(m.num_active_params / active - 1) < 0.02
  assert capacity.kv_bytes_per_token(m, KVDtype.BFLOAT16) == kv_per_token


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "default", "partial_rotary_factor": 0.75}, "partial_rotary_factor")])
def test_phi3_rope_it_cannot_run_is_refused_by_name(rope, message):
  hf = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 4, "rope_scaling": rope}
  with pytest.raises(ValueError, match=f"phi3 with .*{message}"):
    readers.from_hf(hf)
