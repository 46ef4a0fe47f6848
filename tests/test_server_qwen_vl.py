"""Qwen2.5-VL through a live server (issue 50's done-when): the tiny random
Qwen2_5_VLForConditionalGeneration built offline by transformers, served with a character-level
tokenizer that spells Qwen's chat and image tokens. The official openai client sends chats with
one and two PNG data URLs of different sizes beside a text-only chat: the server templates each
chat, repeats each image's placeholder as Qwen's processor does for that image's size, places and
preprocesses the images on the work pool, and the engine's greedy tokens equal transformers'
generate on the same ids and the Pillow processor's patches, each logprob within 1e-3, with no
compile after warm-up."""

from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import PIL.Image
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.batching import qwen_prompts
from jaxserve.batching.images import Image
from jaxserve.config import AttentionBackend, EngineConfig
from jaxserve.text.tokenizer import Tokenizer
from support import images as im
from support import qwen_vl
from support import server_harness as h
from support.openai_http import call, post
from support.tiny import count_compiles

transformers = pytest.importorskip("transformers")

ENGINE = EngineConfig(**qwen_vl.ENGINE, attention_backend=AttentionBackend.REFERENCE)
NUM_TOKENS = 6
MARKERS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
RGBS = [np.random.default_rng(11 + i).integers(0, 256, size, dtype=np.uint8)
        for i, size in enumerate([(40, 60, 3), (150, 200, 3)])]
PNGS = [im.encode(rgb) for rgb in RGBS]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
  """(transformers' model, the server, its tokenizer, the vision config)."""
  hf = qwen_vl.build()
  path = tmp_path_factory.mktemp("tiny_qwen_vl_served")
  qwen_vl.save(hf, path)
  tokenizer = Tokenizer.from_hf_dir(path)
  engine = im.hf_engine(path, ENGINE, stop_ids=tokenizer.stop_ids)
  srv = h.serve(engine, tokenizer, name="tiny-qwen-vl")
  yield hf, srv, tokenizer, engine.model_config.vision
  srv.close()


def prompt_ids(tokenizer, vision, rgbs) -> list[int]:
  """The chat templated, each placeholder repeated for its image, tokenized."""
  text = tokenizer.apply_chat_template(im.chat(*[{"type": "image"}] * len(rgbs)))
  images = [Image.of(rgb) for rgb in rgbs]
  return tokenizer.encode(qwen_prompts.expand_text(text, images, *MARKERS, vision), add_bos=False)


def expected(hf, tokenizer, vision, rgbs) -> tuple[int, list[int], list[float]]:
  """The prompt's length and transformers' greedy tokens and logprobs on `prompt_ids`, with the
  Pillow processor's patches."""
  ids = prompt_ids(tokenizer, vision, rgbs)
  processor = transformers.Qwen2VLImageProcessorPil(**qwen_vl.PROCESSOR)
  patches, grids = [], []
  for rgb in rgbs:
    out = processor(PIL.Image.fromarray(rgb), return_tensors="np")
    patches.append(out["pixel_values"])
    grids.append(tuple(int(x) for x in out["image_grid_thw"][0]))
  return len(ids), *qwen_vl.reference(hf, ids, patches, grids, NUM_TOKENS)


def chat(srv, tokenizer, pngs: list[bytes]) -> tuple[int, list[int], list[float]]:
  return im.served_chat(srv, tokenizer, pngs, NUM_TOKENS)


def test_image_chats_equal_transformers_with_text_beside_them(vl):
  hf, srv, tokenizer, vision = vl
  want = [expected(hf, tokenizer, vision, rgbs) for rgbs in ([RGBS[0]], RGBS, [])]
  with count_compiles() as counts:
    one = chat(srv, tokenizer, PNGS[:1])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      two, text = pool.map(lambda pngs: chat(srv, tokenizer, pngs), (PNGS, []))
  assert counts["compile"] == 0, counts
  for got, ref in zip((one, two, text), want):
    assert got[:2] == ref[:2]
    assert np.abs(np.array(got[2]) - ref[2]).max() < 1e-3
  assert want[1][0] > want[0][0] + 30  # The big image's 35 tokens.
  h.wait_idle(srv)


def test_tokenize_expands_each_image_for_its_size(vl):
  """/tokenize and gRPC Tokenize take image parts as generation does: the ids a chat of two
  images of two sizes runs (whose outputs equal transformers' above)."""
  _, srv, tokenizer, vision = vl
  want = prompt_ids(tokenizer, vision, RGBS)
  messages = im.chat(*[im.image_part(im.data_url(p)) for p in PNGS])
  out = post(srv, {"messages": messages}, "/tokenize")
  assert out["tokens"] == want and out["count"] == len(want)
  msg = pb.ChatMessage(role="user", content="What is it?", images=PNGS)
  with grpc.insecure_channel(srv.grpc_address) as channel:
    got = h.stub(channel).Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[msg])))
  assert list(got.token_ids) == want
  status, err = call(srv, "/tokenize", {"messages": im.chat(im.image_part(im.data_url(b"no")))},
                     method="POST")
  assert status == 400 and "image" in err["error"]["message"], err
