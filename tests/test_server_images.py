"""Images through a live server (issue 50, the serving side): OpenAI's image_url content parts
and gRPC's image bytes, decoded on the work pool under the server's and the model's limits. The
engine is the mock one told it takes 4 images a prompt (EngineInfo.max_images), behind SmolLM2's
tokenizer with a Gemma-3-style template, so no model compiles; the vision model is the engine
side's. Each bad image gets a 400 (INVALID_ARGUMENT) naming the problem, with the official client
and over gRPC, while a stream already running goes on undisturbed."""

import concurrent.futures
import dataclasses
import os
import threading

import grpc
import numpy as np
import openai
import PIL.PngImagePlugin
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.serving.gateway import ApiError
from jaxserve.serving.media import ImageSource, MediaLimits
from jaxserve.serving.requests import GenerateInput, Prompt
from support import images as im
from support import mock_serving
from support import server_harness as h
from support.mock_engine import MockEngine, assert_all_free
from support.openai_http import openai_client as client

LIMITS = dict(max_images=3, max_image_pixels=64 * 64, max_media_bytes=30_000)
PNG = im.encode(im.pixels())


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("media")
  (root / "allowed").mkdir()
  (root / "allowed" / "cat.png").write_bytes(PNG)
  (root / "secret.png").write_bytes(PNG)
  os.symlink(root / "secret.png", root / "allowed" / "link.png")
  return root


@pytest.fixture(scope="module")
def vlm(smol, media_dir):
  """A server whose model takes 4 images a prompt, and its engine's gate (token pacing)."""
  gate = mock_serving.Gate()
  engine = MockEngine(max_model_len=128, vocab_size=smol.vocab_size, next_token=gate)
  engine.info = dataclasses.replace(engine.info, max_images=4)
  media = MediaLimits(**LIMITS, local_media_path=str(media_dir / "allowed"))
  srv = h.serve(engine, im.mm_tokenizer(smol), name="vlm", media=media)
  yield srv, gate
  srv.close()


@pytest.fixture(scope="module")
def text_srv():
  srv = mock_serving.serve()  # EngineInfo.max_images 0: a text-only model.
  yield srv
  srv.close()


def chat(srv, *urls: str, **kw):
  return client(srv).chat.completions.create(
      model="", messages=im.chat(*map(im.image_part, urls)), max_tokens=4, **kw)


def refused(srv, *urls: str) -> str:
  with pytest.raises(openai.BadRequestError) as e:
    chat(srv, *urls)
  return e.value.body["message"]


def test_an_image_chat_is_served_with_the_templates_image_parts(vlm, smol, media_dir,
                                                               monkeypatch):
  srv, _ = vlm
  media, threads = srv.server.service.prompts.media, []
  load = media.load
  monkeypatch.setattr(media, "load", lambda *a: threads.append(threading.current_thread().name)
                      or load(*a))
  out = chat(srv, im.data_url(PNG), f"file://{media_dir}/allowed/cat.png")
  assert len(threads) == 1 and threads[0].startswith("jaxserve-work-")  # Not the event loop.
  text = im.mm_tokenizer(smol).apply_chat_template(im.chat({"type": "image"}, {"type": "image"}))
  assert "<start_of_image><start_of_image>What is it?" in text
  assert out.usage.prompt_tokens == len(smol.encode(text, add_bos=False))
  assert out.usage.completion_tokens == 4


def test_the_internal_request_shape_carries_the_decoded_images(vlm):
  """GenerateInput's prompt takes the images as sent; Service.prepare decodes them for the
  engine: Prepared.images, RGB pixels and their hash."""
  service = vlm[0].server.service
  jpeg = im.encode(im.pixels(seed=3), "JPEG")
  inp = GenerateInput(Prompt(messages=im.chat({"type": "image"}, {"type": "image"}),
                             images=(ImageSource(PNG, "a"), ImageSource(jpeg, "b"))),
                      max_tokens=4)
  prepared = service.prepare(inp)
  np.testing.assert_array_equal(prepared.images[0].pixels, im.pixels())
  assert prepared.images[1].pixels.shape == (17, 23, 3)
  assert prepared.images[0].hash != prepared.images[1].hash
  one_part = dataclasses.replace(inp.prompt, messages=im.chat({"type": "image"}))
  with pytest.raises(ApiError, match="the messages have 1 image parts for 2 images"):
    service.prepare(dataclasses.replace(inp, prompt=one_part))


def _large_png() -> bytes:
  """64x64 pixels, within the pixel limit, in a file over the 30,000-byte limit."""
  info = PIL.PngImagePlugin.PngInfo()
  info.add_text("pad", "x" * 40_000)
  return im.encode(im.pixels(64, 64), "PNG", pnginfo=info)


SMALL = im.data_url(PNG)
BAD = [
    ([im.data_url(PNG[:100])], "messages[0].content[0].image_url: the PNG, JPEG or WebP image "
     "could not be decoded"),
    ([im.data_url(im.bomb())], "refused as a decompression bomb"),
    ([im.data_url(im.bomb(1000))], "1000x1000 = 1,000,000 pixels, more than this server's limit "
     "of 4,096 pixels an image (--max-image-pixels)"),
    ([im.data_url(im.encode(im.pixels(), "GIF"), "image/gif")], "image format GIF is not "
     "supported; send a PNG, JPEG or WebP image"),
    ([im.data_url(b"hello")], "the data is not a PNG, JPEG or WebP image"),
    ([SMALL] * 4, "4 images in one prompt are more than this server's limit of 3 "
     "(--limit-mm-per-prompt)"),
    ([SMALL] * 5, "5 images in one prompt are more than model 'vlm' takes (4)"),
    ([im.data_url(im.encode(im.pixels(64, 64)))] * 3, "messages[0].content[2].image_url: the "
     "request's images decode to more than this server's limit of 30,000 bytes "
     "(--max-media-bytes)"),
    ([im.data_url(_large_png())], "the image file is"),
    (["https://example.com/cat.png"], "remote image URLs are refused"),
    (["file:///etc/hostname"], "no image file '/etc/hostname' under the allowed local media path"),
    (["LINK"], "under the allowed local media path"),  # A symlink inside, to a file outside.
]


@pytest.mark.parametrize("urls,want", BAD, ids=range(len(BAD)))
def test_each_bad_image_gets_a_400_naming_the_problem(vlm, media_dir, urls, want):
  urls = [f"file://{media_dir}/allowed/link.png" if u == "LINK" else u for u in urls]
  assert want in refused(vlm[0], *urls)


def test_a_text_only_model_refuses_images_over_http_and_grpc(text_srv):
  assert "model 'mock' does not accept images: it is a text-only model" in refused(
      text_srv, im.data_url(PNG))
  with grpc.insecure_channel(text_srv.grpc_address) as channel:
    with pytest.raises(grpc.RpcError) as e:
      h.generate(h.stub(channel), _grpc_chat(PNG), key=None)
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "model 'mock' does not accept images" in e.value.details()


def _grpc_chat(*images: bytes) -> pb.GenerateRequest:
  msg = pb.ChatMessage(role="user", content="What is it?", images=images)
  return pb.GenerateRequest(chat=pb.ChatMessages(messages=[msg]), max_tokens=4)


def test_grpc_carries_image_bytes_under_the_same_checks_and_messages(vlm, smol):
  srv, _ = vlm
  with grpc.insecure_channel(srv.grpc_address) as channel:
    out = h.generate(h.stub(channel), _grpc_chat(PNG, PNG), key=None)
    text = im.mm_tokenizer(smol).apply_chat_template(im.chat({"type": "image"}, {"type": "image"}))
    assert out[-1].usage.prompt_tokens == len(smol.encode(text, add_bos=False))
    for images, want in (([PNG[:100]], "chat.messages[0].images[0]: the PNG, JPEG or WebP image "
                           "could not be decoded"),
                         ([PNG] * 4, "more than this server's limit of 3 (--limit-mm-per-prompt)"),
                         ([im.bomb(1000)], "1000x1000 = 1,000,000 pixels")):
      with pytest.raises(grpc.RpcError) as e:
        h.generate(h.stub(channel), _grpc_chat(*images), key=None)
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
      assert want in e.value.details()


def test_a_stream_goes_on_while_bad_image_requests_arrive(vlm):
  """Bombs, corrupt files and too many images, 24 at once, while a stream runs: each gets its
  400, the stream all its tokens, and the engine ends with every page and slot free."""
  srv, gate = vlm
  gate.token_s = 0.05  # 2 s of stream: the bad requests come and go within it.
  try:
    stream = client(srv).chat.completions.create(
        model="", messages=[{"role": "user", "content": "Count."}], max_tokens=40, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = next(stream)
    bad = [([im.data_url(im.bomb())], "decompression bomb"),
           ([im.data_url(PNG[:100])], "could not be decoded"),
           ([SMALL] * 5, "more than model 'vlm' takes")] * 8
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      messages = list(pool.map(lambda case: refused(srv, *case[0]), bad))
    assert all(want in message for (_, want), message in zip(bad, messages))
    assert len(srv.scheduler.running) == 1  # The stream is still running.
    chunks = [first, *stream]
  finally:
    gate.token_s = 0.0
  assert chunks[-1].usage.completion_tokens == 40
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  h.wait_idle(srv)
  assert_all_free(srv.scheduler)
