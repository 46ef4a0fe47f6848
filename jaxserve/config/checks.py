"""Checks shared by every config and by the front ends' request parsers."""

from __future__ import annotations

from typing import Any


def is_int(x: Any) -> bool:
  """An int, and not a bool: JSON's true is no number."""
  return isinstance(x, int) and not isinstance(x, bool)


def short(value: Any, limit: int = 80) -> str:
  """repr(value), cut to `limit` characters: an error message quotes a bad value, not 10 MB."""
  shown = repr(value)
  return shown if len(shown) <= limit else shown[:limit] + "..."


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "a number", float: "a number", type(None): "null"}


def json_type(value: Any) -> str:
  """What a parsed JSON value is, as an error message names it: "an array", "null", ..."""
  return _JSON_TYPES.get(type(value), type(value).__name__)
