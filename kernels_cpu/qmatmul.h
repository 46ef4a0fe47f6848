// What qmatmul.cc (the float activation tiles) and qmatmul_int8.cc (the int8 activation tiles)
// share: the problem one call solves, where a kn value lies, and the tasks' sizes.
#pragma once

#include <cstdint>
#include <vector>

namespace jaxserve_cpu {

struct Problem {
  const float* x;     // [M, K]
  const int8_t* v;    // one matrix's values (int8; packed: uint8, two 4-bit values a byte)
  const float* s;     // its scales
  const float* m;     // its minima, or null
  float* y;           // [M, N]
  int64_t M, K, N, G;
  const float* xsum;  // [M, K / G]: x's sum over each group (kn)
  bool packed;        // kn only: row pairs (2j, 2j + 1) in the low and high nibbles of row j.
  // kn only, where rows of values and scales lie: row r, column n at
  // (n / kTaskColumns) * block + n % kTaskColumns + r * row. Rows as stored, [rows, N]: row = N,
  // block = kTaskColumns. Tiled (each task's columns one contiguous run, [N / 64, rows, 64]):
  // row = kTaskColumns, block = rows * kTaskColumns.
  int64_t row_v, block_v, row_s, block_s;
  // int8 activations only (qmatmul_int8.cc's Int8Rows): x as int8 in blocks of kBlock with one
  // float scale each, x ~ d * q, in three byte orders the tiles broadcast four at a time.
  const int8_t* xq;   // [M, K] q
  const int8_t* xp;   // [M, K] q, each four (k, k+1, k+2, k+3) as (k, k+2, k+1, k+3)
  const uint8_t* xu;  // [M, K] q + 128
  const float* xd;    // [M, K / kBlock] d
  const float* xgs;   // [M, K / G] the sum of d * q over each group (for the minimum)
};

// Output columns (kn) or rows of W (nk) that one task computes.
constexpr int64_t kTaskColumns = 64;
constexpr int64_t kTaskRowsNK = 16;
// Inputs that share one int8 activation scale (llama.cpp's Q8_0 / Q8_1 blocks: 32).
constexpr int64_t kBlock = 32;

// Where row r, column n of a kn array lies (Problem's row and block strides).
inline int64_t At(int64_t r, int64_t n, int64_t row, int64_t block) {
  return (n / kTaskColumns) * block + n % kTaskColumns + r * row;
}

using Task = void (*)(const Problem&, int64_t, int64_t);

}  // namespace jaxserve_cpu

namespace jaxserve_cpu {

// x quantized for the int8 activation mode (qmatmul_int8.cc): the buffers Problem's xq, xp, xu,
// xd and xgs point into.
struct Int8Rows {
  std::vector<int8_t> q, p;
  std::vector<uint8_t> u;
  std::vector<float> d, gs;
};

// Quantizes x [M, K] in blocks of kBlock (K % kBlock == 0, G % kBlock == 0) into `out`.
void QuantizeRows(const float* x, int64_t M, int64_t K, int64_t G, Int8Rows& out);

// The int8 activation task for an instruction set (kAvx512Vnni, kAvx512 and kAvx2 run their
// tiles; kScalar one output at a time) and layout.
Task Int8Task(int64_t isa, bool nk);

}  // namespace jaxserve_cpu
