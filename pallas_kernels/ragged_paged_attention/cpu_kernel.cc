// The CPU kernel of paged attention for query tokens that each see a causal run of their
// sequence's positions (decode rows): one call per layer instead of XLA's block walk.
//
// On XLA:CPU the block walk (pallas_kernels/paged_blocks.py) is a while loop of a few dozen
// small thunks per block, about 70 us a layer at one decode row however short the context
// (SmolLM2's 30 layers: 2 ms of a 9 ms step). Here token t, of sequence seq[t] at position
// q_pos[t], attends over positions [lo, q_pos[t]] of that sequence's pages (lo = 0, or
// q_pos[t] - window + 1 on a sliding-window layer), reading each position's K and V row of
// one KV head once for the whole group of query heads that share it (GQA):
//
//   s[g, p] = cap * tanh(sm_scale q[g] . k[p] / cap)        (no cap: sm_scale q[g] . k[p])
//   out[g]  = sum_p exp(s[g, p] - m[g]) v[p] / l[g],   lse[g] = m[g] + log l[g]
//
// with m the row maximum and l the sum of the exponentials (two passes over the scores, kept
// in a buffer: a decode row's positions fit in cache; AVX-512 dot products and weighted sums
// where head_dim is a multiple of 16, plain loops otherwise). A sink logit per query head
// joins the denominator only. A token with seq[t] outside [0, num_seqs) or q_pos[t] < 0 is
// padding: out 0, lse -inf. Block-table entries are clamped into the pool, as the XLA path does
// (the entries a live position reads must be valid pages; the entry checks that when it
// can). Work items (token, KV head) are spread over XLA's intra-op thread pool when a call
// holds enough of them. Float32 pages [num_pages, page_size, num_kv_heads, head_dim].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // independent partial sums of the portable dot product

struct Problem {
  const float *q, *k, *v, *sinks;  // q [T, Hq, D]; pages [P, ps, Hkv, D]; sinks [Hq] or null
  const int32_t *tables, *seq, *pos;  // [S, W], [T], [T]
  float *out, *lse;                   // [T, Hq, D], [T, Hq]
  int64_t T, Hq, Hkv, D, P, ps, S, W, window;
  float sm_scale, cap;
};

float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
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

#if defined(__AVX512F__)
// The scores of G query heads (q [G, D], D a multiple of 16) against n rows of the pages
// (their offsets from k), sm_scale applied: scores[g * n + i].
void score_rows(const float* q, const float* k, const int64_t* rows, int64_t n, int64_t G, int64_t D, float scale,
                float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const float* r = k + rows[i];
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(r));
      for (int64_t d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(r + d), acc);
      scores[g * n + i] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// out[g] = sum_i w[g * n + i] v[rows[i]] for G heads, D a multiple of 16: 64 outputs at a
// time in four accumulators, so consecutive multiply-adds do not wait on each other.
void weigh_rows(const float* w, const float* v, const int64_t* rows, int64_t n, int64_t G, int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    const float* wg = w + g * n;
    for (int64_t d = 0; d < D; d += 64) {
      const int64_t vecs = std::min<int64_t>(4, (D - d) / 16);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t i = 0; i < n; ++i) {
        const __m512 wi = _mm512_set1_ps(wg[i]);
        const float* r = v + rows[i] + d;
        for (int64_t u = 0; u < vecs; ++u) acc[u] = _mm512_fmadd_ps(wi, _mm512_loadu_ps(r + 16 * u), acc[u]);
      }
      for (int64_t u = 0; u < vecs; ++u) _mm512_storeu_ps(out + g * D + d + 16 * u, acc[u]);
    }
  }
}
#endif

// Token t's query heads [h * G, (h + 1) * G) over their KV head h. `rows` and `scores` are
// the calling thread's scratch.
void attend(const Problem& p, int64_t t, int64_t h, std::vector<int64_t>& rows, std::vector<float>& scores) {
  const int64_t G = p.Hq / p.Hkv, D = p.D;
  float* out = p.out + (t * p.Hq + h * G) * D;
  float* lse = p.lse + t * p.Hq + h * G;
  const int64_t s = p.seq[t], hi = std::min<int64_t>(p.pos[t], p.W * p.ps - 1);
  if (s < 0 || s >= p.S || p.pos[t] < 0) {
    std::fill(out, out + G * D, 0.0f);
    std::fill(lse, lse + G, -std::numeric_limits<float>::infinity());
    return;
  }
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, hi - p.window + 1) : 0, n = hi - lo + 1;
  // Each position's row offset in the pages (the same in K and V), found once.
  const int32_t* table = p.tables + s * p.W;
  rows.resize(n);
  const int64_t stride = p.Hkv * D;  // from one slot of a page to the next
  for (int64_t position = lo, i = 0; position <= hi;) {  // a page at a time
    const int64_t page = std::clamp<int64_t>(table[position / p.ps], 0, p.P - 1), slot = position % p.ps;
    const int64_t slots = std::min(p.ps - slot, hi - position + 1), first = (page * p.ps + slot) * stride + h * D;
    for (int64_t j = 0; j < slots; ++j) rows[i++] = first + j * stride;
    position += slots;
  }
  const float* q = p.q + (t * p.Hq + h * G) * D;
  scores.resize(G * n);
#if defined(__AVX512F__)
  const bool vectors = D % 16 == 0;
  if (vectors) score_rows(q, p.k, rows.data(), n, G, D, p.sm_scale, scores.data());
#else
  const bool vectors = false;
#endif
  if (!vectors)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) scores[g * n + i] = dot(q + g * D, p.k + rows[i], D) * p.sm_scale;
  std::fill(out, out + G * D, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * n;
    if (p.cap > 0.0f)
      for (int64_t i = 0; i < n; ++i) sg[i] = p.cap * std::tanh(sg[i] / p.cap);
    const float m = *std::max_element(sg, sg + n);
    for (int64_t i = 0; i < n; ++i) sg[i] = exp_nonpositive(sg[i] - m);  // vectorizes; the sum would not
    float l = 0.0f;
    for (int64_t i = 0; i < n; ++i) l += sg[i];
    float total = m + std::log(l);  // l >= 1: the maximum's own term
    float keep = 1.0f / l;
    if (p.sinks) {  // logaddexp(lse, sink): the sink's share leaves the output
      const float sink = p.sinks[h * G + g], top = std::max(total, sink);
      const float with = top + std::log(std::exp(total - top) + std::exp(sink - top));
      keep *= std::exp(total - with);
      total = with;
    }
    for (int64_t i = 0; i < n; ++i) sg[i] *= keep;
    lse[g] = total;
  }
#if defined(__AVX512F__)
  if (vectors) return weigh_rows(scores.data(), p.v, rows.data(), n, G, D, out);
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float* v = p.v + rows[i];
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * n + i];
      float* o = out + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
    }
  }
}

// Work items (token, KV head) handed out through one counter to the calling thread and the
// pool's; a helper that starts after all are taken returns at once (the state outlives the call).
struct Shared {
  Problem p;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    std::vector<int64_t> rows;
    std::vector<float> scores;
    const int64_t items = p.T * p.Hkv;
    for (int64_t i; (i = next.fetch_add(1)) < items; done.fetch_add(1)) attend(p, i / p.Hkv, i % p.Hkv, rows, scores);
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                           ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::F32> sinks,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, float sm_scale,
                           int64_t sliding_window, float soft_cap, int64_t has_sinks) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument("decode_attention_cpu: q must be 3-D, the pages 4-D, block_tables 2-D");
  const int64_t T = qd[0], Hq = qd[1], D = qd[2], Hkv = kd[2];
  const auto vd = v_pages.dimensions();
  if (kd[3] != D || Hkv <= 0 || Hq % Hkv || vd.size() != 4 || !std::equal(vd.begin(), vd.end(), kd.begin()))
    return ffi::Error::InvalidArgument("decode_attention_cpu: page shapes do not match q's heads");
  if (seq.element_count() != T || q_pos.element_count() != T || (has_sinks && sinks.element_count() != Hq))
    return ffi::Error::InvalidArgument("decode_attention_cpu: seq / q_pos / sinks lengths do not match q");
  auto shared = std::make_shared<Shared>();
  shared->p = Problem{q.typed_data(), k_pages.typed_data(), v_pages.typed_data(),
                      has_sinks ? sinks.typed_data() : nullptr, block_tables.typed_data(), seq.typed_data(),
                      q_pos.typed_data(), out->typed_data(), lse->typed_data(), T, Hq, Hkv, D, kd[0], kd[1],
                      bd[0], bd[1], sliding_window, sm_scale, soft_cap};
  // Helpers when the call holds several items of real work (a wake-up costs a few us): one
  // decode row's three KV heads over a short context take less than that alone.
  int64_t positions = 0;
  for (int64_t t = 0; t < T; ++t) positions += std::max<int32_t>(q_pos.typed_data()[t] + 1, 0);
  const int64_t items = T * Hkv, threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = positions * Hq * D < (int64_t{1} << 18) ? 0 : std::min(threads, items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (shared->done.load() < items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvfoldDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages [P, ps, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages [P, ps, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [Hq] (any [1] when absent)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [T, Hq]
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("has_sinks"));
