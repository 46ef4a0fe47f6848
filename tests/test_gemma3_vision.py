"""Gemma 3 with images (issue 50): a tiny random Gemma3ForConditionalGeneration built offline by
transformers is the reference. Its soft tokens, the processor's pixels, and greedy tokens with
their logprobs for prompts of one and two images, batched with text-only prompts, chunked, with
no compile after warm-up; the prefix cache keyed by each image's content."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.batching import images as mm
from jaxserve.batching.runner import Runner
from jaxserve.config import AttentionBackend, EngineConfig, SamplingParams, SchedulerConfig
from support import gemma3_vl, hf_tiny
from support.gemma3_vl import pictures
from support.images import hf_engine
from support.mock_engine import MockTokenizer
from support.tiny import count_compiles

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ENGINE = EngineConfig(num_slots=4, page_size=4, num_pages=64, max_model_len=64,
                      prefill_buckets=(16, 32), compilation_cache_dir=None,
                      attention_backend=AttentionBackend.REFERENCE)
IDS = hf_tiny.GEMMA3_IMAGE_IDS
BOI, IMAGE, EOI = IDS["boi_token_index"], IDS["image_token_index"], IDS["eoi_token_index"]
N = IDS["mm_tokens_per_image"]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  hf = hf_tiny.build_gemma3_vision()
  path = tmp_path_factory.mktemp("tiny_gemma3_vision")
  hf.save_pretrained(path)
  return hf, path


@pytest.fixture(scope="module")
def engine(tiny_hf):
  return hf_engine(tiny_hf[1], ENGINE)


def runner(engine, budget: int = 32) -> Runner:
  return Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=budget))


def prompt(text: list[int], num_images: int) -> list[int]:
  """Text, then one boi placeholder per image, each between text tokens."""
  out = list(text[:3])
  for i in range(num_images):
    out += [BOI] + text[3 + 2 * i:5 + 2 * i]
  return out + text[3 + 2 * num_images:]


def reference(hf, ids: list[int], pixels: list[np.ndarray]) -> tuple[list[int], list[float]]:
  return gemma3_vl.reference(hf, ids, pixels, NUM_TOKENS)


def requests(engine, cases):
  """Runner.generate's tuples and the references' inputs: cases of (text ids, images)."""
  vision = engine.model_config.vision
  out = []
  for text, rgbs in cases:
    ids = mm.expand_ids(prompt(text, len(rgbs)), len(rgbs), vision)
    spans = mm.place_images(ids, [mm.Image.of(rgb) for rgb in rgbs], vision)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    out.append(((ids, greedy, None, spans), [s.pixels for s in spans]))
  return out


def test_soft_tokens_match_transformers(tiny_hf, engine):
  pixels = np.random.default_rng(0).normal(size=(1, 3, 28, 28)).astype(np.float32)
  ours = engine.images.soft_tokens(mm.ImageSpan("x", pixels[0], 0, N))
  assert np.abs(ours - hf_tiny.image_features(tiny_hf[0], pixels)[0]).max() < 1e-5


def test_encoder_attention_in_query_blocks_equals_it_whole(monkeypatch):
  from jaxserve.model import siglip

  rng = np.random.default_rng(1)
  q, k, v = (rng.normal(size=(2, 64, 2, 8)).astype(np.float32) for _ in range(3))
  whole = np.asarray(siglip.attention(q, k, v))
  monkeypatch.setattr(siglip, "QUERY_BLOCK", 16)
  assert np.abs(np.asarray(siglip.attention(q, k, v)) - whole).max() < 1e-6


def test_pixels_match_the_pillow_processor():
  """Odd sizes, a grayscale and an RGBA image (converted as the processor converts them)."""
  from PIL import Image

  processor = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
  vision = dataclasses.replace(_vision(), image_size=28)
  rng = np.random.default_rng(3)
  shots = [Image.fromarray(rng.integers(0, 256, (31, 53, 3), dtype=np.uint8)),
           Image.fromarray(rng.integers(0, 256, (64, 9), dtype=np.uint8), "L"),
           Image.fromarray(rng.integers(0, 256, (20, 20, 4), dtype=np.uint8), "RGBA")]
  for shot in shots:
    theirs = processor(shot, return_tensors="np")["pixel_values"][0]
    ours = mm.preprocess(mm.from_pil(shot).pixels, vision)
    assert ours.shape == theirs.shape and np.abs(ours - theirs).max() < 1e-5


def _vision():
  from jaxserve.config import gemma3

  return gemma3.from_hf({"text_config": hf_tiny.GEMMA3, "vision_config": hf_tiny.GEMMA3_VISION,
                         **IDS}).vision


def test_config_reads_the_vision_side_and_round_trips():
  import json

  from jaxserve.config import ModelConfig, gemma3

  cfg = gemma3.from_hf({"text_config": hf_tiny.GEMMA3, "vision_config": hf_tiny.GEMMA3_VISION,
                        **IDS})
  v = cfg.vision
  assert (v.num_patches, v.pool, v.num_image_tokens, v.image_token_id) == (16, 2, 6, IMAGE)
  assert cfg.final_logit_softcapping is None  # transformers' multimodal class caps nothing.
  assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_prompt_expansion_is_the_processors():
  v = _vision()
  assert mm.expand_ids([5, BOI, 6], 1, v) == [5, BOI, *[IMAGE] * N, EOI, 6]
  text = mm.expand_text("Look: <boi> ok", 1, "<boi>", "<img>", "<eoi>", 2)
  assert text == "Look: \n\n<boi><img><img><eoi>\n\n ok"
  with pytest.raises(ValueError, match="placeholders"):
    mm.expand_ids([5, BOI, 6], 2, v)


@pytest.mark.parametrize("budget", [32, 6])
def test_greedy_tokens_and_logprobs_match_transformers(tiny_hf, engine, checked, budget):
  """One prompt of one image, one of two, and a text-only one, batched; zero compiles. With a
  budget of 6 tokens a step, chunks would cut images in two: the scheduler ends a chunk before
  an image instead (batching/chunks.py's chunk_end), so each image's tokens still see their
  whole image, as transformers' do."""
  rng = np.random.default_rng(4)
  text = lambda n: [int(t) for t in rng.integers(0, 250, n)]
  _equal_transformers(tiny_hf[0], checked(runner(engine, budget)), [
      (text(9), pictures(1)), (text(11), pictures(2, seed=1)), (text(7), [])])


@pytest.mark.parametrize("backend", [AttentionBackend.CPU, AttentionBackend.PALLAS],
                         ids=lambda b: b.value)
def test_the_kernels_let_an_images_tokens_see_the_whole_image(tiny_hf, checked, backend):
  """The ragged kernels (C++ on the CPU; Pallas, interpreted here) take each query's attention
  reach, as the jnp backend does: an image's tokens attend both ways among themselves."""
  engine = hf_engine(tiny_hf[1], dataclasses.replace(ENGINE, page_size=8, num_pages=32,
                                                     attention_backend=backend))
  rng = np.random.default_rng(6)
  text = lambda n: [int(t) for t in rng.integers(0, 250, n)]
  _equal_transformers(tiny_hf[0], checked(runner(engine, 16)), [
      (text(9), pictures(1, seed=2)), (text(7), [])])


def _equal_transformers(hf, r: Runner, cases):
  """Greedy tokens equal transformers', logprobs within 1e-3, no compile."""
  reqs = requests(r.engine, cases)
  with count_compiles() as counts:
    outs = r.generate([q for q, _ in reqs])
  assert counts["compile"] == 0, counts
  for out, (q, pixels) in zip(outs, reqs):
    tokens, logprobs = reference(hf, q[0], pixels)
    assert list(out.token_ids) == tokens
    assert np.abs(np.array([lp.logprob for lp in out.logprobs]) - logprobs).max() < 1e-3


def test_prefix_cache_pages_are_keyed_by_the_images(tiny_hf, engine, checked):
  """Same tokens, another image: only the page before the image is shared (4 tokens); the same
  image again: every full page (16). The other image's tokens are transformers' own."""
  text = [int(t) for t in np.random.default_rng(5).integers(0, 250, 14)]
  a, b = pictures(2, seed=7)
  r = checked(runner(engine))
  (first,), (other,), (again,) = (r.generate([q for q, _ in requests(engine, [(text, [rgb])])])
                                  for rgb in (a, b, a))
  assert (first.num_cached_tokens, other.num_cached_tokens, again.num_cached_tokens) == (0, 4, 16)
  (q, pixels), = requests(engine, [(text, [b])])
  assert list(other.token_ids) == reference(tiny_hf[0], q[0], pixels)[0]
  assert again.token_ids == first.token_ids


def test_page_keys_take_image_hashes_and_salts():
  from jaxserve.batching.page_keys import prefix_keys

  ids = list(range(12))
  spans = lambda h: (mm.ImageSpan(h, np.zeros(1), 5, 2),)  # Page 1 only.
  keys = lambda h, salt=None: [k for k, _ in prefix_keys(
      ids, 4, salt, extras=mm.page_extras(spans(h), 4))]
  x, y = keys("x" * 64), keys("y" * 64)
  assert x[0] == y[0] and all(p != q for p, q in zip(x[1:], y[1:]))  # The keys chain.
  assert keys("x" * 64) == x and keys("x" * 64, "tenant")[0] != x[0]
  assert [k for k, _ in prefix_keys(ids, 4)][0] == x[0]  # Text pages keep their keys.


def test_chunks_end_before_an_image_they_would_cut():
  from jaxserve.batching.chunks import chunk_end
  from jaxserve.batching.request import Request

  span = mm.ImageSpan("x", np.zeros(1), 4, 4)  # Positions 4..7.
  req = Request("r", tuple(range(12)), SamplingParams(), 0, 0, images=(span,))
  req.num_prefill_tokens = 12
  assert chunk_end(req, 0, 6, 6) == 4  # Stops before the image.
  assert chunk_end(req, 4, 3, 6) == 4  # Waits for a step with room for all of it.
  assert chunk_end(req, 4, 6, 6) == 10  # Whole, then text.
  assert chunk_end(req, 5, 2, 2) == 7  # Longer than any step: cut.


def test_offline_api_takes_vllms_multi_modal_data(engine):
  """LLM.generate with {"prompt_token_ids", "multi_modal_data": {"image": PIL image}} gives the
  runner's tokens for the same image; a text-only model refuses an image by name."""
  from types import SimpleNamespace

  from PIL import Image

  from jaxserve.batching import mm_prompts
  from jaxserve.llm import LLM

  llm = LLM.__new__(LLM)  # The module's engine, not a second one (its compiles).
  llm.model, llm.tokenizer = SimpleNamespace(cfg=engine.model_config), MockTokenizer()
  llm.runner = runner(engine)
  text, (rgb,) = [int(t) for t in np.random.default_rng(6).integers(0, 250, 8)], pictures(1)
  greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
  (out,) = llm.generate({"prompt_token_ids": prompt(text, 1),
                         "multi_modal_data": {"image": Image.fromarray(rgb)}}, greedy)
  (q, _), = requests(engine, [(text, [rgb])])
  (ref,) = llm.runner.generate([(q[0], greedy, None, q[3])])
  assert out.token_ids == ref.token_ids and out.prompt_token_ids == tuple(q[0])
  with pytest.raises(ValueError, match="'tiny-text' is text-only: it takes no images"):
    mm_prompts.read({"prompt": "hi", "multi_modal_data": {"image": rgb}}, None, "tiny-text",
                    list, str)
  with pytest.raises(ValueError, match="only 'image'"):
    llm.generate({"prompt_token_ids": [1], "multi_modal_data": {"video": rgb}})


def test_a_text_only_engine_refuses_images_by_name():
  """The serving side's door (Runner.new_request) names the problem before anything queues."""
  from support.mock_engine import MockEngine

  span = mm.ImageSpan("x", np.zeros(1), 1, 4)
  r = Runner(MockEngine(), MockTokenizer())
  with pytest.raises(ValueError, match="text-only: it takes no images, and the request has 1"):
    r.new_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2), images=(span,))


def test_plan_compile_compiles_the_encoder_for_a_tpu(engine):
  """`plan --compile` lists the encoder after the steps (a text model's list is unchanged) and
  compiles it for a v5e here, as Engine.warmup compiles it."""
  from jaxserve.compiling import compile_plan, programs

  cfg, config = engine.model_config, dataclasses.replace(ENGINE, attention_backend=None)
  names = [p.name for p in programs.engine_programs(cfg, config, AttentionBackend.PALLAS_TPU)]
  assert names[-1] == programs.ENCODE and names.count(programs.ENCODE) == 1
  [report] = compile_plan.compile_programs("v5e", cfg, config, only=programs.ENCODE)
  assert report["compiled"], report["error"]
