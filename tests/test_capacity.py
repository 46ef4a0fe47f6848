"""The capacity planner against arithmetic done by hand, and the published worked example."""

import argparse
import dataclasses
import json

import pytest

from jaxserve.planning import capacity
from jaxserve.planning.capacity import GIB, KVDtype, WeightDtype
from jaxserve.config import ModelConfig

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
    ("llama-2-7b", KVDtype.INT8, 270_336),  # 2 * 32 * 32 * (128 * 1 B + 4 B scale)
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
  assert "no full-length conversation fits" in capacity.format_plan(plan)


def test_num_kv_pages():
  # 90% of 80 GiB = 77,309,411,328; minus weights 13,476,831,232 = 63,832,580,096;
  # a page is 16 * 524,288 = 8,388,608 B; 63,832,580,096 // 8,388,608 = 7,609.
  pages = capacity.num_kv_pages(LLAMA2_7B, 80 * GIB, 0.9, 16, KVDtype.BFLOAT16, 13_476_831_232)
  assert pages == 7609
  # int8 KV with page 32: 32 * 270,336 = 8,650,752 B per page; 63,832,580,096 // that = 7,378.
  assert capacity.num_kv_pages(LLAMA2_7B, 80 * GIB, 0.9, 32, KVDtype.INT8,
                                13_476_831_232) == 7378


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
              kv_dtype="bfloat16", page_size=16, prefill_tokens=512, overhead_gib=0.5)
  return argparse.Namespace(**{**args, **overrides})


def test_run_plan_prints_the_worked_example(capsys):
  assert capacity.run_plan(_args()) == 0
  out = capsys.readouterr().out
  assert "12.55 GiB (bfloat16)" in out  # 13,476,831,232 / 2**30
  assert "512.00 KiB" in out  # 524,288 B per token
  assert "4.00 GiB (8192 tokens in 512 pages of 16)" in out
  assert "16 at 8192 tokens" in out
  assert "3.45 GiB for activations" in out  # 3,703,037,952 / 2**30 = 3.4487


def test_run_plan_from_a_config_file_matches_the_known_name(tmp_path, capsys):
  hf = tmp_path / "Llama-2-7b-hf" / "config.json"
  hf.parent.mkdir()
  hf.write_text(json.dumps(_hf_llama2_7b_config()))
  assert capacity.run_plan(_args(model=str(hf))) == 0
  from_file = capsys.readouterr().out
  capacity.run_plan(_args())
  assert from_file.replace("Llama-2-7b-hf", "llama-2-7b") == capsys.readouterr().out


def test_run_plan_when_nothing_fits(capsys):
  assert capacity.run_plan(_args(model="llama-2-13b", memory_gib=24.0)) == 1
  out = capsys.readouterr().out
  assert "conversations       0" in out
  assert "no full-length conversation fits" in out


def test_run_plan_rejects_an_unknown_model(capsys):
  assert capacity.run_plan(_args(model="gpt-9")) == 1
  assert "neither a known model" in capsys.readouterr().err


def test_plan_subcommand_parses_and_defaults_to_the_models_context(capsys):
  parser = argparse.ArgumentParser(prog="jaxserve")
  capacity.add_plan_parser(parser.add_subparsers(dest="command"))
  args = parser.parse_args(["plan", "--model", "smollm2-135m", "--memory-gib", "16",
                            "--kv-dtype", "int8", "--weight-dtype", "q4_1", "--page-size", "32"])
  assert capacity.run_plan(args) == 0
  out = capsys.readouterr().out
  # SmolLM2's context is 8192 = 256 pages of 32; int8 KV per token 2 * 30 * 3 * (64 + 4) = 12,240 B.
  assert "(8192 tokens in 256 pages of 32)" in out
  assert "11.95 KiB (int8)" in out  # 12,240 / 1024 = 11.953
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
