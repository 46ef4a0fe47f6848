"""Known public models for the capacity planner, each from its published Hugging Face config.json.

The Gemma 3 entries are read from the config.json keys themselves (`readers.from_hf`, the reader
`jaxserve plan --model config.json` uses): the multimodal 4B and 12B publish only their
`text_config`'s keys that differ from transformers' defaults, and are planned as their text
model (the vision tower, ~0.4B parameters, is left out).
"""

from __future__ import annotations

import types

from jaxserve.config import ModelConfig, RopeScaling, readers

_GEMMA3_LINEAR_8 = {"factor": 8.0, "rope_type": "linear"}

# Known public models, from each one's published Hugging Face config.json.
KNOWN_MODELS = types.MappingProxyType({
    # meta-llama/Llama-2-7b-hf config.json
    "llama-2-7b": ModelConfig(
        vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
        hidden_dim=11008, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
        tie_embeddings=False, name="llama-2-7b"),
    # meta-llama/Llama-2-13b-hf config.json
    "llama-2-13b": ModelConfig(
        vocab_size=32000, dim=5120, num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128,
        hidden_dim=13824, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
        tie_embeddings=False, name="llama-2-13b"),
    # meta-llama/Meta-Llama-3-8B config.json
    "llama-3-8b": ModelConfig(
        vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        hidden_dim=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
        tie_embeddings=False, name="llama-3-8b"),
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        hidden_dim=14336, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_seq_len=131072,
        tie_embeddings=False, name="llama-3.1-8b"),
    # mistralai/Mistral-7B-v0.3 config.json (v0.3: no sliding window, so the KV is full length)
    "mistral-7b": ModelConfig(
        vocab_size=32768, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        hidden_dim=14336, norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768,
        tie_embeddings=False, name="mistral-7b"),
    # Qwen/Qwen2-7B-Instruct config.json
    "qwen2-7b": ModelConfig(
        vocab_size=152064, dim=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        hidden_dim=18944, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
        tie_embeddings=False, qkv_bias=True, name="qwen2-7b"),
    # HuggingFaceTB/SmolLM2-135M config.json
    "smollm2-135m": ModelConfig(
        vocab_size=49152, dim=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        hidden_dim=1536, norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192,
        tie_embeddings=True, name="smollm2-135m"),
    # google/gemma-3-270m config.json (Gemma3ForCausalLM; layer_types: 5 sliding, 1 full, x3)
    "gemma-3-270m": readers.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "_sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": None, "rms_norm_eps": 1e-06}, name="gemma-3-270m"),
    # google/gemma-3-4b-it config.json (Gemma3ForConditionalGeneration): its text_config
    "gemma-3-4b": readers.from_hf({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": _GEMMA3_LINEAR_8,
                        "sliding_window": 1024}}, name="gemma-3-4b"),
    # google/gemma-3-12b-it config.json (Gemma3ForConditionalGeneration): its text_config
    "gemma-3-12b": readers.from_hf({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 3840, "intermediate_size": 15360,
                        "model_type": "gemma3_text",
                        "num_attention_heads": 16, "num_hidden_layers": 48,
                        "num_key_value_heads": 8, "rope_scaling": _GEMMA3_LINEAR_8,
                        "sliding_window": 1024}}, name="gemma-3-12b"),
    # Qwen/Qwen3-8B config.json
    "qwen3-8b": readers.from_hf({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
        "rms_norm_eps": 1e-06, "attention_bias": False, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None}, name="qwen3-8b"),
    # Qwen/Qwen3-30B-A3B config.json (128 experts, 8 a token)
    "qwen3-30b-a3b": readers.from_hf({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-06,
        "attention_bias": False, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None}, name="qwen3-30b-a3b"),
    # mistralai/Mixtral-8x7B-v0.1 config.json (8 experts, 2 a token; no sliding window)
    "mixtral-8x7b": readers.from_hf({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
        "rms_norm_eps": 1e-05, "sliding_window": None, "tie_word_embeddings": False},
        name="mixtral-8x7b"),
})
