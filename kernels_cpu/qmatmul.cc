// y[M, N] = x[M, K] @ W, W = values * scale + minimum in float32, read where it lies: the int8
// values and float32 scales (and minima) of model/quant.py's Quantized weights, never a float
// copy of W. Layouts (qmatmul.py checks them; this file trusts the shapes XLA hands it):
//   kn (a layer's weights, [K, N]): values [(L,) K, N], scale and minimum [(L,) K / G, N];
//     or packed, uint8 values [(L,) K / 2, N]: rows 2j and 2j + 1 of W in the low and high 4
//     bits of row j's bytes (4-bit blocks without a sign, Q4_1 and Q4_K)
//   nk (the tied head, [N, K]):     values [(L,) N, K], scale and minimum [(L,) N, K / G]
// G inputs share a scale (G = K: one scale per output channel). With a leading [L] axis, `layer`
// picks the matrix, so a scan over stacked weights hands them over without a per-layer copy.
//
// One body of tiles (qmatmul_tiles.inc) is compiled three times: AVX-512, AVX2 + FMA, and plain
// C++ (a "vector" of one float); the widest the CPU has is chosen at run time by CPUID. Each
// weight is dequantized in registers, as the jnp reference does (v * s + m, float32; for
// one row, s * (x . v) + m * sum(x) a group at a time), and the activations stay float32. With
// `int8_x` (EngineConfig.cpu_activations int8) x is quantized to int8 and the products run on
// integers instead: qmatmul_int8.cc.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "qmatmul.h"

namespace ffi = xla::ffi;
using jaxserve_cpu::kAuto, jaxserve_cpu::kScalar, jaxserve_cpu::kAvx2, jaxserve_cpu::kAvx512,
    jaxserve_cpu::kAvx512Vnni;
using jaxserve_cpu::ParallelFor, jaxserve_cpu::Supported, jaxserve_cpu::Widest;
using jaxserve_cpu::At, jaxserve_cpu::Problem, jaxserve_cpu::Task, jaxserve_cpu::kTaskColumns,
    jaxserve_cpu::kTaskRowsNK;

namespace {

// Rows of x a tile keeps in registers.
constexpr int kMaxRows = 8;

namespace scalar {
using F = float;
constexpr int kLanes = 1;
inline F Zero() { return 0.0f; }
inline F Load(const float* p) { return *p; }
inline void Store(float* p, F v) { *p = v; }
inline F Set1(float a) { return a; }
inline F Fma(F a, F b, F c) { return a * b + c; }
inline F LoadI8(const int8_t* p) { return static_cast<float>(*p); }
inline float Sum(F v) { return v; }
inline void LoadU4Pair(const uint8_t* p, F& lo, F& hi) {
  lo = static_cast<float>(*p & 15);
  hi = static_cast<float>(*p >> 4);
}
#include "qmatmul_tiles.inc"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using F = __m256;
constexpr int kLanes = 8;
inline F Zero() { return _mm256_setzero_ps(); }
inline F Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F Set1(float a) { return _mm256_set1_ps(a); }
inline F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F LoadI8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline float Sum(F v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline void LoadU4Pair(const uint8_t* p, F& lo, F& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#include "qmatmul_tiles.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx2,fma")
namespace avx512 {
using F = __m512;
constexpr int kLanes = 16;
inline F Zero() { return _mm512_setzero_ps(); }
inline F Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F Set1(float a) { return _mm512_set1_ps(a); }
inline F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F LoadI8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline float Sum(F v) { return _mm512_reduce_add_ps(v); }
inline void LoadU4Pair(const uint8_t* p, F& lo, F& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#include "qmatmul_tiles.inc"
}  // namespace avx512
#pragma GCC pop_options

Task TaskFor(int64_t isa, bool nk) {
  switch (isa) {
    case kAvx512: return nk ? avx512::RowsOfW : avx512::Columns;
    case kAvx2: return nk ? avx2::RowsOfW : avx2::Columns;
    default: return nk ? scalar::RowsOfW : scalar::Columns;
  }
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                   ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> minimum,
                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, bool nk,
                   bool has_min, bool tiled, bool int8_x, int64_t isa) {
  if (isa == kAuto) isa = int8_x && Supported(kAvx512Vnni) ? kAvx512Vnni : Widest();
  if (!Supported(isa)) return ffi::Error::InvalidArgument("this CPU lacks the asked ISA");
  if (isa == kAvx512Vnni && !int8_x) isa = kAvx512;  // VNNI adds nothing to float products.
  auto vd = values.dimensions();
  auto sd = scale.dimensions();
  const int64_t rank = vd.size();
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const int64_t N = nk ? vd[rank - 2] : vd[rank - 1];
  const int64_t groups = nk ? sd[rank - 1] : sd[rank - 2];
  const int64_t l = rank == 3 ? *layer.typed_data() : 0;
  if (rank == 3 && (l < 0 || l >= vd[0])) return ffi::Error::InvalidArgument("layer out of range");
  const int64_t per_scale = groups * N, G = K / groups;
  const bool packed = values.element_type() == ffi::DataType::U8;
  if (packed && (nk || G % 2)) return ffi::Error::InvalidArgument("packed values: kn, even groups");
  if (tiled && (nk || N % kTaskColumns)) return ffi::Error::InvalidArgument("tiled: kn, N % 64");
  const int8_t* v = static_cast<const int8_t*>(values.untyped_data()) + l * (packed ? K / 2 : K) * N;
  if (int8_x && (K % jaxserve_cpu::kBlock || G % jaxserve_cpu::kBlock))
    return ffi::Error::InvalidArgument("int8 activations: K and G multiples of 32");
  std::vector<float> xsum(nk || int8_x ? 0 : M * groups, 0.0f);  // One-row kn tiles factor.
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    const float* xg = x.typed_data() + (i / groups) * K + (i % groups) * G;
    for (int64_t k = 0; k < G; ++k) xsum[i] += xg[k];
  }
  Problem p{x.typed_data(), v, scale.typed_data() + l * per_scale,
            has_min ? minimum.typed_data() + l * per_scale : nullptr,
            y->typed_data(), M, K, N, G, xsum.data(), packed};
  const int64_t rows_v = packed ? K / 2 : K, t = kTaskColumns;
  p.row_v = tiled ? t : N, p.block_v = tiled ? rows_v * t : t;
  p.row_s = tiled ? t : N, p.block_s = tiled ? groups * t : t;
  jaxserve_cpu::Int8Rows xq;
  if (int8_x) {
    jaxserve_cpu::QuantizeRows(x.typed_data(), M, K, G, xq);
    p.xq = xq.q.data(), p.xp = xq.p.data(), p.xu = xq.u.data();
    p.xd = xq.d.data(), p.xgs = xq.gs.data();
  }
  const Task task = int8_x ? jaxserve_cpu::Int8Task(isa, nk) : TaskFor(isa, nk);
  ParallelFor(pool, N, nk ? kTaskRowsNK : kTaskColumns,
              [&](int64_t begin, int64_t end) { task(p, begin, end); });
  return ffi::Error::Success();
}

}  // namespace

// The Isa that isa = auto runs on this CPU, outside XLA (library.py reads it with ctypes):
// `--quantization auto` picks the kernels only where it is a path that was measured.
extern "C" int64_t JaxserveWidestIsa() { return Widest(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQMatmul, QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // values: s8, or u8 packed
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()   // minimum ([1] if none)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<bool>("nk")
                                  .Attr<bool>("has_min")
                                  .Attr<bool>("tiled")
                                  .Attr<bool>("int8_x")
                                  .Attr<int64_t>("isa"));
