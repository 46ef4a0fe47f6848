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
