// What the kernels of kernels_cpu share: the instruction sets chosen at run time by CPUID, and
// ParallelFor over XLA's intra-op thread pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

namespace ffi = xla::ffi;

// The `isa` attribute's values (library.py's ISAS): auto is the widest the CPU has. VNNI
// (vpdpbusd) matters only to int8 activations (qmatmul_int8.cc); the float tiles run it as AVX-512.
enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Vnni = 4 };

inline bool Supported(int64_t isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case kAvx512Vnni: return Supported(kAvx512) && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

inline int64_t Widest() {
  static const int64_t widest = Supported(kAvx512) ? kAvx512 : Supported(kAvx2) ? kAvx2 : kScalar;
  return widest;
}

// Runs fn(begin, end) over [0, total) in pieces of `piece`, on the calling thread and on
// XLA's intra-op pool. Pieces are taken from a shared counter, so a pool task that starts late
// finds none left and returns at once: the caller waits only for pieces already begun. The
// caller counts as one of the pool's threads: with as many helpers as the pool has
// threads, one more thread than cores ran, and a descheduled one held the whole call back (at
// M = 1 on 2 cores, the kernel's matmuls about 1.2x slower than with one helper fewer).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t total, int64_t piece, const Fn& fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> busy{0};
  };
  auto shared = std::make_shared<Shared>();
  const int64_t pieces = (total + piece - 1) / piece;
  auto work = [shared, &fn, total, piece, pieces]() {
    shared->busy.fetch_add(1);
    for (int64_t i; (i = shared->next.fetch_add(1)) < pieces;) {
      fn(i * piece, std::min(total, (i + 1) * piece));
    }
    shared->busy.fetch_sub(1);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, pieces - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    // Holds `shared` alive past this call's return; `fn` is not touched then (no piece is left).
    pool.Schedule([work]() { work(); });
  }
  work();
  while (shared->busy.load() != 0) _mm_pause();
}

}  // namespace jaxserve_cpu
