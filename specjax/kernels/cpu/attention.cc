// Attention of a few queries per request (decode steps, tree passes, drafting frontiers) over the
// stacked KV cache, read in place: specjax/kernels/cpu/attention.py says what it computes.
//
// Why a kernel of our own: in XLA a tree pass's attention is a chain of small ops per layer (a view
// sliced and transposed out of the cache, scores, masks, max, exp, sum, a second product, the
// tree's block merged in), each a pass through memory; at 17 nodes over a 300-token prefix it took
// 12.9 ms of a 48.8 ms SmolLM2 pass on 2 Xeon cores, for ~0.4 GFLOP of work. Here one call per layer
// reads each K/V row of the committed prefix and of the block once.
//
// Layout: q [B, T, H, Dh]; the cache [L, B, S, KVH, Dh] (one layer read, in place); lengths [B];
// ancestor bits [B, T, W] (bit j of row t: query t sees block slot j, j < R). The block (the pass's
// own tokens or tree) is either the pass's K/V [B, R, KVH, Dh] or, for a drafting pass scoring one
// frontier of a tree written earlier, the cache slots lengths[b] + j (block_in_cache).
//
// Work units are (request, KV head, chunk of CHUNK slots). A unit copies its K transposed into
// [Dh, 16] blocks and its V rows (non-finite tree rows zeroed), then takes its query rows (the G
// query heads of the KV head times T queries) in groups of up to 4: the scores of 16 slots at a time
// in registers, kept in L1 for the chunk; the exact row maximum over the chunk; the exponentials and
// their sum; the outputs (Dh floats per row) in registers. (A running rescale per 16 slots, flash
// style, ran ~10% slower.) Chunks are merged in order, so results never depend on threads, on the
// buffer's length or on other requests.
//
// One source for AVX-512F and for AVX2 + FMA (vec16.h: a 16-float vector is one register or two
// halves). With AVX2's 16 registers a group is 3 query rows and the outputs are summed one 16-float
// column block at a time (the same sums in the same order).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "parallel.h"
#include "vec16.h"

namespace {

using namespace specjax;  // vec16.h: V16 and its operations (AVX-512F, or AVX2 + FMA)

constexpr long CHUNK = 256;  // slots per work unit: a 300-token tree pass splits into 2 x KVH units
constexpr int BS = 16;       // slots per block: one vector of scores per query row
constexpr int MAX_NC = 8;    // head_dim up to 128 (8 vectors)
constexpr int RB_AVX2 = 3;   // query rows per group on AVX2 (see run): 2 and 4 ran 3-5% slower
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Args {
  const float* q;
  const float* k;
  const float* v;
  const float* kb;  // the block [B, R, KVH, Dh] (unless block_in_cache)
  const float* vb;
  bool block_in_cache;
  long layer;
  const int32_t* lengths;
  const uint32_t* anc;
  float* out;
  long B, T, H, KVH, Dh, L, S, W, R;
  float scale;
};

// Per-thread scratch: the unit's scaled queries, transposed K blocks and cleaned V rows.
struct Scratch {
  std::vector<float> q, kt, vc;
  std::vector<uint32_t> tree_bad;
};

struct Unit {
  const Args* a;
  long b, kvh, s0, s1, len, end;  // slots [s0, s1) of request b; prefix [0, len), tree [len, end)
  long rows, dp;                  // query rows (T * G), padded head_dim
  Scratch* sc;

  // Bits of the 16 slots from sb that query t sees.
  uint32_t visible(long t, long sb) const {
    const long ns = std::min<long>(BS, s1 - sb);
    uint32_t bits = 0;
    const long lim = std::min(sb + ns, len);
    if (lim > sb) bits = (1u << (lim - sb)) - 1u;  // lim - sb <= 16
    const long lo = std::max(sb, len), hi = std::min(sb + ns, end);
    if (lo < hi) {
      const uint32_t* row = a->anc + (b * a->T + t) * a->W;
      for (long s = lo; s < hi; ++s) {
        const long j = s - len;
        if ((row[j >> 5] >> (j & 31)) & 1u) bits |= 1u << (s - sb);
      }
    }
    return bits & 0xFFFFu;
  }

  // Copies queries (scaled), K (transposed) and V of this unit into the scratch. A non-finite K/V in
  // the tree is zeroed and flagged (tree_bad): only the queries that see it may turn NaN. One in the
  // prefix, which every query sees, shows in their scores or outputs (rows_group).
  void prepare() {
    const Args& A = *a;
    const long G = A.H / A.KVH, nslots = s1 - s0, nblk = (nslots + BS - 1) / BS, nc = dp / 16;
    const Mask16 tail = A.Dh % 16 ? (Mask16)((1u << (A.Dh % 16)) - 1u) : ALL16;
    sc->q.assign((rows + 4) * dp, 0.0f);
    for (long t = 0; t < A.T; ++t)
      for (long g = 0; g < G; ++g) {
        const float* src = A.q + ((b * A.T + t) * A.H + kvh * G + g) * A.Dh;
        float* dst = sc->q.data() + (t * G + g) * dp;
        for (long d = 0; d < A.Dh; ++d) dst[d] = src[d] * A.scale;
      }
    sc->kt.resize(std::max<long>(nblk, 1) * dp * BS);
    sc->vc.resize(std::max<long>(nblk, 1) * BS * dp);
    sc->tree_bad.assign(A.W, 0u);
    const long stride = A.KVH * A.Dh;  // floats between slots
    const float* kbase = A.k + ((A.layer * A.B + b) * A.S * A.KVH + kvh) * A.Dh;
    const float* vbase = A.v + ((A.layer * A.B + b) * A.S * A.KVH + kvh) * A.Dh;
    // Slot s's K/V row: the cache below len (or everywhere with block_in_cache), else the block.
    const long boff = (b * A.R * A.KVH + kvh) * A.Dh - len * stride;
    const bool in_cache = A.block_in_cache;
    auto krow = [&](long s) { return s < len || in_cache ? kbase + s * stride : A.kb + boff + s * stride; };
    auto vrow = [&](long s) { return s < len || in_cache ? vbase + s * stride : A.vb + boff + s * stride; };
    const V16 zero = v16_zero();
    // (Software prefetch of the rows two blocks ahead did not change a 4k-token decode step: it is
    // bound by the memory bandwidth of the K/V rows.)
    for (long i = 0; i < nblk; ++i) {
      uint32_t keep = 0;  // slots of the block to read (in range and, in the tree, finite)
      for (int j = 0; j < BS; ++j) {
        const long s = s0 + i * BS + j;
        if (s >= s1) break;
        const float* kr = krow(s);
        const float* vr = vrow(s);
        float* vdst = sc->vc.data() + (i * BS + j) * dp;
        if (s >= len) {
          Mask16 bad = 0;
          for (long c = 0; c < nc; ++c) {
            const Mask16 m = c == nc - 1 ? tail : ALL16;
            bad |= v16_not_finite(v16_maskz_loadu(m, kr + c * 16)) | v16_not_finite(v16_maskz_loadu(m, vr + c * 16));
          }
          if (bad) {  // zeroed here, NaN for the queries that see it (run)
            const long t = s - len;
            sc->tree_bad[t >> 5] |= 1u << (t & 31);
            continue;
          }
        }
        keep |= 1u << j;
        for (long c = 0; c < nc; ++c) v16_storeu(vdst + c * 16, v16_maskz_loadu(c == nc - 1 ? tail : ALL16, vr + c * 16));
      }
      for (int j = 0; j < BS; ++j)
        if (!((keep >> j) & 1u)) std::memset(sc->vc.data() + (i * BS + j) * dp, 0, dp * sizeof(float));
      for (long c = 0; c < nc; ++c) {
        const Mask16 m = c == nc - 1 ? tail : ALL16;
        V16 r[16];
        for (int j = 0; j < BS; ++j)
          r[j] = (keep >> j) & 1u ? v16_maskz_loadu(m, krow(s0 + i * BS + j) + c * 16) : zero;
        v16_transpose(r);
        float* dst = sc->kt.data() + (i * dp + c * 16) * BS;
        for (int d = 0; d < 16; ++d) v16_storeu(dst + d * BS, r[d]);
      }
    }
  }

  // Query rows [r0, r0 + R) over the unit's slots (at most CHUNK): (row max, row sum, unnormalised
  // output) into pm, pl, pacc. Three passes over the chunk: the scores (kept in L1) and their row
  // maximum, then their exponentials and sum, then the values; a chunk needs no running rescale.
  template <int NC, int R>
  void rows_group(long r0, float* pm, float* pl, float* pacc) const {
    const Args& A = *a;
    const long G = A.H / A.KVH, nblk = (s1 - s0 + BS - 1) / BS;
    const float* qs = sc->q.data() + r0 * dp;
    alignas(64) float sp[R][CHUNK];  // scores, then their exponentials
    uint16_t vis[R][CHUNK / BS];
    long t[R];
    Mask16 bad[R] = {};  // lanes whose scores were not finite (a non-finite K or query)
    const V16 neg = v16_set1(NEG_INF);
    V16 top[R];
    for (int r = 0; r < R; ++r) t[r] = (r0 + r) / G, top[r] = neg;
    for (long i = 0; i < nblk; ++i) {
      const long sb = s0 + i * BS;
      uint32_t any = 0;
      for (int r = 0; r < R; ++r) any |= vis[r][i] = sb + BS <= std::min(len, s1) ? 0xFFFF : visible(t[r], sb);
      if (!any) continue;
      const float* kt = sc->kt.data() + i * dp * BS;
      V16 s[R], s2[R];  // even and odd dims: two chains per row hide the FMA latency
      for (int r = 0; r < R; ++r) s[r] = s2[r] = v16_zero();
      for (int d = 0; d < NC * 16; d += 2) {
        const V16 k0 = v16_loadu(kt + d * BS), k1 = v16_loadu(kt + (d + 1) * BS);
        for (int r = 0; r < R; ++r) {
          s[r] = v16_fmadd(v16_set1(qs[r * dp + d]), k0, s[r]);
          s2[r] = v16_fmadd(v16_set1(qs[r * dp + d + 1]), k1, s2[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const Mask16 mk = vis[r][i];
        const V16 sr = v16_add(s[r], s2[r]);
        bad[r] |= v16_not_finite(sr) & mk;
        const V16 shown = v16_select(mk, sr, neg);
        top[r] = v16_max(top[r], shown);
        v16_store(sp[r] + i * BS, shown);
      }
    }
    float m[R], sum[R];
    for (int r = 0; r < R; ++r) {
      m[r] = v16_reduce_max(top[r]);
      V16 lv = v16_zero();
      const V16 mv = v16_set1(m[r] == NEG_INF ? 0.0f : m[r]);
      for (long i = 0; i < nblk; ++i) {
        const Mask16 mk = vis[r][i];
        const V16 e = mk ? v16_maskz(mk, v16_exp(v16_sub(v16_load(sp[r] + i * BS), mv))) : v16_zero();
        lv = v16_add(lv, e);
        v16_store(sp[r] + i * BS, e);
      }
      sum[r] = v16_reduce_add(lv);
    }
    const long ns = s1 - s0;
    const float* vb = sc->vc.data();
    alignas(64) float o[R][NC * 16];
    Mask16 nonfinite[R];  // an output that is not finite: a non-finite V
    for (int r = 0; r < R; ++r) nonfinite[r] = bad[r];
    if constexpr (V16_ONE_REGISTER) {  // every row's NC accumulators stay in the 32 registers
      V16 acc[R][NC];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = v16_zero();
      for (long j = 0; j < ns; ++j) {
        for (int c = 0; c < NC; ++c) {
          const V16 vv = v16_loadu(vb + j * dp + c * 16);
          for (int r = 0; r < R; ++r) acc[r][c] = v16_fmadd(v16_set1(sp[r][j]), vv, acc[r][c]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) nonfinite[r] |= v16_not_finite(acc[r][c]), v16_store(o[r] + c * 16, acc[r][c]);
    } else {  // 16 registers: one 16-float column block of the R rows at a time (the same sums)
      for (int c = 0; c < NC; ++c) {
        V16 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = v16_zero();
        for (long j = 0; j < ns; ++j) {
          const V16 vv = v16_loadu(vb + j * dp + c * 16);
          for (int r = 0; r < R; ++r) acc[r] = v16_fmadd(v16_set1(sp[r][j]), vv, acc[r]);
        }
        for (int r = 0; r < R; ++r) nonfinite[r] |= v16_not_finite(acc[r]), v16_store(o[r] + c * 16, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const long row = r0 + r;
      pm[row] = m[r];
      pl[row] = nonfinite[r] || std::isnan(sum[r]) ? std::numeric_limits<float>::quiet_NaN() : sum[r];
      std::memcpy(pacc + row * A.Dh, o[r], A.Dh * sizeof(float));
    }
  }

  template <int NC>
  void run(float* pm, float* pl, float* pacc) {
    prepare();
    // AVX-512: RB x NC accumulators + RB score vectors in 32 registers. AVX2: RB_AVX2 rows' two
    // score chains of two halves and the K rows in its 16.
    constexpr int RB = V16_ONE_REGISTER ? (NC <= 4 ? 4 : 2) : RB_AVX2;
    long r0 = 0;
    for (; r0 + RB <= rows; r0 += RB) rows_group<NC, RB>(r0, pm, pl, pacc);
    switch (rows - r0) {
      case 1: rows_group<NC, 1>(r0, pm, pl, pacc); break;
      case 2: rows_group<NC, 2>(r0, pm, pl, pacc); break;
      case 3: rows_group<NC, 3>(r0, pm, pl, pacc); break;
      default: break;
    }
    // A query that sees a non-finite K/V gets NaN (its sum), as in specjax/attention/xla.py.
    const Args& A = *a;
    const long G = A.H / A.KVH;
    bool tree_bad = false;
    for (uint32_t w : sc->tree_bad) tree_bad |= w != 0;
    if (!tree_bad) return;
    for (long row = 0; row < rows; ++row) {
      const uint32_t* anc = A.anc + (b * A.T + row / G) * A.W;
      bool bad = false;
      for (long w = 0; w < A.W; ++w) bad |= (anc[w] & sc->tree_bad[w]) != 0;
      if (bad) pl[row] = std::numeric_limits<float>::quiet_NaN();
    }
  }
};

// The outputs of rows [0, rows) of (request b, KV head kvh) from their chunks' partial states (row
// max, row sum, unnormalised output; chunk c's at index c * stride), merged in chunk order.
void finish(const Args& A, long b, long kvh, long rows, long chunks, long stride, const float* pm, const float* pl,
            const float* pacc) {
  const long G = A.H / A.KVH;
  for (long row = 0; row < rows; ++row) {
    float* o = A.out + ((b * A.T + row / G) * A.H + kvh * G + row % G) * A.Dh;
    float top = NEG_INF;
    for (long c = 0; c < chunks; ++c) top = std::max(top, pm[c * stride * rows + row]);
    float sum = 0.0f;
    bool nan = false;
    std::fill(o, o + A.Dh, 0.0f);
    for (long c = 0; c < chunks; ++c) {
      const long i = c * stride * rows + row;
      nan |= std::isnan(pl[i]);
      if (pm[i] == NEG_INF) continue;  // this chunk saw nothing
      const float f = chunks == 1 ? 1.0f : std::exp(pm[i] - top);
      sum += pl[i] * f;
      const float* acc = pacc + i * A.Dh;
      for (long d = 0; d < A.Dh; ++d) o[d] += acc[d] * f;
    }
    if (nan) std::fill(o, o + A.Dh, std::numeric_limits<float>::quiet_NaN());
    else if (sum > 0.0f)
      for (long d = 0; d < A.Dh; ++d) o[d] /= sum;
  }
}

template <typename Schedule>
void attention(const Args& A, long threads, Schedule schedule) {
  const long G = A.H / A.KVH, rows = A.T * G, dp = (A.Dh + 15) / 16 * 16, nc = dp / 16;
  // Units: request-major, then chunk, then KV head. Every request has at least one chunk; a request
  // with one (most) writes its outputs from the unit, the others keep partial states to merge.
  std::vector<long> first(A.B + 1, 0), partial(A.B + 1, 0), lens(A.B), ends(A.B);
  long work = 0;
  for (long b = 0; b < A.B; ++b) {
    lens[b] = std::clamp<long>(A.lengths[b], 0, A.S);
    ends[b] = A.block_in_cache ? std::min(A.S, lens[b] + A.R) : lens[b] + A.R;
    const long chunks = std::max<long>(1, (ends[b] + CHUNK - 1) / CHUNK);
    first[b + 1] = first[b] + chunks * A.KVH;
    partial[b + 1] = partial[b] + (chunks > 1 ? chunks * A.KVH : 0);
    work += std::max<long>(ends[b], 16) * A.KVH * (rows * 8 + 24);  // vector ops, roughly
  }
  const long units = first[A.B], kept = partial[A.B];
  std::unique_ptr<float[]> pm(new float[kept * rows]), pl(new float[kept * rows]), pacc(new float[kept * rows * A.Dh]);
  auto run = [&](long u) {
    const long b = std::upper_bound(first.begin(), first.end(), u) - first.begin() - 1;
    const long rem = u - first[b], c = rem / A.KVH, kvh = rem % A.KVH;
    const bool direct = partial[b + 1] == partial[b];
    thread_local Scratch scratch;
    thread_local std::vector<float> own;  // a one-chunk request's partial state
    float *m, *l, *acc;
    if (direct) {
      own.resize(rows * (2 + A.Dh));
      m = own.data(), l = m + rows, acc = l + rows;
    } else {
      const long i = partial[b] + rem;
      m = pm.get() + i * rows, l = pl.get() + i * rows, acc = pacc.get() + i * rows * A.Dh;
    }
    Unit unit{&A, b, kvh, c * CHUNK, std::min(ends[b], (c + 1) * CHUNK), lens[b], ends[b], rows, dp, &scratch};
    switch (nc) {
      case 1: unit.run<1>(m, l, acc); break;
      case 2: unit.run<2>(m, l, acc); break;
      case 3: unit.run<3>(m, l, acc); break;
      case 4: unit.run<4>(m, l, acc); break;
      case 5: unit.run<5>(m, l, acc); break;
      case 6: unit.run<6>(m, l, acc); break;
      case 7: unit.run<7>(m, l, acc); break;
      default: unit.run<8>(m, l, acc); break;
    }
    if (direct) finish(A, b, kvh, rows, 1, 1, m, l, acc);
  };
  // Small work (tiny models, short contexts) runs on the calling thread: a pool task costs more.
  specjax::parallel_units(units, work < (1L << 16) ? 0 : threads - 1, run, schedule);
  for (long b = 0; b < A.B; ++b) {  // requests of several chunks: merged in chunk order
    const long chunks = (partial[b + 1] - partial[b]) / A.KVH;
    for (long kvh = 0; kvh < A.KVH && chunks > 1; ++kvh) {
      const long i = partial[b] + kvh;
      finish(A, b, kvh, rows, chunks, A.KVH, pm.get() + i * rows, pl.get() + i * rows, pacc.get() + i * rows * A.Dh);
    }
  }
}

}  // namespace

// For tests without XLA: one thread.
extern "C" void specjax_cpu_attention_reference(const float* q, const float* k, const float* v, const float* kb,
                                                const float* vb, int block_in_cache, long layer,
                                                const int32_t* lengths, const uint32_t* anc, float* out, long B,
                                                long T, long H, long KVH, long Dh, long L, long S, long W, long R,
                                                float scale) {
  Args a{q, k, v, kb, vb, block_in_cache != 0, layer, lengths, anc, out, B, T, H, KVH, Dh, L, S, W, R, scale};
  attention(a, 1, [](auto&&) {});
}

extern "C" int specjax_cpu_attention_max_head_dim() { return MAX_NC * 16; }

// For tests: the kernel's exponential (vec16.h's, for x <= 0) over n floats (n a multiple of 16).
extern "C" void specjax_cpu_attention_exp(const float* x, float* y, long n) {
  for (long i = 0; i + 16 <= n; i += 16) v16_storeu(y + i, v16_exp(v16_loadu(x + i)));
}

#ifndef SPECJAX_NO_FFI
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

static ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> kb, ffi::Buffer<ffi::F32> vb,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                                ffi::Buffer<ffi::U32> anc, ffi::ResultBuffer<ffi::F32> out, float scale,
                                int64_t region, bool block_in_cache) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), ad = anc.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || ad.size() != 3 || lengths.dimensions().size() != 1 ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "specjax_cpu_attention: expected q [B, T, H, Dh], k/v [L, B, S, KVH, Dh], layer [], lengths [B], "
        "ancestor [B, T, W]");
  const long B = qd[0], T = qd[1], H = qd[2], Dh = qd[3], L = kd[0], S = kd[2], KVH = kd[3], W = ad[2];
  for (size_t i = 0; i < 5; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("specjax_cpu_attention: k and v shapes differ");
  auto bd = kb.dimensions(), bvd = vb.dimensions();
  if (!block_in_cache && (bd.size() != 4 || bvd.size() != 4 || bd[0] != B || bd[1] != region || bd[2] != kd[3] ||
                          bd[3] != Dh || bvd[0] != bd[0] || bvd[1] != bd[1] || bvd[2] != bd[2] || bvd[3] != bd[3]))
    return ffi::Error::InvalidArgument("specjax_cpu_attention: the block is not [B, region, KVH, Dh]");
  if (kd[1] != B || kd[4] != Dh || lengths.dimensions()[0] != B || ad[0] != B || ad[1] != T || KVH < 1 ||
      H % KVH != 0 || Dh > MAX_NC * 16 || region < 0 || region > 32 * W)
    return ffi::Error::InvalidArgument("specjax_cpu_attention: shapes do not match");
  if (B * T * H * Dh == 0) return ffi::Error::Success();
  const long li = std::clamp<long>(layer.typed_data()[0], 0, L - 1);
  Args a{q.typed_data(), k.typed_data(), v.typed_data(), kb.typed_data(), vb.typed_data(), block_in_cache, li, lengths.typed_data(), anc.typed_data(),
         out->typed_data(), B, T, H, KVH, Dh, L, S, W, (long)region, scale};
  const long threads = std::max<int64_t>(1, pool.num_threads());
  attention(a, threads, [&pool](auto&& task) { pool.Schedule(std::move(task)); });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCpuAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("region")
                                  .Attr<bool>("block_in_cache"));
#endif
