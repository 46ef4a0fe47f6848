"""Reads a GGUF file's key/value metadata straight from the file.

`gguf.GGUFReader` builds a numpy view per string of every array, which takes seconds for a 262k
token vocabulary; this reads the header once, keeping numeric arrays as numpy arrays.
"""

from __future__ import annotations

import mmap
import pathlib
import struct
from typing import Any

import gguf
import numpy as np

_V = gguf.GGUFValueType
_GGUF_DTYPES = {_V.UINT8: "<u1", _V.INT8: "<i1", _V.UINT16: "<u2", _V.INT16: "<i2",
                _V.UINT32: "<u4", _V.INT32: "<i4", _V.FLOAT32: "<f4", _V.BOOL: "?",
                _V.UINT64: "<u8", _V.INT64: "<i8", _V.FLOAT64: "<f8"}


def read_gguf_metadata(path: str | pathlib.Path, prefix: str = "") -> dict[str, Any]:
  """The GGUF key/values whose key starts with `prefix`; numeric arrays come as numpy arrays."""
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    magic, version, _, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
      raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
    meta, pos = {}, 24
    for _ in range(num_kv):
      key, pos = _gguf_string(buf, pos)
      (kind,) = struct.unpack_from("<I", buf, pos)
      value, pos = _gguf_value(buf, pos + 4, _V(kind))
      if key.startswith(prefix):
        meta[key] = value
  return meta


def _gguf_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
  (n,) = struct.unpack_from("<Q", buf, pos)
  return buf[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _gguf_value(buf: mmap.mmap, pos: int, kind: gguf.GGUFValueType) -> tuple[Any, int]:
  if kind == _V.STRING:
    return _gguf_string(buf, pos)
  if kind != _V.ARRAY:
    dtype = np.dtype(_GGUF_DTYPES[kind])
    return np.frombuffer(buf[pos:pos + dtype.itemsize], dtype)[0].item(), pos + dtype.itemsize
  item_kind, count = struct.unpack_from("<IQ", buf, pos)
  pos += 12
  if _V(item_kind) in _GGUF_DTYPES:
    dtype = np.dtype(_GGUF_DTYPES[_V(item_kind)])
    end = pos + count * dtype.itemsize
    return np.frombuffer(buf[pos:end], dtype), end
  items = []
  for _ in range(count):
    item, pos = _gguf_value(buf, pos, _V(item_kind))
    items.append(item)
  return items, pos
