// Attention of a prefill chunk (hundreds of queries per request) over the committed prefix in the
// stacked KV cache and the chunk's own K/V, causally: specjax/kernels/cpu/prefill_attention.py says
// what it computes.
//
// Why a kernel of our own: XLA runs a chunk's attention as blocked products with the scores, masks,
// maxima, exponentials and sums between them each a pass through memory; at 4096 tokens of context
// (the last 512-token chunk of a SmolLM2 prompt, 2 Xeon cores) it took 29.7 ms per layer for 4.4 GFLOP,
// and attention was over half of a 4096-token prefill. Here each work unit keeps a block of K
// (transposed) and V in L1 while all its query rows pass over it, scores stay in registers, and the
// softmax is online (flash style, one rescale per 64-slot block): the products run at the rate of the
// FMA units and the exponentials are the only other work.
//
// Work units are (request, KV head, block of QB queries), heaviest (latest queries, most keys) first.
// A unit's rows are its queries times the G query heads of its KV head (row = t * G + g). It walks
// the keys it can see in blocks of KB slots: the prefix [0, lengths[b]) of `layer` in the cache, then
// the chunk's own slots up to its last query. Per block it copies K transposed ([Dh, KB]) and V
// ([KB, Dh]); rows then pass in groups of up to 4: scores of 64 slots in registers, masked where a
// query cannot see (past the prefix, or a later own slot), the running maximum, sum and output
// (kept per row between blocks) rescaled once per block. Every unit writes its own outputs, so results
// never depend on threads, on the buffer's length or on other requests.
//
// Non-finite K/V: the chunk's own rows that are not finite are zeroed and every query from that
// position on is NaN (the queries that see it); one in the prefix reaches every query through its
// scores or output, which are flagged and turn the row NaN. Slots past the prefix are never read.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "simd.h"

#if !defined(__AVX512F__)
#error "specjax's CPU prefill attention kernel needs AVX-512F"
#endif

namespace {

using specjax::exp_ps;
using specjax::not_finite;
using specjax::transpose16;

constexpr long KB = 64;       // key slots per block: 4 vectors of scores per row
constexpr int KV = KB / 16;   // score vectors per row
constexpr long QB = 64;       // queries per work unit (QB_FEW when that leaves too few units)
constexpr long QB_FEW = 16;
constexpr int MAX_NC = 8;     // head_dim up to 128
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Args {
  const float* q;   // [B, T, H, Dh]
  const float* k;   // [L, B, S, KVH, Dh]
  const float* v;
  const float* kb;  // the chunk's own K/V [B, T, KVH, Dh]
  const float* vb;
  long layer;
  const int32_t* lengths;
  float* out;       // [B, T, H, Dh]
  long B, T, H, KVH, Dh, L, S;
  float scale;
};

struct Scratch {
  std::vector<float> q, o, m, l, kt, vt;
  std::vector<uint8_t> bad;
};

struct Unit {
  const Args* a;
  long b, kvh, q0, q1, len;  // queries [q0, q1) of request b; its prefix [0, len)
  long G, rows, dp;          // query heads per KV head, rows (q1 - q0) * G, padded head_dim
  Scratch* sc;
  long first_bad = std::numeric_limits<long>::max();  // the first own slot whose K/V is not finite

  const float* prefix_row(const float* base, long s) const {
    return base + (((a->layer * a->B + b) * a->S + s) * a->KVH + kvh) * a->Dh;
  }
  const float* own_row(const float* base, long j) const { return base + ((b * a->T + j) * a->KVH + kvh) * a->Dh; }

  void start() {
    const Args& A = *a;
    sc->q.assign((rows + 4) * dp, 0.0f);
    for (long t = q0; t < q1; ++t)
      for (long g = 0; g < G; ++g) {
        const float* src = A.q + ((b * A.T + t) * A.H + kvh * G + g) * A.Dh;
        float* dst = sc->q.data() + ((t - q0) * G + g) * dp;
        for (long d = 0; d < A.Dh; ++d) dst[d] = src[d] * A.scale;
      }
    sc->o.assign(rows * dp, 0.0f);
    sc->m.assign(rows, NEG_INF);
    sc->l.assign(rows, 0.0f);
    sc->bad.assign(rows, 0);
    sc->kt.resize(dp * KB);
    sc->vt.resize(KB * dp);
  }

  // Copies n slots (row(i), i < n) into the block scratch: K transposed, V as rows; slots past n are
  // zero. Own rows (own >= 0: the first slot's position in the chunk) that are not finite are zeroed
  // and first_bad records them.
  template <typename Row>
  void load_block(long n, Row row, long own) {
    const long nc = dp / 16;
    const __mmask16 tail = a->Dh % 16 ? (__mmask16)((1u << (a->Dh % 16)) - 1u) : (__mmask16)0xFFFF;
    uint64_t keep = 0;
    for (long i = 0; i < n; ++i) {
      const float* kr = row(i, a->k, a->kb);
      const float* vr = row(i, a->v, a->vb);
      if (own >= 0) {
        __mmask16 bad = 0;
        for (long c = 0; c < nc; ++c) {
          const __mmask16 mk = c == nc - 1 ? tail : (__mmask16)0xFFFF;
          bad |= not_finite(_mm512_maskz_loadu_ps(mk, kr + c * 16)) | not_finite(_mm512_maskz_loadu_ps(mk, vr + c * 16));
        }
        if (bad) {
          first_bad = std::min(first_bad, own + i);
          continue;
        }
      }
      keep |= uint64_t{1} << i;
    }
    for (long i = 0; i < KB; ++i) {
      float* dst = sc->vt.data() + i * dp;
      if ((keep >> i) & 1u) {
        const float* vr = row(i, a->v, a->vb);
        for (long c = 0; c < nc; ++c)
          _mm512_storeu_ps(dst + c * 16, _mm512_maskz_loadu_ps(c == nc - 1 ? tail : (__mmask16)0xFFFF, vr + c * 16));
      } else {
        std::memset(dst, 0, dp * sizeof(float));
      }
    }
    for (long blk = 0; blk < KV; ++blk)
      for (long c = 0; c < nc; ++c) {
        const __mmask16 mk = c == nc - 1 ? tail : (__mmask16)0xFFFF;
        __m512 r[16];
        for (int j = 0; j < 16; ++j) {
          const long i = blk * 16 + j;
          r[j] = (keep >> i) & 1u ? _mm512_maskz_loadu_ps(mk, row(i, a->k, a->kb) + c * 16) : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int d = 0; d < 16; ++d) _mm512_storeu_ps(sc->kt.data() + (c * 16 + d) * KB + blk * 16, r[d]);
      }
  }

  // Rows [r0, r0 + R) over the block in scratch; row r sees its first seen[r] slots (0..KB).
  template <int NC, int R>
  void group(long r0, const long* seen) {
    const float* qs = sc->q.data() + r0 * dp;
    __m512 s[R][KV];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < KV; ++c) s[r][c] = _mm512_setzero_ps();
    const float* kt = sc->kt.data();
    for (long d = 0; d < NC * 16; ++d) {
      __m512 kv[KV];
      for (int c = 0; c < KV; ++c) kv[c] = _mm512_loadu_ps(kt + d * KB + c * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(qs[r * dp + d]);
        for (int c = 0; c < KV; ++c) s[r][c] = _mm512_fmadd_ps(x, kv[c], s[r][c]);
      }
    }
    alignas(64) float p[R][KB];
    float alpha[R];
    long span = 0;  // slots any row of the group sees
    const __m512 neg = _mm512_set1_ps(NEG_INF);
    for (int r = 0; r < R; ++r) {
      const long row = r0 + r, n = seen[r];
      span = std::max(span, n);
      __mmask16 mk[KV];
      __m512 top = neg;
      for (int c = 0; c < KV; ++c) {
        const long lanes = std::clamp<long>(n - 16 * c, 0, 16);
        mk[c] = (__mmask16)((1u << lanes) - 1u);
        if (not_finite(s[r][c]) & mk[c]) sc->bad[row] = 1;
        top = _mm512_max_ps(top, _mm512_mask_mov_ps(neg, mk[c], s[r][c]));
      }
      const float old = sc->m[row], now = std::max(old, _mm512_reduce_max_ps(top));
      if (n == 0 || now == NEG_INF) {  // nothing seen yet: the row's state stays as it is
        alpha[r] = 1.0f;
        std::memset(p[r], 0, sizeof(p[r]));
        continue;
      }
      alpha[r] = old == now ? 1.0f : std::exp(old - now);  // old = -inf: 0
      const __m512 mv = _mm512_set1_ps(now);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < KV; ++c) {
        const __m512 e = _mm512_maskz_mov_ps(mk[c], exp_ps(_mm512_sub_ps(s[r][c], mv)));
        sum = _mm512_add_ps(sum, e);
        _mm512_store_ps(p[r] + c * 16, e);
      }
      sc->m[row] = now;
      sc->l[row] = sc->l[row] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    __m512 acc[R][NC];
    for (int r = 0; r < R; ++r) {
      const __m512 f = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(f, _mm512_loadu_ps(sc->o.data() + (r0 + r) * dp + c * 16));
    }
    const float* vt = sc->vt.data();
    for (long j = 0; j < span; ++j)
      for (int c = 0; c < NC; ++c) {
        const __m512 vv = _mm512_loadu_ps(vt + j * dp + c * 16);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), vv, acc[r][c]);
      }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(sc->o.data() + (r0 + r) * dp + c * 16, acc[r][c]);
  }

  // Every row over the block in scratch, whose first slot is `own0` of the chunk (or, own0 < 0, a
  // block of `valid` prefix slots that every row sees).
  template <int NC>
  void pass(long own0, long valid) {
    constexpr int RB = NC <= 4 ? 4 : 2;
    long seen[4];
    auto fill = [&](long r0, int count) {
      for (int r = 0; r < count; ++r) {
        const long t = q0 + (r0 + r) / G;
        seen[r] = own0 < 0 ? valid : std::clamp<long>(t - own0 + 1, 0, valid);
      }
    };
    long r0 = 0;
    for (; r0 + RB <= rows; r0 += RB) {
      fill(r0, RB);
      bool any = false;
      for (int r = 0; r < RB; ++r) any |= seen[r] > 0;
      if (any) group<NC, RB>(r0, seen);
    }
    fill(r0, rows - r0);
    switch (rows - r0) {
      case 1: group<NC, 1>(r0, seen); break;
      case 2: group<NC, 2>(r0, seen); break;
      case 3: group<NC, 3>(r0, seen); break;
      default: break;
    }
  }

  template <int NC>
  void run() {
    const Args& A = *a;
    start();
    for (long s0 = 0; s0 < len; s0 += KB) {
      const long n = std::min(KB, len - s0);
      load_block(n, [&](long i, const float* cache, const float*) { return prefix_row(cache, s0 + i); }, -1);
      pass<NC>(-1, n);
    }
    for (long j0 = 0; j0 < q1; j0 += KB) {
      const long n = std::min(KB, A.T - j0);
      load_block(n, [&](long i, const float*, const float* block) { return own_row(block, j0 + i); }, j0);
      pass<NC>(j0, n);
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (long row = 0; row < rows; ++row) {
      const long t = q0 + row / G, g = row % G;
      float* dst = A.out + ((b * A.T + t) * A.H + kvh * G + g) * A.Dh;
      const float* o = sc->o.data() + row * dp;
      bool bad = sc->bad[row] || t >= first_bad || std::isnan(sc->l[row]);
      for (long d = 0; d < A.Dh && !bad; ++d) bad = !std::isfinite(o[d]);
      const float inv = sc->l[row] > 0.0f ? 1.0f / sc->l[row] : 0.0f;
      for (long d = 0; d < A.Dh; ++d) dst[d] = bad ? nan : o[d] * inv;
    }
  }
};

template <typename Schedule>
void attention(const Args& A, long threads, Schedule schedule) {
  const long G = A.H / A.KVH, dp = (A.Dh + 15) / 16 * 16, nc = dp / 16;
  const long qb = A.B * A.KVH * ((A.T + QB - 1) / QB) >= 4 * threads ? QB : QB_FEW;
  const long blocks = (A.T + qb - 1) / qb, per_block = A.B * A.KVH;
  long work = 0;  // multiply-adds, roughly
  for (long b = 0; b < A.B; ++b) work += A.H * A.T * (std::clamp<long>(A.lengths[b], 0, A.S) + A.T / 2) * A.Dh * 2;
  auto run = [&](long u) {
    const long i = blocks - 1 - u / per_block;  // the latest query blocks (most keys) first
    const long b = (u % per_block) / A.KVH, kvh = u % A.KVH;
    const long q0 = i * qb, q1 = std::min(A.T, q0 + qb);
    thread_local Scratch scratch;
    Unit unit{&A, b, kvh, q0, q1, std::clamp<long>(A.lengths[b], 0, A.S), G, (q1 - q0) * G, dp, &scratch};
    switch (nc) {
      case 1: unit.run<1>(); break;
      case 2: unit.run<2>(); break;
      case 3: unit.run<3>(); break;
      case 4: unit.run<4>(); break;
      case 5: unit.run<5>(); break;
      case 6: unit.run<6>(); break;
      case 7: unit.run<7>(); break;
      default: unit.run<8>(); break;
    }
  };
  // Small work (tiny models, short chunks) runs on the calling thread: a pool task costs more.
  specjax::parallel_units(blocks * per_block, work < (1L << 20) ? 0 : threads - 1, run, schedule);
}

}  // namespace

// For tests without XLA: one thread.
extern "C" void specjax_cpu_prefill_attention_reference(const float* q, const float* k, const float* v,
                                                        const float* kb, const float* vb, long layer,
                                                        const int32_t* lengths, float* out, long B, long T, long H,
                                                        long KVH, long Dh, long L, long S, float scale) {
  Args a{q, k, v, kb, vb, layer, lengths, out, B, T, H, KVH, Dh, L, S, scale};
  attention(a, 1, [](auto&&) {});
}

#ifndef SPECJAX_NO_FFI
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

static ffi::Error PrefillAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> kb, ffi::Buffer<ffi::F32> vb,
                                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                                       ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), bd = kb.dimensions(), bvd = vb.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || bd.size() != 4 || bvd.size() != 4 ||
      lengths.dimensions().size() != 1 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "specjax_cpu_prefill_attention: expected q [B, T, H, Dh], k/v [L, B, S, KVH, Dh], k/v block "
        "[B, T, KVH, Dh], layer [], lengths [B]");
  const long B = qd[0], T = qd[1], H = qd[2], Dh = qd[3], L = kd[0], S = kd[2], KVH = kd[3];
  for (size_t i = 0; i < 5; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("specjax_cpu_prefill_attention: k and v shapes differ");
  for (size_t i = 0; i < 4; ++i)
    if (bd[i] != bvd[i]) return ffi::Error::InvalidArgument("specjax_cpu_prefill_attention: block shapes differ");
  if (kd[1] != B || kd[4] != Dh || bd[0] != B || bd[1] != T || bd[2] != KVH || bd[3] != Dh ||
      lengths.dimensions()[0] != B || KVH < 1 || H % KVH != 0 || Dh > MAX_NC * 16)
    return ffi::Error::InvalidArgument("specjax_cpu_prefill_attention: shapes do not match");
  if (B * T * H * Dh == 0) return ffi::Error::Success();
  const long li = std::clamp<long>(layer.typed_data()[0], 0, L - 1);
  Args a{q.typed_data(), k.typed_data(), v.typed_data(), kb.typed_data(), vb.typed_data(), li,
         lengths.typed_data(), out->typed_data(), B, T, H, KVH, Dh, L, S, scale};
  const long threads = std::max<int64_t>(1, pool.num_threads());
  attention(a, threads, [&pool](auto&& task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuPrefillAttention, PrefillAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
#endif
