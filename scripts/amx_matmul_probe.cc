// A measurement, not part of the library (scripts/bench_amx_matmul.py builds and runs it): could Intel
// AMX multiply a tree pass's rows faster than specjax's AVX-512 float32 matmul kernel
// (specjax/kernels/cpu/matmul.cc), and at what accuracy?
//
// AMX multiplies bfloat16 tiles into float32 sums. Float32 accuracy without changing the model: each
// weight as two bfloat16 parts taken by truncation (w = w1 + w2 exactly for a weight of at most 16
// significant bits: every layer weight of SmolLM2-135M-Instruct as specjax loads it from its Q4_1 GGUF,
// which bench_amx_matmul.py counts) stacked along K, and each float32 activation as three bfloat16 parts rounded in turn
// (x = x1 + x2 + x3 exactly, 8 + 8 + 8 significand bits) stacked as 3M rows: every product is exact in
// float32 and only the float32 sums round, as in the AVX-512 kernel. Variants that change the numerics
// are timed beside it: weights rounded to bfloat16 (1 part) with exact activations, and both rounded.
// One thread, SmolLM2-135M's 7 weight shapes per layer, distinct buffers per layer so the weights stream
// from memory as in a pass; random weights truncated to 16 significant bits.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

extern "C" void specjax_cpu_matmul_reference(const float* x, const float* w, float* y, long M, long K, long N);
extern "C" int specjax_cpu_matmul_panel_width();

static uint16_t bf16_rne(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
static float bf16_f(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static uint16_t bf16_trunc(float f) { uint32_t u; std::memcpy(&u, &f, 4); return uint16_t(u >> 16); }

// W [K, N] -> its `wparts` bfloat16 parts (truncation: w = w1 + w2 exactly when w has <= 16 significant
// bits; one part rounds to nearest) stacked along K (K' = wparts K), as tiles [N/16][K'/32][16 pair rows][16 cols][2].
static std::vector<uint16_t> pack_amx(const float* w, long K, long N, int wparts) {
  std::vector<float> stacked(wparts * K * N);
  for (long i = 0; i < K * N; ++i) {
    if (wparts == 1) { stacked[i] = bf16_f(bf16_rne(w[i])); continue; }
    const float hi = bf16_f(bf16_trunc(w[i]));
    stacked[i] = hi;
    stacked[K * N + i] = w[i] - hi;  // exact; itself bfloat16-exact for <= 16 significant bits
    if (bf16_f(bf16_trunc(w[i] - hi)) != w[i] - hi) { std::fprintf(stderr, "weight needs 3 parts\n"); std::exit(2); }
  }
  const long K2 = wparts * K;
  std::vector<uint16_t> out(K2 * N);
  long i = 0;
  for (long nb = 0; nb < N / 16; ++nb)
    for (long kb = 0; kb < K2 / 32; ++kb)
      for (long kk = 0; kk < 16; ++kk)
        for (long n = 0; n < 16; ++n)
          for (long e = 0; e < 2; ++e) out[i++] = bf16_trunc(stacked[(kb * 32 + 2 * kk + e) * N + nb * 16 + n]);
  return out;
}

// y[M, N] = x[M, K0] @ W (K0 and N multiples of 32), W packed by pack_amx with `wparts` parts, x split into
// `xparts` parts. parts: bfloat16 scratch [R, wparts K0], R = xparts M rounded up to 16 rows; acc: float32 [R, 32].
static void amx_matmul(const float* x, const uint16_t* wp, float* y, long M, long K0, long N, uint16_t* parts,
                       float* acc, int wparts, int xparts) {
  const long K = wparts * K0;  // the stacked depth
  const long R = (xparts * M + 15) / 16 * 16;
  for (long m = 0; m < M; ++m)
    for (long k = 0; k < K0; k += 16) {  // K0 is a multiple of 32
      __m512 v = _mm512_loadu_ps(x + m * K0 + k);
      for (int p = 0; p < xparts; ++p) {
        const __m256bh a = _mm512_cvtneps_pbh(v);
        v = _mm512_sub_ps(v, _mm512_cvtpbh_ps(a));
        for (int q = 0; q < wparts; ++q) _mm256_storeu_si256((__m256i*)(parts + (p * M + m) * K + q * K0 + k), (__m256i)a);
      }
    }
  std::memset(parts + xparts * M * K, 0, (R - xparts * M) * K * 2);
  const long KB = K / 32;
  for (long nb = 0; nb < N / 16; nb += 2) {
    const uint16_t* b0 = wp + nb * K * 16;
    const uint16_t* b1 = b0 + K * 16;
    for (long r0 = 0; r0 < R; r0 += 32) {
      const bool two = r0 + 16 < R;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (long kb = 0; kb < KB; ++kb) {
        _tile_loadd(6, b0 + kb * 512, 64);
        _tile_loadd(7, b1 + kb * 512, 64);
        _tile_loadd(4, parts + r0 * K + kb * 32, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, parts + (r0 + 16) * K + kb * 32, K * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, acc + r0 * 32, 128);
      _tile_stored(1, acc + r0 * 32 + 16, 128);
      if (two) { _tile_stored(2, acc + (r0 + 16) * 32, 128); _tile_stored(3, acc + (r0 + 16) * 32 + 16, 128); }
    }
    for (long m = 0; m < M; ++m)
      for (long n = 0; n < 32; n += 16) {
        __m512 sum = _mm512_loadu_ps(acc + m * 32 + n);
        for (int p = 1; p < xparts; ++p) sum = _mm512_add_ps(sum, _mm512_loadu_ps(acc + (p * M + m) * 32 + n));
        _mm512_storeu_ps(y + m * N + nb * 16 + n, sum);
      }
  }
}

static std::vector<float> pack_panels(const float* w, long K, long N, long CW) {
  const long P = (N + CW - 1) / CW;
  std::vector<float> out(P * K * CW, 0.f);
  for (long p = 0; p < P; ++p)
    for (long k = 0; k < K; ++k)
      for (long c = 0; c < CW && p * CW + c < N; ++c) out[(p * K + k) * CW + c] = w[k * N + p * CW + c];
  return out;
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XFEATURE_XTILEDATA*/)) {
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  const long CW = specjax_cpu_matmul_panel_width();
  const int layers = argc > 1 ? std::atoi(argv[1]) : 30;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const long shapes[7][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576}, {576, 1536}, {576, 1536}, {1536, 576}};
  // Variants: weight parts x activation parts. 2 x 3 is exact for weights of <= 16 significant bits
  // (every layer weight of SmolLM2-135M-Instruct as specjax loads it).
  const int variants[3][2] = {{2, 3}, {1, 3}, {1, 1}};
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 0.05f);
  std::vector<std::vector<float>> wf, panels;
  std::vector<std::vector<uint16_t>> wa[3];
  for (int l = 0; l < layers; ++l)
    for (auto& s : shapes) {
      std::vector<float> w(s[0] * s[1]);
      for (auto& v : w) {  // 16 significant bits, as SmolLM2's dequantised Q4_1 weights
        v = nd(rng); uint32_t u; std::memcpy(&u, &v, 4); u &= 0xffffff00u; std::memcpy(&v, &u, 4);
      }
      panels.push_back(pack_panels(w.data(), s[0], s[1], CW));
      for (int v = 0; v < 3; ++v) wa[v].push_back(pack_amx(w.data(), s[0], s[1], variants[v][0]));
      if (l == 0) wf.push_back(std::move(w));
    }
  std::vector<float> x(64 * 1536), y(64 * 1536), y2(64 * 1536), acc(3 * 64 * 32 + 1024);
  std::vector<uint16_t> parts(2 * (3 * 64 + 16) * 1536);
  for (auto& v : x) v = nd(rng) * 20;
  std::printf("accuracy on layer 0's 7 weights, 33 rows: worst |y - y64| / sum_k |x w| (float64 reference y64)\n");
  for (int v = -1; v < 3; ++v) {
    double e = 0;
    for (int s = 0; s < 7; ++s) {
      const long K = shapes[s][0], N = shapes[s][1], M = 33;
      if (v < 0) specjax_cpu_matmul_reference(x.data(), panels[s].data(), y2.data(), M, K, N);
      else amx_matmul(x.data(), wa[v][s].data(), y2.data(), M, K, N, parts.data(), acc.data(), variants[v][0], variants[v][1]);
      for (long m = 0; m < M; ++m)
        for (long n = 0; n < N; ++n) {
          double ref = 0, mag = 0;
          for (long k = 0; k < K; ++k) { ref += double(x[m * K + k]) * wf[s][k * N + n]; mag += std::fabs(double(x[m * K + k]) * wf[s][k * N + n]); }
          e = std::max(e, std::fabs(y2[m * N + n] - ref) / mag);
        }
    }
    if (v < 0) std::printf("  avx512 float32 kernel: %.2e\n", e);
    else std::printf("  amx W %d part(s) x x %d part(s): %.2e\n", variants[v][0], variants[v][1], e);
  }
  std::printf("time: %d layers x 7 weights (SmolLM2-135M's), 1 thread, best of %d, ms\n", layers, reps);
  std::printf("  rows   f32-kernel  amx-2x3(exact)  amx-1x3  amx-1x1\n");
  for (long M : {1L, 4L, 8L, 16L, 33L, 49L, 64L}) {
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int rep = 0; rep < reps; ++rep)
      for (int path = 0; path < 4; ++path) {
        auto t0 = std::chrono::steady_clock::now();
        size_t i = 0;
        for (int l = 0; l < layers; ++l)
          for (auto& s : shapes) {
            if (path == 0) specjax_cpu_matmul_reference(x.data(), panels[i].data(), y.data(), M, s[0], s[1]);
            else amx_matmul(x.data(), wa[path - 1][i].data(), y.data(), M, s[0], s[1], parts.data(), acc.data(),
                            variants[path - 1][0], variants[path - 1][1]);
            ++i;
          }
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        best[path] = std::min(best[path], ms);
      }
    std::printf("  %4ld %11.2f %15.2f %8.2f %8.2f\n", M, best[0], best[1], best[2], best[3]);
  }
  _tile_release();
}
