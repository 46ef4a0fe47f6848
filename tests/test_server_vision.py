"""Gemma 3 with images through a live server (issue 50's done-when): the tiny random
Gemma3ForConditionalGeneration built offline by transformers, served (one server for the module)
with a character-level tokenizer that spells Gemma 3's chat and image tokens. The official
openai client sends chats with one and two PNG data URLs: the server templates the chat, expands
each image's placeholder as the processor does, tokenizes, places and preprocesses the images on
the work pool, and the engine's greedy tokens equal transformers' generate on the same ids and
the HF processor's pixels, each logprob within 1e-3; a text-only chat runs beside an image chat;
gRPC's image bytes give the same tokens; nothing compiles after warm-up."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import grpc
import numpy as np
import PIL.Image
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.batching import images as mm
from jaxserve.config import AttentionBackend, EngineConfig
from jaxserve.serving.gateway import ApiError
from jaxserve.serving.media import ImageSource
from jaxserve.serving.requests import GenerateInput, Prompt
from jaxserve.serving.service import Service
from jaxserve.text.tokenizer import Tokenizer
from support import gemma3_vl, hf_tiny
from support import images as im
from support import server_harness as h
from support.tiny import count_compiles

transformers = pytest.importorskip("transformers")

# test_gemma3_vision's engine shapes: a run of both loads the other's programs from the
# persistent compilation cache.
ENGINE = EngineConfig(num_slots=4, page_size=4, num_pages=64, max_model_len=64,
                      prefill_buckets=(16, 32), compilation_cache_dir=None,
                      attention_backend=AttentionBackend.REFERENCE)
NUM_TOKENS = 6
MARKERS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
RGBS = gemma3_vl.pictures(2, seed=11)
PNGS = [im.encode(rgb) for rgb in RGBS]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
  """(transformers' model, the server, its tokenizer)."""
  hf = hf_tiny.build_gemma3_vision()
  path = tmp_path_factory.mktemp("tiny_gemma3_vl")
  hf.save_pretrained(path)
  gemma3_vl.write_tokenizer(path)
  tokenizer = Tokenizer.from_hf_dir(path)
  engine = im.hf_engine(path, ENGINE, stop_ids=tokenizer.stop_ids)
  srv = h.serve(engine, tokenizer, name="tiny-gemma3-vl")
  yield hf, srv, tokenizer
  srv.close()


def expected(hf, tokenizer, rgbs: list[np.ndarray]) -> tuple[int, list[int], list[float]]:
  """The prompt's length and transformers' greedy tokens and logprobs: the chat templated,
  expanded as Gemma 3's processor expands it, tokenized; the HF processor's pixels."""
  text = tokenizer.apply_chat_template(im.chat(*[{"type": "image"}] * len(rgbs)))
  ids = tokenizer.encode(mm.expand_text(text, len(rgbs), *MARKERS, gemma3_vl.IDS[
      "mm_tokens_per_image"]) if rgbs else text, add_bos=False)
  processor = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
  pixels = [processor(PIL.Image.fromarray(rgb), return_tensors="np")["pixel_values"][0]
            for rgb in rgbs]
  return len(ids), *gemma3_vl.reference(hf, ids, pixels, NUM_TOKENS)


def chat(srv, tokenizer, pngs: list[bytes]) -> tuple[int, list[int], list[float]]:
  return im.served_chat(srv, tokenizer, pngs, NUM_TOKENS)


def assert_same(got, want):
  assert got[:2] == want[:2]
  assert np.abs(np.array(got[2]) - want[2]).max() < 1e-3


def test_image_chats_equal_transformers_with_text_beside_them(vl, monkeypatch):
  """One image, two images, and a text-only chat sent at once with an image chat: greedy tokens
  and logprobs as transformers', the images placed on a worker thread, and no compile."""
  hf, srv, tokenizer = vl
  vision = srv.server.service.prompts.vision
  threads, place = [], vision.place
  monkeypatch.setattr(vision, "place", lambda *a: threads.append(
      threading.current_thread().name) or place(*a))
  want = [expected(hf, tokenizer, rgbs) for rgbs in ([RGBS[0]], RGBS, [])]
  with count_compiles() as counts:
    one, two = chat(srv, tokenizer, PNGS[:1]), chat(srv, tokenizer, PNGS)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      text, again = pool.map(lambda pngs: chat(srv, tokenizer, pngs), ([], PNGS[1:]))
  assert counts["compile"] == 0, counts
  assert_same(one, want[0])
  assert_same(two, want[1])
  assert_same(text, want[2])
  assert_same(again, expected(hf, tokenizer, RGBS[1:]))
  assert len(threads) == 4 and all(t.startswith("jaxserve-work-") for t in threads), threads
  info = srv.server.service.engine_info  # The model's limit, which the server's media apply.
  assert info.max_images == ENGINE.max_model_len // info.vision.num_image_tokens == 10
  assert srv.server.service.prompts.media._model_max == 10  # pylint: disable=protected-access
  h.wait_idle(srv)


def test_grpc_image_bytes_give_the_same_tokens(vl):
  hf, srv, tokenizer = vl
  want = expected(hf, tokenizer, RGBS)
  msg = pb.ChatMessage(role="user", content="What is it?", images=PNGS)
  req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[msg]), max_tokens=NUM_TOKENS,
                           temperature=0, ignore_eos=True, logprobs=0)
  with count_compiles() as counts, grpc.insecure_channel(srv.grpc_address) as channel:
    out = h.generate(h.stub(channel), req, key=None)
  assert counts["compile"] == 0, counts
  got = (out[-1].usage.prompt_tokens, [t for m in out for t in m.token_ids],
         [lp.logprob for m in out for lp in m.logprobs])
  assert_same(got, want)


def test_a_pd_decode_server_refuses_images_by_name(vl):
  """The P/D handoff keys pages by tokens only: a decode server (one with a prefill peer)
  refuses a prompt with images before anything is queued, naming why."""
  _, srv, tokenizer = vl
  s = srv.server.service
  decode = Service(s.runner, tokenizer, "tiny-gemma3-vl", s.gateway, s.metrics, pool=s.pool,
                   kv_peer=object())
  inp = GenerateInput(Prompt(messages=im.chat({"type": "image"}),
                             images=(ImageSource(PNGS[0], "image"),)), max_tokens=2)
  with pytest.raises(ApiError, match="P/D decode server.*a prompt with images"):
    decode.prepare(inp)
  text_only = dataclasses.replace(inp, prompt=Prompt(messages=im.chat()))
  assert decode.prepare(text_only).image_spans == ()


def test_a_prompt_cut_through_an_image_is_refused(vl):
  """truncate_prompt keeps a prompt's tail: one that cuts an image's tokens is a 400."""
  _, srv, _ = vl
  inp = GenerateInput(Prompt(messages=im.chat(*[{"type": "image"}] * 2),
                             images=tuple(ImageSource(p, "image") for p in PNGS)),
                      max_tokens=40, truncate_prompt=True)
  with pytest.raises(ApiError, match="runs of image tokens for 2 images"):
    srv.server.service.prepare(inp)
