"""Constraints at their limits: large choice lists, the grammar engine's warnings and limits, the
compile budget (size, time, per API key), compiles that never block the cache's readers, and
allowed_token_ids that leave a constraint no token."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from jaxserve.batching.constrained import Constraints
from jaxserve.config import SamplingParams
from jaxserve.config.constraint import MAX_CONSTRAINT_CHARS
from jaxserve.loading import checkpoint
from jaxserve.serving.constraint_gate import ConstraintGate
from jaxserve.serving.gateway import ApiError, Status
from jaxserve.text.constraint import Constraint, ConstraintCompiler, check
from jaxserve.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
  return Tokenizer.from_hf_dir(checkpoint.resolve(None) / "tokenizer")


@pytest.fixture(scope="module")
def constraints(tokenizer) -> Constraints:
  return Constraints(tokenizer, tokenizer.vocab_size, num_slots=4)


def allowed(matcher, vocab_size: int) -> np.ndarray:
  words = np.frombuffer(matcher._m.compute_bitmask(), np.int32)
  return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])


def walk(grammar, tokenizer, rng, max_len=50) -> str:
  """Draws uniformly among the allowed tokens until only an end is left or one is drawn."""
  matcher, ids, stops = grammar.matcher(), [], sorted(tokenizer.stop_ids)
  for _ in range(max_len):
    ok = allowed(matcher, tokenizer.vocab_size)
    assert not matcher.error and ok.size, (tokenizer.detokenize(ids), matcher.error)
    token = int(rng.choice(ok))
    if token in stops:
      return tokenizer.detokenize(ids)
    assert matcher.accept(token), matcher.error
    ids.append(token)
  raise AssertionError(f"no end after {max_len} tokens")


def slow_grammar(depth: int = 1_200, word: str = "x") -> Constraint:
  """A chain of nested Lark rules: about a second to compile at 1,200 deep (in a thread of any
  stack: 3,000 overflowed an 8 MiB one)."""
  return Constraint.grammar("start: b0\n" + "".join(f'b{i}: "{word}" b{i + 1} | "y"\n'
                                                     for i in range(depth)) + f'b{depth}: "z"')


# Item 2: choice lists past llguidance's 2,000-item row limit.

@pytest.mark.parametrize("num_options", [2_000, 2_500, 20_000])
def test_a_large_choice_list_only_ever_gives_one_of_its_choices(constraints, tokenizer,
                                                                 num_options):
  options = [f"item{i}" for i in range(num_options)]
  grammar = constraints.grammar(Constraint.choice(options))
  # The prefix every option shares is not an output: the matcher must go on past it (a parser
  # row over its limit left "item" as the whole output, finish stop).
  matcher = grammar.matcher(tokenizer.encode("item", add_bos=False))
  assert not matcher.error and not matcher.can_end
  assert matcher.accept_all(tokenizer.encode("1234", add_bos=False)) and matcher.can_end
  rng = np.random.default_rng(num_options)
  texts = [walk(grammar, tokenizer, rng) for _ in range(30)]
  assert set(texts) <= set(options), set(texts) - set(options)


def test_a_warning_of_the_grammar_engine_is_refused():
  # Without the vocabulary, llguidance only warns that it cannot check a token id.
  with pytest.raises(ValueError, match="cannot be enforced: the grammar engine warns: no "
                                       "tokenizer"):
    check(Constraint.grammar("start: <[1]>"))


def test_a_grammar_of_token_ids_compiles_against_the_vocabulary(constraints):
  assert constraints.grammar(Constraint.grammar("start: <[1]>")).first_mask[0] == 0b10


# Item 3: the compile budget.

def test_a_100k_option_list_is_refused_before_any_compile(constraints):
  compiler = constraints.compiler
  num_compiles = compiler.num_compiles
  start = time.perf_counter()
  with pytest.raises(ValueError, match=f"more than the {MAX_CONSTRAINT_CHARS:,} a constraint"):
    Constraint.choice([f"item{i}" for i in range(100_000)])
  assert time.perf_counter() - start < 2.0  # It took 46 s of llguidance before.
  assert compiler.num_compiles == num_compiles


def test_a_compile_never_holds_the_lock_the_cache_readers_take(tokenizer):
  """The event loop reads the cache (`cached`) while other threads compile: it must never wait
  on a compile. The lock that guards the cache is probed all through a slow compile."""
  compiler = ConstraintCompiler(tokenizer)
  small = Constraint.regex("[ab]")
  compiler.compile(small)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(compiler.compile, slow_grammar())
    num_probes = 0
    while not future.done():
      got = compiler._lock.acquire(timeout=0.05)
      assert got, "the lock was held through a compile"
      compiler._lock.release()
      assert compiler.cached(small) is not None
      num_probes += 1
      time.sleep(0.005)
    future.result()
  assert num_probes >= 5  # The compile lasted long enough to be probed.


def test_the_gate_bounds_compiles_per_key_and_in_time(constraints):
  gate = ConstraintGate(constraints, per_key=1, timeout_s=0.01, num_threads=2)
  slow = SamplingParams(constraint=slow_grammar(word="u"))
  with pytest.raises(ApiError, match=r"did not compile within 0.01 s \(the compile budget\)") as e:
    gate.compile("a", slow)
  assert e.value.status is Status.INVALID_ARGUMENT
  # The compile runs on and holds key a's one slot: a's next compile is refused at once, b's not.
  assert gate.num_running("a") == 1
  with pytest.raises(ApiError, match="at most 1 at once") as e:
    gate.compile("a", SamplingParams(constraint=Constraint.regex("[cd]")))
  assert e.value.status is Status.RESOURCE_EXHAUSTED
  gate.timeout_s = 30.0
  assert gate.compile("b", SamplingParams(constraint=Constraint.regex("[ef]"))) is not None
  deadline = time.monotonic() + 60
  while gate.num_running("a") and time.monotonic() < deadline:
    time.sleep(0.01)
  assert gate.num_running("a") == 0
  # Compiled in the end, so a cache hit now: no slot, no thread, at once.
  assert gate.compile("a", slow).constraint == slow.constraint


def test_a_compile_that_never_started_in_time_is_busy_not_invalid(constraints):
  gate = ConstraintGate(constraints, per_key=2, timeout_s=0.01, num_threads=1)
  with pytest.raises(ApiError, match="did not compile within"):
    gate.compile("a", SamplingParams(constraint=slow_grammar(word="v")))
  with pytest.raises(ApiError, match="compilers were busy") as e:  # Queued behind the first.
    gate.compile("b", SamplingParams(constraint=Constraint.regex("[gh]")))
  assert e.value.status is Status.RESOURCE_EXHAUSTED


def test_the_event_loop_awaits_a_compile_without_blocking(constraints):
  """The compile cannot finish until the event loop has ticked five times: a gate that blocked
  the loop would leave it waiting out its 10 s and the test fails (no timing involved)."""
  import asyncio

  ticked = threading.Event()

  class AfterTheLoopRan:  # The real Constraints, whose compile starts once the loop has run on.
    cached = staticmethod(constraints.cached)

    def grammar(self, *args):
      assert ticked.wait(10), "the event loop did not run while the compile was pending"
      return constraints.grammar(*args)

  gate = ConstraintGate(AfterTheLoopRan(), timeout_s=30.0)

  async def main():
    ticks = 0
    task = asyncio.ensure_future(gate.compile_async(
        "a", SamplingParams(constraint=slow_grammar(word="w"))))
    while not task.done():
      await asyncio.sleep(0.01)
      ticks += 1
      if ticks == 5:
        ticked.set()
    return await task, ticks

  grammar, ticks = asyncio.run(main())
  assert grammar is not None and ticks >= 5


# Item 11: allowed_token_ids that leave a constraint no token.

def test_allowed_token_ids_that_leave_no_token_are_refused(constraints, tokenizer):
  red = tokenizer.encode("red", add_bos=False)
  choice = Constraint.choice(["red", "green"])
  constraints.grammar(choice, allowed_token_ids=red[:1])  # "red" can start: fine.
  far = tokenizer.encode(" zebra", add_bos=False)[:1]
  with pytest.raises(ValueError, match="allowed_token_ids and the choice constraint leave no "
                                       "token to start the output with"):
    constraints.grammar(choice, allowed_token_ids=far)
  before = threading.active_count()  # Other modules' servers may have left threads of theirs.
  gate = ConstraintGate(constraints)  # The cached grammar is checked as well.
  for _ in range(8):
    with pytest.raises(ApiError, match="leave no token") as e:
      gate.compile("a", SamplingParams(constraint=choice, allowed_token_ids=far))
    assert e.value.status is Status.INVALID_ARGUMENT
  assert threading.active_count() <= before + 4  # The gate's pool; no thread left per call.


def test_a_grammar_that_overflows_the_parser_on_its_first_token_is_refused(constraints):
  # Passes llguidance's checks, then its first token makes a parser row of 2,501 items.
  rule = Constraint.grammar("start: " + " | ".join(f'"item{i}"' for i in range(2_500)))
  with pytest.raises(ValueError, match="grammar constraint cannot be enforced: .*max is 2000"):
    constraints.grammar(rule)
  assert constraints.grammar(Constraint.grammar('start: "a" | "b"')) is not None


def test_a_deeply_nested_grammar_compiles_in_the_gate_without_crashing(constraints, tokenizer):
  """llguidance recurses over nesting: 3,000 nested rules overflowed an 8 MiB thread stack and
  killed the process. The gate's threads have stacks for the deepest the size cap lets through."""
  depth = 13_000
  deep = Constraint.grammar("start: b0\n" + "".join(f'b{i}: "x" b{i + 1}\n' for i in range(depth))
                            + f'b{depth}: "z"')
  assert len(deep.text) > 0.8 * MAX_CONSTRAINT_CHARS
  grammar = ConstraintGate(constraints, timeout_s=300).compile("a", SamplingParams(constraint=deep))
  matcher = grammar.matcher(tokenizer.encode("x" * 64, add_bos=False))
  assert matcher.num_tokens > 0 and not matcher.error and not matcher.can_end


def _compile_threads() -> set[threading.Thread]:
  return {t for t in threading.enumerate() if t.name.startswith("constraint-compile")}


def test_a_gate_holds_threads_only_while_it_compiles_and_they_end_with_it(constraints):
  """A server test suite creates a gate per Service: its threads (256 MiB stacks each) must not
  outlive it, nor start before a compile needs them."""
  import gc

  before = _compile_threads()
  gate = ConstraintGate(constraints, num_threads=3)
  assert _compile_threads() == before
  for n, regex in enumerate(["[ij]", "[kl]x", "[mn]y"]):  # One at a time: one thread does.
    gate.compile(f"k{n}", SamplingParams(constraint=Constraint.regex(regex)))
  started = _compile_threads() - before
  assert len(started) == 1
  del gate
  gc.collect()
  for t in started:
    t.join(timeout=10)
  assert not any(t.is_alive() for t in started)
