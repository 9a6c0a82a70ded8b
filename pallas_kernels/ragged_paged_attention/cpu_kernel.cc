// The CPU kernel of ragged paged attention for query tokens that each see a causal run of
// their sequence's positions (decode rows, prefill chunks; a draft tree's nodes see less of
// it): one call per layer instead of XLA's block walk, which also stores the step's new K/V
// rows in the pages (aliased in place).
//
// On XLA:CPU the block walk (pallas_kernels/paged_blocks.py) is a while loop of a few dozen
// small thunks per block, about 70 us a layer at one decode row however short the context
// (SmolLM2's 30 layers: 2 ms of a 9 ms step). Here the call first lays the tokens out from
// cu_q_lens and kv_lens (token t: sequence seq[t], position q_pos[t]) and writes each one's K
// and V rows into its page slot; XLA's version of those two steps was six small fusions a
// layer (two scatters, 4-5 us at one decode row). Then token t attends over positions [lo,
// q_pos[t]] of its sequence's pages (lo = 0, or q_pos[t] - window + 1 on a sliding-window
// layer; a draft-tree node: those of them it sees, below), reading each position's K and V
// rows once, every KV head at a time (a page slot holds them side by side), for all query
// heads:
//
//   s[g, p] = cap * tanh(sm_scale q[g] . k[p] / cap)        (no cap: sm_scale q[g] . k[p])
//   out[g]  = sum_p exp(s[g, p] - m[g]) v[p] / l[g],   lse[g] = m[g] + log l[g]
//
// with m the row maximum and l the sum of the exponentials (two passes over the scores, kept
// in a buffer: a decode row's positions fit in cache; where head_dim is a multiple of 16,
// AVX-512 scores 16 positions at a time summed by one transposing tree, a vectorized
// softmax and weighted sums in registers, plain loops otherwise). A sink logit per query head
// joins the denominator only. A token past cu_q_lens[num_seqs] is padding: out 0, lse -inf.
// Block-table entries are clamped into the pool, as the XLA path does (the entries a live
// position reads must be valid pages; the entry checks that when it can). Work items are
// (token, run of positions): a long context is split into runs of kSplit or more positions
// whose softmax parts are merged at the end (flash decoding), and the items are spread over the
// quantized matmul's crew of helper threads (else over XLA's intra-op thread pool when a call
// holds enough work). Reading the rows of every head at once, in page order, and splitting
// one row's context took 1,000 positions of SmolLM2's layer (3 KV heads) from 127 to 95-100
// us; the tree-summed scores and the vectorized softmax took 80 positions from 12 to 7.3 us
// with the pages in cache (16 to 14 us from L3, where the bytes bound it); the crew took 400
// positions from 57-64 to 45-48 us (a gguf_a8 decode step at that context from 7.3-7.7 to
// 6.4-6.5 ms). Float32 or bfloat16 pages [num_pages, page_size, num_kv_heads, head_dim], or
// int8 / E4M3 codes with a float32 scale per position and KV head [num_pages, page_size,
// num_kv_heads] (quant.kv_rows): a position's K scale multiplies its scores, its V scale its
// weights, so the codes are read as they are (a quarter of float32's bytes); or NVFP4's packed
// E2M1 codes [.., head_dim / 2] with an E4M3 scale per 16 [.., head_dim / 16] (no tensor
// scale), decoded 16 at a time. The write quantizes each new row as quant.quantize_rows /
// quant.nvfp4_quantize(x, 1.0) do, bit for bit. A second handler (KvfoldDecodeAttentionTurbo)
// reads TurboQuant pages, written beforehand through XLA, in their rotated basis (TurboPtr).
//
// A prefill chunk (kTileMin query tokens or more of one sequence) is cut into tiles of kTile
// tokens instead (head_dim a multiple of 16 up to 256): a tile reads each KV head's
// positions once, 16 at a time decoded to float32 with their scales, for its kTile * G query
// rows, each row keeping an online softmax (flash attention's running maximum and sum) and
// stopping at its own position. A token's run would read them once per token: on SmolLM2's
// layer (9 query heads over 3 KV heads) a 512-token chunk from position 1,536 took 32.5 ms in
// runs and 23.6 ms in tiles over float32 pages (53.9 and 24.1 over NVFP4 ones), where XLA's
// blocked path took 39.6 (49.9); three passes over a block's rows (tile_block) then took the
// tiles to about 17-20 ms, within 1.5x of the multiply-adds' bound on that 2-core machine.
// A call with fewer tiles than threads cuts each into parts of kTileRun positions or more,
// merged per token as a token's runs are: a 12- or 16-token chunk after 2,000 positions went
// from 1.14 / 1.70 ms on one thread to 0.77 / 0.83 ms on two. A build without AVX-512 runs
// the same tiles in the compiler's portable vectors (AVX2, SSE, NEON: tile_block's portable
// form) and decodes NVFP4 and TurboQuant rows once per KV head (decode_row), 8 codes a word
// (decode_codes: with AVX2 in vector lanes looked up by permutes, else one by one): built as
// x86-64-v3 (AVX2) on that machine, the 512-token chunk after 2,048 positions (and 4 decode
// rows) took 35-37 ms over float32 pages and 34-40 over NVFP4 ones, where XLA's path, limited
// to AVX2 too, took 55-78 and 71-88; 16 decode rows over 2,048 positions took 5.2-6.2 ms over
// NVFP4 pages and 6.3-6.7 over turboquant-3.5 ones (8.9-9.3 and 21.0-21.4 with the codes
// read one at a time and the sparse channel in a pass of its own).
//
// A draft tree's nodes (speculative decoding's verify rows, pallas_kernels/tree_mask.py: a
// token at or past its sequence's tree start) see the prefix before the tree's region (on a
// sliding layer, from their logical position), the region's positions their ancestor bits
// name, and the rest causally (Sight): a token's run skips the positions it does not see,
// a tile masks them per row in each block of 16. Four 16-node trees after 512 positions took
// 3.9-7.2 ms a layer on XLA's blocked path and 0.9-2.1 ms here (five runs); a speculative
// generate of 64 tokens with the default model (float32) went from 4.3-4.4 to 3.8-4.0 s at
// batch 1 and from 18.5-20.3 to 15.0-15.8 s at batch 8.

#include <algorithm>
#include <array>
#include <utility>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // independent partial sums of the portable dot product (summed in halves)

// Vectors in the compiler's vector extension (GCC, clang) of the target's width: 8 float32 /
// int32 lanes with AVX, else 4 (SSE, NEON). What a build without AVX-512 computes its tiles
// in, and what decode_codes looks codes up in where the target has AVX2 (an AVX-512 build
// too, for the rows it reads through decode_row).
#if defined(__AVX__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif
typedef float VF __attribute__((vector_size(4 * kWidth)));
typedef int32_t VI __attribute__((vector_size(4 * kWidth)));

inline VF load(const float* x) {
  VF v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline void save(float* x, VF v) { std::memcpy(x, &v, sizeof v); }
inline VF splat(float x) { return VF{} + x; }
inline VF pick(VI where, VF a, VF b) {  // a where `where` is -1, else b
  return reinterpret_cast<VF>((reinterpret_cast<VI>(a) & where) | (reinterpret_cast<VI>(b) & ~where));
}

#if defined(__AVX2__)
// table[idx[l]] in each of 8 lanes, idx < kEntries <= 16: one vpermps for 8 entries, two
// and a select for 16.
template <int kEntries>
inline VF lookup(const float* table, VI idx) {
  const VF low = reinterpret_cast<VF>(_mm256_permutevar8x32_ps(reinterpret_cast<__m256>(load(table)),
                                                                reinterpret_cast<__m256i>(idx)));
  if constexpr (kEntries <= 8) {
    return low;
  } else {
    const VF high = reinterpret_cast<VF>(_mm256_permutevar8x32_ps(reinterpret_cast<__m256>(load(table + 8)),
                                                                   reinterpret_cast<__m256i>(idx)));
    return pick((idx & 8) != 0, high, low);
  }
}
#endif

// A bfloat16 page element: the high half of a float32.
struct Bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float to_float(Bf16 x) { return from_bits(static_cast<uint32_t>(x.bits) << 16); }

// An FP8 E4M3 (fn) code of a row-scaled page (kv_format "fp8").
struct Fp8 {
  uint8_t bits;
};

// What a row scale is multiplied by as it is read: 1, but 2^8 for E4M3 codes where AVX-512
// reads them through float16 (load16(const Fp8*)) as 2^-8 times their values; every path
// (to_float as well) then gives the codes as that fraction of their values.
template <typename E>
#if defined(__AVX512F__)
constexpr float kScaleUnit = std::is_same_v<E, Fp8> ? 256.0f : 1.0f;
#else
constexpr float kScaleUnit = 1.0f;
#endif

// An E4M3 code's value, as quant.formats.e4m3_decode_arith gives it: a normal code's low 7 bits
// shifted into float32's exponent and mantissa fields (exponent rebiased by 127 - 7), a
// subnormal m * 2^-9, 0x7F / 0xFF NaN.
inline float e4m3_value(uint8_t bits) {
  const uint32_t low = bits & 0x7F;
  const float mag = low == 0x7F ? std::numeric_limits<float>::quiet_NaN()
                    : low < 8   ? static_cast<float>(low) * 0x1p-9f
                                : from_bits((low << 20) + (120u << 23));
  return bits & 0x80 ? -mag : mag;
}

inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(Fp8 x) { return e4m3_value(x.bits) / kScaleUnit<Fp8>; }

// NVFP4 pages (kv_format "nvfp4" with no tensor scale, quant.NVFP4): two E2M1 codes a byte
// (element 2i in the low nibble) [P, ps, Hkv, D / 2] and an E4M3 scale per 16 elements [P, ps,
// Hkv, D / 16]. Nvfp4 names the format; its pages are read through Nvfp4Ptr, which stands
// where a pointer to elements stands for the other formats: an element offset into both.
struct Nvfp4 {};
constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
struct Nvfp4Ptr {
  const uint8_t *packed, *scales;
  int64_t e;
  Nvfp4Ptr operator+(int64_t offset) const { return {packed, scales, e + offset}; }
};

// TurboQuant pages (mse mode, quant.TurboCodes; kv_format a TurboQuant, or a TurboQuantSplit
// as kv_cache_dtype turboquant-3.5 / -2.5 keep them), read in the rotated basis the XLA path
// reads them in (pallas_kernels/paged_attention/kv_formats.py): a row is one channel group
// (a plain TurboQuant) or two (TurboQuantSplit's outlier and regular halves), each group g
// of `size` channels holding bit-packed Lloyd-Max codes (quant.pack_bits: code i at stream
// bits [i b, (i + 1) b)), a float32 scale and `sparse` channels kept aside (uint8 index,
// bfloat16 value stored as its bits). In the group's rotated basis its part of the row is
//   scale * c[code] + sum_j value_j * Pi[:, index_j],
// so with the query rotated once outside (prepare_q) the scores are plain dot products with
// these decoded rows, the values' weighted sum stays in that basis and is rotated back once
// outside (finish_out): no row is ever de-rotated. Turbo names the format; TurboPtr stands
// where a pointer to elements stands for the others (an element offset into the pages).
struct Turbo {};
struct TurboGroup {
  const uint8_t* codes;   // [rows, bytes]
  const float* scales;    // [rows]
  const uint8_t* index;   // [rows, sparse] (null when sparse is 0)
  const uint16_t* value;  // [rows, sparse] bfloat16 bits
  const float* codebook;  // [16], the 2^bits centroids then zeros
  const float* columns;   // [size, size]: row i is Pi[:, i] (Pi transposed)
  int64_t bits, bytes;
  // Code j of 16 starting at a multiple of 16 channels: stream bits from byte first[j] (and
  // first[j] + 1 when it straddles), shifted down by shift[j].
  int32_t first[16], shift[16];
};
struct TurboPages {
  TurboGroup group[2];
  int64_t D, size, sparse;  // size: channels per group (D, or D / 2 when split)
  int64_t twos;             // D = 2^twos * an odd number, whose inverse mod 2^64 is `inverse`
  uint64_t inverse;
  // e / D for an offset e that is a multiple of D (a whole row), without a division.
  int64_t row(int64_t e) const { return static_cast<int64_t>((static_cast<uint64_t>(e) >> twos) * inverse); }
};
struct TurboPtr {
  const TurboPages* pages;
  int64_t e;
  TurboPtr operator+(int64_t offset) const { return {pages, e + offset}; }
};

// Formats whose rows are decoded to float32 once per use (a tile of rows for the scores, a
// row's vectors for the weighted sum) rather than read in place.
template <typename E>
constexpr bool kDecoded = std::is_same_v<E, Nvfp4> || std::is_same_v<E, Turbo>;

// Formats whose key rows scores16 decodes once per KV head into a tile for its G query heads:
// the decoded ones, and E4M3 codes, whose decode costs more than a tile's store and reloads
// (their value rows are still read in place, once for all the heads).
template <typename E>
constexpr bool kTiledKeys = kDecoded<E> || std::is_same_v<E, Fp8>;

// What a page's elements are read through: a pointer to them, an Nvfp4Ptr or a TurboPtr.
template <typename E>
using Ptr = std::conditional_t<std::is_same_v<E, Nvfp4>, Nvfp4Ptr,
                               std::conditional_t<std::is_same_v<E, Turbo>, TurboPtr, const E*>>;

// Pages whose codes carry one float32 scale per (position, KV head): x_hat = code * scale
// (quant.kv_rows, kv_format "int8" / "fp8").
template <typename E>
constexpr bool kScaled = std::is_same_v<E, int8_t> || std::is_same_v<E, Fp8>;

// x stored in a page element: bfloat16 rounds to the nearest, ties to even, as XLA's convert
// does (a NaN stays a quiet NaN).
inline void store(float x, float& out) { out = x; }
inline void store(float x, Bf16& out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    out.bits = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  out.bits = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// y (already multiplied by the row's reciprocal scale) as a code: int8 rounds to the nearest,
// ties to even, and clips to +-127; E4M3 clips to +-448 and rounds to the nearest, ties to
// even (subnormals below 2^-6 in steps of 2^-9), as quant.kv_rows does through XLA.
inline void store(float y, int8_t& out) {
  out = std::isnan(y) ? 0 : static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.0f, 127.0f));  // NaN: XLA's 0
}
inline void store(float y, Fp8& out) {
  if (std::isnan(y)) {
    out.bits = std::signbit(y) ? 0xFF : 0x7F;
    return;
  }
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  const float a = std::min(std::fabs(y), 448.0f);
  if (a < 0x1p-6f) {  // subnormal: m * 2^-9, m = 8 being the smallest normal 2^-6 (code 0x08)
    out.bits = sign | static_cast<uint8_t>(std::nearbyint(a * 0x1p9f));
    return;
  }
  // Normal: float32's exponent and top three mantissa bits, rounded to the nearest (ties to
  // even) at bit 20, a carry stepping the exponent up; then the exponent rebiased to E4M3's.
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  out.bits = sign | static_cast<uint8_t>(((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120u << 3));
}

// Pages of float32 or bfloat16 elements E, row-scaled int8 / E4M3 codes with their scales,
// NVFP4 codes or TurboQuant codes; q, the new rows and the results are float32.
template <typename E>
struct Problem {
  const float* q;      // [T, Hq, D]
  Ptr<E> k, v;         // pages [P, ps, Hkv, D] (NVFP4, TurboQuant: a view of their leaves)
  const float* sinks;  // [Hq] or null
  const int32_t *tables, *seq, *pos;  // [S, W], [T], [T]
  float *out, *lse;                   // [T, Hq, D], [T, Hq]
  int64_t T, Hq, Hkv, D, P, ps, S, W, window;
  float sm_scale, cap;
  const float *ks, *vs;  // kScaled<E>: the scales [P, ps, Hkv], else null
  // A draft tree (pallas_kernels/tree_mask.py): each sequence's region start [S] and each
  // token's ancestor-or-self bits [T, words] over it; null without one.
  const int32_t *tree_start = nullptr, *tree_bits = nullptr;
  int64_t words = 0;
};

// What token t sees of its sequence, as tree_mask.visible says: positions [lo, hi], hi its own
// position (at most the table's last) and lo 0 or, on a sliding layer, the window's first.
// A draft-tree node (a token at or past its sequence's tree start) sees, of [lo, hi], the
// positions before the region from `near` on (the window from its logical position, start -
// 1 + its depth), those of the region [start, start + region) whose bits are set (its
// ancestors and itself) and every one past the region; lo = min(near, start).
struct Sight {
  int64_t lo, hi;
  bool node = false;
  int64_t near = 0, start = 0, region = 0;
  const int32_t* bits = nullptr;
  bool sees(int64_t j) const {
    if (j < lo || j > hi) return false;
    if (j < start) return j >= near;
    const int64_t o = j - start;
    return o >= region || ((static_cast<uint32_t>(bits[o >> 5]) >> (o & 31)) & 1u);
  }
  // Which of positions b0 .. b0 + n - 1 (n <= 16) it sees: bit j for b0 + j.
  uint32_t lanes(int64_t b0, int64_t n) const {
    const int64_t a = std::max<int64_t>(lo - b0, 0), b = std::min<int64_t>(hi - b0 + 1, n);
    if (a >= b) return 0;
    uint32_t m = ((1u << b) - 1) & ~((1u << a) - 1);
    const bool masked = node && ((b0 < near && b0 + n > lo) || (b0 < start + region && b0 + n > start));
    for (int64_t j = a; masked && j < b; ++j)
      if (!sees(b0 + j)) m &= ~(1u << j);
    return m;
  }
};

// lo is kept in [0, hi + 1] (hi + 1: it sees nothing), whatever the window or a tree's start
// (runtime data): a position read is always one of the table's.
template <typename E>
Sight sight(const Problem<E>& p, int64_t t) {
  const int64_t pos = p.pos[t], hi = std::min<int64_t>(pos, p.W * p.ps - 1);
  const auto from = [hi](int64_t lo) { return std::clamp<int64_t>(lo, 0, hi + 1); };
  if (!p.tree_start || pos < p.tree_start[p.seq[t]]) return Sight{from(p.window > 0 ? pos - p.window + 1 : 0), hi};
  const int64_t start = p.tree_start[p.seq[t]];
  const int32_t* bits = p.tree_bits + t * p.words;
  int64_t depth = 0;
  for (int64_t w = 0; w < p.words; ++w) depth += __builtin_popcount(static_cast<uint32_t>(bits[w]));
  const int64_t near = p.window > 0 ? start - 1 + depth - p.window + 1 : 0;
  return Sight{from(std::min(near, start)), hi, true, near, start, 32 * p.words, bits};
}

template <typename P>
float dot(const float* a, P b, int64_t n) {
  static_assert(kLanes == 16, "the sums below halve 16 lanes");
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * to_float(b[i + l]);
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * to_float(b[i]);
  // pairwise, in halves: 4 dependent vector adds, not 16 scalar ones
  for (int l = 0; l < 8; ++l) lanes[l] += lanes[l + 8];
  for (int l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
  for (int l = 0; l < 2; ++l) lanes[l] += lanes[l + 2];
  return s + (lanes[0] + lanes[1]);
}

// exp(r) for |r| <= ln 2 / 2 by Cephes' polynomial, on a float or a vector of them.
template <typename X>
inline X exp_reduced(X r) {
  X p = X{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 within about 2 ulp (Cephes' expf: x = k ln 2 + r, |r| <= ln 2 / 2, a
// degree-6 polynomial for exp(r), 2^k through the exponent bits), in plain float and integer
// operations so that a loop of them vectorizes (libm's expf is a call per element: 12% of
// the kernel at 1,000 positions). Below -87 the result is 0, as the true one rounds to a
// subnormal there; softmax weights that small do not change a float sum.
inline float exp_nonpositive(float x) {
  const bool tiny = x < -87.0f;
  x = tiny ? -87.0f : x;
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float e = exp_reduced(x - k * 0.693359375f + k * 2.12194440e-4f);
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? 0.0f : e * scale;
}

constexpr float kInf = std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const Bf16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const int8_t* x) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
}
// 16 E4M3 codes as float32 values 2^-8 times theirs: each code's sign, exponent and mantissa
// shifted into a float16's fields (whose exponent bias, 15, is 8 more than E4M3's 7), so the
// hardware's float16 conversion decodes them, subnormals included; the caller folds the 2^8
// into the row's scale (kScaleUnit). The NaN codes 0x7F / 0xFF (an inf in a written row
// leaves one under a finite scale) are made NaN, as to_float makes them.
inline __m512 load16(const Fp8* x) {
  // sign-extended code << 7: the sign lands in bit 15 (and a copy in bit 14, cleared), the
  // exponent and mantissa in bits 13..7
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  const __m256i b = _mm256_cvtepi8_epi16(bytes);
  const __m512 value =
      _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(0x7F)),
                                                _mm512_set1_epi32(0x7F));
  return _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// 16 NVFP4 elements from a multiple of 16 (one block): the 8 bytes' nibbles spread over the
// lanes, looked up in the E2M1 table, times the block's E4M3 scale.
inline __m512 load16(const Nvfp4Ptr& x) {
  const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.packed + x.e / 2));
  const __m512i pairs = _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                                 _mm512_cvtepu8_epi32(eight));  // lane i: byte i / 2
  const __m512i shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(pairs, shift), _mm512_set1_epi32(0xF));
  return _mm512_mul_ps(_mm512_permutexvar_ps(codes, _mm512_loadu_ps(kE2M1)),
                       _mm512_set1_ps(e4m3_value(x.scales[x.e / 16])));
}

// The 2 b bytes holding 16 codes from code 16 c of a group, spread over the lanes and each
// lane's code shifted out (with the next byte where codes straddle), looked up in `scaled`.
struct TurboLanes {
  __m512i first, second, shift, mask;
  __m512 codebook;
  __mmask16 load;
  bool straddles;
  int64_t bits;
  explicit TurboLanes(const TurboGroup& f)
      : first(_mm512_loadu_si512(f.first)),
        second(_mm512_add_epi32(first, _mm512_set1_epi32(1))),
        shift(_mm512_loadu_si512(f.shift)),
        mask(_mm512_set1_epi32((1 << f.bits) - 1)),
        codebook(_mm512_loadu_ps(f.codebook)),
        load(static_cast<__mmask16>((1u << (2 * f.bits)) - 1)),
        straddles(8 % f.bits != 0),
        bits(f.bits) {}
  __m512 decode(const uint8_t* codes, int64_t c, __m512 scaled) const {
    const uint8_t* at = codes + c * 2 * bits;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m128i packed = _mm_maskz_loadu_epi8(load, at);
#else
    alignas(16) uint8_t copy[16] = {};
    std::memcpy(copy, at, 2 * bits);
    const __m128i packed = _mm_load_si128(reinterpret_cast<const __m128i*>(copy));
#endif
    const __m512i wide = _mm512_cvtepu8_epi32(packed);
    __m512i word = _mm512_permutexvar_epi32(first, wide);
    if (straddles) word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_permutexvar_epi32(second, wide), 8));
    return _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srlv_epi32(word, shift), mask), scaled);
  }
};

// decode_rows for the engine's TurboQuant pages (kv_cache_dtype turboquant-3.5 / -2.5: two
// groups of kChunks * 16 channels, one sparse channel each): a row at a time, both groups'
// constants in registers, the chunks unrolled and the sparse channel added without a branch
// (an index past the group, only in bytes no write made, adds 0 times column 0).
template <int kChunks>
void decode_split_rows(const TurboPtr& base, const int64_t* rows, int64_t count, float* dst) {
  constexpr int64_t size = 16 * kChunks, D = 2 * size;
  const TurboPages& t = *base.pages;
  const TurboLanes lanes[2] = {TurboLanes(t.group[0]), TurboLanes(t.group[1])};
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = t.row(base.e + rows[r]);
    for (int64_t g = 0; g < 2; ++g) {
      const TurboGroup& f = t.group[g];
      const __m512 scaled = _mm512_mul_ps(lanes[g].codebook, _mm512_set1_ps(f.scales[row]));
      const uint8_t* codes = f.codes + row * f.bytes;
      const int64_t index = f.index[row];
      const bool inside = index < size;
      const __m512 value = _mm512_set1_ps(inside ? from_bits(static_cast<uint32_t>(f.value[row]) << 16) : 0.0f);
      const float* column = f.columns + (inside ? index : 0) * size;
      float* out = dst + r * D + g * size;
      for (int64_t c = 0; c < kChunks; ++c)
        _mm512_storeu_ps(out + 16 * c, _mm512_fmadd_ps(value, _mm512_loadu_ps(column + 16 * c),
                                                       lanes[g].decode(codes, c, scaled)));
    }
  }
}

// TurboQuant rows base + rows[r] (whole rows: offsets that are multiples of D), r < count,
// decoded into dst [count, D]: per channel group (its constants read once for all the rows),
// 16 codes at a time, their 2 b bytes spread over the lanes, each lane's code shifted out of
// its byte (and the next one where codes straddle bytes, b = 3) and looked up in the codebook
// times the row's scale, plus the sparse channels' columns of Pi. A row's index comes from
// its offset by an exact division (a shift and a multiply: TurboPages::row). The engine's
// formats (two groups of 32 or 64 channels, one sparse channel each) go to decode_split_rows.
inline void decode_rows(const TurboPtr& base, const int64_t* rows, int64_t count, int64_t D, float* dst) {
  const TurboPages& t = *base.pages;
  if (t.sparse == 1 && D == 2 * t.size && t.size == 32) return decode_split_rows<2>(base, rows, count, dst);
  if (t.sparse == 1 && D == 2 * t.size && t.size == 64) return decode_split_rows<4>(base, rows, count, dst);
  constexpr int64_t kInLoop = 4;  // sparse channels added as the codes are decoded; others in a pass of their own
  for (int64_t g = 0; g < D / t.size; ++g) {
    const TurboGroup& f = t.group[g];
    const TurboLanes lanes(f);
    const int64_t size = t.size, sparse = t.sparse, bytes = f.bytes;
    const float* columns = f.columns;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row = t.row(base.e + rows[r]);
      const __m512 scaled = _mm512_mul_ps(lanes.codebook, _mm512_set1_ps(f.scales[row]));
      const uint8_t* codes = f.codes + row * bytes;
      // value_j times column index_j of Pi (an index past the group, only in bytes no write
      // made, adds nothing)
      const uint8_t* index = f.index + row * sparse;
      const uint16_t* values = f.value + row * sparse;
      __m512 value[kInLoop];
      const float* column[kInLoop];
      int64_t live = 0, j = 0;
      for (; j < sparse && live < kInLoop; ++j)
        if (index[j] < size) {
          value[live] = _mm512_set1_ps(from_bits(static_cast<uint32_t>(values[j]) << 16));
          column[live++] = columns + index[j] * size;
        }
      float* out = dst + r * D + g * size;
      for (int64_t c = 0; c < size; c += 16) {
        __m512 x = lanes.decode(codes, c / 16, scaled);
        for (int64_t l = 0; l < live; ++l) x = _mm512_fmadd_ps(value[l], _mm512_loadu_ps(column[l] + c), x);
        _mm512_storeu_ps(out + c, x);
      }
      for (; j < sparse; ++j) {
        if (index[j] >= size) continue;
        const __m512 v = _mm512_set1_ps(from_bits(static_cast<uint32_t>(values[j]) << 16));
        for (int64_t c = 0; c < size; c += 16)
          _mm512_storeu_ps(out + c, _mm512_fmadd_ps(v, _mm512_loadu_ps(columns + index[j] * size + c),
                                                    _mm512_loadu_ps(out + c)));
      }
    }
  }
}

// Asks the cache for TurboQuant rows base + rows[r], r < count, every leaf of every group:
// the pages of a sequence lie anywhere in the pool, so the hardware cannot guess the next
// page's lines in each of the eight leaves.
inline void prefetch_rows(const TurboPtr& base, const int64_t* rows, int64_t count) {
  const TurboPages& t = *base.pages;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = t.row(base.e + rows[r]);
    for (int64_t g = 0; g < t.D / t.size; ++g) {
      const TurboGroup& f = t.group[g];
      _mm_prefetch(reinterpret_cast<const char*>(f.codes + row * f.bytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(f.scales + row), _MM_HINT_T0);
      if (t.sparse) {
        _mm_prefetch(reinterpret_cast<const char*>(f.index + row * t.sparse), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(f.value + row * t.sparse), _MM_HINT_T0);
      }
    }
  }
}

// NVFP4 or E4M3 rows base + rows[r], r < count, decoded into dst [count, D] 16 elements (an
// NVFP4 block) at a time, in load16's unit (E4M3: 2^-8 times their values, the caller's
// scales carry kScaleUnit).
template <class P>
inline void decode_rows(const P& base, const int64_t* rows, int64_t count, int64_t D, float* dst) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + r * D + d, load16(base + rows[r] + d));
}

// exp_nonpositive on 16 lanes: the same steps (with fused multiply-adds, so within an ulp of
// it), a NaN staying NaN.
inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // the second operand where either is NaN
  const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
  __m512 c = _mm512_set1_ps(1.9875691500e-4f);
  c = _mm512_fmadd_ps(c, r, _mm512_set1_ps(1.3981999507e-3f));
  c = _mm512_fmadd_ps(c, r, _mm512_set1_ps(8.3334519073e-3f));
  c = _mm512_fmadd_ps(c, r, _mm512_set1_ps(4.1665795894e-2f));
  c = _mm512_fmadd_ps(c, r, _mm512_set1_ps(1.6666665459e-1f));
  c = _mm512_fmadd_ps(c, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(c, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), e, _mm512_castsi512_ps(bits));
}

// Lane j of the result: the sum of a[j]'s 16 lanes (a transposing tree: 15 adds for 16 sums
// where one horizontal sum each would take 64 operations).
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit chunk: [x0+x2, y0+y2, x1+x3, y1+y3], x = a[2j], y = a[2j+1]
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per chunk: a[4j .. 4j+3]'s sums over the chunk's lanes
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44), _mm512_shuffle_f32x4(c[0], c[1], 0xEE));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44), _mm512_shuffle_f32x4(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// scores[h * ns + i] = sm_scale q[h] . k[rows[i]] for every query head over the n positions
// (-inf from n to ns), 16 positions at a time: their rows stay in the L1 cache for all the
// heads, and one tree sums the 16 dot products of a head. D a multiple of 16.
// With row-scaled codes, kscale [Hkv, ns] holds each position's K scale, applied to the sum.
// NVFP4, TurboQuant and E4M3 rows, the dearest to decode (kTiledKeys), are decoded once per
// KV head into tile [16, D] for its G query heads.
template <typename T>
void scores16(const Problem<T>& p, const float* q, const int64_t* rows, int64_t n, int64_t ns, const float* kscale,
              float* tile, float* scores) {
  constexpr bool decode_once = kTiledKeys<T>;
  const int64_t G = p.Hq / p.Hkv, D = p.D;
  const __m512 scale = _mm512_set1_ps(p.sm_scale);
  for (int64_t i0 = 0; i0 < ns; i0 += 16) {
    const int64_t live = std::min<int64_t>(16, n - i0);
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
      const Ptr<T> k = p.k + kvh * D;
      if constexpr (std::is_same_v<T, Turbo>)  // the next 16 positions' rows, while these are scored
        if (kvh == 0 && i0 + 16 < n) prefetch_rows(k, rows + i0 + 16, std::min<int64_t>(16, n - i0 - 16));
      if constexpr (decode_once) decode_rows(k, rows + i0, live, D, tile);
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        const float* qh = q + h * D;
        __m512 a[16];
        for (int64_t j = 0; j < 16; ++j) {
          a[j] = _mm512_setzero_ps();
          if (j >= live) continue;
          if constexpr (decode_once) {
            const float* r = tile + j * D;
            for (int64_t d = 0; d < D; d += 16)
              a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(r + d), a[j]);
          } else {
            const Ptr<T> r = k + rows[i0 + j];
            for (int64_t d = 0; d < D; d += 16) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), load16(r + d), a[j]);
          }
        }
        const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
        __m512 sum = sum16(a);
        if constexpr (kScaled<T>) sum = _mm512_mul_ps(sum, _mm512_loadu_ps(kscale + kvh * ns + i0));
        _mm512_storeu_ps(scores + h * ns + i0, _mm512_mask_mul_ps(_mm512_set1_ps(-kInf), mask, sum, scale));
      }
    }
  }
}
#endif

// One head's softmax in place over ns scores (a multiple of 16, padding -inf): s becomes
// exp(s - m) / l, and the result is the lse m + log l (l >= 1: the maximum's own term).
float softmax(float* s, int64_t ns) {
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-kInf), sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < ns; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + i));
  const float m = _mm512_reduce_max_ps(top);
  for (int64_t i = 0; i < ns; i += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float l = _mm512_reduce_add_ps(sum);
  const __m512 keep = _mm512_set1_ps(1.0f / l);
  for (int64_t i = 0; i < ns; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), keep));
#else
  const float m = *std::max_element(s, s + ns);
  for (int64_t i = 0; i < ns; ++i) s[i] = exp_nonpositive(s[i] - m);  // vectorizes; the sum would not
  float l = 0.0f;
  for (int64_t i = 0; i < ns; ++i) l += s[i];
  const float keep = 1.0f / l;
  for (int64_t i = 0; i < ns; ++i) s[i] *= keep;
#endif
  return m + std::log(l);
}

// One work item: token t over positions [lo, hi] of its sequence, for all of its heads. Its
// part is the attention over those positions alone (per head the output and its lse), and
// the parts of a token are merged once all are done (`merge`), as flash decoding merges the
// splits of a long context; a token of one part is that part, bit for bit.
struct Item {
  int64_t t, lo, hi;
  int64_t count = 0;   // a tile's tokens t .. t + count - 1 (attend_tile); 0: one token's run
  int64_t splits = 1;  // a tile's parts (runs of its positions, merged like a token's runs)
};

struct Part {
  std::vector<float> lse, out;  // [Hq], [Hq, D] (a tile's part: [count, Hq], [count, Hq, D])
};

// A thread's buffers: each position's row offset in the pages (the same in K and V; the row
// holds every KV head, Hkv * D elements), the scores [Hq, n] and, for row-scaled codes, each
// position's K and V scales [Hkv, n]; rows decoded to float32 in `tile`: a KV head's 16 for
// scores16 (kTiledKeys), a run's for weigh ([kRun, D], kDecoded), one row [D] in the plain
// loops (decode_row), or a tile's block (attend_tile: keys, then values [16, D], the keys as
// columns [D, 16] in the portable tiles); and the offsets weigh reads its rows at
// (decoded_rows).
struct Scratch {
  std::vector<int64_t> rows, decoded_rows;
  std::vector<float> scores, kscale, vscale, tile;
  std::vector<float> acc, top, total;  // attend_tile's rows: [R, D], [R], [R] (its blocks in tile, weights in scores)
  std::vector<uint32_t> seen;          // attend_tile's lanes seen: [blocks, count] (Sight::lanes)
};

// `size` codes (a multiple of 8) of kBits bits from a row's bytes (code c at stream bits
// [c b, (c + 1) b), lowest first), looked up in the codebook (2^kBits entries) times step,
// plus value times `column` where one is given (a TurboQuant sparse channel's column of Pi),
// into out[c * stride]: 8 codes at a time from the kBits bytes that hold them, gathered into
// one word; with AVX2 shifted apart in a vector's lanes and looked up by permutes, else one
// by one (shifts by constants: on SSE, which has no per-lane shifts or permutes, a vector
// form measured slower; NEON has both, but a form of its own was not written or measured).
// NVFP4's blocks are 4-bit codes in this order too.
template <int kBits>
inline void decode_codes(const uint8_t* bytes, int64_t size, const float* codebook, float step, float value,
                         const float* column, float* out, int64_t stride) {
  constexpr int32_t mask = (1 << kBits) - 1;
#if defined(__AVX2__)
  const VI shifts = {0, kBits, 2 * kBits, 3 * kBits, 4 * kBits, 5 * kBits, 6 * kBits, 7 * kBits};  // code l's bits
#endif
  for (int64_t c = 0; c < size; c += 8, bytes += kBits) {
    // byte by byte: a memcpy of 3 bytes into the word is two stores the word's 4-byte load
    // cannot be forwarded from, so it waits for them to reach the cache
    uint32_t word = 0;
    for (int i = 0; i < kBits; ++i) word |= static_cast<uint32_t>(bytes[i]) << (8 * i);
#if defined(__AVX2__)
    // the word's top bit, as a sign, reaches no code: a code's top bit is at most bit 31
    VF x = lookup<(1 << kBits)>(codebook, ((VI{} + static_cast<int32_t>(word)) >> shifts) & mask) * step;
    if (column) x += value * load(column + c);
    if (stride == 1) {
      save(out + c, x);
    } else {
      for (int l = 0; l < 8; ++l) out[(c + l) * stride] = x[l];
    }
#else
    if (column)
      for (int l = 0; l < 8; ++l)
        out[(c + l) * stride] = codebook[(word >> (kBits * l)) & mask] * step + value * column[c + l];
    else
      for (int l = 0; l < 8; ++l) out[(c + l) * stride] = codebook[(word >> (kBits * l)) & mask] * step;
#endif
  }
}

// One position's row of one KV head (r: the pages' pointer at it) decoded to float32 times
// `scale`, element d at dst[d * stride] (what a build without AVX-512, or a head_dim over
// 256, reads decoded rows with). NVFP4 rows a block of 16 at a time (its scale
// decoded once; the format's head_dim is a multiple of 16), TurboQuant rows a channel group
// at a time (their row index found once; the first sparse channel added as the codes are
// decoded, so no pass reloads what the last one stored), both by decode_codes; the others
// element by element.
template <typename T>
void decode_row(Ptr<T> r, int64_t D, float scale, float* dst, int64_t stride) {
  if constexpr (std::is_same_v<T, Turbo>) {
    const TurboPages& t = *r.pages;
    const int64_t row = t.row(r.e);
    for (int64_t g = 0; g < D / t.size; ++g) {
      const TurboGroup& f = t.group[g];
      const uint8_t* bytes = f.codes + row * f.bytes;
      const float step = f.scales[row] * scale;
      float* out = dst + g * t.size * stride;
      // the first sparse channel joins the codes' pass, the others a pass each (an index past
      // the group, only in bytes no write made, adds nothing)
      const float* column = nullptr;
      float value = 0.0f;
      if (t.sparse && f.index[row * t.sparse] < t.size) {
        column = f.columns + f.index[row * t.sparse] * t.size;
        value = from_bits(static_cast<uint32_t>(f.value[row * t.sparse]) << 16) * scale;
      }
      switch (f.bits) {  // the kernel's groups have 1 to 4 bits a code (cpu.py's TURBO_MAX_BITS)
        case 1: decode_codes<1>(bytes, t.size, f.codebook, step, value, column, out, stride); break;
        case 2: decode_codes<2>(bytes, t.size, f.codebook, step, value, column, out, stride); break;
        case 3: decode_codes<3>(bytes, t.size, f.codebook, step, value, column, out, stride); break;
        default: decode_codes<4>(bytes, t.size, f.codebook, step, value, column, out, stride); break;
      }
      for (int64_t j = 1; j < t.sparse; ++j) {
        const int64_t channel = f.index[row * t.sparse + j];
        if (channel >= t.size) continue;  // only in bytes no write made: adds nothing
        const float value = from_bits(static_cast<uint32_t>(f.value[row * t.sparse + j]) << 16) * scale;
        for (int64_t c = 0; c < t.size; ++c) out[c * stride] += value * f.columns[channel * t.size + c];
      }
    }
  } else if constexpr (std::is_same_v<T, Nvfp4>) {  // r.e a multiple of 16: a whole row
    for (int64_t b = 0; b < D / 16; ++b) {
      const float step = e4m3_value(r.scales[r.e / 16 + b]) * scale;
      decode_codes<4>(r.packed + r.e / 2 + 8 * b, 16, kE2M1, step, 0.0f, nullptr, dst + 16 * b * stride, stride);
    }
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d * stride] = to_float(r[d]) * scale;
  }
}

// use(row) on one KV head's row at r as the plain loops read it: in the pages, or (NVFP4,
// TurboQuant: kDecoded) decoded once into `tile` [D] for all of that head's query heads.
template <typename T, typename Use>
inline void with_row(Ptr<T> r, int64_t D, std::vector<float>& tile, Use&& use) {
  if constexpr (kDecoded<T>) {
    tile.resize(D);
    decode_row<T>(r, D, 1.0f, tile.data(), 1);
    use(static_cast<const float*>(tile.data()));
  } else {
    use(r);
  }
}

#if defined(__AVX512F__)
// acc[heads, D] += sum_i w[g * n + i] v[rows[i]] for positions [i0, i1) and the heads g of
// one chunk, whose V accumulators (V of them, D / 16 a head: a template constant) stay in
// registers, so each V row is read once for all of them.
template <typename T, int V>
void weigh_chunk(const float* w, Ptr<T> v, const int64_t* rows, int64_t n, int64_t i0, int64_t i1, int64_t D,
                 float* acc) {
  const int64_t per = D / 16;
  int64_t weight[V], part[V];  // accumulator u: head u / per's weights, the row's elements 16 (u % per) on
  for (int u = 0; u < V; ++u) {  // (divisions the loop below would otherwise redo for every position)
    weight[u] = u / per * n;
    part[u] = u % per * 16;
  }
  __m512 a[V];
  for (int u = 0; u < V; ++u) a[u] = _mm512_loadu_ps(acc + 16 * u);
  for (int64_t i = i0; i < i1; ++i) {
    const Ptr<T> r = v + rows[i];
    for (int u = 0; u < V; ++u) a[u] = _mm512_fmadd_ps(_mm512_set1_ps(w[weight[u] + i]), load16(r + part[u]), a[u]);
  }
  for (int u = 0; u < V; ++u) _mm512_storeu_ps(acc + 16 * u, a[u]);
}

template <typename T>
using WeighChunk = void (*)(const float*, Ptr<T>, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*);
template <typename T, int... V>
constexpr std::array<WeighChunk<T>, sizeof...(V) + 1> weigh_chunks(std::integer_sequence<int, V...>) {
  return {nullptr, &weigh_chunk<T, V + 1>...};
}
template <typename T>  // [V] for V = 1 .. 16
constexpr auto kWeighChunk = weigh_chunks<T>(std::make_integer_sequence<int, 16>{});
#endif

// acc[G, D] += sum over positions [i0, i1) of w[g * n + i] v[rows[i]] for the G query heads
// of one KV head (v points at that head's slice of a row): in chunks of heads whose
// accumulators fit in 16 registers where D is a multiple of 16 (and at most 256), else in
// plain loops the compiler vectorizes.
template <typename T>
void weigh(const float* w, Ptr<T> v, const int64_t* rows, int64_t n, int64_t i0, int64_t i1, int64_t G,
           int64_t D, float* acc, Scratch& s) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 256) {
    const int64_t per = D / 16, heads = 16 / per;
    if constexpr (kDecoded<T>) {  // the rows decoded once for all the heads, then weighed as float32 rows
      s.tile.resize((i1 - i0) * D);
      s.decoded_rows.resize(i1);
      for (int64_t i = i0; i < i1; ++i) s.decoded_rows[i] = (i - i0) * D;
      decode_rows(v, rows + i0, i1 - i0, D, s.tile.data());
      for (int64_t g = 0; g < G; g += heads)
        kWeighChunk<float>[std::min(heads, G - g) * per](w + g * n, s.tile.data(), s.decoded_rows.data(), n, i0, i1,
                                                          D, acc + g * D);
    } else {
      for (int64_t g = 0; g < G; g += heads)
        kWeighChunk<T>[std::min(heads, G - g) * per](w + g * n, v, rows, n, i0, i1, D, acc + g * D);
    }
    return;
  }
#endif
  const auto add = [&](int64_t i, auto row) {  // row: position i's V elements, in the pages or decoded
    for (int64_t g = 0; g < G; ++g) {
      const float wi = w[g * n + i];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += wi * to_float(row[d]);
    }
  };
  for (int64_t i = i0; i < i1; ++i) with_row<T>(v + rows[i], D, s.tile, [&](auto row) { add(i, row); });
}

// Positions a weighted pass covers before it moves to the next KV head: two pages' rows of
// every head stay in the L1 cache for the heads after the first.
constexpr int64_t kRun = 32;

// Item `it`'s part: every query head over positions [lo, hi] (a draft-tree node: those of
// them it sees), reading each position's K and V rows (all KV heads, contiguous in the page)
// in page order. A part that sees none: lse -inf, out 0.
template <typename T>
void attend_part(const Problem<T>& p, const Item& it, Part& part, Scratch& s) {
  const int64_t G = p.Hq / p.Hkv, D = p.D, stride = p.Hkv * D;
  const int32_t* table = p.tables + p.seq[it.t] * p.W;
  const Sight see = sight(p, it.t);
  int64_t n = it.hi - it.lo + 1;
  if (see.node)
    for (int64_t j = it.lo; j <= it.hi; ++j) n -= !see.sees(j);
  if (n == 0) {
    part.lse.assign(p.Hq, -kInf);
    part.out.assign(p.Hq * D, 0.0f);
    return;
  }
  const int64_t ns = (n + 15) / 16 * 16;  // a head's stride in the scores: whole vectors, padded with -inf
  s.rows.resize(n);
  if constexpr (kScaled<T>) {  // position i's scales in KV head h: [h * ns + i] (0 past n), in kScaleUnit
    s.kscale.assign(p.Hkv * ns, 0.0f);
    s.vscale.assign(p.Hkv * ns, 0.0f);
  }
  for (int64_t position = it.lo, i = 0; position <= it.hi;) {  // a page at a time
    const int64_t page = std::clamp<int64_t>(table[position / p.ps], 0, p.P - 1), slot = position % p.ps;
    const int64_t slots = std::min(p.ps - slot, it.hi - position + 1), first = page * p.ps + slot;
    for (int64_t j = 0; j < slots; ++j) {
      if (see.node && !see.sees(position + j)) continue;
      s.rows[i] = (first + j) * stride;
      if constexpr (kScaled<T>)
        for (int64_t h = 0; h < p.Hkv; ++h) {
          s.kscale[h * ns + i] = p.ks[(first + j) * p.Hkv + h] * kScaleUnit<T>;
          s.vscale[h * ns + i] = p.vs[(first + j) * p.Hkv + h] * kScaleUnit<T>;
        }
      ++i;
    }
    position += slots;
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, Turbo>)  // the first run's V rows, while the scores are computed
    prefetch_rows(p.v, s.rows.data(), std::min(n, kRun));
#endif
  const float* q = p.q + it.t * p.Hq * D;
  s.scores.resize(p.Hq * ns);
  float* scores = s.scores.data();
  const float* kscale = kScaled<T> ? s.kscale.data() : nullptr;
  const float* vscale = kScaled<T> ? s.vscale.data() : nullptr;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    if constexpr (kTiledKeys<T>) s.tile.resize(16 * D);
    scores16(p, q, s.rows.data(), n, ns, kscale, s.tile.data(), scores);
  } else
#endif
  {
    for (int64_t h = 0; h < p.Hq; ++h) std::fill(scores + h * ns + n, scores + (h + 1) * ns, -kInf);
    const auto score = [&](int64_t i, int64_t kvh, auto row) {  // row: K of position i, KV head kvh
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
        float x = dot(q + h * D, row, D);
        if constexpr (kScaled<T>) x *= kscale[kvh * ns + i];
        scores[h * ns + i] = x * p.sm_scale;
      }
    };
    for (int64_t i = 0; i < n; ++i)
      for (int64_t kvh = 0; kvh < p.Hkv; ++kvh)
        with_row<T>(p.k + s.rows[i] + kvh * D, D, s.tile, [&](auto row) { score(i, kvh, row); });
  }
  part.lse.resize(p.Hq);
  part.out.assign(p.Hq * D, 0.0f);
  for (int64_t h = 0; h < p.Hq; ++h) {
    float* sh = scores + h * ns;
    if (p.cap > 0.0f)
      for (int64_t i = 0; i < n; ++i) sh[i] = p.cap * std::tanh(sh[i] / p.cap);
    part.lse[h] = softmax(sh, ns);
    if constexpr (kScaled<T>)  // the weights of the codes: probability times the V scale
      for (int64_t i = 0; i < n; ++i) sh[i] *= vscale[h / G * ns + i];
  }
  for (int64_t i0 = 0; i0 < n; i0 += kRun) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, Turbo>)  // the next run's V rows, while this one is weighed
      if (i0 + kRun < n) prefetch_rows(p.v, s.rows.data() + i0 + kRun, std::min(kRun, n - i0 - kRun));
#endif
    for (int64_t h = 0; h < p.Hkv; ++h) {
      const int64_t i1 = std::min(n, i0 + kRun);
      weigh<T>(scores + h * G * ns, p.v + h * D, s.rows.data(), ns, i0, i1, G, D, part.out.data() + h * G * D, s);
    }
  }
}

// A sink logit joining a softmax's denominator only: lse becomes logaddexp(lse, sink) and
// the output's factor `keep` loses the sink's share.
inline void join_sink(float sink, float& lse, float& keep) {
  const float most = std::max(lse, sink);
  const float with = most + std::log(std::exp(lse - most) + std::exp(sink - most));
  keep *= std::exp(lse - with);
  lse = with;
}

// Tiles: a prefill chunk's tokens, kTile at a time, each KV head's positions read once for
// the tile's kTile * G query rows (a token's run reads them once for its own G). A query run
// of kTileMin tokens or more of one sequence is cut into tiles.
constexpr int64_t kTile = 16, kTileMin = 8;
constexpr int64_t kTileRun = 256;  // the fewest positions of a tile's part (run)

#if defined(__AVX512F__)

// Positions slots[i], i < n, of one KV head (head: the pages' pointer at its slice of a row)
// decoded into dst [16, D] float32 with their row scales applied (row-scaled codes: scales
// [P, ps, Hkv], else null); rows n..15 are zeros.
template <typename T>
void decode_block(const Problem<T>& p, Ptr<T> head, const float* scales, int64_t kvh, const int64_t* slots,
                  int64_t n, float* dst) {
  const int64_t D = p.D, stride = p.Hkv * D;
  if constexpr (std::is_same_v<T, Turbo>) {
    int64_t rows[kTile];
    for (int64_t i = 0; i < n; ++i) rows[i] = slots[i] * stride;
    decode_rows(head, rows, n, D, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const Ptr<T> r = head + slots[i] * stride;
      if constexpr (kScaled<T>) {
        const __m512 scale = _mm512_set1_ps(scales[slots[i] * p.Hkv + kvh] * kScaleUnit<T>);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + i * D + d, _mm512_mul_ps(load16(r + d), scale));
      } else {
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + i * D + d, load16(r + d));
      }
    }
  }
  std::fill(dst + n * D, dst + kTile * D, 0.0f);
}

// One block of 16 decoded positions (kb, vb [16, D], D = 16 kPer) for a tile's rows: token i's
// G query heads (q [c, Hq, D] at the KV head's first, token_stride apart) see the lanes set in
// seen[i] (Sight::lanes). In three passes over the rows, whose steps then overlap from row
// to row: each row's 16 scores (summed by one tree, soft-capped, unseen lanes -inf) into w
// [R, 16]; its online softmax step (running maximum `top`, sum of exponentials `total`, the
// factor `shrink` its output is rescaled by to the block's new maximum) turning them into
// weights; and its unnormalized output acc [R, D] (in registers for the block) += the
// weighted values.
template <int kPer>
void tile_block(const float* q, int64_t token_stride, int64_t G, int64_t c, const uint32_t* seen,
                const float* kb, const float* vb, float sm_scale, float cap, float* top, float* total, float* acc,
                float* w, float* shrink) {
  constexpr int64_t D = 16 * kPer;
  for (int64_t i = 0; i < c; ++i) {
    if (!seen[i]) continue;
    for (int64_t g = 0; g < G; ++g) {
      const float* qh = q + i * token_stride + g * D;
      __m512 a[16];
      for (int64_t j = 0; j < 16; ++j) {
        a[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16)
          a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(kb + j * D + d), a[j]);
      }
      __m512 score = _mm512_mul_ps(sum16(a), _mm512_set1_ps(sm_scale));
      if (cap > 0.0f) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, score);
        for (float& x : lanes) x = cap * std::tanh(x / cap);
        score = _mm512_load_ps(lanes);
      }
      _mm512_storeu_ps(w + (i * G + g) * 16,
                       _mm512_mask_mov_ps(_mm512_set1_ps(-kInf), static_cast<__mmask16>(seen[i]), score));
    }
  }
  for (int64_t i = 0; i < c; ++i) {
    if (!seen[i]) continue;
    for (int64_t r = i * G; r < (i + 1) * G; ++r) {
      const __m512 score = _mm512_loadu_ps(w + r * 16);
      const float next = std::max(top[r], _mm512_reduce_max_ps(score));
      shrink[r] = exp_nonpositive(top[r] - next);  // 0 for the first block (top -inf)
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(score, _mm512_set1_ps(next)));
      _mm512_storeu_ps(w + r * 16, e);
      total[r] = total[r] * shrink[r] + _mm512_reduce_add_ps(e);
      top[r] = next;
    }
  }
  for (int64_t i = 0; i < c; ++i) {
    const uint32_t m = seen[i];
    if (!m) continue;
    // only the lanes it sees: another row's NaN value must not reach it. A run of lanes (every
    // row but a draft-tree node's) as a counted loop, which the compiler unrolls.
    const int j0 = __builtin_ctz(m), j1 = 32 - __builtin_clz(m);
    const bool run = ((m >> j0) & ((m >> j0) + 1)) == 0;
    for (int64_t r = i * G; r < (i + 1) * G; ++r) {
      __m512 o[kPer];
      const __m512 keep = _mm512_set1_ps(shrink[r]);
      for (int u = 0; u < kPer; ++u) o[u] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + 16 * u), keep);
      if (run) {
        for (int j = j0; j < j1; ++j)
          for (int u = 0; u < kPer; ++u)
            o[u] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * 16 + j]), _mm512_loadu_ps(vb + j * D + 16 * u), o[u]);
      } else {
        for (uint32_t left = m; left; left &= left - 1)
          for (int u = 0, j = __builtin_ctz(left); u < kPer; ++u)
            o[u] = _mm512_fmadd_ps(_mm512_set1_ps(w[r * 16 + j]), _mm512_loadu_ps(vb + j * D + 16 * u), o[u]);
      }
      for (int u = 0; u < kPer; ++u) _mm512_storeu_ps(acc + r * D + 16 * u, o[u]);
    }
  }
}

// Keys are scored as decoded rows here (sum16 sums a row's products).
template <typename T>
void decode_keys(const Problem<T>& p, Ptr<T> head, const float* scales, int64_t kvh, const int64_t* slots,
                 int64_t n, float* dst) {
  decode_block(p, head, scales, kvh, slots, n, dst);
}

#else

// Tiles without AVX-512 compute in VF / VI vectors, kParts of them for a block's 16
// positions. A key block is kept as columns [D, 16] (kt[d * 16 + j]: element d of position
// j), so a row's 16 scores are D broadcast multiply-adds, with no sum across lanes.
constexpr int kParts = 16 / kWidth;

// Rows scored at once and output columns weighed at once: 8 accumulators either way, half
// the 16 vector registers of AVX2 and SSE.
constexpr int kRows = 8 / kParts;
constexpr int64_t kSpan = 8 * kWidth;

// exp_nonpositive on a vector's lanes (the same steps), a NaN staying NaN.
inline VF exp_nonpositive_lanes(VF x) {
  const VI tiny = x < splat(-87.0f);
  x = pick(tiny, splat(-87.0f), x);
  const VF y = x * 1.44269504088896341f + 0.5f;
  VF k = __builtin_convertvector(__builtin_convertvector(y, VI), VF);  // toward zero, then down: floor
  k += __builtin_convertvector(k > y, VF);                             // (true is -1)
  const VF e = exp_reduced(x - k * 0.693359375f + k * 2.12194440e-4f);
  const VI bits = (__builtin_convertvector(k, VI) + 127) << 23;
  return pick(tiny, VF{}, e * reinterpret_cast<VF>(bits));
}

// Positions slots[i], i < n, of one KV head decoded as rows into dst [16, D] (decode_block) or
// as columns into dst [D, 16] (decode_keys), row scales applied; positions n..15 are zeros.
template <typename T>
void decode_block(const Problem<T>& p, Ptr<T> head, const float* scales, int64_t kvh, const int64_t* slots,
                  int64_t n, float* dst, bool columns = false) {
  const int64_t D = p.D, stride = p.Hkv * D;
  if (!columns)
    std::fill(dst + n * D, dst + kTile * D, 0.0f);
  else if (n < kTile)
    std::fill(dst, dst + kTile * D, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float scale = kScaled<T> ? scales[slots[i] * p.Hkv + kvh] * kScaleUnit<T> : 1.0f;
    if (columns)
      decode_row<T>(head + slots[i] * stride, D, scale, dst + i, kTile);
    else
      decode_row<T>(head + slots[i] * stride, D, scale, dst + i * D, 1);
  }
}
template <typename T>
void decode_keys(const Problem<T>& p, Ptr<T> head, const float* scales, int64_t kvh, const int64_t* slots,
                 int64_t n, float* dst) {
  decode_block(p, head, scales, kvh, slots, n, dst, true);
}

// The scores of `ready` query rows (rows[x] of the tile, its query qs[x] [D]; ready <= kRows)
// over a key block kt [D, 16] into w [R, 16], as tile_block writes them: kRows independent
// sums (a short group repeats its first row), so the multiply-adds overlap.
template <int kPer>
void score_rows(const float** qs, const int64_t* rows, int ready, const float* kt, const uint32_t* seen, int64_t G,
                float sm_scale, float cap, float* w) {
  for (int x = ready; x < kRows; ++x) qs[x] = qs[0];
  VF s[kRows][kParts] = {};
  for (int64_t d = 0; d < 16 * kPer; ++d) {
    VF k[kParts];
    for (int v = 0; v < kParts; ++v) k[v] = load(kt + d * 16 + v * kWidth);
    for (int x = 0; x < kRows; ++x) {
      const VF q = splat(qs[x][d]);
      for (int v = 0; v < kParts; ++v) s[x][v] += q * k[v];
    }
  }
  for (int x = 0; x < ready; ++x) {
    const VI mask = VI{} + static_cast<int32_t>(seen[rows[x] / G]);
    for (int v = 0; v < kParts; ++v) {
      VF y = s[x][v] * sm_scale;
      if (cap > 0.0f)
        for (int l = 0; l < kWidth; ++l) y[l] = cap * std::tanh(y[l] / cap);
      VI lane;  // the bits of positions v * kWidth ..
      for (int l = 0; l < kWidth; ++l) lane[l] = 1 << (v * kWidth + l);
      save(w + rows[x] * 16 + v * kWidth, pick((lane & mask) != 0, y, splat(-kInf)));
    }
  }
}

// out[kVecs * kWidth] = out * shrink + sum of w[j] v[j] over the lanes j set in m (v: rows of
// `stride` floats), in kVecs registers: a run of lanes (every row but a draft-tree node's) as
// a counted loop, others bit by bit.
template <int kVecs>
inline void weigh_columns(const float* w, uint32_t m, const float* v, int64_t stride, float shrink, float* out) {
  VF o[kVecs];
  for (int u = 0; u < kVecs; ++u) o[u] = load(out + u * kWidth) * shrink;
  const int j0 = __builtin_ctz(m), j1 = 32 - __builtin_clz(m);
  if (((m >> j0) & ((m >> j0) + 1)) == 0) {
    for (int j = j0; j < j1; ++j)
      for (int u = 0; u < kVecs; ++u) o[u] += w[j] * load(v + j * stride + u * kWidth);
  } else {
    for (uint32_t left = m; left; left &= left - 1)
      for (int u = 0, j = __builtin_ctz(left); u < kVecs; ++u) o[u] += w[j] * load(v + j * stride + u * kWidth);
  }
  for (int u = 0; u < kVecs; ++u) save(out + u * kWidth, o[u]);
}

// tile_block's portable form (the same arguments; kt: the keys as columns [D, 16]).
template <int kPer>
void tile_block(const float* q, int64_t token_stride, int64_t G, int64_t c, const uint32_t* seen,
                const float* kt, const float* vb, float sm_scale, float cap, float* top, float* total, float* acc,
                float* w, float* shrink) {
  constexpr int64_t D = 16 * kPer;
  const float* qs[kRows];
  int64_t rows[kRows];
  int ready = 0;
  for (int64_t r = 0; r < c * G; ++r) {  // the rows of tokens that see the block, kRows at a time
    if (!seen[r / G]) continue;
    qs[ready] = q + r / G * token_stride + r % G * D;
    rows[ready++] = r;
    if (ready == kRows) {
      score_rows<kPer>(qs, rows, ready, kt, seen, G, sm_scale, cap, w);
      ready = 0;
    }
  }
  if (ready) score_rows<kPer>(qs, rows, ready, kt, seen, G, sm_scale, cap, w);
  // each row's online softmax step
  for (int64_t r = 0; r < c * G; ++r) {
    if (!seen[r / G]) continue;
    float most = top[r];
    for (int j = 0; j < 16; ++j) most = w[r * 16 + j] > most ? w[r * 16 + j] : most;  // a NaN score: NaN sum
    shrink[r] = exp_nonpositive(top[r] - most);  // 0 for the first block (top -inf)
    VF sum = VF{};
    for (int v = 0; v < kParts; ++v) {
      const VF e = exp_nonpositive_lanes(load(w + r * 16 + v * kWidth) - most);
      save(w + r * 16 + v * kWidth, e);
      sum += e;
    }
    float added = 0.0f;
    for (int l = 0; l < kWidth; ++l) added += sum[l];
    total[r] = total[r] * shrink[r] + added;
    top[r] = most;
  }
  // the weighted values: only the lanes a row sees (another row's NaN value must not reach
  // it), kSpan columns at a time (their sums in registers), then the rest
  for (int64_t r = 0; r < c * G; ++r) {
    const uint32_t m = seen[r / G];
    if (!m) continue;
    int64_t c0 = 0;
    for (; c0 + kSpan <= D; c0 += kSpan)
      weigh_columns<kSpan / kWidth>(w + r * 16, m, vb + c0, D, shrink[r], acc + r * D + c0);
    if constexpr (D % kSpan != 0)
      weigh_columns<D % kSpan / kWidth>(w + r * 16, m, vb + c0, D, shrink[r], acc + r * D + c0);
  }
}
#endif

using TileBlock = void (*)(const float*, int64_t, int64_t, int64_t, const uint32_t*, const float*, const float*,
                           float, float, float*, float*, float*, float*, float*);
template <int... V>
constexpr std::array<TileBlock, sizeof...(V) + 1> tile_blocks(std::integer_sequence<int, V...>) {
  return {nullptr, &tile_block<V + 1>...};
}
constexpr auto kTileBlock = tile_blocks(std::make_integer_sequence<int, 16>{});  // [kPer] for kPer = 1 .. 16

// Item `it` of kind tile: its it.count tokens (consecutive positions of one sequence) over
// positions [it.lo, it.hi], 16 at a time per KV head, decoded once for the tile's rows
// (token i, query head g of that KV head); each token's out and lse written as merge writes
// them, or, for one of a tile's several parts, the part's (as attend_part's, per token; a
// token that sees none of its positions: lse -inf, out 0), merged once all are done.
template <typename T>
void attend_tile(const Problem<T>& p, const Item& it, Part& part, Scratch& s) {
  const int64_t G = p.Hq / p.Hkv, D = p.D, c = it.count, R = c * G;
  const int32_t* table = p.tables + p.seq[it.t] * p.W;
  const TileBlock block = kTileBlock[D / 16];
  s.tile.resize(2 * kTile * D);
  float *kb = s.tile.data(), *vb = kb + kTile * D;
  s.acc.resize(R * D);
  s.top.resize(R);
  s.total.resize(R);
  s.scores.resize(R * 17);  // the block's scores, then weights [R, 16], and each row's shrink [R]
  float *w = s.scores.data(), *shrink = w + R * 16;
  // the lanes each token sees in each block [b, c] (the same for every KV head)
  const int64_t blocks = (it.hi - it.lo + kTile) / kTile;
  s.seen.resize(blocks * c);
  for (int64_t i = 0; i < c; ++i) {
    const Sight see = sight(p, it.t + i);
    for (int64_t b = 0; b < blocks; ++b)
      s.seen[b * c + i] = see.lanes(it.lo + b * kTile, std::min(kTile, it.hi - it.lo - b * kTile + 1));
  }
  if (it.splits > 1) {
    part.lse.resize(c * p.Hq);
    part.out.resize(c * p.Hq * D);
  }
  for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    std::fill(s.top.begin(), s.top.end(), -kInf);
    std::fill(s.total.begin(), s.total.end(), 0.0f);
    for (int64_t b0 = it.lo; b0 <= it.hi; b0 += kTile) {
      const int64_t n = std::min(kTile, it.hi - b0 + 1);
      int64_t slots[kTile];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t position = b0 + i;
        slots[i] = std::clamp<int64_t>(table[position / p.ps], 0, p.P - 1) * p.ps + position % p.ps;
      }
      decode_keys(p, p.k + kvh * D, kScaled<T> ? p.ks : nullptr, kvh, slots, n, kb);
      decode_block(p, p.v + kvh * D, kScaled<T> ? p.vs : nullptr, kvh, slots, n, vb);
      const uint32_t* seen = s.seen.data() + (b0 - it.lo) / kTile * c;
      block(p.q + (it.t * p.Hq + kvh * G) * D, p.Hq * D, G, c, seen, kb, vb, p.sm_scale, p.cap, s.top.data(),
            s.total.data(), s.acc.data(), w, shrink);
    }
    for (int64_t i = 0; i < c; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g, h = kvh * G + g, t = it.t + i;
        const bool any = s.total[r] != 0.0f;  // a part may see none of a token's positions (NaN stays)
        float lse = any ? s.top[r] + std::log(s.total[r]) : -kInf, keep = any ? 1.0f / s.total[r] : 0.0f;
        if (it.splits > 1) {
          part.lse[i * p.Hq + h] = lse;
          for (int64_t d = 0; d < D; ++d) part.out[(i * p.Hq + h) * D + d] = s.acc[r * D + d] * keep;
          continue;
        }
        if (p.sinks) join_sink(p.sinks[h], lse, keep);
        float* out = p.out + (t * p.Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) out[d] = s.acc[r * D + d] * keep;
        p.lse[t * p.Hq + h] = lse;
      }
  }
}

// Item `it`: a tile's tokens (written whole) or one token's run (its part).
template <typename T>
void attend_item(const Problem<T>& p, const Item& it, Part& part, Scratch& s) {
  if (it.count) return attend_tile(p, it, part, s);
  attend_part(p, it, part, s);
}

// Token t's output and lse from its parts: out = sum_j e_j out_j / sum_j e_j with
// e_j = exp(lse_j - max lse), lse = max lse + log(sum_j e_j) (one part: itself, e = 1); a
// sink logit joins the denominator only (logaddexp(lse, sink), its share leaving the output).
// row: the token's place in a tile's parts (0 for a token's own runs).
template <typename T>
void merge(const Problem<T>& p, int64_t t, const Part* parts, int64_t count, int64_t row = 0) {
  const int64_t D = p.D;
  for (int64_t h = 0; h < p.Hq; ++h) {
    float top = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    bool seen = false;  // a part's lse is -inf where it saw no position (NaN where a NaN reached it)
    for (int64_t j = 0; j < count; ++j) {
      top = std::max(top, parts[j].lse[row * p.Hq + h]);
      seen |= parts[j].lse[row * p.Hq + h] != -kInf;
    }
    float* out = p.out + (t * p.Hq + h) * D;
    std::fill(out, out + D, 0.0f);
    if (!seen) {  // no position seen (a node without its own bit, a row past the table): as ref.py, out 0
      float lse = -kInf, keep = 0.0f;
      if (p.sinks) join_sink(p.sinks[h], lse, keep);
      p.lse[t * p.Hq + h] = lse;
      continue;
    }
    for (int64_t j = 0; j < count; ++j) {
      const float e = std::exp(parts[j].lse[row * p.Hq + h] - top);
      sum += e;
      const float* part = parts[j].out.data() + (row * p.Hq + h) * D;
      for (int64_t d = 0; d < D; ++d) out[d] += e * part[d];
    }
    float total = top + std::log(sum);  // sum >= 1: the largest part's own term
    float keep = 1.0f / sum;
    if (p.sinks) join_sink(p.sinks[h], total, keep);
    for (int64_t d = 0; d < D; ++d) out[d] *= keep;
    p.lse[t * p.Hq + h] = total;
  }
}

// Items handed out through one counter to the calling thread and the pool's; a helper that
// starts after all are taken returns at once (the state outlives the call).
template <typename T>
struct Shared {
  Problem<T> p;
  std::vector<Item> items;
  std::vector<Part> parts;  // one per item
  std::vector<int32_t> seq, pos;  // per token (lay_out_and_write)
  TurboPages turbo[2];  // TurboQuant pages' K and V, where their Ptrs point
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    Scratch s;
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t i; (i = next.fetch_add(1)) < count; done.fetch_add(1)) attend_item(p, items[i], parts[i], s);
  }
  static void item(void* shared, int64_t i) {  // item i, on a thread of the matmul's crew
    thread_local Scratch s;
    auto* self = static_cast<Shared*>(shared);
    attend_item(self->p, self->items[i], self->parts[i], s);
  }
};

// Positions per item: a context of n positions is split into min(n / kSplit, most) near-equal
// runs (at least kSplit positions each), most = max(kMaxSplits, the pool's threads), whatever
// the batch, so a row's result depends on its context (and the machine) alone; the runs of
// one row can then go to several threads. kSplit is short enough that a decode row from 64
// positions on is two items or more, one per core of a small machine; the cap keeps a batch's
// items few enough that their own costs (a part's buffers, its softmax, the merge) stay
// small, while one long row still spreads over every thread: a SmolLM2 layer's call at batch
// 16 and 2,048 positions on 2 cores took 4.3 ms over float32 pages and 3.3 ms over
// turboquant-3.5 ones in 64 runs a row, 2.2 and 2.5 ms in 8.
constexpr int64_t kSplit = 32, kMaxSplits = 8;

// The quantized matmul's crew of helper threads (its KvfoldCrewRun, handed over by cpu.py
// through KvfoldDecodeAttentionUseCrew), or null: a call runs its items on them when it has
// at least two. The crew is awake between a decode step's calls (the q/k/v projections run
// just before attention), so it joins in at once, where a helper woken through XLA's pool
// took tens of us and cost more than it saved below kPoolWork.
using CrewRun = int (*)(void (*)(void*, int64_t), void*, int64_t, int64_t);
std::atomic<CrewRun> crew_run{nullptr};
std::atomic<int64_t> crew_calls{0};  // calls whose items the crew ran (KvfoldDecodeAttentionCrewCalls)
std::atomic<int64_t> tile_items{0};  // tiles attended so far (KvfoldDecodeAttentionTileItems)
std::atomic<int64_t> tile_parts_made{0};  // parts of tiles cut in several (KvfoldDecodeAttentionTileParts)
constexpr int64_t kPoolWork = int64_t{1} << 18;  // positions * query heads * head_dim

// One KV head's new row x [D] into the pages (and their scales) at slot_head, its position's
// slot * Hkv + head: as is; as quant.kv_rows quantizes it (row-scaled codes: scale = absmax *
// (1 / qmax), codes of x * (1 / scale), x * 1 for an all-zero row: the float32 operations
// XLA:CPU runs there); or as quant.nvfp4_quantize at tensor scale 1 (per 16: the E4M3 scale of
// absmax * (1 / 6), each code the nearest E2M1 value of x over the rounded scale, found by
// comparing |x| with the midpoints times it, ties to the even code, 0 under a scale <= 0 or
// NaN).
template <typename T>
void store_row(const float* x, int64_t D, void* pages, void* scales, int64_t slot_head) {
  const auto absmax = [](const float* x, int64_t n) {  // NaN if any is
    float amax = 0.0f;
    for (int64_t d = 0; d < n; ++d)
      amax = std::isnan(x[d]) || std::isnan(amax) ? NAN : std::max(amax, std::fabs(x[d]));
    return amax;
  };
  if constexpr (std::is_same_v<T, Nvfp4>) {
    constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    constexpr bool kUp[7] = {false, true, false, true, false, true, false};
    uint8_t* packed = static_cast<uint8_t*>(pages) + slot_head * D / 2;
    Fp8* block_scales = static_cast<Fp8*>(scales) + slot_head * D / 16;
    for (int64_t b = 0; b < D / 16; ++b) {
      store(absmax(x + 16 * b, 16) * (1.0f / 6.0f), block_scales[b]);
      const float scale = e4m3_value(block_scales[b].bits);
      uint8_t codes[16];
      for (int j = 0; j < 16; ++j) {
        const float mag = std::fabs(x[16 * b + j]);
        uint8_t c = 0;
        for (int m = 0; m < 7; ++m) c += kUp[m] ? mag >= kMid[m] * scale : mag > kMid[m] * scale;
        codes[j] = scale > 0.0f ? static_cast<uint8_t>(c | (std::signbit(x[16 * b + j]) ? 8 : 0)) : 0;
      }
      for (int j = 0; j < 8; ++j) packed[8 * b + j] = static_cast<uint8_t>(codes[2 * j] | codes[2 * j + 1] << 4);
    }
  } else if constexpr (kScaled<T>) {
    T* codes = static_cast<T*>(pages) + slot_head * D;
    float& scale = static_cast<float*>(scales)[slot_head];
    const float qmax = std::is_same_v<T, int8_t> ? 127.0f : 448.0f;
    scale = absmax(x, D) * (1.0f / qmax);
    const float inv = 1.0f / (scale > 0.0f ? scale : 1.0f);
    for (int64_t d = 0; d < D; ++d) store(x[d] * inv, codes[d]);
  } else {
    T* row = static_cast<T*>(pages) + slot_head * D;
    for (int64_t d = 0; d < D; ++d) store(x[d], row[d]);
  }
}

// Token t's sequence and position from the step's layout, as ref.token_layout gives them:
// seq[t] counts the query starts cu_q_lens[1 .. S] at or before t (S for the padding past
// the last row, whose position is -1), and its position is kv_lens[s] - q_len[s] + t -
// cu_q_lens[s]. Then (k not null) its new K/V rows are stored at that position's page slot,
// as ref.write_new_kv stores them: nothing for padding, a position past the table, or an
// entry outside [0, P) (a bad entry never lands in another sequence's page). TurboQuant pages
// come written (cpu.py writes them through XLA, as quant.TurboQuant quantizes).
template <typename T>
void lay_out_and_write(const int32_t* cu, const int32_t* kv_lens, const float* k, const float* v, int64_t S,
                       Problem<T>& p, std::vector<int32_t>& seq, std::vector<int32_t>& pos, void* k_pages,
                       void* v_pages, void* k_scales, void* v_scales) {
  const int64_t row = p.Hkv * p.D;
  seq.assign(p.T, static_cast<int32_t>(S));
  pos.assign(p.T, -1);
  for (int64_t t = 0; t < p.T; ++t) {
    int64_t s = 0;
    for (int64_t j = 1; j <= S; ++j) s += t >= cu[j];
    if (s >= S) continue;
    seq[t] = static_cast<int32_t>(s);
    pos[t] = kv_lens[s] - (cu[s + 1] - cu[s]) + static_cast<int32_t>(t) - cu[s];
    if (!k || pos[t] < 0 || pos[t] >= p.W * p.ps) continue;
    const int64_t page = p.tables[s * p.W + pos[t] / p.ps];
    if (page < 0 || page >= p.P) continue;
    const int64_t slot = page * p.ps + pos[t] % p.ps;
    if constexpr (!std::is_same_v<T, Turbo>)
      for (int64_t h = 0; h < p.Hkv; ++h) {
        store_row<T>(k + t * row + h * p.D, p.D, k_pages, k_scales, slot * p.Hkv + h);
        store_row<T>(v + t * row + h * p.D, p.D, v_pages, v_scales, slot * p.Hkv + h);
      }
  }
}

// A call's draft tree as the kernel reads it (Problem's tree_start, tree_bits, words), or none.
struct Tree {
  const int32_t *start = nullptr, *bits = nullptr;
  int64_t words = 0;
};

// The draft tree of a call (has_tree) from its operands start [S] and bits [T, words], or an
// error naming what does not fit.
ffi::Error tree_of(const char* who, int64_t has_tree, const ffi::Buffer<ffi::S32>& start,
                   const ffi::Buffer<ffi::S32>& bits, int64_t S, int64_t T, Tree& tree) {
  if (!has_tree) return ffi::Error::Success();
  const auto bd = bits.dimensions();
  if (start.element_count() != S || bd.size() != 2 || bd[0] != T)
    return ffi::Error::InvalidArgument(std::string(who) + ": a tree needs start [num_seqs] and bits [tokens, words]");
  tree = Tree{start.typed_data(), bits.typed_data(), bd[1]};
  return ffi::Error::Success();
}

// One decode-attention step over pages of T: the new K/V (k, v; null for TurboQuant pages,
// which come written) written into the pages kp, vp (the results, aliased to the operands),
// then every token's attention over them. turbo: TurboQuant pages' K and V views, else null.
template <typename T>
void run(ffi::ThreadPool pool, const ffi::Buffer<ffi::F32>& q, const float* k, const float* v, void* kp, void* vp,
         void* ks, void* vs, const ffi::Buffer<ffi::S32>& block_tables, const ffi::Buffer<ffi::S32>& cu_q_lens,
         const ffi::Buffer<ffi::S32>& kv_lens, const float* sinks, float* out, float* lse, int64_t P, int64_t ps,
         int64_t Hkv, float sm_scale, int64_t sliding_window, float soft_cap, const Tree& tree,
         const TurboPages* turbo = nullptr) {
  const auto qd = q.dimensions(), bd = block_tables.dimensions();
  const int64_t T_ = qd[0], Hq = qd[1], D = qd[2], S = kv_lens.element_count();
  auto shared = std::make_shared<Shared<T>>();
  Problem<T>& p = shared->p;
  if (turbo) std::copy(turbo, turbo + 2, shared->turbo);  // where the views point, for the helpers' lifetime
  const auto view = [&shared](void* pages, void* scales, int kv) -> Ptr<T> {
    if constexpr (std::is_same_v<T, Nvfp4>)
      return Nvfp4Ptr{static_cast<const uint8_t*>(pages), static_cast<const uint8_t*>(scales), 0};
    else if constexpr (std::is_same_v<T, Turbo>)
      return TurboPtr{&shared->turbo[kv], 0};
    else
      return static_cast<const T*>(pages);
  };
  constexpr bool scaled = kScaled<T>;
  p = Problem<T>{q.typed_data(), view(kp, ks, 0), view(vp, vs, 1), sinks, block_tables.typed_data(), nullptr, nullptr,
                 out, lse, T_, Hq, Hkv, D, P, ps, S, bd[1], sliding_window, sm_scale, soft_cap,
                 scaled ? static_cast<const float*>(ks) : nullptr, scaled ? static_cast<const float*>(vs) : nullptr,
                 tree.start, tree.bits, tree.words};
  lay_out_and_write(cu_q_lens.typed_data(), kv_lens.typed_data(), k, v, S, p, shared->seq, shared->pos, kp, vp, ks,
                    vs);
  p.seq = shared->seq.data();
  p.pos = shared->pos.data();
  // A sequence's run of kTileMin query tokens or more in tiles (the last, the dearest, first),
  // where head_dim allows them.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), last = p.W * p.ps - 1;
  std::vector<char> tiled(T_, 0);
  int64_t positions = 0;
  const int32_t* cu = cu_q_lens.typed_data();
  for (int64_t s = 0; D % 16 == 0 && D <= 256 && s < S; ++s) {
    const int64_t a = std::max<int64_t>(cu[s], 0), b = std::min<int64_t>(cu[s + 1], T_);
    // seq[t] never decreases, so [a, b) is all sequence s (and its positions consecutive)
    // when its ends are; a cu_q_lens out of order leaves the tokens to their runs
    if (b - a < kTileMin || p.seq[a] != s || p.seq[b - 1] != s || p.pos[a] < 0) continue;
    for (int64_t t1 = b; t1 > a; t1 -= kTile) {
      const int64_t t0 = std::max(a, t1 - kTile), hi = std::min<int64_t>(p.pos[t1 - 1], last);
      int64_t lo = hi + 1;  // the first position a token of the tile sees (draft-tree nodes' windows differ)
      for (int64_t t = t0; t < t1; ++t) lo = std::min(lo, sight(p, t).lo);
      shared->items.push_back(Item{t0, lo, hi, t1 - t0});
      std::fill(tiled.begin() + t0, tiled.begin() + t1, 1);
      positions += (hi - lo + 1) * (t1 - t0);
    }
  }
  const auto cost = [](const Item& x) { return (x.hi - x.lo + 1) * x.count; };
  std::stable_sort(shared->items.begin(), shared->items.end(),
                   [&cost](const Item& x, const Item& y) { return cost(x) > cost(y); });  // the dearest first
  const int64_t tiles = static_cast<int64_t>(shared->items.size());
  tile_items.fetch_add(tiles, std::memory_order_relaxed);
  // Tiles fewer than the threads are cut into parts of kTileRun positions or more, so that a
  // short chunk over a long context spreads over the threads as a token's runs do; a
  // tiled token's parts are then items [tile_first[t], + tile_parts[t]), its row in them
  // tile_row[t].
  std::vector<int64_t> tile_first(T_, 0), tile_parts(T_, 1), tile_row(T_, 0);
  if (tiles > 0 && tiles < threads) {
    std::vector<Item> whole;
    whole.swap(shared->items);
    for (const Item& x : whole) {
      const int64_t n = x.hi - x.lo + 1;
      const int64_t splits = std::clamp<int64_t>(std::min(threads / tiles, n / kTileRun), 1, std::max<int64_t>(n, 1));
      for (int64_t i = 0; i < x.count; ++i) {
        tile_first[x.t + i] = static_cast<int64_t>(shared->items.size());
        tile_parts[x.t + i] = splits;
        tile_row[x.t + i] = i;
      }
      for (int64_t j = 0; j < splits; ++j)
        shared->items.push_back(Item{x.t, x.lo + n * j / splits, x.lo + n * (j + 1) / splits - 1, x.count, splits});
      if (splits > 1) tile_parts_made.fetch_add(splits, std::memory_order_relaxed);
    }
  }
  // Each other live token's positions, in runs of kSplit or more.
  std::vector<int64_t> first(T_ + 1, shared->items.size());  // token t's items: [first[t], first[t + 1])
  for (int64_t t = 0; t < T_; ++t) {
    first[t + 1] = first[t];
    const int64_t s = p.seq[t];
    if (tiled[t] || s < 0 || s >= p.S || p.pos[t] < 0) continue;  // in a tile, or padding
    const Sight see = sight(p, t);
    const int64_t lo = see.lo, n = see.hi - lo + 1;
    const int64_t splits = std::clamp<int64_t>(n / kSplit, 1, std::max(kMaxSplits, threads));
    for (int64_t j = 0; j < splits; ++j)
      shared->items.push_back(Item{t, lo + n * j / splits, lo + n * (j + 1) / splits - 1});
    first[t + 1] += splits;
    positions += n;
  }
  const int64_t items = static_cast<int64_t>(shared->items.size());
  shared->parts.resize(items);
  const CrewRun crew = crew_run.load();
  if (crew && items > 1 && crew(&Shared<T>::item, shared.get(), items, threads)) {
    crew_calls.fetch_add(1, std::memory_order_relaxed);
  } else {
    // XLA's pool when the call holds enough work for a wake-up (tens of us) to pay.
    const int64_t helpers = positions * Hq * D < kPoolWork ? 0 : std::min(threads, items) - 1;
    for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
    shared->work();
    while (shared->done.load() < items) std::this_thread::yield();
  }
  for (int64_t t = 0; t < T_; ++t) {
    if (tiled[t]) {  // written by its tile, or merged from the tile's parts
      if (tile_parts[t] > 1)
        merge(p, t, shared->parts.data() + tile_first[t], tile_parts[t], tile_row[t]);
      continue;
    }
    if (first[t + 1] > first[t]) {
      merge(p, t, shared->parts.data() + first[t], first[t + 1] - first[t]);
    } else {  // padding
      std::fill(out + t * Hq * D, out + (t + 1) * Hq * D, 0.0f);
      std::fill(lse + t * Hq, lse + (t + 1) * Hq, -std::numeric_limits<float>::infinity());
    }
  }
}

// A result buffer that XLA aliased to its operand; where it did not, the operand copied in.
void* aliased(const ffi::AnyBuffer& operand, ffi::Result<ffi::AnyBuffer>& result) {
  void* data = result->untyped_data();
  if (data != operand.untyped_data()) std::memcpy(data, operand.untyped_data(), operand.size_bytes());
  return data;
}

// The checks of one call and its run over float32 or bfloat16 pages, int8 / E4M3 codes with
// their row scales (float32 [P, ps, Hkv]), or NVFP4's packed codes (uint8 [P, ps, Hkv, D / 2])
// with their block scales (E4M3 [P, ps, Hkv, D / 16]); beside float pages the scales are a
// placeholder of one float32. E4M3 leaves come as float8_e4m3fn or as their uint8 bits (what
// the pools keep): uint8 pages are E4M3 codes when head_dim wide, NVFP4 when half that.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::F32> sinks,
                           ffi::Buffer<ffi::S32> tree_start, ffi::Buffer<ffi::S32> tree_bits,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                           ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                           ffi::Result<ffi::AnyBuffer> ks_out, ffi::Result<ffi::AnyBuffer> vs_out, float sm_scale,
                           int64_t sliding_window, float soft_cap, int64_t has_sinks, int64_t has_tree) {
  using Type = ffi::DataType;
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention_cpu: q must be 3-D, the pages 4-D, block_tables 2-D");
  const Type type = k_pages.element_type();
  const int64_t T = qd[0], Hq = qd[1], D = qd[2], Hkv = kd[2], S = kv_lens.element_count();
  const bool fp8 = type == Type::F8E4M3FN || (type == Type::U8 && kd[3] == D);
  const bool fp4 = type == Type::U8 && !fp8, scaled = type == Type::S8 || fp8;
  const auto vd = v_pages.dimensions();
  if (D <= 0 || kd[3] != (fp4 ? D / 2 : D) || (fp4 && D % 16) || Hkv <= 0 || Hq % Hkv || vd.size() != 4 ||
      !std::equal(vd.begin(), vd.end(), kd.begin()))
    return ffi::Error::InvalidArgument("decode_attention_cpu: page shapes do not match q's heads");
  if ((type != Type::F32 && type != Type::BF16 && !scaled && !fp4) || v_pages.element_type() != type)
    return ffi::Error::InvalidArgument("decode_attention_cpu: the pages must both be float32, bfloat16, int8, "
                                       "float8_e4m3fn or uint8 (E4M3 bits, or NVFP4)");
  const int64_t scales = fp4 ? kd[0] * kd[1] * Hkv * (D / 16) : scaled ? kd[0] * kd[1] * Hkv : 1;
  const Type scale_type = k_scales.element_type();
  const bool scale_ok = fp4 ? scale_type == Type::F8E4M3FN || scale_type == Type::U8 : scale_type == Type::F32;
  if (!scale_ok || v_scales.element_type() != scale_type || k_scales.element_count() != scales ||
      v_scales.element_count() != scales)
    return ffi::Error::InvalidArgument("decode_attention_cpu: int8 / fp8 pages need float32 scales [num_pages, "
                                       "page_size, num_kv_heads], NVFP4 pages E4M3 ones (float8_e4m3fn or uint8 "
                                       "bits) [.., head_dim / 16], float pages a float32 placeholder of one");
  if (k.element_count() != T * Hkv * D || v.element_count() != T * Hkv * D)
    return ffi::Error::InvalidArgument("decode_attention_cpu: the new K/V rows do not match q and the pages");
  if (bd[0] != S || cu_q_lens.element_count() != S + 1 || (has_sinks && sinks.element_count() != Hq))
    return ffi::Error::InvalidArgument("decode_attention_cpu: block_tables / cu_q_lens / kv_lens / sinks lengths "
                                       "do not match");
  Tree tree;
  const ffi::Error tree_ok = tree_of("decode_attention_cpu", has_tree, tree_start, tree_bits, S, T, tree);
  if (tree_ok.failure()) return tree_ok;
  const float* sink = has_sinks ? sinks.typed_data() : nullptr;
  void *kp = aliased(k_pages, k_out), *vp = aliased(v_pages, v_out);
  void *ks = aliased(k_scales, ks_out), *vs = aliased(v_scales, vs_out);
  const auto go = [&](auto element) {
    run<decltype(element)>(pool, q, k.typed_data(), v.typed_data(), kp, vp, ks, vs, block_tables, cu_q_lens, kv_lens,
                           sink, out->typed_data(), lse->typed_data(), kd[0], kd[1], Hkv, sm_scale, sliding_window,
                           soft_cap, tree);
  };
  if (type == Type::F32)
    go(float{});
  else if (type == Type::BF16)
    go(Bf16{});
  else if (type == Type::S8)
    go(int8_t{});
  else if (fp8)
    go(Fp8{});
  else
    go(Nvfp4{});
  return ffi::Error::Success();
}

// One pool's (K or V) TurboQuant pages as the kernel reads them: per channel group its codes
// (uint8 [P, ps, Hkv, size * bits / 8]), scales (float32 [P, ps, Hkv]), sparse indices (uint8
// [.., sparse]) and values (their bfloat16 bits, uint16 [.., sparse]), beside the groups'
// codebooks and transposed rotations; an error names what does not fit.
ffi::Error turbo_pages(const std::array<const ffi::AnyBuffer*, 8>& leaves, int64_t groups, const int64_t* bits,
                       int64_t sparse, int64_t D, const ffi::Buffer<ffi::F32>& codebooks,
                       const ffi::Buffer<ffi::F32>& columns, TurboPages& t, int64_t* lead) {
  using Type = ffi::DataType;
  t.D = D;
  t.size = D / groups;
  t.sparse = sparse;
  t.twos = 0;
  while (!((D >> t.twos) & 1)) ++t.twos;
  const uint64_t odd = static_cast<uint64_t>(D >> t.twos);
  t.inverse = odd;  // Newton's iteration x (2 - odd x) doubles the correct low bits: 3, 6, .., 96
  for (int i = 0; i < 5; ++i) t.inverse *= 2 - odd * t.inverse;
  for (int64_t g = 0; g < groups; ++g) {
    const ffi::AnyBuffer &codes = *leaves[4 * g], &scales = *leaves[4 * g + 1];
    const ffi::AnyBuffer &index = *leaves[4 * g + 2], &value = *leaves[4 * g + 3];
    const auto cd = codes.dimensions();
    if (bits[g] < 1 || bits[g] > 4 || cd.size() != 4 || codes.element_type() != Type::U8 ||
        cd[3] != t.size * bits[g] / 8)
      return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: codes must be uint8 [num_pages, page_size, "
                                         "num_kv_heads, group size * bits / 8] of 1 to 4 bits");
    if (g == 0) std::copy(cd.begin(), cd.begin() + 3, lead);
    const int64_t rows = lead[0] * lead[1] * lead[2];
    if (!std::equal(cd.begin(), cd.begin() + 3, lead) || scales.element_type() != Type::F32 ||
        scales.element_count() != rows)
      return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: every group's codes and float32 scales must "
                                         "share [num_pages, page_size, num_kv_heads]");
    if (sparse && (index.element_type() != Type::U8 || value.element_type() != Type::U16 ||
                   index.element_count() != rows * sparse || value.element_count() != rows * sparse))
      return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: sparse channels need uint8 indices and "
                                         "values' bfloat16 bits (uint16) [num_pages, page_size, num_kv_heads, "
                                         "sparse]");
    TurboGroup& f = t.group[g];
    f = TurboGroup{static_cast<const uint8_t*>(codes.untyped_data()), static_cast<const float*>(scales.untyped_data()),
                   sparse ? static_cast<const uint8_t*>(index.untyped_data()) : nullptr,
                   sparse ? static_cast<const uint16_t*>(value.untyped_data()) : nullptr,
                   codebooks.typed_data() + 16 * g, columns.typed_data() + g * t.size * t.size, bits[g], cd[3]};
    for (int j = 0; j < 16; ++j) {
      f.first[j] = static_cast<int32_t>(j * bits[g] / 8);
      f.shift[j] = static_cast<int32_t>(j * bits[g] % 8);
    }
  }
  if (groups == 1) t.group[1] = t.group[0];
  return ffi::Error::Success();
}

// The checks of one call over TurboQuant pages and its run: q [T, Hq, D] in the groups'
// rotated basis (prepare_q), out [T, Hq, D] in it too (finish_out turns it back), lse as for
// the other pages. The pages come written; nothing is written here.
ffi::Error DecodeAttentionTurbo(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc0, ffi::AnyBuffer ks0,
                                ffi::AnyBuffer ki0, ffi::AnyBuffer kv0, ffi::AnyBuffer kc1, ffi::AnyBuffer ks1,
                                ffi::AnyBuffer ki1, ffi::AnyBuffer kv1, ffi::AnyBuffer vc0, ffi::AnyBuffer vs0,
                                ffi::AnyBuffer vi0, ffi::AnyBuffer vv0, ffi::AnyBuffer vc1, ffi::AnyBuffer vs1,
                                ffi::AnyBuffer vi1, ffi::AnyBuffer vv1, ffi::Buffer<ffi::F32> codebooks,
                                ffi::Buffer<ffi::F32> columns, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> tree_start,
                                ffi::Buffer<ffi::S32> tree_bits, ffi::ResultBuffer<ffi::F32> out,
                                ffi::ResultBuffer<ffi::F32> lse, float sm_scale, int64_t sliding_window, float soft_cap,
                                int64_t has_sinks, int64_t has_tree, int64_t groups, int64_t bits0, int64_t bits1,
                                int64_t sparse) {
  const auto qd = q.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || bd.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: q must be 3-D, block_tables 2-D");
  const int64_t Hq = qd[1], D = qd[2], S = kv_lens.element_count(), bits[2] = {bits0, bits1};
  if ((groups != 1 && groups != 2) || D <= 0 || Hq <= 0 || D % (16 * groups) || sparse < 0 ||
      (sparse && D / groups > 256))
    return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: one or two channel groups of a multiple of 16 "
                                       "channels each (at most 256 with sparse channels)");
  if (codebooks.element_count() != 16 * groups || columns.element_count() != (sparse ? D / groups * D : groups))
    return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: codebooks must be [groups, 16], columns "
                                       "[groups, size, size] (with sparse channels, else [groups, 1, 1])");
  TurboPages pages[2];
  int64_t lead[3], v_lead[3];
  for (auto [leaves, t, at] : {std::tuple{std::array<const ffi::AnyBuffer*, 8>{&kc0, &ks0, &ki0, &kv0, &kc1, &ks1, &ki1,
                                                                               &kv1}, &pages[0], lead},
                               std::tuple{std::array<const ffi::AnyBuffer*, 8>{&vc0, &vs0, &vi0, &vv0, &vc1, &vs1, &vi1,
                                                                               &vv1}, &pages[1], v_lead}}) {
    const ffi::Error checked = turbo_pages(leaves, groups, bits, sparse, D, codebooks, columns, *t, at);
    if (checked.failure()) return checked;
  }
  if (!std::equal(lead, lead + 3, v_lead) || lead[2] <= 0 || Hq % lead[2])
    return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: K and V pages must match, with q's heads a "
                                       "multiple of theirs");
  if (bd[0] != S || cu_q_lens.element_count() != S + 1 || (has_sinks && sinks.element_count() != Hq))
    return ffi::Error::InvalidArgument("decode_attention_turbo_cpu: block_tables / cu_q_lens / kv_lens / sinks "
                                       "lengths do not match");
  Tree tree;
  const ffi::Error tree_ok = tree_of("decode_attention_turbo_cpu", has_tree, tree_start, tree_bits, S, qd[0], tree);
  if (tree_ok.failure()) return tree_ok;
  run<Turbo>(pool, q, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, block_tables, cu_q_lens, kv_lens,
             has_sinks ? sinks.typed_data() : nullptr, out->typed_data(), lse->typed_data(), lead[0], lead[1], lead[2],
             sm_scale, sliding_window, soft_cap, tree, pages);
  return ffi::Error::Success();
}

}  // namespace

// Hands over the quantized matmul library's KvfoldCrewRun (cpu.py calls it once both are
// loaded); null goes back to XLA's pool alone.
extern "C" void KvfoldDecodeAttentionUseCrew(CrewRun run) { crew_run.store(run); }

// How many calls so far ran their items on the crew (what tells a test that it did).
extern "C" int64_t KvfoldDecodeAttentionCrewCalls() { return crew_calls.load(); }

// How many tiles calls so far cut their chunks into (what tells a test that tiles ran).
extern "C" int64_t KvfoldDecodeAttentionTileItems() { return tile_items.load(); }

// How many parts tiles cut in several have made so far (what tells a test that they were).
extern "C" int64_t KvfoldDecodeAttentionTileParts() { return tile_parts_made.load(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvfoldDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, Hkv, D], the new rows
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()         // k_pages [P, ps, Hkv, D] (NVFP4: D / 2 bytes)
                                  .Arg<ffi::AnyBuffer>()         // v_pages [P, ps, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()         // k_scales [P, ps, Hkv] f32, f8 [.., D / 16] or [1]
                                  .Arg<ffi::AnyBuffer>()         // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq] (any [1] when absent)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree start [S] (any [1] when absent)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree bits [T, words] (any [1, 1] when absent)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [T, Hq]
                                  .Ret<ffi::AnyBuffer>()         // k_pages, aliased to the operand
                                  .Ret<ffi::AnyBuffer>()         // v_pages, aliased to the operand
                                  .Ret<ffi::AnyBuffer>()         // k_scales, aliased to the operand
                                  .Ret<ffi::AnyBuffer>()         // v_scales, aliased to the operand
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("has_sinks")
                                  .Attr<int64_t>("has_tree"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvfoldDecodeAttentionTurbo, DecodeAttentionTurbo,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D], in the rotated basis
                                  .Arg<ffi::AnyBuffer>()         // K group 0: codes [P, ps, Hkv, size * bits / 8]
                                  .Arg<ffi::AnyBuffer>()         //   scales f32 [P, ps, Hkv]
                                  .Arg<ffi::AnyBuffer>()         //   sparse indices u8 [.., sparse] (or any [1])
                                  .Arg<ffi::AnyBuffer>()         //   sparse values, bf16 bits u16 (or any [1])
                                  .Arg<ffi::AnyBuffer>()         // K group 1 (group 0's again when one group)
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()         // V group 0
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()         // V group 1
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // codebooks [groups, 16], zero-padded
                                  .Arg<ffi::Buffer<ffi::F32>>()  // columns [groups, size, size]: Pi transposed
                                                                 // (no sparse channels: [groups, 1, 1])
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq] (any [1] when absent)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree start [S] (any [1] when absent)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tree bits [T, words] (any [1, 1] when absent)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D], in the rotated basis
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [T, Hq]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("has_sinks")
                                  .Attr<int64_t>("has_tree")
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("bits0")
                                  .Attr<int64_t>("bits1")
                                  .Attr<int64_t>("sparse"));
