#!/usr/bin/env bash
# The accelerator check of issue 24, one command on a fresh machine with one NVIDIA GPU (under
# 10 minutes; nothing in CI depends on it):
#   1. a venv with jax[cuda12] at the project's jax version (pyproject's jax[tpu] pin),
#   2. the ragged kernel sweep compiled by Triton (not interpreted) against the jnp reference,
#      every KV dtype (float32, bfloat16, int8, float8 e4m3 / e5m2),
#   3. the engine tests on the Pallas GPU backend (the kernels against the jnp path in the engine),
#   4. decode steps of a Llama-3.2-1B-shaped model, random weights: bfloat16, int8 weights (where
#      the quantized-weight work is merged; skipped otherwise) and int8 KV, each step's fraction
#      of the GPU's memory bandwidth.
#   bash scripts/device_check.sh [--dry-run]   # --dry-run: print the commands, run nothing
# Output: stdout, and each step's log under device_check_out/ (paste into BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=${1:-}
run() { echo "+ $*"; [ "$DRY" = "--dry-run" ] || "$@"; }
OUT=device_check_out
if [ "$DRY" = "--dry-run" ]; then OUT=$(mktemp -d); fi
mkdir -p "$OUT"
JAX_VERSION=$(sed -n 's/.*"jax\[tpu\]==\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$JAX_VERSION" ] || { echo "no jax[tpu]==X pin in pyproject.toml" >&2; exit 1; }
echo "jax $JAX_VERSION; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true)"

VENV=.venv-device
if [ ! -x "$VENV/bin/python" ]; then run python3 -m venv "$VENV"; fi
PY="$VENV/bin/python"
run "$PY" -m pip install -q --upgrade pip
run "$PY" -m pip install -q "jax[cuda12]==$JAX_VERSION" -e . pytest
run "$PY" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"

export PYTHONPATH="$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false
# f32 matmuls in full f32 (not TF32), so the kernels and the references agree to the tests' 2e-5.
export JAX_DEFAULT_MATMUL_PRECISION=highest
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)
status=0
echo "== 2. ragged kernel sweep, compiled"
run env JAXSERVE_RAGGED_COMPILED=1 "${PYTEST[@]}" tests/test_kernels_ragged.py \
  -k "kernel_matches_reference or float8_per_tensor" 2>&1 | tee "$OUT/sweep.txt" || status=1
echo "== 3. engine tests, Pallas GPU backend"
run "${PYTEST[@]}" tests/test_backend_pallas.py -k "matches_reference" 2>&1 \
  | tee "$OUT/engine.txt" || status=1
echo "== 4. decode benchmark, Llama-3.2-1B-shaped"
for mode in "--weights bfloat16 --kv-dtype bfloat16" "--weights int8 --kv-dtype bfloat16" \
            "--weights bfloat16 --kv-dtype int8"; do
  # shellcheck disable=SC2086
  run "$PY" -m scripts.bench device $mode 2>&1 | tail -1 | tee -a "$OUT/bench.jsonl" \
    || status=1
done
exit $status
