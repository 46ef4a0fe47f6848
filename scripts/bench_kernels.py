"""Benchmarks the Pallas paged-attention kernels against the jnp reference.

On CPU there is no kernel compiler: the kernels run in Pallas interpret mode, so this script
checks their correctness against the reference and says so, and times nothing (interpret-mode
times say nothing about the kernels). On a GPU or TPU it times each kernel and the reference
over batch and context sizes, and reports the HBM bandwidth achieved (bytes of K/V pages, Q and
output moved once, over the measured time) as a fraction of the device's peak.

  python scripts/bench_kernels.py                  # correctness on CPU; timings on GPU/TPU
  python scripts/bench_kernels.py --model llama8b --dtype bfloat16
  python scripts/bench_kernels.py --time-on-cpu    # exercise the timing path (meaningless numbers)
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas
from kernels_pallas import reference, testing

# Peak HBM bandwidth in bytes/s by jax device_kind (vendor datasheets).
PEAK_HBM = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
    "NVIDIA L4": 0.3e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 0.819e12,  # v5e
    "TPU v5e": 0.819e12,
    "TPU v5": 2.765e12,  # v5p
    "TPU v5p": 2.765e12,
    "TPU v6 lite": 1.64e12,  # v6e (Trillium)
    "TPU v6e": 1.64e12,
}

MODELS = {
    "smollm2": dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=16),
    "llama8b": dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16),
}


@dataclasses.dataclass(frozen=True)
class Timing:
  seconds: float
  bytes_moved: int

  def report(self, peak: float | None) -> str:
    bw = self.bytes_moved / self.seconds
    frac = f" {bw / peak:6.1%} of peak" if peak else ""
    return f"{self.seconds * 1e6:9.1f} us {bw / 1e9:8.1f} GB/s{frac}"


def time_fn(fn, args, iters: int) -> float:
  """Median seconds of one call, after a compile-and-warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def decode_bytes(shape: testing.PagedShape, lengths) -> int:
  """K and V of every valid position's page, Q in and the output out, each moved once."""
  item = jnp.dtype(shape.dtype).itemsize
  pages = sum(-(-n // shape.page_size) for n in lengths)
  kv = 2 * pages * shape.page_size * shape.num_kv_heads * shape.head_dim * item
  return kv + 2 * len(lengths) * shape.num_heads * shape.head_dim * item


def prefill_bytes(shape: testing.PagedShape, kv_lens, num_tokens: int) -> int:
  return decode_bytes(shape, kv_lens) + 2 * (num_tokens - len(kv_lens)) * shape.num_heads * \
      shape.head_dim * jnp.dtype(shape.dtype).itemsize


def decode_case(shape, batch, context, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(context // 2, context + 1, size=batch)  # Ragged around the context.
  return testing.decode_inputs(rng, lengths.tolist(), shape), lengths.tolist()


def prefill_case(shape, num_seqs, chunk, context, seed=0):
  """num_seqs sequences, each a `chunk`-token prefill after `context` cached positions."""
  rng = np.random.default_rng(seed)
  args = testing.prefill_inputs(rng, [chunk] * num_seqs, [context] * num_seqs, num_seqs * chunk,
                                shape)
  return args, [context + chunk] * num_seqs


def check(name, out, ref, dtype) -> bool:
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  ok = err <= (2e-5 if dtype == jnp.float32 else 3e-2)
  print(f"  {name:<40} max |kernel - reference| = {err:.2e}  {'ok' if ok else 'MISMATCH'}")
  return ok


def run_correctness(model: dict, dtype) -> bool:
  print("CPU backend: Pallas kernels run in interpret mode here; checking correctness only, "
        "no timings (interpret-mode speed says nothing about the kernels).")
  ok = True
  for variant in ("tpu", "gpu"):
    shape = testing.PagedShape(pages_per_seq=32, dtype=dtype, **model)
    args, _ = decode_case(shape, batch=4, context=256)
    out = kernels_pallas.paged_decode_attention(*args, platform=variant, interpret=True)
    ok &= check(f"decode [{variant}] batch 4 ctx<=256", out, reference.paged_decode_reference(*args),
                dtype)
    args, _ = prefill_case(shape, num_seqs=3, chunk=48, context=100)
    out = kernels_pallas.ragged_prefill_attention(*args, platform=variant, interpret=True)
    ok &= check(f"prefill [{variant}] 3 x 48 new after 100", out,
                reference.ragged_prefill_reference(*args), dtype)
  return ok


def run_timings(model: dict, dtype, batches, contexts, iters: int, interpret: bool):
  device = jax.devices()[0]
  peak = PEAK_HBM.get(device.device_kind)
  print(f"device: {device.device_kind} (peak HBM {peak / 1e9 if peak else '?'} GB/s), "
        f"model heads {model}, dtype {jnp.dtype(dtype).name}")
  kernel_kw = dict(interpret=True, platform="cpu") if interpret else {}
  decode = jax.jit(lambda *a: kernels_pallas.paged_decode_attention(*a, **kernel_kw))
  prefill = jax.jit(lambda *a: kernels_pallas.ragged_prefill_attention(*a, **kernel_kw))
  print("decode (one token per sequence; lengths uniform in [context/2, context]):")
  for batch in batches:
    for context in contexts:
      shape = testing.PagedShape(pages_per_seq=-(-context // model["page_size"]), dtype=dtype,
                                 **model)
      args, lengths = decode_case(shape, batch, context)
      moved = decode_bytes(shape, lengths)
      check(f"batch {batch} context {context}", decode(*args),
            reference.paged_decode_reference(*args), dtype)
      print(f"    kernel    {Timing(time_fn(decode, args, iters), moved).report(peak)}")
      print(f"    reference {Timing(time_fn(reference.paged_decode_reference, args, iters), moved).report(peak)}")
  print("prefill (each sequence: a 256-token chunk after `context` cached positions):")
  for batch in batches[:2]:
    for context in contexts:
      shape = testing.PagedShape(pages_per_seq=-(-(context + 256) // model["page_size"]),
                                 dtype=dtype, **model)
      args, kv_lens = prefill_case(shape, batch, 256, context)
      moved = prefill_bytes(shape, kv_lens, batch * 256)
      print(f"  {batch} seqs context {context}")
      print(f"    kernel    {Timing(time_fn(prefill, args, iters), moved).report(peak)}")
      # The reference gathers every token's whole page table: [T, W * Z, K, H] f32.
      if batch * 256 * shape.max_len * model["num_kv_heads"] * model["head_dim"] * 4 > 4e9:
        print("    reference skipped: its per-token gather would not fit")
        continue
      check("kernel vs reference", prefill(*args), reference.ragged_prefill_reference(*args), dtype)
      print(f"    reference {Timing(time_fn(reference.ragged_prefill_reference, args, iters), moved).report(peak)}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
  parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
  parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--time-on-cpu", action="store_true",
                      help="run the timing loop in interpret mode on CPU (tests the script only)")
  args = parser.parse_args()
  dtype, model = jnp.dtype(args.dtype).type, MODELS[args.model]
  if jax.default_backend() == "cpu" and not args.time_on_cpu:
    raise SystemExit(0 if run_correctness(model, dtype) else 1)
  run_timings(model, dtype, args.batches, args.contexts, args.iters,
              interpret=jax.default_backend() == "cpu")


if __name__ == "__main__":
  main()
