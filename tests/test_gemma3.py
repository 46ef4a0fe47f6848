"""Gemma 3 against Hugging Face transformers: a tiny random model saved by transformers (fast),
and the packaged Gemma 3 270M GGUF loaded by both (real_model): last-position logits of a raw, a
chat and a longer-than-the-window prompt, and greedy continuations through the engine."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.batching.plan import PrefillChunk
from jaxserve.batching.runner import Runner
from jaxserve.config import (
  AttentionBackend,
  EngineConfig,
  ModelConfig,
  ModelFamily,
  SamplingParams,
  SchedulerConfig,
  readers,
)
from jaxserve.config import gemma3 as gemma3_config
from jaxserve.config.engine import window_pages_per_seq
from jaxserve.engine import kv_spec
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint, pull, weights
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import SCRATCH_PAGE
from support import hf_tiny
from support.engine_calls import decode, prefill
from support.mock_engine import MockTokenizer, assert_all_free
from support.tiny import dense_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY_LAYERS, TINY_HF = hf_tiny.GEMMA3_LAYERS, hf_tiny.GEMMA3


TINY_ENGINE = EngineConfig(num_slots=2, page_size=4, num_pages=40, max_model_len=64,
                           prefill_buckets=(16,), compilation_cache_dir=None,
                           attention_backend=AttentionBackend.REFERENCE)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  """(transformers model, its saved directory): random weights, norms included (they init to 0)."""
  model = hf_tiny.build("Gemma3TextConfig", TINY_HF, norms=(-0.5, 0.5))
  path = tmp_path_factory.mktemp("tiny_gemma3")
  model.save_pretrained(path)
  return model, path


@pytest.fixture(scope="module")
def tiny(tiny_hf):
  cfg, params = weights.load_hf_dir(tiny_hf[1])
  return checkpoint.build_model(cfg, params)


def test_tiny_config_from_transformers_dir(tiny):
  cfg = tiny.cfg
  assert cfg.family is ModelFamily.GEMMA3
  assert cfg.local_layers == tuple(t == "sliding_attention" for t in TINY_LAYERS)
  assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta, cfg.rope_linear_factor) == (
      8, 1e6, 1e4, 2.0)
  assert (cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (24, 3.0)
  params = nnx.to_pure_dict(nnx.state(tiny))
  assert cfg.tie_embeddings and "lm_head" not in params
  assert cfg.num_params == sum(x.size for x in jax.tree.leaves(params))  # The planner's count.


def test_tiny_logits_match_transformers_at_every_position(tiny, tiny_hf):
  """40 tokens over pages of 4: positions past the 8-token window see only their window."""
  hf_tiny.assert_logits_match(tiny_hf[0], tiny)


def test_tiny_chunked_prefill_and_decode_match_transformers(tiny, tiny_hf):
  """The engine's own steps: a 21-token prompt in chunks of 16 and 5, then 12 decode steps
  (positions 21..32, far past the window), greedy, against transformers' greedy argmax."""
  engine = Engine(tiny, dataclasses.replace(TINY_ENGINE, window_pages=False))  # Tables by hand.
  prompt = [int(i) for i in np.random.default_rng(1).integers(0, 256, 21)]
  table = list(range(1, 17))
  greedy = SamplingParams(temperature=0)
  for start, end in ((0, 16), (16, 21)):
    future = prefill(engine, PrefillChunk("r", 0, prompt[start:end], start, table, end == 21,
                                         greedy, 0, prompt_token_ids=prompt))
  ours = [int(future.result()[0])]
  for _ in range(11):
    ours.append(int(decode(engine, [0], np.array([table], np.int32)).result()[0]))
  assert ours == hf_tiny.argmax_tokens(tiny_hf[0], prompt, 12)


def test_config_in_transformers_4_spelling():
  """A config.json as transformers 4 wrote Gemma 3 text models (google/gemma-3-1b-it's keys)."""
  hf = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "rope_scaling": None, "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "final_logit_softcapping": None, "attn_logit_softcapping": None}
  assert readers.from_hf(hf).family is ModelFamily.GEMMA3
  cfg = readers.from_hf(hf)
  assert cfg.local_layers == tuple((i + 1) % 6 != 0 for i in range(26))
  assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_linear_factor) == (1e6, 1e4, None)
  scaled = readers.from_hf({**hf, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
  assert scaled.rope_linear_factor == 8.0
  assert ModelConfig.from_dict(json.loads(json.dumps(scaled.to_dict()))) == scaled


def test_gguf_pattern_key_as_period_or_flags():
  meta = {"gemma3.block_count": 4, "gemma3.attention.head_count": 2, "gemma3.embedding_length": 32,
          "gemma3.feed_forward_length": 64, "gemma3.attention.sliding_window": 16,
          "tokenizer.ggml.tokens": ["a"] * 10}
  assert gemma3_config.from_gguf(meta, False).local_layers == (True,) * 4  # llama.cpp's period 6
  assert gemma3_config.from_gguf({**meta, "gemma3.attention.sliding_window_pattern": 2},
                                 False).local_layers == (True, False, True, False)
  flags = [False, True, True, False]
  assert gemma3_config.from_gguf({**meta, "gemma3.attention.sliding_window_pattern": flags},
                                 False).local_layers == tuple(flags)


@pytest.mark.parametrize("backend, page_size", [(AttentionBackend.REFERENCE, 4),
                                                (AttentionBackend.PALLAS, 8)])  # TPU tiles: 8.
def test_tiny_window_pages_through_the_scheduler_match_transformers(tiny, tiny_hf, checked, backend,
                                                                   page_size):
  """Window pages (the default): the local layers' KV lives in a pool of its own, holding only
  the pages their 8-token window still sees. Three prompts batched, one of 45 tokens prefilled
  in chunks of 16, then decoding far past the window: transformers' greedy tokens, and both
  pools all free afterwards. With the jnp attention and with the ragged kernel (interpret mode
  on CPU), which reads the window pool through the window tables."""
  engine = Engine(tiny, dataclasses.replace(TINY_ENGINE, attention_backend=backend,
                                            page_size=page_size))
  assert len(engine.cache.groups) == 2
  full, window = engine.cache.groups
  # 2 slots * 7 pages of 4 (8 - 1 + 16 positions span up to 7), not 2 * 16; of 8: 2 * 4, not 2 * 8.
  per_seq = window_pages_per_seq(8, page_size, 16)
  assert window.num_pages == 1 + 2 * per_seq and per_seq < 64 // page_size
  assert full.k.shape[0] == 1 and window.k.shape[0] == 3  # Layers.
  runner = checked(Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16)))
  rng = np.random.default_rng(2)
  prompts = [[int(i) for i in rng.integers(0, 256, n)] for n in (45, 6, 19)]
  results = runner.generate([(p, SamplingParams(temperature=0, max_tokens=8)) for p in prompts])
  for prompt, result in zip(prompts, results):
    assert list(result.token_ids) == hf_tiny.argmax_tokens(tiny_hf[0], prompt, 8)


# ---------------------------------------------------------------------------------------------
# The packaged Gemma 3 270M (Q4_K_M GGUF): transformers dequantizes the same file.

RAW = "What is a mortgage rate? A mortgage rate is"
CHAT = [{"role": "user", "content": "What is a mortgage rate?"}]
COLORS = ("red", "blue", "green", "amber", "violet", "silver", "teal")
# Varied lines, so the continuation has to read back past the 512-token window to the pattern.
LONG = " ".join(f"Box {i} is {COLORS[i % 7]} and holds {(i * 7) % 13} apples." for i in range(130))
REAL_ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=400, max_model_len=2048,
                           prefill_buckets=(64, 512), compilation_cache_dir=None,
                           attention_backend=AttentionBackend.REFERENCE, quantization="gguf")
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path():
  return pull.gguf_path(pull.GEMMA3)


@pytest.fixture(scope="module")
def llm(gguf_path):
  from jaxserve.llm import LLM
  return LLM(str(gguf_path), engine_config=REAL_ENGINE, warmup=False)


@pytest.fixture(scope="module")
def prompts(llm):
  tok = llm.tokenizer
  return {"raw": tok.encode(RAW), "chat": tok.encode(tok.apply_chat_template(CHAT), add_bos=False),
          "long": tok.encode(LONG)}


@pytest.fixture(scope="module")
def reference(gguf_path, prompts, llm):
  """transformers' last-position logits and greedy continuations, computed once."""
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
  out = {}
  with torch.no_grad():
    for kind, ids in prompts.items():
      # The raw logits of the first step are the prompt's last-position logits.
      greedy = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False,
                           pad_token_id=0, eos_token_id=sorted(llm.tokenizer.stop_ids),
                           output_logits=True, return_dict_in_generate=True)
      out[kind] = (greedy.logits[0][0].numpy(), greedy.sequences[0, len(ids):].tolist())
  return out


def chunked_last_logits(model, ids, chunk: int, page_size: int):
  """[V] logits after `ids`, prefilled `chunk` tokens at a time into a paged cache with window
  pages, with the metadata an engine step builds: each chunk attends to the pages of the ones
  before it, and the local layers' window table holds only the pages its window can see. A page
  that falls out of the window goes back to a free list that the next chunk takes from first, so
  a long prompt's local layers overwrite the pages they freed (as the scheduler's would)."""
  pages = REAL_ENGINE.max_model_len // page_size  # The same shapes for every prompt: one compile.
  engine = EngineConfig(num_slots=1, page_size=page_size, num_pages=pages + 1,
                        max_model_len=pages * page_size, prefill_buckets=(chunk,))
  cache = kv_spec.create(model.cfg, engine)
  assert len(cache.groups) == 2
  window, Z = model.cfg.sliding_window, page_size
  free, held = list(range(cache.groups[1].num_pages - 1, 0, -1)), {}  # pool page by table index
  for start in range(0, len(ids), chunk):
    piece = ids[start:start + chunk]
    first, last = max(0, start - window + 1) // Z, (start + len(piece) - 1) // Z
    for i in [i for i in held if i < first]:
      free.append(held.pop(i))
    for i in range(first, last + 1):
      if i not in held:
        assert free, "the window pool holds a window plus a chunk"
        held[i] = free.pop()
    table = np.zeros(2 * pages, np.int32)
    table[:pages] = np.arange(1, pages + 1)
    table[pages + np.array(list(held))] = list(held.values())
    tokens = jnp.asarray(piece + [0] * (chunk - len(piece)), jnp.int32)
    logits, cache = _chunk(model, tokens, cache, jnp.asarray(table), jnp.int32(start),
                           jnp.int32(len(piece)))
  return np.asarray(logits[0])


@nnx.jit
def _chunk(model, tokens, cache, table, start, n):
  """table [2W]: the page table, then the window table."""
  T, Z, W = tokens.shape[0], cache.page_size, table.shape[0] // 2
  positions = start + jnp.arange(T, dtype=jnp.int32)
  column = jnp.minimum(positions // Z, W - 1)
  page = jnp.stack([table[column], table[W + column]])  # [2, T]
  page = jnp.where(jnp.arange(T) < n, page, SCRATCH_PAGE)  # Padding writes to the scratch page.
  rows = jnp.arange(T, dtype=jnp.int32)
  meta = AttentionMetadata(positions=positions[None], cache_index=page * Z + positions % Z,
                           page_tables=table[None], kv_lens=(start + n)[None],
                           cu_q_lens=jnp.stack([0, n]).astype(jnp.int32), sample_rows=(n - 1)[None],
                           block_rows=jnp.where(rows < n, rows, T)[None],
                           block_seq=jnp.zeros(1, jnp.int32))
  return model(tokens[None], cache, meta)


@pytest.mark.real_model
def test_real_config_matches_transformers(llm, prompts):
  cfg = llm.model.cfg
  assert (cfg.family, cfg.sliding_window, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (
      ModelFamily.GEMMA3, 512, 1e4, 256)
  assert cfg.local_layers == gemma3_config.pattern_layers(18, 6)
  assert 1500 <= len(prompts["long"]) <= REAL_ENGINE.max_model_len - NUM_TOKENS


@pytest.mark.real_model
def test_real_chat_prompt_is_gemma_turns(llm, prompts):
  tok = llm.tokenizer
  assert tok.apply_chat_template(CHAT) == (
      "<bos><start_of_turn>user\nWhat is a mortgage rate?<end_of_turn>\n<start_of_turn>model\n")
  assert prompts["chat"][0] == tok.bos_id and tok.token_to_id("<end_of_turn>") in tok.stop_ids


@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["raw", "chat", "long"])
def test_real_last_position_logits_match_transformers(llm, prompts, reference, kind):
  ours = chunked_last_logits(llm.model, prompts[kind], chunk=512, page_size=16)
  assert np.abs(ours - reference[kind][0]).max() < 1e-3


@pytest.mark.real_model
def test_real_greedy_continuations_match_transformers(llm, prompts, reference):
  """32 greedy tokens for all three prompts, batched through the scheduler (the long one in
  chunks of 512)."""
  kinds = ("raw", "chat", "long")
  greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
  outs = llm.generate([prompts[k] for k in kinds], greedy)
  for kind, out in zip(kinds, outs):
    assert list(out.token_ids) == reference[kind][1], kind
  # The local layers kept only their window's pages, and gave every one back.
  scheduler = llm.runner.scheduler
  assert len(llm.engine.cache.groups) == 2 and scheduler.pools.window == 512
  assert_all_free(scheduler)
  # Again: the prefix cache serves the long prompt's pages, the window pool its last window.
  again = llm.generate([prompts["long"]], greedy)[0]
  assert again.num_cached_tokens >= len(prompts["long"]) - 2 * REAL_ENGINE.page_size
  assert list(again.token_ids) == reference["long"][1]
  assert_all_free(scheduler)


@pytest.mark.real_model
def test_checkpoint_round_trip(tiny, llm, tmp_path):
  """Our checkpoint format keeps the family, the layer pattern and the Gemma turn template."""
  checkpoint.save(tmp_path / "g", tiny.cfg, nnx.to_pure_dict(nnx.state(tiny)), llm.tokenizer)
  cfg, params, tokenizer = checkpoint.restore(tmp_path / "g")
  assert cfg == tiny.cfg and tokenizer.chat_template == llm.tokenizer.chat_template
  ids = list(range(3, 43))
  restored = checkpoint.build_model(cfg, params)
  assert np.array_equal(dense_logits(restored, ids, 4), dense_logits(tiny, ids, 4))


@pytest.mark.real_model
def test_real_gguf_blocks_give_the_float_models_logits(llm, gguf_path, prompts):
  """--quantization gguf serves the Q4_K_M file's own blocks (Q4_K and Q6_K ffn_down layers in one
  array, Q5_0 and Q8_0 attn_v, the Q8_0 embedding as the tied head): the logits are the float32
  dequantized model's within 1e-4."""
  from jaxserve.config import Quantization
  from jaxserve.model import quant

  assert isinstance(llm.model.layers.w_down, quant.Quantized)
  assert isinstance(llm.model.embed, quant.Quantized)
  dense, _ = checkpoint.load_model(str(gguf_path), quantization=Quantization.NONE)
  for kind in ("raw", "chat"):
    ours = chunked_last_logits(llm.model, prompts[kind], chunk=512, page_size=16)
    ref = chunked_last_logits(dense, prompts[kind], chunk=512, page_size=16)
    assert np.abs(ours - ref).max() < 1e-4, kind
