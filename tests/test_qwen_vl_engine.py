"""Qwen2.5-VL in the engine (issue 50): a tiny random Qwen2_5_VLForConditionalGeneration built
offline by transformers is the reference. Its M-RoPE positions, greedy tokens and logprobs for
prompts of one and two images of different sizes (two encoder buckets), batched with a text-only
prompt, whole and in chunks that cut through an image, with no compile after warm-up; the prefix
cache keyed by each image's content."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.batching import images as mm
from jaxserve.batching import mm_prompts, mrope
from jaxserve.batching.runner import Runner
from jaxserve.config import AttentionBackend, EngineConfig, SamplingParams, SchedulerConfig
from support import qwen_vl
from support.images import hf_engine
from support.mock_engine import MockTokenizer
from support.tiny import count_compiles

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ENGINE = EngineConfig(**qwen_vl.ENGINE, attention_backend=AttentionBackend.REFERENCE)
START, PAD, END = (qwen_vl.IDS[k] for k in ("vision_start_token_id", "image_token_id",
                                            "vision_end_token_id"))
NUM_TOKENS = 6


def pictures(n: int, seed: int = 0) -> list[np.ndarray]:
  """Odd-sized pictures: the first resized up to 56 x 84 pixels (6 tokens, the 64-patch bucket),
  the second to 140 x 196 (35 tokens over several attention windows, the 256-patch bucket)."""
  rng = np.random.default_rng(seed)
  sizes = [(40, 60, 3), (150, 200, 3)]
  return [rng.integers(0, 256, sizes[i % 2], dtype=np.uint8) for i in range(n)]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  hf = qwen_vl.build()
  path = tmp_path_factory.mktemp("tiny_qwen_vl")
  qwen_vl.save(hf, path)
  return hf, path


@pytest.fixture(scope="module")
def engine(tiny_hf):
  return hf_engine(tiny_hf[1], ENGINE)


def prompt(text: list[int], num_images: int) -> list[int]:
  """Text, then each image's start, placeholder and end between text tokens."""
  out = list(text[:3])
  for i in range(num_images):
    out += [START, PAD, END] + text[3 + 2 * i:5 + 2 * i]
  return out + text[3 + 2 * num_images:]


def requests(engine, cases):
  """Runner.generate's tuples for cases of (text ids, pictures)."""
  vision = engine.model_config.vision
  out = []
  for text, rgbs in cases:
    images = [mm.Image.of(rgb) for rgb in rgbs]
    ids = mm_prompts.expand_ids(prompt(text, len(rgbs)), images, vision)
    spans = mm_prompts.place_images(ids, images, vision)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    out.append((ids, greedy, None, spans))
  return out


def reference(hf, q) -> tuple[list[int], list[float]]:
  ids, _, _, spans = q
  return qwen_vl.reference(hf, ids, [s.pixels for s in spans], [s.grid for s in spans],
                           NUM_TOKENS)


def test_config_reads_qwen2_5_vl(engine):
  cfg = engine.model_config
  assert cfg.mrope_section == (2, 3, 3) and cfg.qkv_bias and cfg.vision.buckets == (64, 256)
  assert cfg.vision.max_pixels == qwen_vl.PROCESSOR["max_pixels"]


def test_rope_shifts_are_transformers_positions(tiny_hf, engine):
  """Two images between text: the 1-D positions plus the shifts are get_rope_index's three
  axes, and the delta its rope_deltas."""
  text = list(range(20))
  (q,) = requests(engine, [(text, pictures(2))])
  ids, spans = q[0], q[3]
  ids_t = torch.tensor([ids])
  theirs, delta = tiny_hf[0].model.get_rope_index(
      ids_t, (ids_t == PAD).int(), image_grid_thw=torch.tensor([s.grid for s in spans]))
  ours = np.arange(len(ids))[:, None] + mrope.shifts(spans, 0, len(ids), 2)
  assert np.array_equal(ours.T, theirs[:, 0].numpy())
  assert mrope.delta(spans, 2) == int(delta[0, 0])


@pytest.mark.parametrize("budget", [128, 16])
def test_greedy_tokens_and_logprobs_match_transformers(tiny_hf, engine, checked, budget):
  """One prompt of one image, one of two (two buckets), a text-only one, batched; zero compiles.
  With 16 tokens a step, the 35-token image is cut across chunks (its tokens attend causally)."""
  rng = np.random.default_rng(4)
  text = lambda n: [int(t) for t in rng.integers(0, 250, n)]
  reqs = requests(engine, [(text(9), pictures(1)), (text(11), pictures(2, seed=1)),
                           (text(7), [])])
  r = checked(Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=budget)))
  with count_compiles() as counts:
    outs = r.generate(reqs)
  assert counts["compile"] == 0, counts
  for out, q in zip(outs, reqs):
    tokens, logprobs = reference(tiny_hf[0], q)
    assert list(out.token_ids) == tokens
    assert np.abs(np.array([lp.logprob for lp in out.logprobs]) - logprobs).max() < 1e-3


def test_prefix_cache_pages_are_keyed_by_the_images(tiny_hf, engine, checked):
  """Same tokens, another image of the same size: only the page before the image is shared; the
  same image again: every full page. The other image's tokens are transformers' own."""
  text = [int(t) for t in np.random.default_rng(5).integers(0, 250, 14)]
  a, b = pictures(1, seed=7)[0], pictures(1, seed=8)[0]
  r = checked(Runner(engine, MockTokenizer()))
  (first,), (other,), (again,) = (r.generate(requests(engine, [(text, [rgb])]))
                                  for rgb in (a, b, a))
  n = len(requests(engine, [(text, [a])])[0][0])
  assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 4)
  assert again.num_cached_tokens == (n - 1) // 4 * 4
  assert list(other.token_ids) == reference(tiny_hf[0], requests(engine, [(text, [b])])[0])[0]
  assert again.token_ids == first.token_ids


def test_prompt_expansion_is_the_processors(engine):
  """The chat template's one placeholder per image becomes as many as the processor writes."""
  vision = engine.model_config.vision
  small, big = (mm.Image.of(p) for p in pictures(2))
  text = mm_prompts.expand_text("a<s><p><e>b<s><p><e>", [small, big], ["<s>", "<p>", "<e>"],
                                vision)
  assert text == "a<s>" + "<p>" * 6 + "<e>b<s>" + "<p>" * 35 + "<e>"
  with pytest.raises(ValueError, match="placeholders"):
    mm_prompts.expand_ids([1, PAD, 2], [small, big], vision)
  with pytest.raises(ValueError, match="a run of 5"):
    mm_prompts.place_images([1, *[PAD] * 5, 2], [small], vision)


def test_offline_api_takes_vllms_multi_modal_data(engine):
  """LLM.generate with {"prompt_token_ids", "multi_modal_data": {"image": [PIL images]}} gives
  the runner's tokens for the same images (placeholders repeated per image size)."""
  from types import SimpleNamespace

  from PIL import Image

  from jaxserve.llm import LLM

  llm = LLM.__new__(LLM)  # The module's engine, not a second one (its compiles).
  llm.model, llm.tokenizer = SimpleNamespace(cfg=engine.model_config), MockTokenizer()
  llm.runner = Runner(engine, MockTokenizer())
  text, rgbs = [int(t) for t in np.random.default_rng(6).integers(0, 250, 8)], pictures(2)
  greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
  (out,) = llm.generate({"prompt_token_ids": prompt(text, 2),
                         "multi_modal_data": {"image": [Image.fromarray(p) for p in rgbs]}},
                        greedy)
  (q,) = requests(engine, [(text, rgbs)])
  (ref,) = llm.runner.generate([(q[0], greedy, None, q[3])])
  assert out.token_ids == ref.token_ids and out.prompt_token_ids == tuple(q[0])


def test_plan_compile_compiles_each_encoder_bucket(engine):
  """`plan --compile` lists one encoder program per patch bucket after the steps and compiles
  them for a v5e here."""
  import dataclasses

  from jaxserve.compiling import compile_plan, programs

  cfg, config = engine.model_config, dataclasses.replace(ENGINE, attention_backend=None)
  names = [p.name for p in programs.engine_programs(cfg, config, AttentionBackend.PALLAS_TPU)]
  encoders = [n for n in names if n.startswith(programs.ENCODE)]
  assert encoders == [f"{programs.ENCODE} ({b} patches)" for b in (64, 256)] == names[-2:]
  [report] = compile_plan.compile_programs("v5e", cfg, config, only=encoders[-1])
  assert report["compiled"], report["error"]
