// qmatmul's int8 activation mode (`--cpu-activations int8`): each row of x is quantized in
// blocks of kBlock = 32 inputs to int8 with one float scale a block, x ~ d * q (llama.cpp's
// Q8_0 activations; with the block's sum d * sum(q) for a weight group's minimum, as its Q8_1
// carries for Q4_1), and the products run on integers: y = sum over blocks of
// (d * (q . v)) * s, plus m * sum(d * q) per group. So y is exactly the float product of the
// quantized x and W, up to float32 rounding; reference.qmatmul_int8_reference writes the same
// arithmetic in numpy. Weight groups must be whole blocks (G % 32 == 0: every GGUF type the
// default model uses, Q4_0, and int8 per channel; qmatmul.py checks).
//
// Learned from llama.cpp's ggml-cpu (quantize_row_q8_0 / q8_1, ggml_vec_dot_q4_1_q8_1's
// mul_sum_us8_pairs), not copied: its weights lie block by block along K, ours in columns
// (kn, tiled), so the tiles here interleave four rows of columns in registers (qmatmul_int8.inc).
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "qmatmul.h"

namespace jaxserve_cpu {

namespace {

// x[r, k], quantized: the value as the integer tiles read it.
inline int8_t QuantizedX(const Problem& p, int64_t r, int64_t k) { return p.xq[r * p.K + k]; }

// One output, with no vectors: kn columns past the last tile, and the nk layout. The integer
// sums are exact, so only the float steps' order matters, and it is the tiles'.
void ElementInt8(const Problem& p, int64_t r, int64_t n, bool nk) {
  const int64_t groups = p.K / p.G, blocks = p.K / kBlock;
  float acc = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t si = nk ? n * groups + g : At(g, n, p.row_s, p.block_s);
    for (int64_t b = g * p.G / kBlock; b < (g + 1) * p.G / kBlock; ++b) {
      int32_t dot = 0;
      for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
        int32_t v;
        if (nk) {
          v = p.v[n * p.K + k];
        } else if (p.packed) {
          const uint8_t byte = reinterpret_cast<const uint8_t*>(p.v)[At(k / 2, n, p.row_v, p.block_v)];
          v = k % 2 ? byte >> 4 : byte & 15;
        } else {
          v = p.v[At(k, n, p.row_v, p.block_v)];
        }
        dot += QuantizedX(p, r, k) * v;
      }
      acc = std::fma(static_cast<float>(dot) * p.xd[r * blocks + b], p.s[si], acc);
    }
    if (p.m) acc = std::fma(p.xgs[r * groups + g], p.m[si], acc);
  }
  p.y[r * p.N + n] = acc;
}

void ColumnsScalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < p.M; ++r) ElementInt8(p, r, n, false);
}

// nk task: rows [n0, n1) of W, each an output column (the tied head when V % 64 != 0).
void RowsOfWInt8(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < p.M; ++r) ElementInt8(p, r, n, true);
}

inline int32_t Four(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using I = __m256i;
using F = __m256;
constexpr int kLanes = 8;
constexpr bool kVnni = false;
inline I ZeroI() { return _mm256_setzero_si256(); }
inline I LoadRow(const int8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline I UnpackLo8(I a, I b) { return _mm256_unpacklo_epi8(a, b); }
inline I UnpackHi8(I a, I b) { return _mm256_unpackhi_epi8(a, b); }
inline I UnpackLo16(I a, I b) { return _mm256_unpacklo_epi16(a, b); }
inline I UnpackHi16(I a, I b) { return _mm256_unpackhi_epi16(a, b); }
inline I AndI(I a, I b) { return _mm256_and_si256(a, b); }
inline I ShiftRight4(I a) { return _mm256_srli_epi16(a, 4); }  // Then masked: bytes' high nibbles.
inline I Broadcast4(const void* p) { return _mm256_set1_epi32(Four(p)); }
inline I SetBytes(int8_t b) { return _mm256_set1_epi8(b); }
// Unsigned a times signed b, four adjacent bytes summed into each lane (no overflow: each
// pair's sum is at most 2 * 128 * 127 in 16 bits).
inline I DotUS(I acc, I a, I b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
inline I Abs8(I w) { return _mm256_abs_epi8(w); }
inline I Sign8(I x, I w) { return _mm256_sign_epi8(x, w); }
inline I SubI(I a, I b) { return _mm256_sub_epi32(a, b); }
inline I ShiftLeft7(I a) { return _mm256_slli_epi32(a, 7); }
inline F ToFloat(I a) { return _mm256_cvtepi32_ps(a); }
inline F Zero() { return _mm256_setzero_ps(); }
inline F Set1(float a) { return _mm256_set1_ps(a); }
inline F Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
// Columns 0-31 as four vectors -> the unpacks' order: vector j holds columns 4j..4j+3 of each
// 16-column half (128-bit lane).
inline void ToWeightOrder(const F v[4], F w[4]) {
  w[0] = _mm256_permute2f128_ps(v[0], v[2], 0x20);
  w[1] = _mm256_permute2f128_ps(v[0], v[2], 0x31);
  w[2] = _mm256_permute2f128_ps(v[1], v[3], 0x20);
  w[3] = _mm256_permute2f128_ps(v[1], v[3], 0x31);
}
inline void FromWeightOrder(const F w[4], F v[4]) {
  v[0] = _mm256_permute2f128_ps(w[0], w[1], 0x20);
  v[2] = _mm256_permute2f128_ps(w[0], w[1], 0x31);
  v[1] = _mm256_permute2f128_ps(w[2], w[3], 0x20);
  v[3] = _mm256_permute2f128_ps(w[2], w[3], 0x31);
}
#include "qmatmul_int8.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma")
namespace vnni {
using I = __m512i;
using F = __m512;
constexpr int kLanes = 16;
constexpr bool kVnni = true;
inline I ZeroI() { return _mm512_setzero_si512(); }
inline I LoadRow(const int8_t* p) { return _mm512_loadu_si512(p); }
inline I UnpackLo8(I a, I b) { return _mm512_unpacklo_epi8(a, b); }
inline I UnpackHi8(I a, I b) { return _mm512_unpackhi_epi8(a, b); }
inline I UnpackLo16(I a, I b) { return _mm512_unpacklo_epi16(a, b); }
inline I UnpackHi16(I a, I b) { return _mm512_unpackhi_epi16(a, b); }
inline I AndI(I a, I b) { return _mm512_and_si512(a, b); }
inline I ShiftRight4(I a) { return _mm512_srli_epi16(a, 4); }
inline I Broadcast4(const void* p) { return _mm512_set1_epi32(Four(p)); }
inline I SetBytes(int8_t b) { return _mm512_set1_epi8(b); }
// In asm, not _mm512_dpbusd_epi32: GCC 12 then copies every accumulator to another register
// and back on each pass of the loop (two moves a product at 8 rows).
inline I DotUS(I acc, I a, I b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
inline I Abs8(I w) { return w; }      // Unused: VNNI takes x + 128 instead (Products).
inline I Sign8(I x, I) { return x; }  // Unused, as Abs8.
inline I SubI(I a, I b) { return _mm512_sub_epi32(a, b); }
inline I ShiftLeft7(I a) { return _mm512_slli_epi32(a, 7); }
inline F ToFloat(I a) { return _mm512_cvtepi32_ps(a); }
inline F Zero() { return _mm512_setzero_ps(); }
inline F Set1(float a) { return _mm512_set1_ps(a); }
inline F Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
// Columns 0-63 as four vectors -> the unpacks' order: vector j holds columns 4j..4j+3 of each
// 16-column quarter (128-bit lane); a 4 x 4 transpose of 128-bit blocks, its own inverse.
inline void ToWeightOrder(const F v[4], F w[4]) {
  const F t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const F t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  w[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  w[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  w[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  w[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}
inline void FromWeightOrder(const F w[4], F v[4]) { ToWeightOrder(w, v); }
#include "qmatmul_int8.inc"
}  // namespace vnni
#pragma GCC pop_options

}  // namespace

void QuantizeRows(const float* x, int64_t M, int64_t K, int64_t G, Int8Rows& out) {
  const int64_t blocks = K / kBlock, groups = K / G;
  out.q.resize(M * K), out.p.resize(M * K), out.u.resize(M * K);
  out.d.assign(M * blocks, 0.0f), out.gs.assign(M * groups, 0.0f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * K + b * kBlock;
      float amax = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      int8_t* q = out.q.data() + r * K + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));  // To nearest, ties to even.
        sum += q[i];
      }
      for (int64_t i = 0; i < kBlock; ++i) {
        const int64_t at = r * K + b * kBlock + i;
        out.p[at] = q[(i & ~3) + ((i & 3) == 1 ? 2 : (i & 3) == 2 ? 1 : (i & 3))];
        out.u[at] = static_cast<uint8_t>(q[i] + 128);
      }
      out.d[r * blocks + b] = d;
      out.gs[r * groups + b * kBlock / G] += d * static_cast<float>(sum);
    }
  }
}

Task Int8Task(int64_t isa, bool nk) {
  if (nk) return RowsOfWInt8;
  switch (isa) {
    case kAvx512Vnni: return vnni::ColumnsInt8;
    case kAvx512:  // AVX-512 without VNNI: the AVX2 products.
    case kAvx2: return avx2::ColumnsInt8;
    default: return ColumnsScalar;
  }
}

}  // namespace jaxserve_cpu
