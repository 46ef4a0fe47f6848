"""What a request's output must match: a constraint, as plain data on `SamplingParams`.

This layer checks what plain Python can (the kind, JSON that parses, a non-empty pattern) and
writes the text in a canonical form, so that equal constraints compare equal: they are the key of
the grammar cache. What only the grammar engine can check (a schema keyword it cannot enforce, a
regex that does not compile, a grammar's unknown rule) is `text/constraint.py`'s `check`, which
the serving core calls before a request is queued.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, Mapping, Sequence

from jaxserve.config.checks import json_type

# The longest constraint text (a schema, pattern, grammar, or the choices' JSON list) compiled:
# compile time grows faster than the text (a Lark rule of 32k alternatives, 352k characters, took
# 1.2 s, 60k took 9 s, 100k 20 s), and this bound keeps the worst well under a second.
MAX_CONSTRAINT_CHARS = 256 * 1024


class ConstraintKind(enum.Enum):
  JSON_OBJECT = "json_object"  # Any JSON object (OpenAI's response_format json_object).
  JSON_SCHEMA = "json_schema"  # text: the schema's JSON.
  REGEX = "regex"  # text: a pattern the whole output must match.
  CHOICE = "choice"  # text: a JSON list of the strings the output may be.
  GRAMMAR = "grammar"  # text: a Lark grammar, or a GBNF one (llama.cpp's, with `root ::=`).


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A kind and its text. Raises ValueError naming the problem when the text cannot be one."""

  kind: ConstraintKind
  text: str = ""  # Canonical: a schema or choice list is re-serialized, so spacing does not matter.

  @classmethod
  def json_object(cls) -> Constraint:
    return cls(ConstraintKind.JSON_OBJECT)

  @classmethod
  def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> Constraint:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return cls(ConstraintKind.JSON_SCHEMA, text)

  @classmethod
  def regex(cls, pattern: str) -> Constraint:
    return cls(ConstraintKind.REGEX, pattern)

  @classmethod
  def choice(cls, options: Sequence[str]) -> Constraint:
    return cls(ConstraintKind.CHOICE, json.dumps(list(options), ensure_ascii=False))

  @classmethod
  def grammar(cls, text: str) -> Constraint:
    return cls(ConstraintKind.GRAMMAR, text)

  def __post_init__(self):
    try:
      kind = ConstraintKind(self.kind)
    except ValueError:
      kinds = ", ".join(k.value for k in ConstraintKind)
      raise ValueError(f"constraint kind must be one of {kinds}, got {self.kind!r}") from None
    if not isinstance(self.text, str):
      raise ValueError(f"{kind.value} constraint text must be a string, "
                       f"got {type(self.text).__name__}")
    object.__setattr__(self, "kind", kind)
    if len(self.text) > 4 * MAX_CONSTRAINT_CHARS:  # Not even parsed: canonical text is shorter.
      raise _too_long(kind, len(self.text))
    text = _CANONICAL[kind](self.text)
    if len(text) > MAX_CONSTRAINT_CHARS:
      raise _too_long(kind, len(text))
    object.__setattr__(self, "text", text)

  @classmethod
  def from_json(cls, value: Any) -> Constraint:
    """From one-key JSON, as a batch file's line or the gRPC oneof spell it: {"json_schema": {...}},
    {"json_object": true}, {"regex": "..."}, {"choice": ["a", "b"]} or {"grammar": "..."}."""
    kinds = ", ".join(k.value for k in ConstraintKind)
    if not (isinstance(value, dict) and len(value) == 1):
      raise ValueError(f"a constraint must be an object with one key of {kinds}, got {value!r:.80}")
    (kind, arg), = value.items()
    makers = {"json_object": lambda a: cls.json_object(), "json_schema": cls.json_schema,
              "regex": cls.regex, "choice": cls.choice, "grammar": cls.grammar}
    if kind not in makers:
      raise ValueError(f"constraint kind must be one of {kinds}, got {kind!r}")
    if kind == "choice" and not isinstance(arg, list):
      raise ValueError(f"choice constraint: the options must be a list of strings, got {arg!r:.80}")
    if kind in ("regex", "grammar") and not isinstance(arg, str):
      raise ValueError(f"{kind} constraint must be a string, got {arg!r:.80}")
    return makers[kind](arg)

  @property
  def schema(self) -> Any:
    """The JSON schema of a json_schema constraint (parsed from its text)."""
    return json.loads(self.text) if self.kind is ConstraintKind.JSON_SCHEMA else None


def _too_long(kind: ConstraintKind, num_chars: int) -> ValueError:
  what = "choice list" if kind is ConstraintKind.CHOICE else f"{kind.value} constraint"
  return ValueError(f"the {what} is {num_chars:,} characters long, more than the "
                    f"{MAX_CONSTRAINT_CHARS:,} a constraint may have")


def _json_object(text: str) -> str:
  if text:
    raise ValueError("json_object constraint takes no text (use json_schema for a schema)")
  return ""


def _json_schema(text: str) -> str:
  schema = parse_json(text, "json_schema constraint: the schema")
  if not isinstance(schema, (dict, bool)):
    raise ValueError("json_schema constraint: the schema must be a JSON object, "
                     f"got {json_type(schema)}")
  # Key order is kept: properties are generated in the order the schema lists them.
  return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _regex(text: str) -> str:
  if not text:
    raise ValueError("regex constraint: the pattern is empty")
  return text


def _choice(text: str) -> str:
  options = parse_json(text, "choice constraint: the options")
  if not isinstance(options, list) or not options:
    raise ValueError("choice constraint: the options must be a non-empty list of strings")
  for n, option in enumerate(options):
    if not isinstance(option, str) or not option:
      raise ValueError(f"choice constraint: option {n} must be a non-empty string, got {option!r}")
  return json.dumps(options, ensure_ascii=False)


def _grammar(text: str) -> str:
  if not text.strip():
    raise ValueError("grammar constraint: the grammar is empty")
  return text


_CANONICAL = {ConstraintKind.JSON_OBJECT: _json_object, ConstraintKind.JSON_SCHEMA: _json_schema,
              ConstraintKind.REGEX: _regex, ConstraintKind.CHOICE: _choice,
              ConstraintKind.GRAMMAR: _grammar}


def parse_json(text: str, what: str) -> Any:
  try:
    return json.loads(text)
  except RecursionError:
    raise ValueError(f"{what} is nested too deeply") from None
  except ValueError as e:
    raise ValueError(f"{what} is not valid JSON: {e}") from None
