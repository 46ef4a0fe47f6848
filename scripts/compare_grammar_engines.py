"""llguidance vs xgrammar on the default model's vocab (SmolLM2: byte-level BPE, 49,152 tokens).

Both engines get their tokenizer info from jaxserve's Tokenizer (`constraint.vocab_bytes`), never a
hub download. Measured: the installed size of each package and of what it pulls in, the time to
build the tokenizer info, to compile four constraints (a 3-level nested JSON schema, a regex, a
choice list, a GBNF grammar) with every cache off, the mask time per token for 1 and for 16
sequences (each drives a valid output token by token: fill the mask, then accept the token), and
which JSON-schema keywords each enforces (accepts a valid instance and refuses a breaking one).
Times are medians, wall clock and process CPU (all threads), so read them on a quiet machine.

  python scripts/compare_grammar_engines.py [--xgrammar-path DIR]   # DIR: a `pip install --target`
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time

import numpy as np

from jaxserve.loading import checkpoint
from jaxserve.text.constraint import Constraint, ConstraintCompiler
from jaxserve.text.constraint_vocab import vocab_bytes
from jaxserve.text.tokenizer import Tokenizer

NESTED_SCHEMA = {"type": "object", "required": ["id", "customer", "items"], "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
    "status": {"enum": ["open", "paid", "shipped"]},
    "customer": {"type": "object", "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 40},
        "address": {"type": "object", "required": ["city", "country"], "properties": {
            "city": {"type": "string"}, "country": {"enum": ["FR", "DE", "US"]},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
        "type": "object", "required": ["sku", "qty"], "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 100}}}}}}
# (kind, text, a valid output) for the compile and mask timings.
WORKLOADS = {
    "json_schema": ("json_schema", json.dumps(NESTED_SCHEMA), json.dumps({
        "id": 4211, "status": "paid", "customer": {"name": "Marie Curie", "address": {
            "city": "Paris", "country": "FR", "zip": "75005"}},
        "items": [{"sku": "A-100", "qty": 2}, {"sku": "B-7", "qty": 15},
                  {"sku": "C-3", "qty": 1}]})),
    "regex": ("regex", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T[0-9]{2}:[0-9]{2}",
              "2024-05-17T09:30"),
    "choice": ("choice", json.dumps(["positive", "negative", "neutral", "mixed", "not sure"]),
               "neutral"),
    "grammar": ("grammar", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                'term ::= factor (("*" | "/") factor)*\nfactor ::= [0-9]+ | "(" expr ")"',
                "(12+3)*4-5/(6+78)"),
}
# (keyword, schema, valid instance, breaking instance).
FEATURES = [
    ("integer minimum/maximum", {"type": "integer", "minimum": 0, "maximum": 10}, 7, 11),
    ("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 0}, 1, 0),
    ("number bounds", {"type": "number", "minimum": 0.5, "maximum": 1.5}, 1.25, 2.5),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    ("pattern", {"type": "string", "pattern": "^[a-z]+$"}, "abc", "ABC"),
    ("format: date", {"type": "string", "format": "date"}, "2024-01-31", "tomorrow"),
    ("format: email", {"type": "string", "format": "email"}, "a@b.co", "no email"),
    ("format: uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000",
     "x"),
    ("enum", {"enum": ["a", "b"]}, "a", "c"),
    ("const", {"const": "x"}, "x", "y"),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                           "maxItems": 2},
     [1], [1, 2, 3]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2],
     [1, 1]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, [1, "a"], ["a", 1]),
    ("contains", {"type": "array", "contains": {"const": 1}}, [0, 1], [0]),
    ("required + additionalProperties false",
     {"type": "object", "properties": {"a": {"type": "integer"}},
      "required": ["a"], "additionalProperties": False},
     {"a": 1}, {"b": 1}),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"x": 1}, {"x": "s"}),
    ("patternProperties", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"m": 1}),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 3}}, {"ab": 1},
     {"abcd": 1}),
    ("maxProperties", {"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, "a", "abc"),
    ("oneOf (both match)", {"oneOf": [{"type": "integer", "multipleOf": 2},
                                      {"type": "integer", "multipleOf": 3}]}, 4, 6),
    ("allOf", {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
     3, 7),
    ("$ref/$defs", {"$defs": {"p": {"type": "integer", "maximum": 3}}, "type": "array",
                    "items": {"$ref": "#/$defs/p"}}, [1], [9]),
    ("recursive $ref", {"$defs": {"n": {"type": "object", "properties": {"c": {
        "type": "array", "items": {"$ref": "#/$defs/n"}}}, "additionalProperties": False}},
        "$ref": "#/$defs/n"}, {"c": [{"c": []}]}, {"c": [{"d": 1}]}),
    ("if/then/else",
     {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}}, 1, -1),
    ("not", {"not": {"type": "string"}}, 1, "a"),
    ("dependentRequired", {"type": "object", "properties": {"a": {}, "b": {}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    ("type list", {"type": ["integer", "null"]}, None, "a"),
]


class Llguidance:
  """jaxserve's own path: Constraint validation, ConstraintCompiler, its mask filling."""
  name = "llguidance"

  def __init__(self, tokenizer: Tokenizer):
    # Cache off: every compile counts.
    self.compiler = ConstraintCompiler(tokenizer, max_grammars=0)

  def compile(self, kind: str, text: str):
    return self.compiler.compile(Constraint(kind, text))

  def matcher(self, grammar):
    return grammar.matcher()

  def accept(self, matcher, token: int) -> bool:
    return matcher.accept(token)

  def can_end(self, matcher) -> bool:
    return matcher.can_end

  def fill(self, matchers, bitmask) -> None:
    self.compiler.fill_bitmask(bitmask, list(enumerate(matchers)))


class Xgrammar:
  name = "xgrammar"

  def __init__(self, tokenizer: Tokenizer):
    import xgrammar  # Imports torch: about 5 s here.
    self.strict = True  # xgrammar's default: no properties or items the schema does not list.
    self.xgr = xgrammar
    token_bytes, special = vocab_bytes(tokenizer)
    for i in special:  # An empty token is one xgrammar never matches in text.
      token_bytes[i] = b""
    self.stops = sorted(tokenizer.stop_ids)
    info = xgrammar.TokenizerInfo(token_bytes, xgrammar.VocabType.RAW,
                                  vocab_size=tokenizer.vocab_size, stop_token_ids=self.stops)
    self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

  def compile(self, kind: str, text: str):
    c = self.compiler
    if kind == "json_schema":  # Spaced as jaxserve's llguidance grammars are.
      return c.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "),
                                   strict_mode=self.strict)
    if kind == "regex":
      return c.compile_regex(text)
    if kind == "choice":
      return c.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in json.loads(text)))
    return c.compile_grammar(text)

  def matcher(self, grammar):
    return self.xgr.GrammarMatcher(grammar)

  def accept(self, matcher, token: int) -> bool:
    return matcher.accept_token(token)

  def can_end(self, matcher) -> bool:
    return matcher.fork().accept_token(self.stops[0])

  def fill(self, matchers, bitmask) -> None:
    if len(matchers) == 1:
      matchers[0].fill_next_token_bitmask(bitmask, 0)
    else:
      self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


def timed(fn, repeats: int):
  """(result of the last call, median wall ms, median process-CPU ms)."""
  walls, cpus = [], []
  for _ in range(repeats):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    walls.append(time.perf_counter() - w)
    cpus.append(time.process_time() - c)
  return out, 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)


def mask_times(engine, grammar, ids, num_seqs: int, vocab_words: int) -> tuple[float, float]:
  """Median ms per decode step to fill the [num_seqs, W] mask, over the steps of `ids`."""
  matchers = [engine.matcher(grammar) for _ in range(num_seqs)]
  bitmask = np.full((num_seqs, vocab_words), -1, np.int32)
  walls, cpus = [], []
  for token in ids:
    _, wall, cpu = timed(lambda: engine.fill(matchers, bitmask), 1)
    walls.append(wall)
    cpus.append(cpu)
    bit = (bitmask[:, token // 32] >> (token % 32)) & 1
    assert bit.all(), f"{engine.name}: token {token} of the valid output is masked"
    assert all(engine.accept(m, token) for m in matchers)
  return statistics.median(walls), statistics.median(cpus)


def feature_support(engine, tokenizer) -> dict[str, str]:
  """keyword -> enforced | ignored (takes the breaking instance) | refused (no compile) | wrong."""
  results = {}
  for name, schema, good, bad in FEATURES:
    try:
      grammar = engine.compile("json_schema", json.dumps(schema))
    except Exception as e:  # Each engine raises its own types.
      results[name] = f"refused ({type(e).__name__})"
      continue
    takes = []
    for instance in (good, bad):
      m = engine.matcher(grammar)
      ok = all(engine.accept(m, t) for t in tokenizer.encode(json.dumps(instance)))
      takes.append(ok and engine.can_end(m))
    results[name] = {(True, False): "enforced", (True, True): "ignored"}.get(tuple(takes), "wrong")
  return results


def installed_mib(dist_name: str) -> str:
  try:
    dist = importlib.metadata.distribution(dist_name)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"
  size = sum(f.locate().stat().st_size for f in dist.files or () if f.locate().exists())
  return f"{size / 2**20:.1f} MiB"


def report_install(names) -> None:
  for name in names:
    requires = importlib.metadata.requires(name) or []
    runtime = [r.split(";")[0].strip() for r in requires if "extra ==" not in r]
    deps = ", ".join(f"{r} ({installed_mib(r.split('>')[0].split('=')[0].split('<')[0])})"
                     for r in runtime)
    print(f"{name} {importlib.metadata.version(name)}: {installed_mib(name)}; "
          f"requires: {deps or 'nothing'}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--xgrammar-path", help="a folder holding xgrammar (pip install --target)")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  if args.xgrammar_path:
    sys.path.insert(0, args.xgrammar_path)
  tokenizer = Tokenizer.from_hf_dir(checkpoint.resolve(None) / "tokenizer")
  words = -(-tokenizer.vocab_size // 32)
  report_install(["llguidance", "xgrammar"])
  support = {}
  for cls in (Llguidance, Xgrammar):
    engine, wall, _ = timed(lambda: cls(tokenizer), 1)
    print(f"\n## {cls.name}: tokenizer info in {wall:.0f} ms")
    print("| constraint | compile ms (wall / cpu) | first mask ms | mask ms/step, 1 seq | "
          "16 seqs |")
    print("|---|---|---|---|---|")
    for label, (kind, text, output) in WORKLOADS.items():
      grammar, wall, cpu = timed(lambda: engine.compile(kind, text), args.repeats)
      _, first, _ = timed(lambda: engine.fill([engine.matcher(grammar)],
                                              np.full((1, words), -1, np.int32)), 1)
      ids = tokenizer.encode(output)
      one = mask_times(engine, grammar, ids, 1, words)
      many = mask_times(engine, grammar, ids, 16, words)
      print(f"| {label} ({len(ids)} tokens) | {wall:.2f} / {cpu:.2f} | {first:.2f} | "
            f"{one[0]:.3f} / {one[1]:.3f} | {many[0]:.3f} / {many[1]:.3f} |")
    support[cls.name] = feature_support(engine, tokenizer)
    if cls is Xgrammar:
      engine.strict = False
      support["xgrammar strict_mode=False"] = feature_support(engine, tokenizer)
  print("\n| JSON-schema keyword | " + " | ".join(support) + " |")
  print("|---" * (len(support) + 1) + "|")
  for name, *_ in FEATURES:
    print(f"| {name} | " + " | ".join(results[name] for results in support.values()) + " |")

if __name__ == "__main__":
  main()
