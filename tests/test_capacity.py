"""The capacity planner against arithmetic done by hand, and the published worked example."""

import argparse
import dataclasses
import json

import pytest

from jaxserve.config import ModelConfig
from jaxserve.planning import capacity, plan_cli
from jaxserve.planning.capacity import GIB, KVDtype, WeightDtype

LLAMA2_7B = capacity.KNOWN_MODELS["llama-2-7b"]
SMOLLM2 = capacity.KNOWN_MODELS["smollm2-135m"]
MIB = 2**20


def test_llama2_7b_param_count_is_the_published_6_74b():
  # Per layer: attention 4096 * 128 * (32 + 32 + 32 + 32)   =  67,108,864
  #            MLP 3 * 4096 * 11008                            = 135,266,304
  #            two norms 2 * 4096                              =       8,192
  #            sum                                             = 202,383,360
  # 32 layers = 6,476,267,520; + untied embed and head 2 * 32000 * 4096 = 262,144,000;
  # + final norm 4096 -> 6,738,415,616 (Hugging Face reports 6.74B).
  assert LLAMA2_7B.num_params == 6_738_415_616


def test_known_param_counts():
  # SmolLM2-135M: layer 576*64*(9+9+3+3) + 3*576*1536 + 2*576 = 884,736 + 2,654,208 + 1,152
  # = 3,540,096; * 30 = 106,202,880; + tied embed 49152*576 = 28,311,552; + 576 = 134,515,008.
  assert SMOLLM2.num_params == 134_515_008
  # Llama-3-8B: layer 4096*128*(32+32+8+8) + 3*4096*14336 + 8192 = 41,943,040 + 176,160,768
  # + 8,192 = 218,112,000; * 32 = 6,979,584,000; + 2*128256*4096 = 1,050,673,152; + 4096.
  assert capacity.KNOWN_MODELS["llama-3-8b"].num_params == 8_030_261_248


@pytest.mark.parametrize("dtype, expected", [
    (WeightDtype.FLOAT32, 26_953_662_464),  # 6,738,415,616 * 4
    (WeightDtype.BFLOAT16, 13_476_831_232),  # * 2
    (WeightDtype.FLOAT16, 13_476_831_232),  # * 2
    (WeightDtype.INT8, 7_159_566_592),  # 6,738,415,616 / 32 = 210,575,488 pages * 34 bytes
    (WeightDtype.INT4, 3_790_358_784),  # 210,575,488 pages * 18 bytes
    (WeightDtype.Q4_1, 4_211_509_760),  # 210,575,488 pages * 20 bytes
])
def test_weight_bytes(dtype, expected):
  assert capacity.weight_bytes(LLAMA2_7B, dtype) == expected


def test_weight_bytes_round_up_a_partial_quant_block():
  tiny = ModelConfig(vocab_size=1, dim=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                     hidden_dim=1)
  # Layer 1*1*(1+1+1+1) + 3*1*1 + 2 = 9; + tied embed 1 + final norm 1 = 11 params.
  assert tiny.num_params == 11
  assert capacity.weight_bytes(tiny, WeightDtype.INT4) == 7  # 11 * 18 / 32 = 6.19 -> 7
  assert capacity.weight_bytes(tiny, WeightDtype.FLOAT32) == 44


@pytest.mark.parametrize("name, dtype, expected", [
    ("llama-2-7b", KVDtype.BFLOAT16, 524_288),  # 2 * 32 layers * 32 heads * 128 * 2 B
    ("llama-2-7b", KVDtype.FLOAT32, 1_048_576),  # 2 * 32 * 32 * 128 * 4 B
    ("llama-2-7b", KVDtype.INT8, 264_192),  # 2 * 32 * 32 * (128 * 1 B + 1 B scale exponent)
    ("llama-2-7b", KVDtype.FLOAT8_E4M3, 262_144),  # 2 * 32 * 32 * 128 * 1 B
    ("llama-3-8b", KVDtype.BFLOAT16, 131_072),  # 2 * 32 * 8 * 128 * 2 B
    ("smollm2-135m", KVDtype.BFLOAT16, 23_040),  # 2 * 30 * 3 * 64 * 2 B
])
def test_kv_bytes_per_token(name, dtype, expected):
  assert capacity.kv_bytes_per_token(capacity.KNOWN_MODELS[name], dtype) == expected


@pytest.mark.parametrize("context, page_size, expected", [
    (1024, 16, 23_592_960),  # 64 pages * 16 tokens * 23,040 B
    (1000, 16, 23_224_320),  # ceil(1000 / 16) = 63 pages = 1008 tokens * 23,040 B
    (1000, 128, 23_592_960),  # ceil(1000 / 128) = 8 pages = 1024 tokens * 23,040 B
    (1, 64, 1_474_560),  # one whole page of 64 tokens * 23,040 B for a single token
])
def test_kv_per_conversation_rounds_up_to_whole_blocks(context, page_size, expected):
  got = capacity.kv_bytes_per_conversation(SMOLLM2, context, page_size, KVDtype.BFLOAT16)
  assert got == expected


def test_activation_estimate():
  # Llama-2-7B, a 512-token chunk at 8,192 context, bfloat16:
  # per token 2*4096 + (32+32+32)*128 + 32*128 + 3*11008
  #         = 8,192 + 12,288 + 4,096 + 33,024 = 57,600 values; * 512 * 2 B = 58,982,400
  # scores 32 heads * 512 * 8192 * 4 B = 536,870,912; logits 512 * 32000 * 4 B = 65,536,000.
  got = capacity.activation_bytes(LLAMA2_7B, 512, 8192, WeightDtype.BFLOAT16)
  assert got == 58_982_400 + 536_870_912 + 65_536_000


def test_published_worked_example():
  plan = capacity.plan_capacity(LLAMA2_7B, 80 * GIB, 8192)
  assert plan.kv_bytes_per_conversation == 4 * GIB  # 8192 * 524,288 B = 2**32
  assert plan.weight_bytes == 13_476_831_232
  assert round(plan.weight_bytes / GIB, 1) == 12.6
  assert plan.max_conversations == 16
  # 85,899,345,920 - 13,476,831,232 - 16 * 4,294,967,296 = 3,703,037,952 B = 3.449 GiB
  assert plan.reserve_bytes == 3_703_037_952
  assert round(plan.reserve_bytes / GIB, 1) == 3.4
  assert plan.min_reserve_bytes <= plan.reserve_bytes < plan.kv_bytes_per_conversation


def test_a_17th_conversation_does_not_fit_even_with_no_reserve():
  plan = capacity.plan_capacity(LLAMA2_7B, 80 * GIB, 8192, prefill_tokens=0, overhead_bytes=0)
  assert plan.min_reserve_bytes == 0
  assert plan.max_conversations == 16


def test_minimum_reserve_boundary():
  # With exactly the 3,703,037,952 B left over required, 16 still fit; one byte more and only 15.
  exact = capacity.plan_capacity(LLAMA2_7B, 80 * GIB, 8192, prefill_tokens=0,
                                 overhead_bytes=3_703_037_952)
  assert exact.max_conversations == 16
  over = capacity.plan_capacity(LLAMA2_7B, 80 * GIB, 8192, prefill_tokens=0,
                                overhead_bytes=3_703_037_953)
  assert over.max_conversations == 15
  assert over.reserve_bytes == 3_703_037_952 + 4 * GIB


def test_zero_conversations_fit():
  # SmolLM2 weights 269,030,016 B; one 8192-token conversation 188,743,680 B; 0.25 GiB total.
  plan = capacity.plan_capacity(SMOLLM2, GIB // 4, 8192, prefill_tokens=0, overhead_bytes=0)
  assert plan.max_conversations == 0
  assert "no full-length conversation fits" in plan_cli.format_plan(plan)


def test_num_kv_pages():
  # 90% of 80 GiB = 77,309,411,328; minus weights 13,476,831,232 = 63,832,580,096;
  # a page is 16 * 524,288 = 8,388,608 B; 63,832,580,096 // 8,388,608 = 7,609.
  pages = capacity.num_kv_pages(LLAMA2_7B, 80 * GIB, 0.9, 16, KVDtype.BFLOAT16, 13_476_831_232)
  assert pages == 7609
  # int8 KV with page 32: 32 * 264,192 = 8,454,144 B per page; 63,832,580,096 // that = 7,550.
  assert capacity.num_kv_pages(LLAMA2_7B, 80 * GIB, 0.9, 32, KVDtype.INT8,
                                13_476_831_232) == 7550


def test_num_kv_pages_rejects_what_cannot_work():
  # Room for exactly two 8,388,608 B pages (page 0 is scratch, so two is the least that works).
  weights = 16 * GIB - 2 * 8_388_608
  assert capacity.num_kv_pages(LLAMA2_7B, 16 * GIB, 1.0, 16, KVDtype.BFLOAT16, weights) == 2
  with pytest.raises(ValueError, match="KV cache does not fit"):
    capacity.num_kv_pages(LLAMA2_7B, 16 * GIB, 1.0, 16, KVDtype.BFLOAT16, weights + 1)
  with pytest.raises(ValueError, match="KV cache does not fit"):  # Weights beyond the memory.
    capacity.num_kv_pages(LLAMA2_7B, 8 * GIB, 0.9, 16, KVDtype.BFLOAT16, 13_476_831_232)
  with pytest.raises(ValueError, match="memory_fraction"):
    capacity.num_kv_pages(LLAMA2_7B, 80 * GIB, 1.5, 16, KVDtype.BFLOAT16, 0)


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-8b", "mistral-7b", "smollm2-135m"])
def test_engine_pool_agrees_with_the_plan(name):
  cfg = capacity.KNOWN_MODELS[name]
  plan = capacity.plan_capacity(cfg, 40 * GIB, 4096, kv_dtype=KVDtype.INT8, page_size=32)
  # The engine, handed the planner's weights + minimum reserve, holds as many conversations.
  pages = capacity.num_kv_pages(cfg, 40 * GIB, 1.0, 32, KVDtype.INT8,
                                  plan.weight_bytes + plan.min_reserve_bytes)
  assert pages // capacity.pages_per_conversation(4096, 32) == plan.max_conversations


def _hf_llama2_7b_config():
  # The fields of meta-llama/Llama-2-7b-hf's config.json that matter here.
  return {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
          "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32000,
          "tie_word_embeddings": False}


def test_load_model_config(tmp_path):
  hf = tmp_path / "llama" / "config.json"
  hf.parent.mkdir()
  hf.write_text(json.dumps(_hf_llama2_7b_config()))
  assert capacity.load_model_config(str(hf)) == dataclasses.replace(LLAMA2_7B, name="llama")
  ckpt = tmp_path / "smol"
  ckpt.mkdir()
  (ckpt / "model_config.json").write_text(json.dumps(SMOLLM2.to_dict()))
  assert capacity.load_model_config(str(ckpt)) == SMOLLM2
  assert capacity.load_model_config("Llama-2-7B") is LLAMA2_7B
  with pytest.raises(ValueError, match="known model"):
    capacity.load_model_config(str(tmp_path / "missing"))


def _args(**overrides):
  args = dict(model="llama-2-7b", memory_gib=80.0, context=8192, weight_dtype="bfloat16",
              kv_dtype="bfloat16", page_size=16, prefill_tokens=512, overhead_gib=0.5,
              quantization="none")
  return argparse.Namespace(**{**args, **overrides})


def test_run_plan_prints_the_worked_example(capsys):
  assert plan_cli.run_plan(_args()) == 0
  out = capsys.readouterr().out
  assert "12.55 GiB (bfloat16)" in out  # 13,476,831,232 / 2**30
  assert "512.00 KiB" in out  # 524,288 B per token
  assert "4.00 GiB (8192 tokens in 512 pages of 16)" in out
  assert "16 at 8192 tokens" in out
  assert "3.45 GiB for activations" in out  # 3,703,037,952 / 2**30 = 3.4487
  # 16 conversations of 4 GiB; and the 12.55 GiB of weights.
  assert "sleep frees         64.00 GiB at level 1 (the KV cache), 76.55 GiB at level 2" in out


def test_run_plan_from_a_config_file_matches_the_known_name(tmp_path, capsys):
  hf = tmp_path / "Llama-2-7b-hf" / "config.json"
  hf.parent.mkdir()
  hf.write_text(json.dumps(_hf_llama2_7b_config()))
  assert plan_cli.run_plan(_args(model=str(hf))) == 0
  from_file = capsys.readouterr().out
  plan_cli.run_plan(_args())
  assert from_file.replace("Llama-2-7b-hf", "llama-2-7b") == capsys.readouterr().out


def test_run_plan_when_nothing_fits(capsys):
  assert plan_cli.run_plan(_args(model="llama-2-13b", memory_gib=24.0)) == 1
  out = capsys.readouterr().out
  assert "conversations       0" in out
  assert "no full-length conversation fits" in out


def test_run_plan_rejects_an_unknown_model(capsys):
  assert plan_cli.run_plan(_args(model="gpt-9")) == 1
  assert "neither a known model" in capsys.readouterr().err


def test_plan_subcommand_parses_and_defaults_to_the_models_context(capsys):
  parser = argparse.ArgumentParser(prog="jaxserve")
  plan_cli.add_plan_parser(parser.add_subparsers(dest="command"))
  args = parser.parse_args(["plan", "--model", "smollm2-135m", "--memory-gib", "16",
                            "--kv-dtype", "int8", "--weight-dtype", "q4_1", "--page-size", "32"])
  assert plan_cli.run_plan(args) == 0
  out = capsys.readouterr().out
  # SmolLM2's context is 8192 = 256 pages of 32; int8 KV per token 2 * 30 * 3 * (64 + 1) = 11,700 B.
  assert "(8192 tokens in 256 pages of 32)" in out
  assert "11.43 KiB (int8)" in out  # 11,700 / 1024 = 11.426
  # Q4_1 weights: 134,515,008 / 32 = 4,203,594 pages * 20 B = 84,071,880 B = 80.18 MiB.
  assert "80.18 MiB (q4_1)" in out
  with pytest.raises(SystemExit):
    parser.parse_args(["plan", "--kv-dtype", "int3"])


def test_a_context_shorter_than_the_prefill_chunk_caps_the_chunk():
  # SmolLM2, context 100 < 512 chunk, so the chunk is 100 tokens:
  # per token 2*576 + (9+3+3)*64 + 9*64 + 3*1536 = 1,152 + 960 + 576 + 4,608 = 7,296;
  # * 100 * 2 B = 1,459,200; scores 9 * 100 * 100 * 4 B = 360,000; logits 100 * 49152 * 4 B
  # = 19,660,800; sum 21,480,000.
  plan = capacity.plan_capacity(SMOLLM2, GIB, 100, prefill_tokens=512, overhead_bytes=0)
  assert plan.min_reserve_bytes == 21_480_000


# ---------------------------------------------------------------------------------------------
# Gemma 3: sliding-window (local) layers, and window-only pages.

GEMMA3_270M = capacity.KNOWN_MODELS["gemma-3-270m"]
GEMMA3_4B = capacity.KNOWN_MODELS["gemma-3-4b"]
GEMMA3_12B = capacity.KNOWN_MODELS["gemma-3-12b"]
# google/gemma-3-4b-it's config.json as published: the text model's keys nested, heads left to
# transformers' defaults.
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
    "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_gemma3_param_counts_are_the_published_ones():
  # 270M: layer 640*256*(4+4+1+1) + 3*640*2048 + 4 norms 4*640 + q/k norms 2*256
  #   = 1,638,400 + 3,932,160 + 2,560 + 512 = 5,573,632; * 18 = 100,325,376;
  #   + tied embed 262144*640 = 167,772,160; + 640 -> 268,098,176 (Google: 268M).
  assert GEMMA3_270M.num_params == 268_098_176
  # 4B text: layer 2560*256*(8+8+4+4) + 3*2560*10240 + 4*2560 + 2*256
  #   = 15,728,640 + 78,643,200 + 10,752 = 94,382,592; * 34 = 3,209,008,128 (the report's
  #   3,209M non-embedding); + 262208*2560 = 671,252,480; + 2560 -> 3,880,263,168.
  assert GEMMA3_4B.num_params == 3_880_263_168
  # 12B text: layer 3840*256*48 + 3*3840*15360 + 4*3840 + 2*256 = 47,185,920 + 176,947,200
  #   + 15,872 = 224,148,992; * 48 = 10,759,151,616 (10,759M); + 262208*3840 + 3840.
  assert GEMMA3_12B.num_params == 11_766_034_176


def test_gemma3_known_models_read_their_layer_pattern():
  for cfg, layers, window in ((GEMMA3_270M, 18, 512), (GEMMA3_4B, 34, 1024),
                              (GEMMA3_12B, 48, 1024)):
    assert cfg.local_layers == tuple((i + 1) % 6 != 0 for i in range(layers))
    assert cfg.sliding_window == window
  assert (GEMMA3_4B.num_heads, GEMMA3_4B.num_kv_heads, GEMMA3_4B.head_dim) == (8, 4, 256)
  assert (GEMMA3_12B.num_heads, GEMMA3_12B.num_kv_heads,
          GEMMA3_12B.rope_linear_factor) == (16, 8, 8.0)


def test_window_pages_count_the_page_a_window_straddles():
  # 512 positions from position 1 to 512 touch pages 0..32 of 16: 33; one more than they fill.
  assert capacity.window_pages(GEMMA3_270M, 16) == 33  # 1 + ceil(511 / 16)
  assert capacity.window_pages(GEMMA3_270M, 512) == 2  # 1 + ceil(511 / 512)
  assert capacity.window_pages(GEMMA3_4B, 16) == 65  # 1 + ceil(1023 / 16)
  assert capacity.window_pages(dataclasses.replace(GEMMA3_270M, sliding_window=1), 16) == 1


def test_window_only_pages_by_hand():
  # 270M at 32,768 tokens in pages of 16: 2,048 pages per layer. Today every one of 18 layers
  # keeps them: 36,864 layer-pages; window-only, 3 global * 2,048 + 15 local * 33 = 6,639.
  # One layer's page is 16 tokens * 2 (K, V) * 1 KV head * 256 * 2 B = 16,384 B.
  assert capacity.layer_pages_per_conversation(GEMMA3_270M, 32768, 16) == 36_864
  assert capacity.layer_pages_per_conversation(GEMMA3_270M, 32768, 16, window_only=True) == 6_639
  assert capacity.kv_bytes_per_conversation(
      GEMMA3_270M, 32768, 16, KVDtype.BFLOAT16, window_only=True) == 6_639 * 16_384
  # A context inside the window: a local layer keeps every page, as today (16 pages of 16).
  assert capacity.layer_pages_per_conversation(GEMMA3_270M, 256, 16, window_only=True) == 18 * 16
  # A model without local layers is unchanged.
  assert capacity.kv_bytes_per_conversation(LLAMA2_7B, 8192, 16, KVDtype.BFLOAT16,
                                            window_only=True) == 4 * GIB


def test_num_kv_pages_with_a_window_pool_by_hand():
  """The engine's sizing with window pages: the window pool's bytes come off the top, and a
  page of the main pool holds only the global layers. 270M, bfloat16, pages of 16: one layer's
  page is 16,384 B; 8 GiB, no weights. Every page for all 18 layers: 8,589,934,592 // 294,912
  = 29,127. A window pool of 1 + 16 * 35 = 561 pages * 15 local layers * 16,384 B =
  137,871,360 B; the rest over 3 global layers' 49,152 B pages: 8,452,063,232 // 49,152 =
  171,957."""
  assert capacity.num_kv_pages(GEMMA3_270M, 8 * GIB, 1.0, 16, KVDtype.BFLOAT16, 0) == 29_127
  assert capacity.num_kv_pages(GEMMA3_270M, 8 * GIB, 1.0, 16, KVDtype.BFLOAT16, 0,
                               num_window_pages=561) == 171_957


def test_gemma3_4b_conversations_with_and_without_window_only_pages():
  # 4B at 8,192 tokens on 16 GiB, no reserve: weights 3,880,263,168 * 2 B = 7,760,526,336, so
  # 17,179,869,184 - 7,760,526,336 = 9,419,342,848 B for KV. One layer's page: 16 * 2 * 4 * 256
  # * 2 B = 65,536 B. Today: 34 * 512 pages = 17,408 -> 1,140,850,688 B, 8 conversations
  # (8.26). Window-only: 5 * 512 + 29 * 65 = 4,445 -> 291,307,520 B, 32 conversations (32.3).
  plan = lambda window_only: capacity.plan_capacity(GEMMA3_4B, 16 * GIB, 8192, prefill_tokens=0,
                                                     overhead_bytes=0, window_only=window_only)
  today, windowed = plan(False), plan(True)
  assert today.weight_bytes == 7_760_526_336
  assert (today.kv_bytes_per_conversation, today.max_conversations) == (1_140_850_688, 8)
  assert (windowed.kv_bytes_per_conversation, windowed.max_conversations) == (291_307_520, 32)
  assert windowed.reserve_bytes == 9_419_342_848 - 32 * 291_307_520


def test_gemma3_text_defaults_are_transformers_own():
  transformers = pytest.importorskip("transformers")
  from jaxserve.config import gemma3
  hf = transformers.Gemma3TextConfig().to_dict()
  assert {k: hf[k] for k in gemma3.TEXT_DEFAULTS} == gemma3.TEXT_DEFAULTS


def test_plan_reads_a_multimodal_gemma3_config_as_its_text_model_and_encoder(tmp_path, capsys):
  """The text model is the known 4B's; the vision tower and projector add their weights:
  4,300,079,472 parameters in all, Google's 4.3B (343,142,784 + 27 layers * 2,839,760 more MLP
  than SigLIP's default 3072 = 419,816,304 of them the encoder's). 8,600,158,944 B of bfloat16
  weights leave 8,579,710,240 B on 16 GiB: 7 conversations of 1,140,850,688 B (7.52), 29 of
  291,307,520 B with window pages (29.45)."""
  path = tmp_path / "gemma-3-4b-it" / "config.json"
  path.parent.mkdir()
  path.write_text(json.dumps(GEMMA3_4B_IT))
  cfg = capacity.load_model_config(str(path.parent))
  assert dataclasses.replace(cfg, vision=None) == dataclasses.replace(GEMMA3_4B,
                                                                      name="gemma-3-4b-it")
  assert cfg.num_params == 4_300_079_472
  assert plan_cli.run_plan(_args(model=str(path), memory_gib=16.0, context=8192,
                                 prefill_tokens=0, overhead_gib=0.0)) == 0
  out = capsys.readouterr().out
  assert "conversations       7 at 8192 tokens" in out
  assert "29 of 34 layers are local (1024-token window): each keeps 65 pages" in out
  assert "KV per conversation 277.81 MiB (every layer every page: 1.06 GiB)" in out  # 291,307,520 B
  assert "conversations       29 at 8192 tokens (4.14x)" in out


def test_plan_of_a_model_without_local_layers_prints_no_window_lines(capsys):
  assert plan_cli.run_plan(_args()) == 0
  assert "window-only" not in capsys.readouterr().out


def test_sleep_frees_the_kv_cache_then_the_weights_but_not_the_adapter_slots():
  plan = capacity.plan_capacity(LLAMA2_7B, 80 * GIB, 8192, max_loras=2)
  assert plan.sleep_bytes(1) == plan.max_conversations * plan.kv_bytes_per_conversation > 0
  assert plan.adapter_bytes > 0  # Engine.sleep frees the model's weights, not the adapters'.
  assert plan.sleep_bytes(2) - plan.sleep_bytes(1) == capacity.weight_bytes(
      LLAMA2_7B, capacity.WeightDtype.BFLOAT16)
