"""Our tokenizers against an independent implementation: transformers reading the same GGUF.

SmolLM2-135M-Instruct has a byte-level BPE (`gpt2`) vocab, Gemma 3 270M a SentencePiece (`llama`)
vocab of 262144 pieces with byte fallback. transformers rebuilds both from the GGUF on its own, so
agreeing ids, decodes and special ids check our GGUF reading, pre-tokenizers and proto rebuild.
"""

import json
import logging

import gguf
import numpy as np
import pytest

from jaxserve.gguf_metadata import read_gguf_metadata
from jaxserve.loading import pull
from jaxserve.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }",
    "Emoji: 😀👍🏽 🇫🇷 👨‍👩‍👧",
    "日本語のテキストと中文字符",
    "한국어 텍스트",
    "   leading and trailing spaces   ",
    "tabs\tand\n\nnewlines\r\n  indented\n\n\n",
    "Numbers: 1234567890, 3.14159, -42, 2024-11-30",
    "Ünïcödé àccents naïve café",
    "Mixed: Привет мир, مرحبا بالعالم, שלום",
    "I'm sure you'll see they've DONE it",
    "x=(alpha)+'beta';\n\n  \n IT'S .hidden\r\n\r\nend",  # Where pre-tokenizer regexes differ.
    "a",
    " ",
]
SMOL_SPECIAL = ["<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
                "text<|endoftext|>more"]
GEMMA_SPECIAL = ["<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
                 "<bos>text<eos>"]


def _hf_tokenizer(model):
  path = pull.gguf_path(model)
  logging.getLogger("transformers").setLevel(logging.ERROR)
  return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_smol():
  return _hf_tokenizer(pull.SMOLLM2)


@pytest.fixture(scope="module")
def hf_gemma():
  return _hf_tokenizer(pull.GEMMA3)


@pytest.fixture(params=["smollm2", "gemma3"])
def pair(request, smol, hf_smol):
  """(ours, transformers', texts with special tokens) for one model."""
  if request.param == "smollm2":
    return smol, hf_smol, SMOL_SPECIAL
  return (request.getfixturevalue("gemma"), request.getfixturevalue("hf_gemma"), GEMMA_SPECIAL)


def test_gguf_metadata_reader_matches_gguf_package():
  path = pull.gguf_path(pull.SMOLLM2)
  ours = read_gguf_metadata(path)
  reader = gguf.GGUFReader(path)
  keys = [k for k in reader.fields if not k.startswith("GGUF.")]
  assert sorted(ours) == sorted(keys)
  for key in keys:
    expected = reader.fields[key].contents()
    got = ours[key]
    if isinstance(got, np.ndarray):
      np.testing.assert_array_equal(got, np.asarray(expected), err_msg=key)
    else:
      assert got == expected, key


def test_encode_matches_transformers(pair):
  ours, hf, special = pair
  for text in TEXTS + special:
    assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False), text
    # With the metadata's add_bos: Gemma gets <bos>, SmolLM2 gets nothing.
    assert ours.encode(text) == hf.encode(text), text


def test_decode_round_trips_and_matches_transformers(pair):
  ours, hf, special = pair
  for text in TEXTS:
    assert ours.detokenize(ours.encode(text)) == text
  for text in special:
    ids = ours.encode(text)
    assert ours.detokenize(ids, skip_special_tokens=False) == hf.decode(ids)
    assert ours.detokenize(ids) == hf.decode(ids, skip_special_tokens=True)


def test_decode_random_ids_matches_transformers(pair):
  """Random ids include partial UTF-8 bytes, control and unused tokens."""
  ours, hf, _ = pair
  rng = np.random.default_rng(0)
  for _ in range(30):
    ids = rng.integers(0, ours.vocab_size, size=12).tolist()
    assert ours.detokenize(ids, skip_special_tokens=False) == hf.decode(ids), ids
    assert ours.detokenize(ids) == hf.decode(ids, skip_special_tokens=True), ids


def test_ids_past_the_vocab_decode_to_nothing(smol, gemma):
  # A model's embedding may have padding rows past the tokenizer's vocab.
  for tok in (smol, gemma):
    assert tok.detokenize([tok.vocab_size + 3] + tok.encode("Hello", add_bos=False)) == "Hello"


def test_vocab_matches_transformers(pair):
  ours, hf, _ = pair
  assert ours.vocab_size == len(hf)
  sample = np.random.default_rng(1).integers(0, ours.vocab_size, size=300).tolist()
  for token_id, token in zip(sample, hf.convert_ids_to_tokens(sample)):
    assert ours.token_to_id(token) == token_id, token


def test_special_ids_match_transformers(pair):
  ours, hf, _ = pair
  assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id)


def test_smollm2_metadata(smol, hf_smol):
  assert not smol.add_bos
  # eos is <|im_end|>; <|endoftext|> also ends generation (the base model's end of document).
  assert smol.stop_ids == set(hf_smol.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
  assert smol.vocab_size == 49152


def test_gemma3_metadata(gemma, hf_gemma):
  assert gemma.add_bos
  assert gemma.stop_ids == set(hf_gemma.convert_tokens_to_ids(["<eos>", "<end_of_turn>"]))
  assert gemma.vocab_size == 262144
  # Chat markers are single ids, as the model was trained on them.
  for marker in ("<start_of_turn>", "<end_of_turn>"):
    assert gemma.encode(marker, add_bos=False) == [hf_gemma.convert_tokens_to_ids(marker)]


def test_gemma3_gguf_without_template_gets_gemma_turns(gemma, tmp_path):
  """The GGUF has no tokenizer.chat_template: its turn markers pick Gemma's built-in format
  (written out by hand from Gemma's documented turns); a template in the files wins."""
  messages = [{"role": "system", "content": "You are a pirate. "},
              {"role": "user", "content": " Where is the gold?"},
              {"role": "assistant", "content": "Buried."}, {"role": "user", "content": "Where?"}]
  assert gemma.apply_chat_template(messages) == (
      "<bos><start_of_turn>user\nYou are a pirate.\n\nWhere is the gold?<end_of_turn>\n"
      "<start_of_turn>model\nBuried.<end_of_turn>\n<start_of_turn>user\nWhere?<end_of_turn>\n"
      "<start_of_turn>model\n")
  assert gemma.apply_chat_template(messages[1:2], add_generation_prompt=False) == (
      "<bos><start_of_turn>user\nWhere is the gold?<end_of_turn>\n")
  gemma.save(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                             "chat_template": "{{ 'x' }}"}))
  assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(messages) == "x"


def test_no_fallback_template_without_turn_markers(smol, tmp_path):
  smol.save(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
  assert Tokenizer.from_hf_dir(tmp_path).chat_template is None


def test_smollm2_chat_template_by_hand(smol):
  # Written out from the template text in the GGUF (ChatML, default system prompt if none).
  messages = [{"role": "system", "content": "You are a pirate."},
              {"role": "user", "content": "Where is the gold?"}]
  assert smol.apply_chat_template(messages) == (
      "<|im_start|>system\nYou are a pirate.<|im_end|>\n"
      "<|im_start|>user\nWhere is the gold?<|im_end|>\n"
      "<|im_start|>assistant\n")
  assert smol.apply_chat_template(messages[1:], add_generation_prompt=False) == (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n<|im_start|>user\nWhere is the gold?<|im_end|>\n")


def test_chat_template_rejects_bad_messages(smol):
  with pytest.raises(ValueError, match="role"):
    smol.apply_chat_template([{"role": "wizard", "content": "Hi"}])
  with pytest.raises(ValueError, match="content"):
    smol.apply_chat_template([{"role": "user"}])
  with pytest.raises(ValueError, match="non-empty"):
    smol.apply_chat_template([])


def test_chat_template_from_config_and_raise_exception(smol, tmp_path):
  smol.save(tmp_path)
  config_path = tmp_path / "tokenizer_config.json"
  config = json.loads(config_path.read_text())
  config["chat_template"] = (
      "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}"
      "{% endif %}{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
      "{{ eos_token }}{% endfor %}")
  config_path.write_text(json.dumps(config))
  tok = Tokenizer.from_hf_dir(tmp_path)
  assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
      "<|im_start|>[user]Hi<|im_end|>")
  with pytest.raises(ValueError, match="must start with user"):
    tok.apply_chat_template([{"role": "assistant", "content": "Hi"}])


@pytest.mark.parametrize("name", ["smol", "gemma"])
def test_save_then_from_hf_dir_is_identical(name, tmp_path, request):
  ours = request.getfixturevalue(name)
  ours.save(tmp_path)
  # Byte-level BPE saves a tokenizer.json, SentencePiece a tokenizer.model.
  assert (tmp_path / ("tokenizer.json" if name == "smol" else "tokenizer.model")).exists()
  again = Tokenizer.from_hf_dir(tmp_path)
  for attr in ("vocab_size", "bos_id", "eos_id", "stop_ids", "add_bos", "chat_template"):
    assert getattr(again, attr) == getattr(ours, attr), attr
  for text in TEXTS + SMOL_SPECIAL + GEMMA_SPECIAL:
    assert again.encode(text) == ours.encode(text), text
    ids = ours.encode(text)
    assert again.detokenize(ids, skip_special_tokens=False) == ours.detokenize(ids, False)


def test_from_hf_dir_reads_transformers_saved_dir(pair, tmp_path):
  """A directory written by transformers itself: tokenizer.json and its HF configs."""
  ours, hf, special = pair
  hf.save_pretrained(tmp_path)
  config_path = tmp_path / "tokenizer_config.json"
  config = json.loads(config_path.read_text())
  # Without add_bos_token we must read BOS-adding from the tokenizer.json post-processor.
  config.pop("add_bos_token", None)
  config_path.write_text(json.dumps(config))
  loaded = Tokenizer.from_hf_dir(tmp_path)
  assert (loaded.bos_id, loaded.eos_id, loaded.add_bos) == (ours.bos_id, ours.eos_id,
                                                           ours.add_bos)
  assert loaded.stop_ids == ours.stop_ids
  assert loaded.chat_template == ours.chat_template
  for text in TEXTS + special:
    assert loaded.encode(text) == hf.encode(text), text
