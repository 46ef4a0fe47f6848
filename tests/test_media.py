"""A request's images (issue 50, the serving side), without a server: serving/media.py decodes
PNG, JPEG and WebP to the RGB pixels Pillow (and transformers' processors) make of them, refuses
each bad input and each limit by name, reads local files only under the allowed path and
fetches nothing remote; chat content parts become the template's image parts."""

import http.server
import io
import os
import threading
import time

import numpy as np
import PIL.Image
import pytest
from transformers.image_transforms import convert_to_rgb

from jaxserve.api import openai_prompt
from jaxserve.batching.images import Image
from jaxserve.cli import serve_flags
from jaxserve.cli.main import build_parser
from jaxserve.serving import media_fetch
from jaxserve.serving.gateway import ApiError, Status
from jaxserve.serving.media import ImageSource, MediaLimits, MediaLoader
from support import images as im


def loader(max_images: int = 4, model_max: int = 4, **limits) -> MediaLoader:
  return MediaLoader(MediaLimits(max_images=max_images, **limits), "vlm", model_max)


def refusal(fn, *args) -> str:
  with pytest.raises(ApiError) as e:
    fn(*args)
  assert e.value.status is Status.INVALID_ARGUMENT
  return e.value.message


def pillow_rgb(data: bytes) -> np.ndarray:
  return np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("fmt,options", [("PNG", {}), ("JPEG", {"quality": 90}),
                                         ("WEBP", {"lossless": True}), ("WEBP", {})])
def test_png_jpeg_and_webp_decode_to_pillows_rgb_pixels(fmt, options):
  data = im.encode(im.pixels(), fmt, **options)
  image = loader().decode(data, "x")
  assert image.pixels.dtype == np.uint8 and image.pixels.shape == (17, 23, 3)
  np.testing.assert_array_equal(image.pixels, pillow_rgb(data))


def test_grayscale_and_transparency_convert_as_transformers_processors_do():
  gray = im.encode(im.pixels(channels=3)[..., 0])
  np.testing.assert_array_equal(loader().decode(gray, "x").pixels, pillow_rgb(gray))
  rgba = im.encode(im.pixels(channels=4))  # Random alpha: composited onto white, not dropped.
  want = convert_to_rgb(PIL.Image.open(io.BytesIO(rgba)), return_numpy=True)
  got = loader().decode(rgba, "x").pixels
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, pillow_rgb(rgba))


def test_the_hash_is_the_pixels_not_the_file():
  png, webp = im.encode(im.pixels()), im.encode(im.pixels(), "WEBP", lossless=True)
  assert png != webp and loader().decode(png, "x") == loader().decode(webp, "x")
  other = loader().decode(im.encode(im.pixels(seed=1)), "x")
  assert other.hash != loader().decode(png, "x").hash
  with pytest.raises(ValueError, match="uint8"):
    Image.of(np.zeros((2, 2, 3), np.float32))


@pytest.mark.parametrize("data,want", [
    (im.bomb(), "refused as a decompression bomb"),  # Over Pillow's own cap: refused as opened.
    (im.bomb(5000), "5000x5000 = 25,000,000 pixels, more than this server's limit of 16,777,216 "
     "pixels an image (--max-image-pixels)"),
    (im.encode(im.pixels(), "GIF"), "image format GIF is not supported; send a PNG, JPEG or WebP"),
    (im.encode(im.pixels(), "BMP"), "image format BMP is not supported"),
    (im.encode(im.pixels(), "TIFF"), "image format TIFF is not supported"),
    (b"not an image at all", "the data is not a PNG, JPEG or WebP image (19 bytes of no format "
     "known)"),
    (im.encode(im.pixels())[:80], "could not be decoded (image file is truncated)"),
])
def test_each_bad_image_is_refused_by_name(data, want):
  assert want in refusal(loader().decode, data, "messages[0].content[1].image_url")


def test_the_limits_on_count_pixels_and_bytes_each_name_their_flag():
  one = ImageSource(im.data_url(im.encode(im.pixels(8, 8))), "img")
  assert "more than this server's limit of 2 (--limit-mm-per-prompt)" in refusal(
      loader(max_images=2).load, [one] * 3)
  assert "more than model 'vlm' takes (1)" in refusal(loader(model_max=1).load, [one] * 2)
  assert "model 'vlm' does not accept images: it is a text-only model" in refusal(
      loader(model_max=0).load, [one])
  assert "8x8 = 64 pixels, more than this server's limit of 63" in refusal(
      loader(max_image_pixels=63).load, [one])
  # Two 8x8 images decode to 384 bytes: the second is over a 300-byte budget.
  assert "decode to more than this server's limit of 300 bytes (--max-media-bytes)" in refusal(
      loader(max_media_bytes=300).load, [one, one])
  big = ImageSource(im.encode(im.pixels(64, 64)), "img")  # 12 KiB of PNG.
  assert "the image file is" in refusal(loader(max_media_bytes=4096).load, [big])
  assert len(loader(max_media_bytes=384).load([one, one])) == 2


@pytest.mark.parametrize("url,want", [
    ("https://example.com/cat.png", "remote image URLs are refused ('https://example.com/cat.png')"
     ": this server fetches nothing over the network"),
    ("http://10.0.0.1/x.jpg", "remote image URLs are refused"),
    ("ftp://example.com/cat.png", "must be a data URL"),
    ("data:image/png,abc", "a data URL must be base64"),
    ("data:text/plain;base64,aGk=", "media type is 'text/plain', not an image"),
    ("data:image/png;base64,***", "not valid base64"),
    ("file:///etc/passwd", "local image files are refused: this server reads none unless it is "
     "started with --allowed-local-media-path DIR"),
])
def test_urls_that_are_not_inline_images_are_refused_by_name(url, want):
  assert want in refusal(loader().load, [ImageSource(url, "img")])


def test_local_files_are_read_only_under_the_allowed_path(tmp_path):
  allowed, outside = tmp_path / "allowed", tmp_path / "outside"
  allowed.mkdir()
  outside.mkdir()
  data = im.encode(im.pixels())
  (allowed / "cat one.png").write_bytes(data)
  (outside / "secret.png").write_bytes(data)
  os.symlink(outside / "secret.png", allowed / "link.png")  # A way out, inside.
  media = loader(local_media_path=str(allowed))
  got, = media.load([ImageSource(f"file://{allowed}/cat%20one.png", "img")])
  np.testing.assert_array_equal(got.pixels, pillow_rgb(data))
  for url in (f"file://{outside}/secret.png", f"file://{allowed}/link.png",
              f"file://{allowed}/../outside/secret.png", f"file://{allowed}/missing.png",
              f"file://otherhost{allowed}/cat%20one.png", f"file://{allowed}"):
    assert "under the allowed local media path" in refusal(media.load, [ImageSource(url, "img")])
  with pytest.raises(ValueError, match="must be a directory"):
    MediaLimits(local_media_path=str(tmp_path / "nowhere"))


def test_chat_image_parts_become_template_parts_and_text_parts_stay_one_string():
  url = im.data_url(im.encode(im.pixels()))
  body = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be "},
                                                      {"type": "text", "text": "terse."}]},
                       {"role": "user", "content": [im.image_part(url), im.image_part("u2"),
                                                    {"type": "text", "text": "Same?"}]}]}
  prompt = openai_prompt.chat_prompt(body)
  assert prompt.messages == [
      {"role": "system", "content": "Be terse."},
      {"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                   {"type": "text", "text": "Same?"}]}]
  assert prompt.images == (ImageSource(url, "messages[1].content[0].image_url"),
                           ImageSource("u2", "messages[1].content[1].image_url"))
  for part, want in (({"type": "image_url", "image_url": "x"}, "image_url must be an object"),
                     ({"type": "input_audio"}, "must be a text part")):
    body = {"messages": [{"role": "user", "content": [part]}]}
    assert want in refusal(openai_prompt.chat_prompt, body)


def test_a_multimodal_template_renders_the_image_parts(smol):
  tok = im.mm_tokenizer(smol)
  text = tok.apply_chat_template(im.chat({"type": "image"}, {"type": "image"}))
  assert "<start_of_turn>user\n<start_of_image><start_of_image>What is it?<end_of_turn>" in text
  with pytest.raises(ValueError, match="no string 'content'"):
    tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}])


def test_the_serve_flags_set_the_limits():
  args = build_parser().parse_args(["serve", "--limit-mm-per-prompt", '{"image": 2}',
                                    "--max-image-pixels", "1000", "--max-media-bytes", "5000"])
  assert serve_flags.media_limits(args) == MediaLimits(2, 1000, 5000, None)
  args = build_parser().parse_args(["serve", "--allowed-media-domains", "Example.com", "b.org"])
  assert serve_flags.media_limits(args).media_domains == ("example.com", "b.org")
  assert build_parser().parse_args(["serve"]).limit_mm_per_prompt == MediaLimits().max_images
  with pytest.raises(SystemExit):
    build_parser().parse_args(["serve", "--limit-mm-per-prompt", '{"video": 1}'])


class _Files(http.server.BaseHTTPRequestHandler):
  """/cat.png, a PNG; /big, 100 KB; /in and /out, redirects to /cat.png on localhost (allowed)
  and on 127.0.0.1 (not named); /slow, a byte every 0.1 s; anything else 404."""

  def do_GET(self):  # pylint: disable=invalid-name
    port = self.server.server_address[1]
    moves = {"/in": f"http://localhost:{port}/cat.png", "/out": f"http://127.0.0.1:{port}/cat.png"}
    if self.path in moves:
      self.send_response(302)
      self.send_header("Location", moves[self.path])
      self.end_headers()
      return
    body = {"/cat.png": im.encode(im.pixels()), "/big": b"x" * 100_000, "/slow": b"x" * 30}
    if self.path not in body:
      self.send_error(404)
      return
    self.send_response(200)
    self.send_header("Content-Length", str(len(body[self.path])))
    self.end_headers()
    for k in range(0, len(body[self.path]), 1 if self.path == "/slow" else 2**20):
      self.wfile.write(body[self.path][k:k + (1 if self.path == "/slow" else 2**20)])
      self.wfile.flush()
      if self.path == "/slow":
        time.sleep(0.1)

  def log_message(self, *args):
    pass


@pytest.fixture(scope="module")
def files():
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield f"http://localhost:{server.server_address[1]}"
  server.shutdown()


def test_remote_images_are_fetched_only_from_the_named_domains(files):
  media = loader(max_media_bytes=50_000, media_domains=("localhost",))
  for path in ("/cat.png", "/in"):  # A redirect within the named domains is followed.
    got, = media.load([ImageSource(files + path, "img")])
    np.testing.assert_array_equal(got.pixels, im.pixels())
  for url, want in ((files + "/out", "redirects to 'http://127.0.0.1:"),
                    (files + "/big", "more than this server's limit of 50,000 bytes"),
                    (files + "/nothing", "could not be fetched: HTTP 404"),
                    (files.replace("localhost", "127.0.0.1") + "/cat.png",
                     "'127.0.0.1' is not one"),
                    ("http://localhost:1/cat.png", "could not be fetched")):
    assert want in refusal(media.load, [ImageSource(url, "img")]), url
  assert "took more than 0.5 s" in refusal(
      media_fetch.fetch, files + "/slow", "img", ("localhost",), 50_000, 0.5)
  assert media_fetch.allowed("https://cdn.Example.com/x", ("example.com",))
  assert not media_fetch.allowed("https://badexample.com/x", ("example.com",))
  with pytest.raises(ValueError, match="lowercase host names"):
    MediaLimits(media_domains=("https://example.com",))
