// Ragged paged attention on CPU: one call per layer for a whole engine step, the reference's
// contract (kernels_pallas/ragged_reference.py; ragged.py checks the arguments and this file
// trusts the shapes XLA hands it). The pages are in the ragged layout
// (kernels_pallas/ragged_layout.py): [L, P, Z, Cr], one row per token, K heads then V heads,
// int8 rows with their scale exponents after the V heads.
//   write   every real token's new row ([T, Cr], already quantized to the pages' dtype by the
//           wrapper, bit for bit the reference's) is copied into its page row, in the output
//           buffer, which XLA aliases to the input pages: no copy of the cache;
//   attend  each (sequence, block of its new tokens, KV head) is one work item on XLA's
//           intra-op pool: its G query heads of each token run an online softmax over the
//           sequence's keys, kChunk at a time, read and dequantized where their page rows lie
//           (no gather of the sequence's pages into a copy), causal (or up to each token's
//           reach past its own position: an image's tokens see their whole image) and within
//           the window.
// Tokens past cu_q_lens[num_seqs] (padding) write nothing and give zeros, as the reference.
// The attention loops are plain C++ (ragged_attend.inc), compiled for AVX-512, AVX2 + FMA and
// SSE2 and chosen at run time by CPUID as qmatmul.cc's tiles are.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using jaxserve_cpu::kAuto, jaxserve_cpu::kAvx2, jaxserve_cpu::kAvx512;
using jaxserve_cpu::ParallelFor, jaxserve_cpu::Supported, jaxserve_cpu::Widest;

namespace {

// Keys dequantized and attended at a time (a chunk's K and V: 2 * kChunk * H floats).
constexpr int64_t kChunk = 32;
// Query rows (tokens x G) an item aims at: enough to reuse each dequantized key, few enough
// that a prefill chunk splits into items for every thread.
constexpr int64_t kItemRows = 32;

// The storage types: float32, bfloat16, int8 (times 2^e, its row's exponent) and float8
// (times the per-tensor scale), each read as float32 exactly as kv_quant.dequantize does.
struct Bf16 { uint16_t bits; };
struct F8E4M3 { uint8_t bits; };
struct F8E5M2 { uint8_t bits; };

struct Float8Tables {
  float e4m3[256], e5m2[256];
  Float8Tables() {
    for (int b = 0; b < 256; ++b) {
      const float sign = b & 128 ? -1.0f : 1.0f;
      const int e4 = (b >> 3) & 15, m3 = b & 7;  // e4m3fn: bias 7, no infinities.
      e4m3[b] = e4 == 15 && m3 == 7 ? std::numeric_limits<float>::quiet_NaN()
                : sign * (e4 ? std::ldexp(8.0f + m3, e4 - 10) : std::ldexp(float(m3), -9));
      const int e5 = (b >> 2) & 31, m2 = b & 3;  // e5m2: bias 15, IEEE-like.
      e5m2[b] = e5 == 31 ? (m2 ? std::numeric_limits<float>::quiet_NaN()
                               : sign * std::numeric_limits<float>::infinity())
                : sign * (e5 ? std::ldexp(4.0f + m2, e5 - 17) : std::ldexp(float(m2), -16));
    }
  }
};
const Float8Tables kFloat8;

inline float ToFloat(float x) { return x; }
inline float ToFloat(int8_t x) { return static_cast<float>(x); }
inline float ToFloat(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float ToFloat(F8E4M3 x) { return kFloat8.e4m3[x.bits]; }
inline float ToFloat(F8E5M2 x) { return kFloat8.e5m2[x.bits]; }

// e^x for x <= 0 (a logit less the running max), in arithmetic only, so that the loop over a
// chunk's keys vectorizes (std::exp is a call per key): x = n ln 2 + r with |r| <= ln 2 / 2
// (Cody-Waite), e^r by Cephes expf's polynomial (about 1 ulp), 2^n from the exponent bits. x is
// clamped to -87 (e^-87 ~ 2^-125.5, the smallest normal float's neighbourhood): below, it gives
// about 1.6e-38 where std::exp gives 0 or a subnormal, which no sum of weights can tell apart.
inline float ExpNonPositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer.
  x = std::max(x, -87.0f);
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float er = poly * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return er * two_n;
}

struct Problem {
  const float* q;        // [T, N, H]
  float* out;            // [T, N, H]
  const void* pages;     // the layer's [P, Z, Cr], in the output buffer (new rows written)
  ffi::DataType dtype;   // the pages'
  const int32_t* tables; // [B, W]
  const int32_t* reach;  // [T] keys past its own position each token sees (>= 0, in bounds)
  int64_t num_pages, page_size, lanes, width, num_kv_heads, group, head_dim;
  float sm_scale, k_scale, v_scale;
  int64_t window;        // 0: none
};

// One work item: tokens [t0, t1) of sequence `seq` (packed rows; the sequence's first is
// q_start, at KV position `context`), and one KV head.
struct Item {
  int64_t seq, t0, t1, q_start, context, head;
};

// The page row (in the layer's [P * Z] rows) of key `key` of sequence `seq`; a table entry out
// of [0, P) is clamped, as a jnp gather clamps it.
inline int64_t RowOf(const Problem& p, int64_t seq, int64_t key) {
  const int64_t page = std::clamp<int64_t>(p.tables[seq * p.width + key / p.page_size], 0,
                                           p.num_pages - 1);
  return page * p.page_size + key % p.page_size;
}

// The [T * N] row of q and out of the item's query row r (token t0 + r / G, head's member r % G).
inline int64_t QueryRow(const Problem& p, const Item& it, int64_t r) {
  return (it.t0 + r / p.group) * p.num_kv_heads * p.group + it.head * p.group + r % p.group;
}

// One thread's buffers: a chunk's K and V, one row's logits, every row's softmax state.
struct Scratch {
  std::vector<float> kT, v, logits, m, l, acc;
  explicit Scratch(const Problem& p)
      : kT(p.head_dim * kChunk), v(kChunk * p.head_dim), logits(kChunk) {}
  void Reset(int64_t rows, int64_t H) {
    m.assign(rows, -std::numeric_limits<float>::infinity());
    l.assign(rows, 0.0f);
    acc.assign(rows * H, 0.0f);
  }
};

namespace scalar {
#include "ragged_attend.inc"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "ragged_attend.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx2,fma")
namespace avx512 {
#include "ragged_attend.inc"
}  // namespace avx512
#pragma GCC pop_options

using Task = void (*)(const Problem&, const Item*, int64_t, int64_t);

Task TaskFor(int64_t isa) {
  switch (isa) {
    case kAvx512: return avx512::AttendItems;
    case kAvx2: return avx2::AttendItems;
    default: return scalar::AttendItems;
  }
}

// Copies each real token's new row into its page row; a position outside the sequence's
// table (only a malformed call has one) writes nothing.
void WriteNewRows(const Problem& p, const char* new_rows, char* pages, const int32_t* cu,
                  const int32_t* kv_lens, int64_t num_seqs, int64_t row_bytes) {
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t context = kv_lens[b] - (cu[b + 1] - cu[b]);
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
      const int64_t pos = context + t - cu[b];
      if (pos < 0 || pos / p.page_size >= p.width) continue;
      std::memcpy(pages + RowOf(p, b, pos) * row_bytes, new_rows + t * row_bytes, row_bytes);
    }
  }
}

// The work items: each live sequence's new tokens in blocks of about kItemRows query rows,
// times the KV heads.
std::vector<Item> Items(const Problem& p, const int32_t* cu, const int32_t* kv_lens,
                        int64_t num_seqs) {
  const int64_t block = std::max<int64_t>(1, kItemRows / p.group);
  std::vector<Item> items;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t context = kv_lens[b] - (cu[b + 1] - cu[b]);
    for (int64_t t0 = cu[b]; t0 < cu[b + 1]; t0 += block) {
      const int64_t t1 = std::min<int64_t>(t0 + block, cu[b + 1]);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({b, t0, t1, cu[b], context, h});
    }
  }
  return items;
}

ffi::Error RaggedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer new_rows,
                           ffi::AnyBuffer, ffi::Buffer<ffi::S32> page_tables,
                           ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> num_seqs_buf, ffi::Buffer<ffi::S32> layer_buf,
                           ffi::Buffer<ffi::S32> reach,
                           ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> pages,
                           int64_t num_kv_heads, float sm_scale, float k_scale, float v_scale,
                           int64_t sliding_window, int64_t isa) {
  if (isa == kAuto) isa = Widest();
  if (!Supported(isa)) return ffi::Error::InvalidArgument("this CPU lacks the asked ISA");
  const auto qd = q.dimensions(), pd = pages->dimensions(), td = page_tables.dimensions();
  const int64_t T = qd[0], N = qd[1], H = qd[2], layer = *layer_buf.typed_data();
  const int64_t num_seqs = std::clamp<int64_t>(*num_seqs_buf.typed_data(), 0, td[0]);
  if (layer < 0 || layer >= pd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const int64_t row_bytes = pd[3] * ffi::ByteWidth(pages->element_type());
  char* layer_pages = static_cast<char*>(pages->untyped_data()) + layer * pd[1] * pd[2] * row_bytes;
  Problem p{q.typed_data(), out->typed_data(), layer_pages, pages->element_type(),
            page_tables.typed_data(), reach.typed_data(), pd[1], pd[2], pd[3], td[1], num_kv_heads,
            N / num_kv_heads, H, sm_scale, k_scale, v_scale, sliding_window};
  const int32_t* cu = cu_q_lens.typed_data();
  WriteNewRows(p, static_cast<const char*>(new_rows.untyped_data()), layer_pages, cu,
               kv_lens.typed_data(), num_seqs, row_bytes);
  const int64_t real = cu[num_seqs];  // Padding rows past it are zeros.
  std::fill(p.out + std::clamp<int64_t>(real, 0, T) * N * H, p.out + T * N * H, 0.0f);
  const std::vector<Item> items = Items(p, cu, kv_lens.typed_data(), num_seqs);
  const Task task = TaskFor(isa);
  ParallelFor(pool, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    task(p, items.data(), begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedAttention, RaggedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, N, H]
                                  .Arg<ffi::AnyBuffer>()          // new rows [T, Cr]
                                  .Arg<ffi::AnyBuffer>()          // kv_pages [L, P, Z, Cr]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_tables [B, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [B + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // reach [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, N, H]
                                  .Ret<ffi::AnyBuffer>()          // kv_pages, aliased
                                  .Attr<int64_t>("num_kv_heads")
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("k_scale")
                                  .Attr<float>("v_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("isa"));
