"""A request's images, from what the client sent to decoded RGB pixels (batching/images.Image).

A chat message's image part carries a URL: a data URL (`data:image/png;base64,...`) is decoded
here; a `file://` URL is read only from under the server's --allowed-local-media-path (symlinks
resolved first; a file that is missing and one outside the path get the same answer); a remote
http(s) URL is fetched only from the domains --allowed-media-domains names (media_fetch.py), else
refused. gRPC sends the file's bytes.
PNG, JPEG and WebP are decoded with Pillow and converted to RGB as transformers' processors
convert a PIL image (transparency composited onto white), so the engine sees what the model's own
processor would.

Everything here runs on the work pool (Service.prepare), never on the event loop: Pillow and
hashlib release the GIL while they decode and hash. The cheap checks come first: whether the
model takes images and how many, before any byte is decoded; each image's size from its header,
before its pixels are decoded (a 100-byte PNG can declare a billion pixels). Each refusal is an
INVALID_ARGUMENT naming the image and the limit or the problem.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.parse
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import PIL.Image

from jaxserve.batching.images import Image
from jaxserve.config import short
from jaxserve.serving import media_fetch
from jaxserve.serving.gateway import invalid

FORMATS = ("PNG", "JPEG", "WEBP")  # Pillow's names of the formats decoded.
_FORMAT_NAMES = "PNG, JPEG or WebP"
# Formats a client may send by mistake, known by their first bytes, to name them in the refusal
# without handing them to Pillow's other parsers: only the three decoders ever see a file.
_OTHER_FORMATS = ((b"GIF8", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
                  (b"\x00\x00\x01\x00", "ICO"), (b"<svg", "SVG"), (b"<?xml", "SVG"),
                  (b"%PDF", "PDF"))
_FTYP_FORMATS = {b"avif": "AVIF", b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF"}


class ImageSource(NamedTuple):
  """An image as the client sent it, before it is decoded."""

  data: str | bytes  # A data:, file:// or http(s) URL as sent; or the encoded file (gRPC).
  field: str  # Where the request had it, for errors: "messages[0].content[1].image_url".


@dataclasses.dataclass(frozen=True)
class MediaLimits:
  """What a server decodes for one request (ServerConfig.media; `serve`'s flags)."""

  max_images: int = 8  # --limit-mm-per-prompt's image count (the model's limit applies too).
  max_image_pixels: int = 4096 * 4096  # --max-image-pixels: width x height of one image.
  # --max-media-bytes: a request's images decoded (3 bytes a pixel), and any one encoded file.
  max_media_bytes: int = 128 * 2**20
  local_media_path: str | None = None  # --allowed-local-media-path: file:// URLs read under it.
  media_domains: tuple[str, ...] = ()  # --allowed-media-domains: http(s) URLs fetched from them.

  def __post_init__(self):
    for field in ("max_images", "max_image_pixels", "max_media_bytes"):
      if getattr(self, field) < 0:
        raise ValueError(f"MediaLimits.{field} must be >= 0, got {getattr(self, field)}")
    if any(not d or d != d.lower().strip(".") or "/" in d for d in self.media_domains):
      raise ValueError("--allowed-media-domains takes lowercase host names (example.com), got "
                       f"{list(self.media_domains)}")
    if self.local_media_path is not None and not os.path.isdir(self.local_media_path):
      raise ValueError("--allowed-local-media-path must be a directory, got "
                       f"{self.local_media_path!r}")


class MediaLoader:
  """Decodes a request's images under a server's limits and its model's."""

  def __init__(self, limits: MediaLimits, model_name: str, model_max_images: int):
    """`model_max_images`: images one prompt may carry for the model (0: a text-only model)."""
    self.limits = limits
    self._model = model_name
    self._model_max = model_max_images
    self._root = None if limits.local_media_path is None else os.path.realpath(
        limits.local_media_path)

  def load(self, sources: Sequence[ImageSource],
           messages: Sequence[Mapping[str, Any]] | None = None) -> tuple[Image, ...]:
    """Every image decoded, in order; the first problem is an INVALID_ARGUMENT naming it.
    `messages`: a chat's, whose {"type": "image"} parts must be as many as the images."""
    num_parts = _num_image_parts(messages or ())
    if messages is not None and num_parts != len(sources):  # An internal caller's slip.
      raise invalid(f"the messages have {num_parts} image parts for {len(sources)} images")
    if not sources:
      return ()
    self._check_count(len(sources))
    budget = self.limits.max_media_bytes
    images = []
    for source in sources:
      images.append(self.decode(self._file(source), source.field, budget))
      budget -= images[-1].num_bytes
    return tuple(images)

  def _check_count(self, num: int) -> None:
    if self._model_max == 0:
      raise invalid(f"model {self._model!r} does not accept images: it is a text-only model; "
                    "send text content only")
    if num > self._model_max:
      raise invalid(f"{num} images in one prompt are more than model {self._model!r} takes "
                    f"({self._model_max})")
    if num > self.limits.max_images:
      raise invalid(f"{num} images in one prompt are more than this server's limit of "
                    f"{self.limits.max_images} (--limit-mm-per-prompt)")

  def _file(self, source: ImageSource) -> bytes:
    """The encoded image: gRPC's bytes, a data URL's payload, or a local file's contents."""
    if isinstance(source.data, bytes):
      self._check_file_size(len(source.data), source.field)
      return source.data
    url = source.data
    scheme = url.partition(":")[0].lower()
    if scheme == "data":
      return self._data_url(url, source.field)
    if scheme == "file":
      return self._local_file(url, source.field)
    if scheme in ("http", "https"):  # Only from the domains named (media_fetch.py).
      return media_fetch.fetch(url, source.field, self.limits.media_domains,
                               self.limits.max_media_bytes)
    raise invalid(f"{source.field}.url must be a data URL (data:image/png;base64,...) or a "
                  f"file:// URL under --allowed-local-media-path, got {short(url, 80)}")

  def _data_url(self, url: str, field: str) -> bytes:
    header, comma, payload = url.partition(",")
    media_type = header[len("data:"):].split(";")[0].lower()
    if not comma or not header.lower().endswith(";base64"):
      raise invalid(f"{field}: a data URL must be base64 (data:image/png;base64,...), got "
                    f"{short(header + comma, 60)}")
    if media_type and not media_type.startswith("image/"):
      raise invalid(f"{field}: the data URL's media type is {media_type!r}, not an image")
    self._check_file_size(len(payload) * 3 // 4, field)  # Before decoding it.
    try:
      return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
      raise invalid(f"{field}: the data URL's payload is not valid base64 ({e})") from e

  def _local_file(self, url: str, field: str) -> bytes:
    if self._root is None:
      raise invalid(f"{field}: local image files are refused: this server reads none unless it "
                    "is started with --allowed-local-media-path DIR")
    parts = urllib.parse.urlsplit(url)
    path = urllib.parse.unquote(parts.path)
    found = os.path.realpath(path)  # Symlinks resolved: none leads out of the root.
    if parts.netloc not in ("", "localhost") or not os.path.isfile(found) or os.path.commonpath(
        [found, self._root]) != self._root:
      raise invalid(f"{field}: no image file {short(path, 120)} under the allowed local media "
                    "path (--allowed-local-media-path)")
    with open(found, "rb") as f:
      data = f.read(self.limits.max_media_bytes + 1)  # No more than the limit, whatever its size.
    self._check_file_size(len(data), field)
    return data

  def _check_file_size(self, num_bytes: int, field: str) -> None:
    if num_bytes > self.limits.max_media_bytes:
      raise invalid(f"{field}: the image file is {num_bytes:,} bytes, more than this server's "
                    f"limit of {self.limits.max_media_bytes:,} (--max-media-bytes)")

  def decode(self, data: bytes, field: str, budget: int | None = None) -> Image:
    """`data` (an encoded PNG, JPEG or WebP) as RGB pixels; `budget`: the bytes the request's
    images may still decode to (None: max_media_bytes)."""
    budget = self.limits.max_media_bytes if budget is None else budget
    try:
      with PIL.Image.open(io.BytesIO(data), formats=FORMATS) as img:  # Reads the header only.
        self._check_header(img, field, budget)
        return Image.of(to_rgb(img))
    except PIL.Image.DecompressionBombError as e:  # Pillow's own cap, as it opens the header.
      raise invalid(f"{field}: the image was refused as a decompression bomb ({e}); this "
                    f"server's limit is {self.limits.max_image_pixels:,} pixels an image "
                    "(--max-image-pixels)") from e
    except PIL.UnidentifiedImageError as e:
      other = _other_format(data)
      if other is not None:
        raise invalid(f"{field}: image format {other} is not supported; send a {_FORMAT_NAMES} "
                      "image") from e
      raise invalid(f"{field}: the data is not a {_FORMAT_NAMES} image ({len(data):,} bytes "
                    "of no format known)") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # Truncated, or corrupt.
      raise invalid(f"{field}: the {_FORMAT_NAMES} image could not be decoded ({e}); it is "
                    "corrupt or truncated") from e

  def _check_header(self, img: PIL.Image.Image, field: str, budget: int) -> None:
    width, height = img.size
    if width * height > self.limits.max_image_pixels:
      raise invalid(f"{field}: the image is {width}x{height} = {width * height:,} pixels, more "
                    f"than this server's limit of {self.limits.max_image_pixels:,} pixels an "
                    "image (--max-image-pixels)")
    if width * height * 3 > budget:
      raise invalid(f"{field}: the request's images decode to more than this server's limit "
                    f"of {self.limits.max_media_bytes:,} bytes (--max-media-bytes); send fewer "
                    "or smaller images")


def _num_image_parts(messages: Sequence[Mapping[str, Any]]) -> int:
  """The {"type": "image"} parts of the messages' content lists (string content has none)."""
  contents = [m.get("content") for m in messages if isinstance(m, Mapping)]
  return sum(isinstance(p, Mapping) and p.get("type") == "image"
             for c in contents if isinstance(c, list) for p in c)


def _other_format(data: bytes) -> str | None:
  """The name of a format this server does not decode, from its first bytes; None: unknown."""
  if data[4:8] == b"ftyp":
    return _FTYP_FORMATS.get(data[8:12])
  return next((name for magic, name in _OTHER_FORMATS if data.startswith(magic)), None)


def to_rgb(img: PIL.Image.Image) -> np.ndarray:
  """[H, W, 3] uint8 pixels, as transformers' convert_to_rgb makes of a PIL image: transparency
  composited onto white, so a transparent background is not whatever color its pixels hold."""
  if "A" in img.getbands() or img.info.get("transparency") is not None:
    rgba = img.convert("RGBA")
    white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    img = PIL.Image.alpha_composite(white, rgba)
  return np.asarray(img.convert("RGB"))
