// The CPU kernel of paged attention for query tokens that each see a causal run of their
// sequence's positions (decode rows): one call per layer instead of XLA's block walk, which
// also stores the step's new K/V rows in the pages (aliased in place).
//
// On XLA:CPU the block walk (pallas_kernels/paged_blocks.py) is a while loop of a few dozen
// small thunks per block, about 70 us a layer at one decode row however short the context
// (SmolLM2's 30 layers: 2 ms of a 9 ms step). Here the call first lays the tokens out from
// cu_q_lens and kv_lens (token t: sequence seq[t], position q_pos[t]) and writes each one's K
// and V rows into its page slot; XLA's version of those two steps was six small fusions a
// layer (two scatters, 4-5 us at one decode row). Then token t attends over positions [lo,
// q_pos[t]] of its sequence's pages (lo = 0, or q_pos[t] - window + 1 on a sliding-window
// layer), reading each position's K and V rows once, every KV head at a time (a page slot
// holds them side by side), for all query heads:
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
// (token, run of positions): a long context is split into runs of kSplit positions whose
// softmax parts are merged at the end (flash decoding), and the items are spread over the
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
// quant.nvfp4_quantize(x, 1.0) do, bit for bit.

#include <algorithm>
#include <array>
#include <utility>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // independent partial sums of the portable dot product

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
  float operator[](int64_t i) const {  // element e + i, decoded
    const int64_t at = e + i;
    const uint8_t byte = packed[at / 2];
    return kE2M1[at % 2 ? byte >> 4 : byte & 0xF] * e4m3_value(scales[at / 16]);
  }
};

// What a page's elements are read through: a pointer to them, or an Nvfp4Ptr.
template <typename E>
using Ptr = std::conditional_t<std::is_same_v<E, Nvfp4>, Nvfp4Ptr, const E*>;

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

// Pages of float32 or bfloat16 elements E, row-scaled int8 / E4M3 codes with their scales, or
// NVFP4 codes; q, the new rows and the results are float32.
template <typename E>
struct Problem {
  const float* q;      // [T, Hq, D]
  Ptr<E> k, v;         // pages [P, ps, Hkv, D] (NVFP4: a view of the codes and block scales)
  const float* sinks;  // [Hq] or null
  const int32_t *tables, *seq, *pos;  // [S, W], [T], [T]
  float *out, *lse;                   // [T, Hq, D], [T, Hq]
  int64_t T, Hq, Hkv, D, P, ps, S, W, window;
  float sm_scale, cap;
  const float *ks, *vs;  // kScaled<E>: the scales [P, ps, Hkv], else null
};

template <typename P>
float dot(const float* a, P b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * to_float(b[i + l]);
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * to_float(b[i]);
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
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
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
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
// NVFP4 rows, the dearest to decode, are decoded once per KV head into tile [16, D] for its
// G query heads.
template <typename T>
void scores16(const Problem<T>& p, const float* q, const int64_t* rows, int64_t n, int64_t ns, const float* kscale,
              float* tile, float* scores) {
  constexpr bool decode_once = std::is_same_v<T, Nvfp4>;
  const int64_t G = p.Hq / p.Hkv, D = p.D;
  const __m512 scale = _mm512_set1_ps(p.sm_scale);
  for (int64_t i0 = 0; i0 < ns; i0 += 16) {
    const int64_t live = std::min<int64_t>(16, n - i0);
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
      const Ptr<T> k = p.k + kvh * D;
      if constexpr (decode_once)
        for (int64_t j = 0; j < live; ++j)
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(tile + j * D + d, load16(k + rows[i0 + j] + d));
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
};

struct Part {
  std::vector<float> lse, out;  // [Hq], [Hq, D]
};

// A thread's buffers: each position's row offset in the pages (the same in K and V; the row
// holds every KV head, Hkv * D elements), the scores [Hq, n] and, for row-scaled codes, each
// position's K and V scales [Hkv, n], and (NVFP4) a KV head's rows decoded for scores16 [16, D].
struct Scratch {
  std::vector<int64_t> rows;
  std::vector<float> scores, kscale, vscale, tile;
};

#if defined(__AVX512F__)
// acc[heads, D] += sum_i w[g * n + i] v[rows[i]] for positions [i0, i1) and the heads g of
// one chunk, whose V accumulators (V of them, D / 16 a head: a template constant) stay in
// registers, so each V row is read once for all of them.
template <typename T, int V>
void weigh_chunk(const float* w, Ptr<T> v, const int64_t* rows, int64_t n, int64_t i0, int64_t i1, int64_t D,
                 float* acc) {
  const int64_t per = D / 16;
  __m512 a[V];
  for (int u = 0; u < V; ++u) a[u] = _mm512_loadu_ps(acc + 16 * u);
  for (int64_t i = i0; i < i1; ++i) {
    const Ptr<T> r = v + rows[i];
    for (int u = 0; u < V; ++u)
      a[u] = _mm512_fmadd_ps(_mm512_set1_ps(w[u / per * n + i]), load16(r + u % per * 16), a[u]);
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
           int64_t D, float* acc) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 256) {
    const int64_t per = D / 16, heads = 16 / per;
    for (int64_t g = 0; g < G; g += heads) {
      const int64_t count = std::min(heads, G - g);
      kWeighChunk<T>[count * per](w + g * n, v, rows, n, i0, i1, D, acc + g * D);
    }
    return;
  }
#endif
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float wi = w[g * n + i];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += wi * to_float(v[rows[i] + d]);
    }
}

// Positions a weighted pass covers before it moves to the next KV head: two pages' rows of
// every head stay in the L1 cache for the heads after the first.
constexpr int64_t kRun = 32;

// Item `it`'s part: every query head over positions [lo, hi], reading each position's K and
// V rows (all KV heads, contiguous in the page) in page order.
template <typename T>
void attend_part(const Problem<T>& p, const Item& it, Part& part, Scratch& s) {
  const int64_t G = p.Hq / p.Hkv, D = p.D, n = it.hi - it.lo + 1, stride = p.Hkv * D;
  const int32_t* table = p.tables + p.seq[it.t] * p.W;
  const int64_t ns = (n + 15) / 16 * 16;  // a head's stride in the scores: whole vectors, padded with -inf
  s.rows.resize(n);
  if constexpr (kScaled<T>) {  // position i's scales in KV head h: [h * ns + i] (0 past n), in kScaleUnit
    s.kscale.assign(p.Hkv * ns, 0.0f);
    s.vscale.assign(p.Hkv * ns, 0.0f);
  }
  for (int64_t position = it.lo, i = 0; position <= it.hi;) {  // a page at a time
    const int64_t page = std::clamp<int64_t>(table[position / p.ps], 0, p.P - 1), slot = position % p.ps;
    const int64_t slots = std::min(p.ps - slot, it.hi - position + 1), first = page * p.ps + slot;
    for (int64_t j = 0; j < slots; ++j, ++i) {
      s.rows[i] = (first + j) * stride;
      if constexpr (kScaled<T>)
        for (int64_t h = 0; h < p.Hkv; ++h) {
          s.kscale[h * ns + i] = p.ks[(first + j) * p.Hkv + h] * kScaleUnit<T>;
          s.vscale[h * ns + i] = p.vs[(first + j) * p.Hkv + h] * kScaleUnit<T>;
        }
    }
    position += slots;
  }
  const float* q = p.q + it.t * p.Hq * D;
  s.scores.resize(p.Hq * ns);
  float* scores = s.scores.data();
  const float* kscale = kScaled<T> ? s.kscale.data() : nullptr;
  const float* vscale = kScaled<T> ? s.vscale.data() : nullptr;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    if constexpr (std::is_same_v<T, Nvfp4>) s.tile.resize(16 * D);
    scores16(p, q, s.rows.data(), n, ns, kscale, s.tile.data(), scores);
  } else
#endif
  {
    for (int64_t h = 0; h < p.Hq; ++h) std::fill(scores + h * ns + n, scores + (h + 1) * ns, -kInf);
    for (int64_t i = 0; i < n; ++i) {
      const Ptr<T> r = p.k + s.rows[i];
      for (int64_t h = 0; h < p.Hq; ++h) {
        float score = dot(q + h * D, r + h / G * D, D);
        if constexpr (kScaled<T>) score *= kscale[h / G * ns + i];
        scores[h * ns + i] = score * p.sm_scale;
      }
    }
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
  for (int64_t i0 = 0; i0 < n; i0 += kRun)
    for (int64_t h = 0; h < p.Hkv; ++h) {
      const int64_t i1 = std::min(n, i0 + kRun);
      weigh<T>(scores + h * G * ns, p.v + h * D, s.rows.data(), ns, i0, i1, G, D, part.out.data() + h * G * D);
    }
}

// Token t's output and lse from its parts: out = sum_j e_j out_j / sum_j e_j with
// e_j = exp(lse_j - max lse), lse = max lse + log(sum_j e_j) (one part: itself, e = 1); a
// sink logit joins the denominator only (logaddexp(lse, sink), its share leaving the output).
template <typename T>
void merge(const Problem<T>& p, int64_t t, const Part* parts, int64_t count) {
  const int64_t D = p.D;
  for (int64_t h = 0; h < p.Hq; ++h) {
    float top = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t j = 0; j < count; ++j) top = std::max(top, parts[j].lse[h]);
    float* out = p.out + (t * p.Hq + h) * D;
    std::fill(out, out + D, 0.0f);
    for (int64_t j = 0; j < count; ++j) {
      const float e = std::exp(parts[j].lse[h] - top);
      sum += e;
      const float* part = parts[j].out.data() + h * D;
      for (int64_t d = 0; d < D; ++d) out[d] += e * part[d];
    }
    float total = top + std::log(sum);  // sum >= 1: the largest part's own term
    float keep = 1.0f / sum;
    if (p.sinks) {
      const float sink = p.sinks[h], most = std::max(total, sink);
      const float with = most + std::log(std::exp(total - most) + std::exp(sink - most));
      keep *= std::exp(total - with);
      total = with;
    }
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
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    Scratch s;
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t i; (i = next.fetch_add(1)) < count; done.fetch_add(1)) attend_part(p, items[i], parts[i], s);
  }
  static void item(void* shared, int64_t i) {  // item i, on a thread of the matmul's crew
    thread_local Scratch s;
    auto* self = static_cast<Shared*>(shared);
    attend_part(self->p, self->items[i], self->parts[i], s);
  }
};

// Positions per item: a context of n positions is split into n / kSplit near-equal runs
// (kSplit to 2 kSplit - 1 positions each), whatever the batch and the machine, so a row's
// result depends on its context alone; the runs of one row can then go to several threads.
// Short enough that a decode row from 64 positions on is two items or more, one per core of
// a small machine.
constexpr int64_t kSplit = 32;

// The quantized matmul's crew of helper threads (its KvfoldCrewRun, handed over by cpu.py
// through KvfoldDecodeAttentionUseCrew), or null: a call runs its items on them when it has
// at least two. The crew is awake between a decode step's calls (the q/k/v projections run
// just before attention), so it joins in at once, where a helper woken through XLA's pool
// took tens of us and cost more than it saved below kPoolWork.
using CrewRun = int (*)(void (*)(void*, int64_t), void*, int64_t, int64_t);
std::atomic<CrewRun> crew_run{nullptr};
std::atomic<int64_t> crew_calls{0};  // calls whose items the crew ran (KvfoldDecodeAttentionCrewCalls)
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
// cu_q_lens[s]. Then its new K/V rows are stored at that position's page slot, as
// ref.write_new_kv stores them: nothing for padding, a position past the table, or an entry
// outside [0, P) (a bad entry never lands in another sequence's page).
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
    if (pos[t] < 0 || pos[t] >= p.W * p.ps) continue;
    const int64_t page = p.tables[s * p.W + pos[t] / p.ps];
    if (page < 0 || page >= p.P) continue;
    const int64_t slot = page * p.ps + pos[t] % p.ps;
    for (int64_t h = 0; h < p.Hkv; ++h) {
      store_row<T>(k + t * row + h * p.D, p.D, k_pages, k_scales, slot * p.Hkv + h);
      store_row<T>(v + t * row + h * p.D, p.D, v_pages, v_scales, slot * p.Hkv + h);
    }
  }
}

// One decode-attention step over pages of T: the new K/V written into the pages kp, vp (the
// results, aliased to the operands), then every token's attention over them.
template <typename T>
void run(ffi::ThreadPool pool, const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k,
         const ffi::Buffer<ffi::F32>& v, void* kp, void* vp, void* ks, void* vs,
         const ffi::Buffer<ffi::S32>& block_tables, const ffi::Buffer<ffi::S32>& cu_q_lens,
         const ffi::Buffer<ffi::S32>& kv_lens, const float* sinks, float* out, float* lse, int64_t P, int64_t ps,
         int64_t Hkv, float sm_scale, int64_t sliding_window, float soft_cap) {
  const auto qd = q.dimensions(), bd = block_tables.dimensions();
  const int64_t T_ = qd[0], Hq = qd[1], D = qd[2], S = kv_lens.element_count();
  auto shared = std::make_shared<Shared<T>>();
  Problem<T>& p = shared->p;
  const auto view = [](void* pages, void* scales) -> Ptr<T> {
    if constexpr (std::is_same_v<T, Nvfp4>)
      return Nvfp4Ptr{static_cast<const uint8_t*>(pages), static_cast<const uint8_t*>(scales), 0};
    else
      return static_cast<const T*>(pages);
  };
  constexpr bool scaled = kScaled<T>;
  p = Problem<T>{q.typed_data(), view(kp, ks), view(vp, vs), sinks, block_tables.typed_data(), nullptr, nullptr, out,
                 lse, T_, Hq, Hkv, D, P, ps, S, bd[1], sliding_window, sm_scale, soft_cap,
                 scaled ? static_cast<const float*>(ks) : nullptr, scaled ? static_cast<const float*>(vs) : nullptr};
  lay_out_and_write(cu_q_lens.typed_data(), kv_lens.typed_data(), k.typed_data(), v.typed_data(), S, p, shared->seq,
                    shared->pos, kp, vp, ks, vs);
  p.seq = shared->seq.data();
  p.pos = shared->pos.data();
  // Each live token's positions, in runs of kSplit.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  std::vector<int64_t> first(T_ + 1, 0);  // token t's items: [first[t], first[t + 1])
  int64_t positions = 0;
  for (int64_t t = 0; t < T_; ++t) {
    first[t + 1] = first[t];
    const int64_t s = p.seq[t], hi = std::min<int64_t>(p.pos[t], p.W * p.ps - 1);
    if (s < 0 || s >= p.S || p.pos[t] < 0) continue;  // padding
    const int64_t lo = p.window > 0 ? std::max<int64_t>(0, hi - p.window + 1) : 0, n = hi - lo + 1;
    const int64_t splits = std::max<int64_t>(1, n / kSplit);
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
// with their block scales (float8_e4m3fn [P, ps, Hkv, D / 16]); beside float pages the scales
// are a placeholder of one float32.
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                           ffi::ResultBuffer<ffi::F32> lse, ffi::Result<ffi::AnyBuffer> k_out,
                           ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> ks_out,
                           ffi::Result<ffi::AnyBuffer> vs_out, float sm_scale, int64_t sliding_window, float soft_cap,
                           int64_t has_sinks) {
  using Type = ffi::DataType;
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention_cpu: q must be 3-D, the pages 4-D, block_tables 2-D");
  const Type type = k_pages.element_type();
  const bool fp4 = type == Type::U8, scaled = type == Type::S8 || type == Type::F8E4M3FN;
  const int64_t T = qd[0], Hq = qd[1], D = qd[2], Hkv = kd[2], S = kv_lens.element_count();
  const auto vd = v_pages.dimensions();
  if (kd[3] != (fp4 ? D / 2 : D) || (fp4 && D % 16) || Hkv <= 0 || Hq % Hkv || vd.size() != 4 ||
      !std::equal(vd.begin(), vd.end(), kd.begin()))
    return ffi::Error::InvalidArgument("decode_attention_cpu: page shapes do not match q's heads");
  if ((type != Type::F32 && type != Type::BF16 && !scaled && !fp4) || v_pages.element_type() != type)
    return ffi::Error::InvalidArgument("decode_attention_cpu: the pages must both be float32, bfloat16, int8, "
                                       "float8_e4m3fn or uint8 (NVFP4)");
  const int64_t scales = fp4 ? kd[0] * kd[1] * Hkv * (D / 16) : scaled ? kd[0] * kd[1] * Hkv : 1;
  const Type scale_type = fp4 ? Type::F8E4M3FN : Type::F32;
  if (k_scales.element_type() != scale_type || v_scales.element_type() != scale_type ||
      k_scales.element_count() != scales || v_scales.element_count() != scales)
    return ffi::Error::InvalidArgument("decode_attention_cpu: int8 / fp8 pages need float32 scales [num_pages, "
                                       "page_size, num_kv_heads], NVFP4 pages float8_e4m3fn ones [.., head_dim / "
                                       "16], float pages a float32 placeholder of one");
  if (k.element_count() != T * Hkv * D || v.element_count() != T * Hkv * D)
    return ffi::Error::InvalidArgument("decode_attention_cpu: the new K/V rows do not match q and the pages");
  if (bd[0] != S || cu_q_lens.element_count() != S + 1 || (has_sinks && sinks.element_count() != Hq))
    return ffi::Error::InvalidArgument("decode_attention_cpu: block_tables / cu_q_lens / kv_lens / sinks lengths "
                                       "do not match");
  const float* sink = has_sinks ? sinks.typed_data() : nullptr;
  void *kp = aliased(k_pages, k_out), *vp = aliased(v_pages, v_out);
  void *ks = aliased(k_scales, ks_out), *vs = aliased(v_scales, vs_out);
  const auto go = [&](auto element) {
    run<decltype(element)>(pool, q, k, v, kp, vp, ks, vs, block_tables, cu_q_lens, kv_lens, sink, out->typed_data(),
                           lse->typed_data(), kd[0], kd[1], Hkv, sm_scale, sliding_window, soft_cap);
  };
  if (type == Type::F32)
    go(float{});
  else if (type == Type::BF16)
    go(Bf16{});
  else if (type == Type::S8)
    go(int8_t{});
  else if (type == Type::F8E4M3FN)
    go(Fp8{});
  else
    go(Nvfp4{});
  return ffi::Error::Success();
}

}  // namespace

// Hands over the quantized matmul library's KvfoldCrewRun (cpu.py calls it once both are
// loaded); null goes back to XLA's pool alone.
extern "C" void KvfoldDecodeAttentionUseCrew(CrewRun run) { crew_run.store(run); }

// How many calls so far ran their items on the crew (what tells a test that it did).
extern "C" int64_t KvfoldDecodeAttentionCrewCalls() { return crew_calls.load(); }

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
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [T, Hq]
                                  .Ret<ffi::AnyBuffer>()         // k_pages, aliased to the operand
                                  .Ret<ffi::AnyBuffer>()         // v_pages, aliased to the operand
                                  .Ret<ffi::AnyBuffer>()         // k_scales, aliased to the operand
                                  .Ret<ffi::AnyBuffer>()         // v_scales, aliased to the operand
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("has_sinks"));
