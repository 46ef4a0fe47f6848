#!/usr/bin/env bash
# Issue 45's check on the lent H200 machine as it is: no network, its own python3 (3.12) with jax
# 0.11.2 + the CUDA 13 plugin, flax, torch, transformers; this tree run in place (PYTHONPATH),
# the packages that image lacks carried as wheels in .whl/ (scripts/device_wheels.py), the C++
# CPU kernels not built. Each step is its own timed sub-run with its own log and exit code, so a
# failing step hides no other; the logs and one summary.json land in $OUT (the device tool's
# folder; device_check_out/ elsewhere).
#
#   bash scripts/device_check.sh --fetch-wheels  # here, once: download .whl/ (10 MiB), check it
#   bash scripts/device_check.sh --dry-run       # here: is the wheel set complete? print steps
#   bash scripts/device_check.sh --smoke         # on the H200 first: about 3 minutes at most
#   bash scripts/device_check.sh                 # on the H200: every step, under 8 minutes
# On the device tool: command `bash scripts/device_check.sh --smoke`, carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:---full}
case $MODE in --full|--smoke|--dry-run|--fetch-wheels) ;; *) echo "usage: $0 [--smoke|--dry-run|--fetch-wheels]" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/device_check_out}
WORK=$(mktemp -d)  # The logs, packed at the end: the tool brings back 8 files at most.
BUDGET=${DEVICE_CHECK_BUDGET:-$([ "$MODE" = --smoke ] && echo 180 || echo 455)}  # Seconds, all steps.
START=$SECONDS

if [ "$MODE" = --fetch-wheels ]; then exec "$PY" -m scripts.device_wheels fetch; fi
if [ "$MODE" = --dry-run ]; then
  "$PY" -m scripts.device_wheels check || exit 1
  echo "wheels: $(du -sh .whl 2>/dev/null | cut -f1 || echo none); carry limit 64 MiB with the tree"
fi

step() {  # step NAME LIMIT_S COMMAND...: one sub-run, its log $WORK/NAME.log, its line in steps.
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  ((limit > left)) && limit=$left
  if [ "$MODE" = --dry-run ]; then echo "+ [$name, ${limit}s] $*"; return; fi
  if ((limit < 15)); then
    echo "{\"step\": \"$name\", \"rc\": null, \"skipped\": \"no time left\"}" >>"$WORK/steps.jsonl"
    return
  fi
  echo "== $name (at most ${limit}s)"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit\": $limit}" \
    >>"$WORK/steps.jsonl"
  tail -n 2 "$WORK/$name.log"
}

setup() {  # The carried wheels into /tmp, flax's hijax shim where the image's flax needs it.
  echo "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
  echo "$("$PY" --version) at $(command -v "$PY"); $(ldd --version | head -1)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jaxserve-site .whl/*.whl
  local rc=$?  # Recorded; the steps still run, and their logs say what was missing.
  export PYTHONPATH=/tmp/jaxserve-site:$PWD
  if ! "$PY" -c "import flax.nnx" 2>"$WORK/flax_import.log"; then
    echo "flax.nnx does not import on this jax: scripts/device/sitecustomize.py shims it"
    export PYTHONPATH=$PWD/scripts/device:$PYTHONPATH
  fi
  return $rc
}

if [ "$MODE" != --dry-run ]; then
  setup >"$WORK/setup.log" 2>&1
  echo "{\"step\": \"setup\", \"rc\": $?, \"seconds\": $SECONDS}" >>"$WORK/steps.jsonl"
  cat "$WORK/setup.log"
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAXSERVE_CPU_KERNELS=off PYTHONUNBUFFERED=1
TESTS=(env JAX_DEFAULT_MATMUL_PRECISION=highest "$PY" -m pytest -q -p no:cacheprovider -rs)
KERNELS=(env JAXSERVE_RAGGED_COMPILED=1 "${TESTS[@]}" tests/test_kernels_ragged.py)
BENCH=("$PY" -m scripts.bench device)
EIGHT_B=(--shape llama-3.1-8b --runs 1:4096,64:2048,256:1024 --prefill 2048 --steps 10)

run_steps() {  # run_steps --smoke|--full
step probe 30 "$PY" -m jaxserve.compat
if [ "$1" = --smoke ]; then
  # A few kernel cases compiled by Triton: f32 mixed, bf16 window decode, int8 mixed.
  step kernels 45 "${KERNELS[@]}" -k "kernel_matches_reference and (n9k3h64z16 or n9k3h64z32)"
  step engine_pallas 35 "${TESTS[@]}" tests/test_backend_pallas.py -k matches_reference
  step families 30 "${TESTS[@]}" tests/test_families.py -k "greedy_through and (qwen3 or mistral)"
  step bench_1b 40 "${BENCH[@]}" --layers 4 --runs 1:1024,16:1024 --prefill 512 --steps 3 \
    --copy-gib 1 --matmul-n 4096
else
  step kernel_sweep 100 "${KERNELS[@]}" -k "kernel_matches_reference or float8_per_tensor"
  step bench_8b_bf16 110 "${BENCH[@]}" "${EIGHT_B[@]}" --weights bfloat16 --kv-dtype bfloat16
  step bench_8b_int8 100 "${BENCH[@]}" "${EIGHT_B[@]}" --weights int8 --kv-dtype int8
  step families 45 "${TESTS[@]}" tests/test_families.py -k "logits_match or greedy_through"
  step engine_pallas 30 "${TESTS[@]}" tests/test_backend_pallas.py -k matches_reference
  step served 30 "${TESTS[@]}" tests/test_bench_serving.py tests/test_server.py -k \
    "reports_latencies or streams_match or logprobs_match"
fi
}

if [ "$MODE" = --dry-run ]; then
  echo "+ [setup] $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir" \
    "--upgrade --target /tmp/jaxserve-site .whl/*.whl; PYTHONPATH=/tmp/jaxserve-site:\$PWD" \
    "(and scripts/device first if flax.nnx does not import)"
  for mode in --smoke --full; do echo "== $mode"; START=$SECONDS
    BUDGET=$([ $mode = --smoke ] && echo 180 || echo 455); run_steps $mode; done
  exit 0
fi
run_steps "$MODE"

mkdir -p "$OUT"
"$PY" scripts/device/summary.py "$WORK" "$MODE" >"$OUT/summary.json"
tar -czf "$OUT/logs.tar.gz" -C "$WORK" .
cat "$OUT/summary.json"
"$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); sys.exit(any(x['rc'] for x in s['steps']))" \
  "$OUT/summary.json"
