"""Qwen2.5-VL's image side against transformers: a tiny random Qwen2_5_VLForConditionalGeneration
built offline is the reference for the vision tower's merged tokens (images spanning several
attention windows, padded to their encoder bucket), Qwen2VLImageProcessorPil for the patches, and
transformers' own names for the checkpoint's split."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxserve.batching import qwen_images
from jaxserve.config import ModelConfig, qwen_vl
from support import qwen_vl as qwen_vl_tiny
from support.qwen_vl import IDS, TEXT, VISION

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def tiny_hf():
  return qwen_vl_tiny.build()


def model_config(vision: qwen_vl.QwenVisionConfig) -> ModelConfig:
  return ModelConfig(vocab_size=256, dim=48, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=24, hidden_dim=64, vision=vision)


def vision_config(**changes) -> qwen_vl.QwenVisionConfig:
  hf = {"vision_config": VISION, **IDS}
  return dataclasses.replace(qwen_vl.from_hf(hf), **changes)


@pytest.fixture(scope="module")
def tower(tiny_hf):
  import jax.numpy as jnp
  from flax import nnx

  from jaxserve.loading import vision_weights
  from jaxserve.loading.qwen_vision_weights import qwen_vision_params
  from jaxserve.model.qwen_vision import QwenVisionTower

  raw = {k: v.numpy() for k, v in tiny_hf.state_dict().items()}
  text, tower_raw, _ = vision_weights.split_names(raw)
  cfg = model_config(vision_config())
  graphdef, state = nnx.split(QwenVisionTower(cfg, jnp.float32, nnx.Rngs(0)))
  nnx.replace_by_pure_dict(state, qwen_vision_params(cfg, tower_raw))
  return nnx.merge(graphdef, state)


def encode(tower, patches, grid):
  """Our merged tokens for one image's patches, padded to its bucket with random rows."""
  v = tower.v
  n = patches.shape[0]
  Pb = v.bucket(n)
  pos, window = qwen_images.patch_layout(grid, v, Pb)
  garbage = np.random.default_rng(9).normal(size=(Pb - n, v.patch_dim)).astype(np.float32)
  out = np.asarray(tower(np.concatenate([patches, garbage]), pos, window))
  assert out.shape == (Pb // v.merge_unit, v.out_dim) and np.isfinite(out).all()
  return out[:qwen_images.num_tokens(grid, v)]


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 10, 22)])
def test_tower_matches_transformers(tiny_hf, tower, grid):
  """(1, 10, 22): 5 x 11 merged tokens, windows of 4 x 4 cut short at the right and bottom."""
  n = grid[1] * grid[2]
  patches = np.random.default_rng(n).normal(size=(n, tower.v.patch_dim)).astype(np.float32)
  with torch.no_grad():
    theirs = tiny_hf.model.visual(torch.from_numpy(patches),
                                  grid_thw=torch.tensor([grid])).pooler_output.numpy()
  assert np.abs(encode(tower, patches, grid) - theirs).max() < 1e-5


def test_attention_in_query_blocks_equals_it_whole(tower, monkeypatch):
  from jaxserve.model import qwen_vision

  grid = (1, 10, 22)
  patches = np.random.default_rng(2).normal(size=(220, tower.v.patch_dim)).astype(np.float32)
  whole = encode(tower, patches, grid)
  monkeypatch.setattr(qwen_vision, "QUERY_BLOCK", 64)
  assert np.abs(encode(tower, patches, grid) - whole).max() < 1e-5  # Summed in other orders.


def test_patches_match_the_pillow_processor():
  """Odd sizes, a grayscale and an RGBA image (converted as the processor converts them), and
  one that max_pixels shrinks."""
  from PIL import Image

  from jaxserve.batching.images import from_pil

  rng = np.random.default_rng(3)
  shots = [Image.fromarray(rng.integers(0, 256, (57, 91, 3), dtype=np.uint8)),
           Image.fromarray(rng.integers(0, 256, (200, 31, 3), dtype=np.uint8)),
           Image.fromarray(rng.integers(0, 256, (64, 90), dtype=np.uint8), "L"),
           Image.fromarray(rng.integers(0, 256, (40, 70, 4), dtype=np.uint8), "RGBA"),
           Image.fromarray(rng.integers(0, 256, (300, 410, 3), dtype=np.uint8))]
  small = 28 * 28 * 20
  for i, shot in enumerate(shots):
    v = vision_config(max_pixels=small) if i == 4 else vision_config()
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=v.min_pixels,
                                                      max_pixels=v.max_pixels)
    theirs = processor(shot, return_tensors="np")
    patches, grid = qwen_images.preprocess(from_pil(shot).pixels, v)
    assert grid == tuple(theirs["image_grid_thw"][0])
    assert patches.shape == theirs["pixel_values"].shape
    assert np.abs(patches - theirs["pixel_values"]).max() < 1e-5
  assert grid[1] * grid[2] * 14 * 14 <= small < 300 * 410


def test_patch_layout_places_patches_and_windows():
  v = vision_config()
  pos, window = qwen_images.patch_layout((1, 10, 22), v, 256)
  assert pos[:4].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]  # One merged token's square.
  assert pos[4].tolist() == [0, 2] and pos[44].tolist() == [2, 0]
  assert window.tolist()[:220:4] == [c // 4 + 3 * (r // 4) for r in range(5) for c in range(11)]
  assert (window[220:] == -1).all() and qwen_images.num_tokens((1, 10, 22), v) == 55
  with pytest.raises(ValueError, match="cannot hold"):
    qwen_images.patch_layout((1, 10, 22), v, 64)


def test_smart_resize_bounds_and_refusals():
  v = vision_config()
  assert qwen_images.smart_resize(57, 91, v) == (56, 84)
  assert qwen_images.smart_resize(10, 10, v) == (56, 56)  # Up to min_pixels.
  h, w = qwen_images.smart_resize(4000, 3000, dataclasses.replace(v, max_pixels=28 * 28 * 100))
  assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 100
  with pytest.raises(ValueError, match="aspect ratio"):
    qwen_images.smart_resize(10, 2010, v)


def test_config_reads_the_vision_side_and_round_trips():
  v = qwen_vl.from_hf({"vision_config": VISION, **IDS},
                      {"size": {"shortest_edge": 100, "longest_edge": 5000},
                       "image_mean": [0.5, 0.5, 0.5], "merge_size": 2})
  assert (v.dim, v.num_layers, v.num_heads, v.hidden_dim, v.out_dim) == (32, 2, 2, 64, 48)
  assert (v.full_layers, v.image_token_id, v.min_pixels, v.max_pixels) == ((1,), 250, 100, 5000)
  assert v.image_mean == (0.5, 0.5, 0.5) and v.image_std == qwen_vl.CLIP_STD
  assert (v.patch_dim, v.merge_unit, v.max_patches) == (1176, 4, 25)
  assert v.buckets == (64,) and v.bucket(30) == 64
  with pytest.raises(ValueError, match="limit of 64"):
    v.bucket(65)
  assert qwen_vl.from_hf({"vision_config": VISION}, {"min_pixels": 7}).min_pixels == 7
  assert vision_config(max_patches=65536).buckets == (64, 256, 1024, 4096, 16384, 65536)
  capped = qwen_vl.from_hf({"vision_config": VISION, **IDS})  # The engine's cap: 5,120 patches.
  assert capped.max_pixels == qwen_vl.MAX_PIXELS and capped.buckets == (64, 256, 1024, 4096, 5120)
  assert qwen_vl.QwenVisionConfig.from_dict(json.loads(json.dumps(v.to_dict()))) == v
  assert qwen_vl.from_hf({"text_config": TEXT}) is None
  with pytest.raises(ValueError, match="activation 'gelu'"):
    qwen_vl.from_hf({"vision_config": {**VISION, "hidden_act": "gelu"}})
  with pytest.raises(ValueError, match="merge_size"):
    qwen_vl.from_hf({"vision_config": VISION}, {"merge_size": 3})


def test_checkpoint_names_split_and_params_count(tiny_hf, tmp_path):
  """transformers' state_dict (`model.visual.*`, `model.language_model.*`) and its saved file
  (`visual.*`, `model.*`) give the same tower and text names; the tower's parameters count."""
  from safetensors.numpy import load_file

  from jaxserve.loading import vision_weights

  tiny_hf.save_pretrained(tmp_path)
  saved = load_file(str(tmp_path / "model.safetensors"))
  live = {k: v.numpy() for k, v in tiny_hf.state_dict().items()}
  (text_a, tower_a, _), (text_b, tower_b, _) = map(vision_weights.split_names, (live, saved))
  assert set(tower_a) == set(tower_b) and set(text_a) == set(text_b)
  assert "model.embed_tokens.weight" in text_a and "patch_embed.proj.weight" in tower_a
  v = vision_config()
  assert sum(w.size for w in tower_a.values()) == v.num_params(v.out_dim)
