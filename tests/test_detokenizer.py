"""Streaming deltas concatenate to exactly the full decode and never split a character."""

import hypothesis
import pytest
from hypothesis import strategies as st
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from jaxserve.text.detokenizer import IncrementalDetokenizer
from jaxserve.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def llama_style(gemma, tmp_path_factory):
  """Gemma's vocab with a Llama-2 style dummy prefix: decode drops the first token's space."""
  d = tmp_path_factory.mktemp("llama_style")
  gemma.save(d)
  proto = sp_pb2.ModelProto()
  proto.ParseFromString((d / "tokenizer.model").read_bytes())
  proto.normalizer_spec.add_dummy_prefix = True
  (d / "tokenizer.model").write_bytes(proto.SerializeToString())
  return Tokenizer.from_hf_dir(d)


def _byte_ids(tok, data: bytes) -> list[int]:
  """Gemma's byte-fallback tokens <0xNN> spelling `data`."""
  return [tok.token_to_id(f"<0x{b:02X}>") for b in data]


def _stream(tok, ids, prompt_ids=(), chunks=None):
  """The deltas of feeding `ids` in `chunks` (sizes; default one at a time), then the flush."""
  detok = IncrementalDetokenizer(tok, prompt_ids)
  deltas, pos = [], 0
  for size in chunks or [1] * len(ids):
    deltas.append(detok.add(ids[pos:pos + size]))
    pos += size
  deltas.append(detok.flush())
  assert detok.text == "".join(deltas)
  return deltas


def test_gemma_byte_fallback_characters_are_held_until_complete(gemma):
  hello, world = gemma.token_to_id("Hello"), gemma.token_to_id("\u2581world")
  ids = ([hello] + _byte_ids(gemma, "é".encode()) + [world] + _byte_ids(gemma, "日".encode()) +
         _byte_ids(gemma, "😀".encode()))
  assert gemma.detokenize(ids) == "Helloé world日😀"
  assert _stream(gemma, ids) == ["Hello", "", "é", " world", "", "", "日", "", "", "", "😀", ""]
  assert "".join(_stream(gemma, ids, chunks=[2, 2, 3, 2, 2])) == "Helloé world日😀"


def test_invalid_and_unfinished_bytes_match_the_full_decode(gemma):
  hello = gemma.token_to_id("Hello")
  # 0xFF is never valid UTF-8; its U+FFFD is held like an unfinished character, then kept.
  stray = _byte_ids(gemma, b"\xff") + [hello]
  assert _stream(gemma, stray) == ["", REPLACEMENT + "Hello", ""]
  cut = [hello] + _byte_ids(gemma, "日".encode()[:2])  # Ends mid-character: flush gives it up.
  assert _stream(gemma, cut) == ["Hello", "", "", REPLACEMENT * 2]
  assert "".join(_stream(gemma, cut)) == gemma.detokenize(cut)


def test_bpe_emoji_and_cjk(smol):
  text = "Emoji 😀👍🏽 🇫🇷 and 日本語, 한국어 text."
  ids = smol.encode(text)
  deltas = _stream(smol, ids)
  assert "".join(deltas) == text
  assert not any(REPLACEMENT in d for d in deltas)
  assert "" in deltas[:-1]  # Some characters span several tokens and were held back.


def test_prompt_context_keeps_the_first_tokens_space(smol, gemma):
  for tok in (smol, gemma):
    prompt = tok.encode("Say")
    output = tok.encode(" hello 😀 world", add_bos=False)
    assert "".join(_stream(tok, output, prompt_ids=prompt)) == " hello 😀 world"


def test_dummy_prefix_space_is_kept_after_the_first_token(llama_style):
  hello, world, again = (llama_style.token_to_id(t)
                         for t in ("Hello", "\u2581world", "\u2581again"))
  assert llama_style.detokenize([world]) == "world"  # Alone, the space goes...
  assert _stream(llama_style, [hello, world, again]) == ["Hello", " world", " again", ""]
  assert _stream(llama_style, [world, again]) == ["world", " again", ""]
  # ...but after a prompt it is the space between the prompt and the answer.
  say = llama_style.encode("Say")
  assert _stream(llama_style, [world, again], prompt_ids=say) == [" world", " again", ""]


def test_prompt_cut_mid_character(gemma):
  prompt = gemma.encode("Say") + _byte_ids(gemma, "日".encode()[:1])
  output = _byte_ids(gemma, "日".encode()[1:]) + [gemma.token_to_id("Hello")]
  assert "".join(_stream(gemma, output, prompt_ids=prompt)) == gemma.detokenize(output)


def test_special_tokens_are_skipped(smol):
  ids = smol.encode("<|im_start|>assistant\nHi!<|im_end|>")
  assert "".join(_stream(smol, ids)) == "assistant\nHi!"


class _WindowSpy:
  """Records the length of every id list the detokenizer decodes."""

  def __init__(self, tok):
    self._tok = tok
    self.lengths = []

  def detokenize(self, ids, skip_special_tokens=True):
    self.lengths.append(len(ids))
    return self._tok.detokenize(ids, skip_special_tokens)


def test_decode_windows_stay_short(smol):
  ids = smol.encode("A long answer with 😀 and 日本語 in it. " * 40)
  spy = _WindowSpy(smol)
  detok = IncrementalDetokenizer(spy, smol.encode("The prompt is here."))
  text = "".join(detok.add([i]) for i in ids) + detok.flush()
  assert text == smol.detokenize(ids)
  assert len(ids) > 400
  assert max(spy.lengths) <= 8  # Not growing with the sequence.
  assert len(spy.lengths) <= 2 * len(ids) + 2


def _chunked(draw, ids):
  sizes = []
  while sum(sizes) < len(ids):
    sizes.append(draw(st.integers(1, 4)))
  return sizes


@st.composite
def _token_stream(draw, vocab):
  ids = draw(st.lists(vocab, max_size=40))
  return draw(st.lists(vocab, max_size=8)), ids, _chunked(draw, ids)


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(data=st.data())
def test_property_smollm2_random_ids(smol, data):
  prompt, ids, chunks = data.draw(_token_stream(st.integers(0, smol.vocab_size - 1)))
  deltas = _stream(smol, ids, prompt_ids=prompt, chunks=chunks)
  full = smol.detokenize(ids)
  assert "".join(deltas) == full
  if REPLACEMENT not in full:
    assert not any(REPLACEMENT in d for d in deltas)


@hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
@hypothesis.given(data=st.data())
def test_property_gemma_byte_tokens(gemma, data):
  # Mostly byte-fallback tokens (valid and broken UTF-8), some words and control tokens.
  words = [gemma.token_to_id(t) for t in ("Hello", "\u2581world", "<start_of_turn>", "<eos>")]
  vocab = st.one_of(st.sampled_from(_byte_ids(gemma, "é日😀\n".encode())), st.sampled_from(words),
                    st.integers(0, gemma.vocab_size - 1))
  prompt, ids, chunks = data.draw(_token_stream(vocab))
  deltas = _stream(gemma, ids, prompt_ids=prompt, chunks=chunks)
  full = gemma.detokenize(ids)
  assert "".join(deltas) == full
  if REPLACEMENT not in full:
    assert not any(REPLACEMENT in d for d in deltas)


@hypothesis.settings(max_examples=100, deadline=None, derandomize=True)
@hypothesis.given(data=st.data())
def test_property_dummy_prefix_random_ids(llama_style, data):
  vocab = st.one_of(st.sampled_from(_byte_ids(llama_style, "é日😀 ".encode())),
                    st.integers(0, llama_style.vocab_size - 1))
  _, ids, chunks = data.draw(_token_stream(vocab))
  assert "".join(_stream(llama_style, ids, chunks=chunks)) == llama_style.detokenize(ids)
