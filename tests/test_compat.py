"""jaxserve/compat.py: every probe of a jax API we lean on passes on the pinned jax (the same
probes are the H200 smoke run's first step, on that machine's jax 0.11.2), and flax's hijax shim
lets flax.nnx import and run on a jax without `HiPrimitive`, as jax 0.11.2 is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxserve import compat

ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def test_every_probe_passes_on_the_pinned_jax():
  out = subprocess.run([sys.executable, "-m", "jaxserve.compat"], env=ENV, capture_output=True,
                       text=True, timeout=300)
  report = json.loads(out.stdout.splitlines()[-1])
  assert report["probes"] == {name: "ok" for name in compat.PROBES}, report["probes"]
  assert out.returncode == 0 and not report["flax_hijax_patched"]


def test_flax_imports_and_runs_on_a_jax_without_hiprimitive():
  code = ("from jax.experimental import hijax; del hijax.HiPrimitive\n"
          "from jaxserve import compat; assert compat.patch_flax_hijax()\n"
          "assert not compat.patch_flax_hijax()  # Once only.\n"
          "import jax.numpy as jnp; from flax import nnx\n"
          "print(nnx.Linear(2, 3, rngs=nnx.Rngs(0))(jnp.ones((1, 2))).shape)")
  out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "(1, 3)", out.stderr[-2000:]


def test_the_compile_event_names_are_jaxs():
  from jax._src import dispatch
  assert compat.BACKEND_COMPILE_EVENT == dispatch.BACKEND_COMPILE_EVENT
  assert compat.JAXPR_TRACE_EVENT == dispatch.JAXPR_TRACE_EVENT
