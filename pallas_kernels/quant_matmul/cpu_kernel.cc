// The CPU kernel of the quantized matmul: y[T, N] = x[T, K] @ W[K, N] for a weight kept
// packed (quant/packed.py), read as it is stored, never dequantized as a whole.
//
// XLA:CPU does not fuse a dequantization into a matmul, so without this kernel a packed
// weight is first turned into a float temporary of the whole matrix at every step, which
// costs several times the float32 matmul. Here 16 stored rows at a time (a block, inside
// one group) are decoded into registers and used at once:
//
//   W[k, n] = (code[k, n] - zero) * scale[g, n] + offset[g, n],   g = k / group
//   y[t, n] = sum over blocks b of  scale[g, n] * (sum_{k in b} x[t, k] code[k, n] - zero * xs[t, b])
//                                   + offset[g, n] * xs[t, b],    xs[t, b] = sum_{k in b} x[t, k]
//
// so the scales are applied once per block and column, and the inner loop is a float
// multiply-add over a register tile of tokens by output columns (AVX-512 intrinsics, or
// loops the compiler vectorizes where the CPU lacks AVX-512; cpu.py builds with
// -march=native on the machine that runs it). Activations stay float32, so the result is
// the dequantize-then-matmul reference's up to the order of float additions.
// With int8_activations (weights_dtype "gguf_a8", on a CPU with AVX-512 VNNI) each
// block of x is rounded to int8 codes with one scale dx (quant.packed.round_activation_blocks
// states the same in JAX) and the block sums are integer dot products, four code bytes by
// four activation bytes per instruction lane, as llama.cpp multiplies GGUF blocks:
//   y[t, n] += scale[g, n] * dx (sum_k xq[t, k] code[k, n] - zero * sum_k xq[t, k])
//              + offset[g, n] * dx sum_k xq[t, k]
// Codes are int8 (8-bit formats) or two 4-bit codes a byte, GGUF's order inside a group:
// byte row j of a group holds row j in its low nibble and row j + group / 2 in its high.
// The stored rows are interleaved four at a time (quant.packed.interleave_rows, what
// quant_matmul.prepare lays out on a CPU): rows 4i .. 4i + 3 of a column are the four bytes
// of one 32-bit word, so one 64-byte load holds 16 columns' words, which are the lanes of
// an integer dot product (vpdpbusd) as they are. In row order each vector of codes first
// took a byte permutation and a masked shift: 576 x 1536 at one token with int8 activations
// and the weight hot in cache went from 19 to 14 us.
// Scales and offsets are float16 or float32. One call may multiply x by several weights of
// one format (a layer's q, k and v): x's blocks are rounded or summed once, and the column
// ranges of all of them are spread over a crew of helper threads, one fewer than XLA's
// intra-op pool has (Crew). With `norm`, x is RMS-normalized first (the norm before a
// layer's projections), so that takes no XLA ops of its own.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 64;  // output columns per tile (four vectors of 16 floats)
constexpr int kToks = 4;       // tokens per register tile
// The most code bytes a column range's block may hold for the next block to be asked for
// ahead (a third of a 48 KiB L1 cache): a longer sweep (the 49152-column head) would evict
// the lines before their use, and its long rows are streams the hardware prefetcher
// follows by itself (the head at one token: 1.03 -> 0.88 ms without the requests).
constexpr int64_t kPrefetchBytes = 16 << 10;

struct Problem {
  const float* x;        // [T, K]
  const uint8_t* codes;  // [K, N] int8, or [K / 2, N] nibbles, four rows interleaved:
                         // stored row r, column n is byte (r / 4) 4N + 4n + r % 4
  const void* scale;     // [K / group, N]
  const void* offset;    // [K / group, N] or null
  const float* xs;       // [T, blocks]: x summed over each block's rows (with int8
                         // activations: dx times the block's int8 codes summed)
  float* y;              // [T, N]
  int64_t T, K, N, group;
  int64_t rows;          // stored code rows per block (16, or a smaller group's: a multiple of 4)
  int64_t blocks;        // stored code rows / rows
  bool nibbles, f16;
  float zero;
  // int8 activations (VNNI): each block's x rounded to int8 codes with one scale dx, four
  // codes to an int32 in the order a dot-product lane takes them (lanes()), [T, blocks,
  // lanes()], and the scales [T, blocks]
  const int32_t* xq = nullptr;
  const float* dx = nullptr;

  // Stored row r of the codes holds weight row r (int8), or rows k and k + group / 2 with
  // k = (r / half) * group + r % half (nibbles, half = group / 2).
  int64_t half() const { return group / 2; }
  int64_t first_row(int64_t b) const {  // the weight row of block b's first stored row
    const int64_t r = b * rows;
    return nibbles ? r / half() * group + r % half() : r;
  }
  int64_t group_of(int64_t b) const { return b * rows / (nibbles ? half() : group); }
  // A block's codes from column n on: its rows / 4 rows of words, 4N bytes apart.
  const uint8_t* words(int64_t b, int64_t n) const { return codes + b * rows * N + 4 * n; }
  // Dot-product lanes per block: a word of four stored rows gives one lane of int8 codes,
  // or two of nibbles (its low nibbles, then its high ones).
  int64_t lanes() const { return nibbles ? rows / 2 : rows / 4; }
  // The weight rows of block b's lane l, in the lane's byte order: the low nibbles of word
  // row l (l < rows / 4), else the high nibbles of word row l - rows / 4; int8 word row l.
  void lane_rows(int64_t b, int64_t l, int64_t k[4]) const {
    const int64_t word_rows = rows / 4;
    const int64_t r = first_row(b) + (l < word_rows ? 4 * l : half() + 4 * (l - word_rows));
    for (int i = 0; i < 4; ++i) k[i] = r + i;
  }
};

// A float16's value from its bits, exactly (every float16 is a float32): in integer operations,
// since GCC before 13 has no _Float16 in C++ on AArch64.
inline float half_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {  // inf, NaN (payload kept)
    bits = sign | 0x7F800000u | mantissa << 13;
  } else if (exponent == 0) {  // zero, subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    std::memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
  } else {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  }
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline float load(const void* p, bool f16, int64_t i) {
  return f16 ? half_value(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Adds block b's rows to y[t0 : t0 + TW, n0 : n0 + 16 NV]. Within a block every weight
// shares its column's scale and offset, so the block's dot products are scaled once.
template <int TW, int NV>
void block_tile_generic(const Problem& p, int64_t b, int64_t t0, int64_t n0) {
  constexpr int64_t W = 16 * NV;
  float ga[TW][W] = {};
  const float* x = p.x + t0 * p.K + p.first_row(b);
  const int64_t half = p.half();
  for (int64_t j = 0; j < p.rows; ++j) {
    const uint8_t* c = p.words(b, n0) + j / 4 * 4 * p.N + j % 4;  // byte j % 4 of each word
    for (int t = 0; t < TW; ++t)
      for (int64_t o = 0; o < W; ++o) {
        const uint8_t code = c[4 * o];
        ga[t][o] += p.nibbles ? x[t * p.K + j] * static_cast<float>(code & 0x0F) +
                                    x[t * p.K + j + half] * static_cast<float>(code >> 4)
                              : x[t * p.K + j] * static_cast<float>(static_cast<int8_t>(code));
      }
  }
  const int64_t g = p.group_of(b);
  for (int t = 0; t < TW; ++t) {
    const float s = p.xs[(t0 + t) * p.blocks + b];
    float* y = p.y + (t0 + t) * p.N + n0;
    for (int64_t o = 0; o < W; ++o)
      y[o] += load(p.scale, p.f16, g * p.N + n0 + o) * (ga[t][o] - p.zero * s) +
              (p.offset ? load(p.offset, p.f16, g * p.N + n0 + o) * s : 0.0f);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVFOLD_AVX512 1
// 16 scales (or offsets) from `at` on, float16 or float32, as floats.
template <bool F16>
inline __m512 load16(const void* a, int64_t at) {
  if constexpr (F16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(a) + at);
}

// A block's share of 16 outputs: y += scale * dot + offset * s (s: the block's x sum).
inline void add_block(float* y, __m512 scale, __m512 offset, __m512 dot, float s) {
  _mm512_storeu_ps(y, _mm512_fmadd_ps(offset, _mm512_set1_ps(s), _mm512_fmadd_ps(scale, dot, _mm512_loadu_ps(y))));
}

// f(i) for the four bytes of a word, i a compile-time constant.
template <typename F>
inline void each_byte(F&& f) {
  f(std::integral_constant<int, 0>{}), f(std::integral_constant<int, 1>{});
  f(std::integral_constant<int, 2>{}), f(std::integral_constant<int, 3>{});
}

// Byte I of each 32-bit word, as a float: unsigned (one byte shuffle within each 128-bit
// lane, zeros elsewhere), or signed (shifted to the top, then back down with its sign).
template <int I>
inline __m512 byte_of(__m512i w, std::integral_constant<int, I>) {
  constexpr int z = static_cast<int>(0x80808000u);
  return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(w, _mm512_set4_epi32(z | (12 + I), z | (8 + I), z | (4 + I), z | I)));
}
template <int I>
inline __m512 signed_byte_of(__m512i w, std::integral_constant<int, I>) {
  const __m512i top = I == 3 ? w : _mm512_slli_epi32(w, 24 - 8 * I);
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(top, 24));
}

// The same with AVX-512 intrinsics: TW tokens by NV vectors of 16 columns of block sums in
// registers. A 64-byte load is one word row's 16 columns: byte i of each word (stored row
// 4q + i) becomes a float per column (byte_of). At one token, the low and high
// nibbles (or even and odd int8 rows) go to two accumulator sets so consecutive
// multiply-adds do not wait on each other.
template <int TW, int NV, bool F16>
void block_tile_avx512(const Problem& p, int64_t b, int64_t t0, int64_t n0) {
  constexpr int S = TW == 1 ? 2 : 1;  // accumulator sets
  __m512 ga[S][TW][NV];
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < TW; ++t)
      for (int v = 0; v < NV; ++v) ga[s][t][v] = _mm512_setzero_ps();
  const float* x = p.x + t0 * p.K + p.first_row(b);
  const uint8_t* c = p.words(b, n0);
  const int64_t half = p.half();
  for (int64_t q = 0; q < p.rows / 4; ++q, c += 4 * p.N) {
    __m512i w[NV];
    for (int v = 0; v < NV; ++v) w[v] = _mm512_loadu_si512(c + 64 * v);
    if (p.nibbles) {
      __m512i lo[NV], hi[NV];  // each byte's low and high nibble
      for (int v = 0; v < NV; ++v) {
        lo[v] = _mm512_and_si512(w[v], _mm512_set1_epi8(0x0F));
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(w[v], 4), _mm512_set1_epi8(0x0F));
      }
      each_byte([&](auto i) {  // stored row 4q + i: weight rows j and j + half
        const int64_t j = 4 * q + i;
        __m512 fl[NV], fh[NV];
        for (int v = 0; v < NV; ++v) fl[v] = byte_of(lo[v], i), fh[v] = byte_of(hi[v], i);
        for (int t = 0; t < TW; ++t) {
          const __m512 xl = _mm512_set1_ps(x[t * p.K + j]), xh = _mm512_set1_ps(x[t * p.K + j + half]);
          for (int v = 0; v < NV; ++v) {
            ga[0][t][v] = _mm512_fmadd_ps(xl, fl[v], ga[0][t][v]);
            ga[S - 1][t][v] = _mm512_fmadd_ps(xh, fh[v], ga[S - 1][t][v]);
          }
        }
      });
    } else {
      each_byte([&](auto i) {  // stored row 4q + i into set i % 2
        constexpr int s = S == 2 ? decltype(i)::value & 1 : 0;
        const int64_t j = 4 * q + i;
        for (int v = 0; v < NV; ++v) {
          const __m512 r = signed_byte_of(w[v], i);
          for (int t = 0; t < TW; ++t) ga[s][t][v] = _mm512_fmadd_ps(_mm512_set1_ps(x[t * p.K + j]), r, ga[s][t][v]);
        }
      });
    }
  }
  const int64_t g = p.group_of(b);
  for (int v = 0; v < NV; ++v) {
    const int64_t at = g * p.N + n0 + 16 * v;
    const __m512 sc = load16<F16>(p.scale, at);
    const __m512 off = p.offset ? load16<F16>(p.offset, at) : _mm512_setzero_ps();
    for (int t = 0; t < TW; ++t) {
      const float s = p.xs[(t0 + t) * p.blocks + b];
      float* y = p.y + (t0 + t) * p.N + n0 + 16 * v;
      __m512 sum = S == 2 ? _mm512_add_ps(ga[0][t][v], ga[S - 1][t][v]) : ga[0][t][v];
      sum = _mm512_sub_ps(sum, _mm512_set1_ps(p.zero * s));
      add_block(y, sc, off, sum, s);
    }
  }
}
#endif

#if defined(KVFOLD_AVX512) && defined(__AVX512VNNI__)
#define KVFOLD_VNNI 1
// Block b of one token's x rounded to int8: the codes in lane order (lanes() int32 words),
// the scale dx and dx times the codes' sum. A block of 16 stored rows is one or two runs
// of 16 inputs (rows r .. r + 15, and r + half .. for nibbles), rounded 16 at a time: the
// division is IEEE's and the conversion rounds to nearest even, as jnp.round(x / d).
void round_block(const Problem& p, const float* x, int64_t b, int32_t* lanes, float* dx, float* xs) {
  const int64_t r = p.first_row(b);
  if (p.rows == 16) {
    const __m512 a = _mm512_loadu_ps(x + r), c = p.nibbles ? _mm512_loadu_ps(x + r + p.half()) : a;
    const float d = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(a)), _mm512_reduce_max_ps(_mm512_abs_ps(c))) / 127.0f;
    const __m512 dv = _mm512_set1_ps(d > 0.0f ? d : 1.0f);
    const __m512i qa = d > 0.0f ? _mm512_cvtps_epi32(_mm512_div_ps(a, dv)) : _mm512_setzero_si512();
    const __m512i qc = d > 0.0f ? _mm512_cvtps_epi32(_mm512_div_ps(c, dv)) : _mm512_setzero_si512();
    const __m128i ba = _mm512_cvtepi32_epi8(qa), bc = _mm512_cvtepi32_epi8(qc);
    int32_t sum = _mm512_reduce_add_epi32(qa);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes), ba);  // lane l: rows 4l .. 4l + 3 of the first run
    if (p.nibbles) {  // lanes 4 .. 7: the second run's
      sum += _mm512_reduce_add_epi32(qc);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes + 4), bc);
    }
    *dx = d;
    *xs = d * static_cast<float>(sum);
    return;
  }
  int64_t k[4];
  float amax = 0.0f;
  for (int64_t l = 0; l < p.lanes(); ++l) {
    p.lane_rows(b, l, k);
    for (int i = 0; i < 4; ++i) amax = std::max(amax, std::fabs(x[k[i]]));
  }
  const float d = amax / 127.0f;
  int32_t sum = 0;
  for (int64_t l = 0; l < p.lanes(); ++l) {
    p.lane_rows(b, l, k);
    uint32_t word = 0;
    for (int i = 0; i < 4; ++i) {
      const int32_t q = d > 0.0f ? static_cast<int32_t>(std::nearbyint(x[k[i]] / d)) : 0;
      sum += q;
      word |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(q))) << (8 * i);
    }
    lanes[l] = static_cast<int32_t>(word);
  }
  *dx = d;
  *xs = d * static_cast<float>(sum);
}
// The tile with int8 activations, as llama.cpp computes its quantized dot products: a
// word of codes is a dot-product lane (vpdpbusd: four unsigned bytes times four signed
// ones, summed into an int32) as it is stored, and the int32 block sums are scaled once per
// block like the float tile's. A word of nibbles is two lanes, its low nibbles (stored rows
// 4q .. 4q + 3, weight rows of the group's first half) and its high ones (the same rows of
// the second half); int8 codes are offset by 128 to be unsigned (the offset's share, 128 dx
// sum(x codes), is taken off with the zero point's).
template <int TW, int NV, bool F16>
void block_tile_vnni(const Problem& p, int64_t b, int64_t t0, int64_t n0) {
  constexpr int S = TW == 1 ? 2 : 1;  // accumulator sets, as in the float tile
  __m512i acc[S][TW][NV];
  for (int s = 0; s < S; ++s)
    for (int t = 0; t < TW; ++t)
      for (int v = 0; v < NV; ++v) acc[s][t][v] = _mm512_setzero_si512();
  const int64_t lanes = p.lanes(), word_rows = p.rows / 4;
  const int32_t* xq = p.xq + (t0 * p.blocks + b) * lanes;
  const int64_t xstride = p.blocks * lanes;
  const uint8_t* codes = p.words(b, n0);
  if (p.nibbles) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t q = 0; q < word_rows; ++q) {
      const uint8_t* c = codes + q * 4 * p.N;
      for (int v = 0; v < NV; ++v) {
        const __m512i w = _mm512_loadu_si512(c + 64 * v);
        const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        for (int t = 0; t < TW; ++t) {
          const int32_t* xt = xq + t * xstride;
          acc[0][t][v] = _mm512_dpbusd_epi32(acc[0][t][v], lo, _mm512_set1_epi32(xt[q]));
          acc[S - 1][t][v] = _mm512_dpbusd_epi32(acc[S - 1][t][v], hi, _mm512_set1_epi32(xt[word_rows + q]));
        }
      }
    }
  } else {
    // word row q into accumulator set u (a constant, so the sets stay in registers)
    auto int8_row = [&](int64_t q, auto u) {
      const uint8_t* c = codes + q * 4 * p.N;
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int v = 0; v < NV; ++v) {
        const __m512i d = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * v), flip);
        for (int t = 0; t < TW; ++t)
          acc[u][t][v] = _mm512_dpbusd_epi32(acc[u][t][v], d, _mm512_set1_epi32(xq[t * xstride + q]));
      }
    };
    int64_t q = 0;
    using Zero = std::integral_constant<int, 0>;
    using Last = std::integral_constant<int, S - 1>;
    for (; q + 2 <= word_rows; q += 2) int8_row(q, Zero{}), int8_row(q + 1, Last{});
    if (q < word_rows) int8_row(q, Zero{});
  }
  const int64_t g = p.group_of(b);
  const float zero = p.zero + (p.nibbles ? 0.0f : 128.0f);
  for (int v = 0; v < NV; ++v) {
    const int64_t at = g * p.N + n0 + 16 * v;
    const __m512 sc = load16<F16>(p.scale, at);
    const __m512 off = p.offset ? load16<F16>(p.offset, at) : _mm512_setzero_ps();
    for (int t = 0; t < TW; ++t) {
      const float s = p.xs[(t0 + t) * p.blocks + b], d = p.dx[(t0 + t) * p.blocks + b];
      float* y = p.y + (t0 + t) * p.N + n0 + 16 * v;
      const __m512i sum = S == 2 ? _mm512_add_epi32(acc[0][t][v], acc[S - 1][t][v]) : acc[0][t][v];
      // dx * codes . x codes - zero * dx * sum(x codes), then the scale and the offset
      const __m512 dot = _mm512_fmsub_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d), _mm512_set1_ps(zero * s));
      add_block(y, sc, off, dot, s);
    }
  }
}
#endif

template <int TW, int NV>
void block_tile(const Problem& p, int64_t b, int64_t t0, int64_t n0) {
#if defined(KVFOLD_VNNI)
  if (p.xq) {
    if (p.f16) return block_tile_vnni<TW, NV, true>(p, b, t0, n0);
    return block_tile_vnni<TW, NV, false>(p, b, t0, n0);
  }
#endif
#if defined(KVFOLD_AVX512)
  if (p.f16) return block_tile_avx512<TW, NV, true>(p, b, t0, n0);
  return block_tile_avx512<TW, NV, false>(p, b, t0, n0);
#else
  block_tile_generic<TW, NV>(p, b, t0, n0);
#endif
}

// Tokens in tiles of TMAX (then 4, then the rest) over one strip of 16 NV columns.
template <int NV, int TMAX>
void block_columns(const Problem& p, int64_t b, int64_t n0) {
  int64_t t0 = 0;
  if constexpr (TMAX == 8)
    for (; t0 + 8 <= p.T; t0 += 8) block_tile<8, NV>(p, b, t0, n0);
  for (; t0 + kToks <= p.T; t0 += kToks) block_tile<kToks, NV>(p, b, t0, n0);
  switch (p.T - t0) {
    case 3: block_tile<3, NV>(p, b, t0, n0); break;
    case 2: block_tile<2, NV>(p, b, t0, n0); break;
    case 1: block_tile<1, NV>(p, b, t0, n0); break;
    default: break;
  }
}

// Asks the L1 cache for block b's codes over columns [n, n + cols) ahead of their use (the
// scales, one row per group, are few: asking for them too measured slower).
void prefetch_block(const Problem& p, int64_t b, int64_t n, int64_t cols) {
  const uint8_t* c = p.words(b, n);
  for (int64_t q = 0; q < p.rows / 4; ++q)
    for (int64_t o = 0; o < 4 * cols; o += 64) __builtin_prefetch(c + q * 4 * p.N + o, 0, 3);
}

// y[:, n0 : n1] over all of K. Row block by row block, sweeping the columns inside each,
// so the partial sums of y stay in the L1 cache. Each tile asks for the same columns of
// the next block when the range is short (kPrefetchBytes): a few cache lines per row in a
// layer's matrix, too short for the hardware prefetcher to follow the rows, while a decode
// step reads every weight once, from memory or the shared L3 (the requests halve a batch-1
// decode's matmul time on this project's CPU). From 8 tokens up a register tile is 8 tokens by 32
// columns rather than 4 by 64: a decoded code then feeds 8 multiply-adds, not 4.
void run_columns(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t t = 0; t < p.T; ++t) std::fill(p.y + t * p.N + n0, p.y + t * p.N + n1, 0.0f);
  const bool prefetch = (n1 - n0) * p.rows <= kPrefetchBytes;
  if (prefetch) prefetch_block(p, 0, n0, n1 - n0);
  for (int64_t b = 0; b < p.blocks; ++b) {
    const bool ahead = prefetch && b + 1 < p.blocks;
    int64_t n = n0;
    if (p.T >= 8)
      for (; n + 64 <= n1; n += 64) {
        if (ahead) prefetch_block(p, b + 1, n, 64);
        block_columns<2, 8>(p, b, n);
        block_columns<2, 8>(p, b, n + 32);
      }
    else
      for (; n + kCols <= n1; n += kCols) {
        if (ahead) prefetch_block(p, b + 1, n, kCols);
        block_columns<kCols / 16, kToks>(p, b, n);
      }
    if (ahead && n < n1) prefetch_block(p, b + 1, n, n1 - n);
    for (; n < n1; n += 16) block_columns<1, 8>(p, b, n);  // every packed width is a multiple of 16
  }
}

// Work for the crew: `count()` items handed out through one counter to the calling thread
// and the crew's.
struct Job {
  std::atomic<int64_t> next{0}, done{0};
#if defined(__x86_64__)
  unsigned mxcsr = _mm_getcsr();  // the caller's float environment (flush-to-zero, denormals-are-zero), which
                                  // helpers take on: read where the job is made, on the calling thread
#endif
  virtual ~Job() = default;
  virtual int64_t count() const = 0;
  virtual void item(int64_t i) = 0;
  bool work() {  // whether any item was left to take
    const int64_t count = this->count();
    if (next.load() >= count) return false;
    bool ran = false;
    for (int64_t i; (i = next.fetch_add(1)) < count; done.fetch_add(1), ran = true) item(i);
    return ran;
  }
};

// A matmul call's job: the column ranges of its weights.
struct Shared : Job {
  struct Range {
    const Problem* p;
    int64_t n0, n1;
  };
  std::vector<Problem> problems;  // one per weight, sharing x and its block sums
  std::vector<Range> ranges;
  int64_t count() const override { return static_cast<int64_t>(ranges.size()); }
  void item(int64_t i) override { run_columns(*ranges[i].p, ranges[i].n0, ranges[i].n1); }
};

// Another library's job (KvfoldCrewRun): item i is fn(arg, i).
struct Foreign : Job {
  void (*fn)(void*, int64_t);
  void* arg;
  int64_t n;
  Foreign(void (*fn)(void*, int64_t), void* arg, int64_t n) : fn(fn), arg(arg), n(n) {}
  int64_t count() const override { return n; }
  void item(int64_t i) override { fn(arg, i); }
};

// One turn of a wait loop: a pause for the first turns, then the core is given up to any
// other runnable thread. A waiter that never yields can hold a core that the thread it waits
// for needs: XLA may run another matmul on its own pool beside this one, and on two cores a
// spinning wait then cost whole scheduler slices (decode steps of 17 instead of 7 ms).
inline void relax(int64_t& turns) {
  if (++turns > 64) return std::this_thread::yield();
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Helper threads that stay awake between calls. A decode step is a few hundred matmuls of
// 5-50 us each, one after another: a helper woken through XLA's thread pool for each of them
// arrived after most of the work was done (a sleeping thread takes tens of us to wake here),
// so the calls ran on about one core. The crew's threads poll for kSpin after their last
// job, yielding the core to any other runnable thread, then sleep until the next one. One
// call at a time holds the crew, a matmul's or another kernel's (KvfoldCrewRun); a concurrent
// call (XLA running two thunks at once) runs without it. Helpers run a job in its caller's
// float environment, so an item's bits do not depend on the thread that ran it.
class Crew {
 public:
  static constexpr std::chrono::microseconds kSpin{200};

  explicit Crew(int64_t helpers) {
    for (int64_t i = 0; i < helpers; ++i) std::thread([this] { loop(); }).detach();
  }

  // shared->work() on the calling thread and the crew; false (nothing run) when another
  // call holds the crew.
  bool run(Job* shared) {
    Job* idle = nullptr;
    if (!job_.compare_exchange_strong(idle, shared)) return false;
    // Without the helpers' mutex: a helper that has just decided to sleep may miss this
    // and sleep through the job (the caller takes every range then), but the caller never
    // waits on a lock a helper holds (nor on one a fork copied locked into a child).
    if (sleeping_.load() > 0) wake_.notify_all();
    shared->work();
    int64_t turns = 0;
    while (shared->done.load() < shared->count()) relax(turns);
    // Withdraw the job, then wait for helpers still inside it: a helper counts itself busy
    // before it reads the job, so it either sees the withdrawal or is waited for.
    job_.store(nullptr);
    while (busy_.load() > 0) relax(turns);
    return true;
  }

 private:
  static bool run_as_caller(Job* job) {
#if defined(__x86_64__)
    const unsigned own = _mm_getcsr();
    _mm_setcsr(job->mxcsr);
    const bool ran = job->work();
    _mm_setcsr(own);
    return ran;
#else
    return job->work();
#endif
  }

  void loop() {
    for (;;) {
      auto last = std::chrono::steady_clock::now();
      int64_t turns = 0;
      for (int64_t spins = 1;; ++spins) {
        busy_.fetch_add(1);
        Job* job = job_.load();
        const bool ran = job && run_as_caller(job);  // a job whose items are all taken returns at once
        busy_.fetch_sub(1);
        if (job) {  // until the caller withdraws it
          last = std::chrono::steady_clock::now();
          turns = ran ? 0 : turns;
          relax(turns);
          continue;
        }
        std::this_thread::yield();  // a runnable thread sharing this core (XLA's pool) goes first
        if (spins % 64 == 0 && std::chrono::steady_clock::now() - last > kSpin) break;
      }
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_.fetch_add(1);
      wake_.wait(lock, [this] { return job_.load() != nullptr; });
      sleeping_.fetch_sub(1);
    }
  }

  std::atomic<Job*> job_{nullptr};
  std::atomic<int64_t> busy_{0}, sleeping_{0};
  std::mutex mu_;
  std::condition_variable wake_;
};

// The process's crew: one helper fewer than XLA's intra-op threads (the caller is one),
// started at the first call that wants helpers and never stopped.
Crew& crew(int64_t threads) {
  static Crew* const c = new Crew(threads - 1);
  return *c;
}

// One weight's buffers checked against x [T, K] and the call's format, and its Problem (x's
// block sums are filled in by the caller); an error names what does not match.
ffi::Error weight_problem(const ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer codes, ffi::AnyBuffer scale,
                          ffi::AnyBuffer offset, ffi::Result<ffi::AnyBuffer> y, int64_t group, bool nibbles,
                          float zero, bool has_offset, Problem& problem) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: x, codes and scale must be 2-D");
  const int64_t T = xd[0], K = xd[1], N = cd[1];
  if (group <= 0 || K % group || (nibbles && group % 2) || cd[0] != (nibbles ? K / 2 : K) ||
      sd[0] != K / group || sd[1] != N || N % 16)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: codes / scale shapes do not match x and group");
  if (codes.element_type() != ffi::DataType::S8 && codes.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: codes must be int8 or uint8 bytes");
  const auto st = scale.element_type();
  if (st != ffi::DataType::F16 && st != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: scale must be float16 or float32");
  if (has_offset && offset.element_type() != st)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: offset must have the scale's dtype");
  if (y->element_type() != ffi::DataType::F32 || yd.size() != 2 || yd[0] != T || yd[1] != N)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: each result must be float32 [T, N] of its weight");
  // A block is 16 stored rows of one group: 16 rows advancing together are streams the
  // prefetcher keeps up with (32 were not, on a 49152-column head; an int4 group of 128 is
  // 64 byte rows).
  const int64_t stored = nibbles ? K / 2 : K, group_rows = nibbles ? group / 2 : group;
  const int64_t rows = group_rows % 16 ? group_rows : 16;
  if (rows % 4)
    return ffi::Error::InvalidArgument("quant_matmul_cpu: codes interleave four stored rows to a word, so a "
                                       "group must have a multiple of 4 stored rows");
  problem = Problem{x.typed_data(), static_cast<const uint8_t*>(codes.untyped_data()), scale.untyped_data(),
                    has_offset ? offset.untyped_data() : nullptr, nullptr, static_cast<float*>(y->untyped_data()),
                    T, K, N, group, rows, stored / rows, nibbles, st == ffi::DataType::F16, zero};
  return ffi::Error::Success();
}

// y_i = x @ W_i for one or more weights of one format and input width (a layer's q, k and v,
// or its gate and up projections): x is rounded (or summed) per block once, and the
// weights' column ranges are one job for the crew. `weights` holds (codes, scale, offset)
// per weight, `ys` its results.
ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                       ffi::RemainingRets ys, int64_t group, int64_t bits, float zero, int64_t has_offset,
                       int64_t int8_activations, int64_t norm, float eps) {
  const int64_t count = static_cast<int64_t>(ys.size());
  if (count == 0 || static_cast<int64_t>(weights.size()) != 3 * count + (norm ? 1 : 0))
    return ffi::Error::InvalidArgument("quant_matmul_cpu: give (codes, scale, offset) for each result, then the "
                                       "norm weight when norm is set");
  // With norm, x is first RMS-normalized as quant_matmul/ref.py's rms_norm does, in float32:
  // x * rsqrt(mean(x^2) + eps) * weight (the norm before a layer's projections, folded here
  // rather than run as XLA's four small fusions).
  std::vector<float> normed;
  if (norm) {
    auto weight = weights.get<ffi::Buffer<ffi::F32>>(3 * count);
    const auto xd = x.dimensions();
    if (weight.has_error() || xd.size() != 2 || weight->dimensions().size() != 1 || weight->dimensions()[0] != xd[1])
      return ffi::Error::InvalidArgument("quant_matmul_cpu: the norm weight must be float32 [K] for x [T, K]");
    const int64_t T = xd[0], K = xd[1];
    const float* w = weight->typed_data();
    normed.resize(T * K);
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = x.typed_data() + t * K;
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += xt[k] * xt[k];
      const float r = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
      for (int64_t k = 0; k < K; ++k) normed[t * K + k] = xt[k] * r * w[k];
    }
  }
  Shared shared;
  for (int64_t i = 0; i < count; ++i) {
    auto codes = weights.get<ffi::AnyBuffer>(3 * i), scale = weights.get<ffi::AnyBuffer>(3 * i + 1);
    auto offset = weights.get<ffi::AnyBuffer>(3 * i + 2);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (codes.has_error() || scale.has_error() || offset.has_error() || y.has_error())
      return ffi::Error::InvalidArgument("quant_matmul_cpu: weights and results must be buffers");
    Problem p;
    ffi::Error error = weight_problem(x, *codes, *scale, *offset, *y, group, bits == 4, zero, has_offset, p);
    if (error.failure()) return error;
    if (norm) p.x = normed.data();
    shared.problems.push_back(p);
  }
  const Problem& first = shared.problems[0];  // every weight's blocks are the same rows of x
  const int64_t T = first.T, K = first.K, blocks = first.blocks, rows = first.rows;
  std::vector<float> xs(T * blocks), dx;  // each block's x sum (both row ranges of a nibble block)
  std::vector<int32_t> xq;
  if (int8_activations) {
#if defined(KVFOLD_VNNI)
    // Each token's x rounded per block: codes round(x / dx) with dx = max |x| / 127 over the
    // block's weight rows (quant.packed.round_activation_blocks states the same in JAX).
    const int64_t lanes = first.lanes();
    xq.resize(T * blocks * lanes);
    dx.resize(T * blocks);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < blocks; ++b)
        round_block(first, first.x + t * K, b, &xq[(t * blocks + b) * lanes], &dx[t * blocks + b],
                    &xs[t * blocks + b]);
#else
    return ffi::Error::InvalidArgument("quant_matmul_cpu: this build has no int8 activations (AVX-512 VNNI)");
#endif
  } else {
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = first.x + t * K + first.first_row(b);
        float s = 0.0f;
        for (int64_t j = 0; j < rows; ++j) s += xt[j] + (first.nibbles ? xt[j + first.half()] : 0.0f);
        xs[t * blocks + b] = s;
      }
  }
  // Column ranges of whole 64-column tiles, about two per thread over all the weights (so a
  // slow thread's share is split), at least one per weight.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t tiles = 0, columns = 0;
  for (const Problem& p : shared.problems) tiles += (p.N + kCols - 1) / kCols, columns += p.N;
  for (Problem& p : shared.problems) {
    p.xs = xs.data(), p.xq = xq.empty() ? nullptr : xq.data(), p.dx = dx.empty() ? nullptr : dx.data();
    const int64_t own = (p.N + kCols - 1) / kCols;
    const int64_t ranges = std::clamp<int64_t>(2 * threads * own / tiles, 1, own);
    const int64_t cols = (own + ranges - 1) / ranges * kCols;
    for (int64_t n = 0; n < p.N; n += cols) shared.ranges.push_back({&p, n, std::min(p.N, n + cols)});
  }
  // Below about 2^18 multiply-adds handing out work costs more than it saves (576 x 192 at
  // one token: 8 us alone, 11 us with a helper woken through XLA's pool).
  if (threads == 1 || T * K * columns < (int64_t{1} << 18) || !crew(threads).run(&shared)) shared.work();
  return ffi::Error::Success();
}

}  // namespace

// The crew for another kernel library's call (the CPU decode attention, which gets this
// function's address from cpu.py): runs fn(arg, i) for i in [0, count) on the calling thread
// and the crew, as a matmul's column ranges run, and returns 1; 0 (nothing run) when another
// call holds the crew or `threads` (the caller's XLA pool size) is 1.
extern "C" int KvfoldCrewRun(void (*fn)(void*, int64_t), void* arg, int64_t count, int64_t threads) {
  if (threads <= 1) return 0;
  Foreign job(fn, arg, count);
  return crew(threads).run(&job) ? 1 : 0;
}

// 1 when built with the AVX-512 tiles, 0 for the portable loops (cpu.py takes fewer tokens
// to this kernel then: the loops lose to XLA's dequantize + matmul from about 8 tokens up).
extern "C" int KvfoldQuantMatmulAvx512() {
#if defined(KVFOLD_AVX512)
  return 1;
#else
  return 0;
#endif
}

// 1 when built with the int8-activation tiles (AVX-512 VNNI), else 0.
extern "C" int KvfoldQuantMatmulVnni() {
#if defined(KVFOLD_VNNI)
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvfoldQuantMatmul, QuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .RemainingArgs()               // per weight: codes, scale [G, N] and
                                                                 // offset [G, N] (scale again when absent);
                                                                 // then the norm weight [K] with norm
                                  .RemainingRets()               // per weight: y [T, N]
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("bits")
                                  .Attr<float>("zero")
                                  .Attr<int64_t>("has_offset")
                                  .Attr<int64_t>("int8_activations")
                                  .Attr<int64_t>("norm")
                                  .Attr<float>("eps"));
