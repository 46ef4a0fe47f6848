"""Shared fixtures: tiny random models for fast tests, the real default model for a few, and one
tiny server per server-test module. What tests share that is not a fixture is in support/."""

from __future__ import annotations

import gc
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
# libtpu (the test extra, for compiling to TPU here) takes a lock per process; tests and their
# subprocesses each load it, and none drives a chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import pytest
from flax import nnx

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import enable_compilation_cache
from jaxserve.model.llama import Transformer
from support.mock_engine import assert_all_free
from support.tiny import TINY

pytest_plugins = ("support.skip_allowlist",)  # --allowed-skips, which .ci/run passes.

# The persistent XLA cache on from the first compile, in the directory `jaxserve serve` uses:
# every engine's programs are saved (those of configs with compilation_cache_dir=None too, which
# only keep an engine from turning the cache on), so a later engine of the same shapes, in
# another module or a server subprocess, loads them instead of compiling. A load still counts
# as a compile in support.tiny.count_compiles, so no recompile goes unseen.
enable_compilation_cache(EngineConfig.compilation_cache_dir)


# XLA:CPU maps each compiled program's code and data into the process (about 2,800 mappings for a
# tiny engine's warm-up), and Linux refuses a process more than vm.max_map_count (65,530 by
# default): a run that kept every module's engines alive got there after ~990 tests, and XLA died
# (SIGSEGV on CI, SIGABRT here). A module's engines go with it; past MAX_MAPS mappings the jit
# caches go too (what later modules share then loads from the persistent cache).
MAX_MAPS = 40_000


def num_mappings() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


@pytest.fixture(scope="module", autouse=True)
def _free_the_modules_programs(request):
  yield
  if not sys.platform.startswith("linux"):
    return
  gc.collect()
  if num_mappings() > MAX_MAPS:
    jax.clear_caches()
    gc.collect()
  if os.environ.get("JAXSERVE_TEST_MAPS_LOG"):
    with open(os.environ["JAXSERVE_TEST_MAPS_LOG"], "a") as f:
      f.write(f"{request.module.__name__} {num_mappings()}\n")


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
  return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def default_model():
  """The real default model (SmolLM2-135M-Instruct), pulled and converted on first use."""
  from jaxserve.loading import checkpoint
  return checkpoint.load_model(None)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_model):
  """A jaxserve checkpoint of a tiny random model with the default model's tokenizer (49,152
  tokens): real text in and out, compiled in seconds. Load it with `LLM(str(path))`."""
  import dataclasses

  from jaxserve.loading import checkpoint

  cfg = dataclasses.replace(TINY, vocab_size=default_model[1].vocab_size, max_seq_len=512,
                            name="tiny-smollm2-vocab")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  path = tmp_path_factory.mktemp("ckpt") / "tiny"
  checkpoint.save(path, cfg, jax.tree.map(lambda x: x, nnx.to_pure_dict(nnx.state(model))),
                  default_model[1])
  return path


@pytest.fixture(scope="session")
def smol():
  """SmolLM2's tokenizer from its GGUF, read once for the modules that test tokenizing."""
  from jaxserve.loading import pull
  from jaxserve.text.tokenizer import Tokenizer
  return Tokenizer.from_gguf(pull.gguf_path(pull.SMOLLM2))


@pytest.fixture(scope="session")
def gemma():
  """Gemma 3's tokenizer from its GGUF (pulled on first use), read once."""
  from jaxserve.loading import pull
  from jaxserve.text.tokenizer import Tokenizer
  return Tokenizer.from_gguf(pull.gguf_path(pull.GEMMA3))


@pytest.fixture(scope="module")
def srv_options() -> dict:
  """How a module's `srv` differs; the module overrides this fixture. `keys`: serve with
  support.server_harness.KEYS and their limits; `engine`: (engine, tokenizer, model name) to serve
  instead of the tiny checkpoint's; the rest are ServerConfig fields. A module whose offline
  reference must run before the server shares the engine makes its override depend on it."""
  return {}


@pytest.fixture(scope="module")
def srv(request, srv_options, tmp_path_factory):
  """A server per module on the session's engine: no module sees another's prefix cache, rate
  limits or counters, and none compiles again."""
  from support import server_harness as h  # Here, so tests without a server import no grpc.

  options = dict(srv_options)
  keys = options.pop("keys", False) and h.write_keys(tmp_path_factory.mktemp("keys") / "keys.json")
  engine = options.pop("engine", None)
  if engine is None:
    engine = (*h.warm_engine(str(request.getfixturevalue("tiny_checkpoint"))), "tiny")
  st = h.serve(*engine, keys_file=keys or None, **options)
  yield st
  st.close()


@pytest.fixture
def checked():
  """Registers schedulers (or runners); after the test, asserts each is back to all-free."""
  items = []
  yield lambda x: items.append(x) or x
  for x in items:
    if hasattr(x, "scheduler"):
      assert not x.has_unfinished
      x = x.scheduler
    assert_all_free(x)
