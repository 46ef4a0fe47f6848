"""`python -m scripts.bench images`: the vision encoder's seconds per image, and the TTFT of an
image chat (one image and 32 text tokens) beside a text chat of the same number of prompt tokens.

Random transformers models (torch.manual_seed(0)), built once in --work-dir:
  gemma3      google/gemma-3-4b-it's SigLIP tower (27 layers, 1152 wide, 896 pixels a side, 256
              soft tokens), Gemma 3 270M's text model (18 layers, 640 wide, vocabulary 262,208)
  qwen2.5-vl  Qwen2.5-VL-3B-Instruct's vision tower (32 layers, 1280 wide, windows of 112 pixels),
              Qwen2.5-0.5B's text model (24 layers, 896 wide, head dim 64, so M-RoPE's sections
              are the 3B's [16, 24, 24] halved: [8, 12, 12]); images 448 x 448 (1024 patches,
              256 tokens)
Each side (image, text) of each family runs in a fresh process, rounds interleaved, the median
round kept. In a process, after Engine.warmup and one untimed request of its kind: the image
side times `engine.images.soft_tokens` on --images new random images (distinct hashes: nothing
comes from the kept encodings; the median is the figure), then one request; each request is
Runner.generate of one prompt with max_tokens 1, timed from the call to its first token (the
image's preprocessing, resize and normalize, is done before). The timed request's text tokens and
image are new, so neither the prefix cache nor the kept encodings serve any of it (the untimed
one reuses an image the encoder timing encoded, to spare an encode). float32, the default
attention backend.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import time

import numpy as np

from . import harness

FAMILIES = ("gemma3", "qwen2.5-vl")
SIDES = ("image", "text")
TEXT_TOKENS = 32  # Of the image chat; the text chat has as many prompt tokens in all.
QWEN_PIXELS = 448  # A side: 32 x 32 patches of 14, merged 2 x 2 into 256 tokens.
GEMMA3_IDS = dict(mm_tokens_per_image=256, boi_token_index=255_999, image_token_index=262_144,
                  eoi_token_index=256_000)
GEMMA3_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                     num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False)
GEMMA3_TEXT = dict(
    vocab_size=262_208, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
    query_pre_attn_scalar=256, max_position_embeddings=32_768,
    layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                 for i in range(18)],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
QWEN_IDS = dict(image_token_id=151_655, vision_start_token_id=151_652, vision_end_token_id=151_653)
QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                   window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                   fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=896)
QWEN_TEXT = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 max_position_embeddings=32_768, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                                  "rope_theta": 1e6})
# --smoke: the same widths and vocabularies, two layers each (a quick check of the command).
SMOKE = {"gemma3": ({"num_hidden_layers": 2}, {"num_hidden_layers": 2,
                                               "layer_types": ["sliding_attention",
                                                               "full_attention"]}),
         "qwen2.5-vl": ({"depth": 2, "fullatt_block_indexes": [1]}, {"num_hidden_layers": 2})}


def _parser():
  p = harness.parser("images", __doc__)
  p.add_argument("--family", choices=(*FAMILIES, "both"), default="both")
  p.add_argument("--work-dir", default="/tmp/jaxserve-bench-images")
  p.add_argument("--images", type=int, default=3, help="images the encoder's median is over")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--smoke", action="store_true", help="two layers a tower (checks the command)")
  p.add_argument("--side", choices=SIDES, default=None, help="(internal) run one side")
  p.add_argument("--seed", type=int, default=0, help="(internal) the round's tokens and images")
  return p


def _folder(args, family: str) -> pathlib.Path:
  return pathlib.Path(args.work_dir) / (family + ("-smoke" if args.smoke else ""))


def _build(args, family: str) -> pathlib.Path:
  """The family's random model saved as a Hugging Face folder (once)."""
  path = _folder(args, family)
  if (path / "config.json").exists():
    return path
  import torch
  import transformers

  vision, text = ((GEMMA3_VISION, GEMMA3_TEXT) if family == "gemma3"
                  else (QWEN_VISION, QWEN_TEXT))
  if args.smoke:
    vision, text = ({**vision, **SMOKE[family][0]}, {**text, **SMOKE[family][1]})
  torch.manual_seed(0)
  if family == "gemma3":
    config = transformers.Gemma3Config(vision_config=vision, text_config=text, **GEMMA3_IDS)
    hf = transformers.Gemma3ForConditionalGeneration(config)
  else:
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text,
                                           tie_word_embeddings=True, **QWEN_IDS)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(config)
  hf.save_pretrained(path)
  if family == "qwen2.5-vl":
    processor = {"min_pixels": 3136, "max_pixels": QWEN_PIXELS ** 2}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
  return path


class _Tokenizer:
  """What Runner needs of a tokenizer for token-id prompts: no stop ids, no text."""
  stop_ids = frozenset()

  def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
    return ""


def _engine(path: pathlib.Path):
  from jaxserve.config import EngineConfig
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint, weights

  cfg, params = weights.load_hf_dir(path)
  config = EngineConfig(num_slots=2, page_size=16, num_pages=2 * 1024 // 16 + 1,
                        max_model_len=1024, prefill_buckets=(64, 256, 512), max_prefill_seqs=2)
  engine = Engine(checkpoint.build_model(cfg, params), config)
  engine.warmup()
  return engine


def _picture(vision, rng) -> np.ndarray:
  side = getattr(vision, "image_size", QWEN_PIXELS)
  return rng.integers(0, 256, (side, side, 3), dtype=np.uint8)


def _image_prompt(vision, rng) -> tuple[list[int], tuple]:
  """An image between two halves of TEXT_TOKENS random text tokens: (ids, the image's span)."""
  from jaxserve.batching import images as mm
  from jaxserve.batching import mm_prompts

  text = rng.integers(1000, 100_000, TEXT_TOKENS).tolist()
  marker = ([vision.boi_token_id, vision.image_token_id, vision.eoi_token_id]
            if hasattr(vision, "merge_size") else [vision.boi_token_id])
  half = TEXT_TOKENS // 2
  image = [mm.Image.of(_picture(vision, rng))]
  ids = mm_prompts.expand_ids(text[:half] + marker + text[half:], image, vision)
  return ids, mm_prompts.place_images(ids, image, vision)


def _ttft(runner, ids, spans) -> float:
  from jaxserve.config import SamplingParams

  sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
  start = time.perf_counter()
  (out,) = runner.generate([(ids, sampling, None, spans)])
  seconds = time.perf_counter() - start
  assert len(out.token_ids) == 1, out
  return seconds


def _encoder_seconds(engine, vision, rng, n: int) -> tuple[float, object]:
  """The median seconds of soft_tokens over n new images (Engine.warmup ran the encoder once
  already), and the last image's span."""
  spans = [_image_prompt(vision, rng)[1][0] for _ in range(n)]
  times = []
  for span in spans:
    start = time.perf_counter()
    engine.images.soft_tokens(span)
    times.append(time.perf_counter() - start)
  return statistics.median(times), spans[-1]


def side(args) -> dict:
  from jaxserve.batching.runner import Runner
  from jaxserve.config import SchedulerConfig

  engine = _engine(_folder(args, args.family))
  vision = engine.model_config.vision
  rng = np.random.default_rng(args.seed)
  runner = Runner(engine, _Tokenizer(), SchedulerConfig(max_num_batched_tokens=512))
  out = {"side": args.side, "load_avg": os.getloadavg()[0]}
  if args.side == "image":
    out["encoder_s"], kept = _encoder_seconds(engine, vision, rng, args.images)
    # The untimed request's image is one encoded just now (a Gemma 3 image is minutes on 2
    # cores), its text new; the timed one's text and image are both new.
    ids, (span,) = _image_prompt(vision, rng)
    kept = dataclasses.replace(span, hash=kept.hash, pixels=kept.pixels)
    prompts = [(ids, (kept,)), _image_prompt(vision, rng)]
  else:
    n = len(_image_prompt(vision, rng)[0])
    prompts = [(rng.integers(1000, 100_000, n).tolist(), ()) for _ in range(2)]
  _ttft(runner, *prompts[0])  # Untimed: first touch of this request's path.
  out["ttft_s"], out["tokens"] = _ttft(runner, *prompts[1]), len(prompts[1][0])
  return out


def _family(args, family: str) -> dict:
  """The family's rounds, each side in a fresh process: {side: the median round's result}, the
  image side's encoder_s the median over the rounds' medians."""
  _build(args, family)
  seeds = iter(range(1, 10 ** 6))  # A new seed a process: new tokens and images each round.
  flags = ["--family", family, "--work-dir", args.work_dir, "--images", str(args.images),
           *(["--smoke"] if args.smoke else [])]
  run = lambda s: harness.fresh("images", flags + ["--side", s, "--seed", str(next(seeds))])
  rounds = harness.interleaved(SIDES, args.rounds, run, reverse_odd=True)
  out = {s: harness.median_item(rounds[s], key=lambda r: r["ttft_s"]) for s in SIDES}
  out["encoder_s"] = statistics.median(r["encoder_s"] for r in rounds["image"])
  return out


def main(argv) -> int:
  args = _parser().parse_args(argv)
  if args.side:
    print(json.dumps(side(args)), flush=True)
    return 0
  families = FAMILIES if args.family == "both" else (args.family,)
  results = {f: _family(args, f) for f in families}
  print("| family | encoder s/image | image-chat TTFT s | text-chat TTFT s | difference s "
        "| prompt tokens |")
  print("|---|---|---|---|---|---|")
  for f, r in results.items():
    image, text = r["image"], r["text"]
    print(f"| {f} | {r['encoder_s']:.3f} | {image['ttft_s']:.3f} | {text['ttft_s']:.3f} "
          f"| {image['ttft_s'] - text['ttft_s']:+.3f} | {image['tokens']} |")
  return 0


COMMANDS = {"images": main}
