// A vector of 16 floats and the operations the attention kernel (attention.cc) needs, for two ISAs:
// AVX-512F (one register; each operation is the one intrinsic, simd.h's helpers) and AVX2 with FMA
// (two 8-float halves). One kernel source then serves both: on AVX2 CPUs without AVX-512 (AMD EPYC
// guests whose hypervisor hides it) XLA's attention was the dearest part of a tree pass.
//
// Masks are 16 bits, bit i for float i, on both ISAs. On AVX2 they become per-lane vectors where an
// operation needs one (masked loads use maskload, which never touches the lanes left out).
#pragma once
#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__)
#include "simd.h"
#elif !(defined(__AVX2__) && defined(__FMA__))
#error "vec16.h needs AVX-512F, or AVX2 with FMA"
#endif

namespace specjax {

typedef uint16_t Mask16;
constexpr Mask16 ALL16 = 0xFFFF;

#if defined(__AVX512F__)

constexpr bool V16_ONE_REGISTER = true;
struct V16 {
  __m512 v;
};
inline V16 v16_zero() { return {_mm512_setzero_ps()}; }
inline V16 v16_set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 v16_loadu(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 v16_load(const float* p) { return {_mm512_load_ps(p)}; }  // p 64-byte aligned
inline V16 v16_maskz_loadu(Mask16 m, const float* p) { return {_mm512_maskz_loadu_ps(m, p)}; }
inline void v16_storeu(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline void v16_store(float* p, V16 a) { _mm512_store_ps(p, a.v); }  // p 64-byte aligned
inline V16 v16_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 v16_sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 v16_max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // b where either is NaN
inline V16 v16_fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 v16_select(Mask16 m, V16 a, V16 otherwise) { return {_mm512_mask_mov_ps(otherwise.v, m, a.v)}; }
inline V16 v16_maskz(Mask16 m, V16 a) { return {_mm512_maskz_mov_ps(m, a.v)}; }
inline float v16_reduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline float v16_reduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline V16 v16_exp(V16 a) { return {exp_ps(a.v)}; }
inline Mask16 v16_not_finite(V16 a) { return not_finite(a.v); }
inline void v16_transpose(V16 r[16]) {  // r[i] (16 rows of 16 floats) becomes column i
  __m512 t[16];  // a copy the compiler removes, rather than an __m512 view of the V16 array
  for (int i = 0; i < 16; ++i) t[i] = r[i].v;
  transpose16(t);
  for (int i = 0; i < 16; ++i) r[i].v = t[i];
}

#else  // AVX2 + FMA: two halves

constexpr bool V16_ONE_REGISTER = false;
struct V16 {
  __m256 lo, hi;  // floats 0-7, 8-15
};

// Lanes of the 8 bits of m (bit i: lane i) as a per-lane mask vector.
inline __m256 lane_mask(unsigned m) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bits), bits));
}
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v16_loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v16_load(const float* p) { return {_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
inline V16 v16_maskz_loadu(Mask16 m, const float* p) {
  if (m == ALL16) return v16_loadu(p);
  return {_mm256_maskload_ps(p, _mm256_castps_si256(lane_mask(m & 0xFFu))),
          _mm256_maskload_ps(p + 8, _mm256_castps_si256(lane_mask(m >> 8)))};
}
inline void v16_storeu(float* p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline void v16_store(float* p, V16 a) { _mm256_store_ps(p, a.lo), _mm256_store_ps(p + 8, a.hi); }
inline V16 v16_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v16_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 v16_max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 v16_fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 v16_select(Mask16 m, V16 a, V16 otherwise) {
  return {_mm256_blendv_ps(otherwise.lo, a.lo, lane_mask(m & 0xFFu)),
          _mm256_blendv_ps(otherwise.hi, a.hi, lane_mask(m >> 8))};
}
inline V16 v16_maskz(Mask16 m, V16 a) {
  return {_mm256_and_ps(a.lo, lane_mask(m & 0xFFu)), _mm256_and_ps(a.hi, lane_mask(m >> 8))};
}
inline float reduce8_max(__m256 a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}
inline float reduce8_add(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}
inline float v16_reduce_max(V16 a) { return reduce8_max(_mm256_max_ps(a.lo, a.hi)); }
inline float v16_reduce_add(V16 a) { return reduce8_add(_mm256_add_ps(a.lo, a.hi)); }

// e^x for x <= 0 (NaN stays NaN): simd.h's exp_ps (Cephes' expf) on 8 lanes. AVX2 has no scalef:
// 2^n (n in [-150, 0]) is applied as 2^(n/2) times 2^(n - n/2), both normal floats, so only the
// second product can round (into the subnormals), as scalef rounds once. x > 0 is outside its range
// (above ~88 the powers overflow into garbage, where scalef gives inf): the kernel's arguments are
// scores minus their row maximum, positive only in a row that saw a non-finite score and is NaN.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-103.972084f), x);  // max keeps its second operand when NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);  // NaN: garbage here, but y is NaN already
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}
inline V16 v16_exp(V16 a) { return {exp8(a.lo), exp8(a.hi)}; }

// Lanes that are not finite (NaN or infinite): x * 0 is NaN exactly there.
inline Mask16 v16_not_finite(V16 a) {
  const __m256 zero = _mm256_setzero_ps();
  const int lo = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(a.lo, zero), zero, _CMP_NEQ_UQ));
  const int hi = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(a.hi, zero), zero, _CMP_NEQ_UQ));
  return (Mask16)(lo | (hi << 8));
}

// In place: r[i] (8 rows of 8 floats) becomes column i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + c], 128-bit lane l: rows 4i..4i+3 at column 4l + c
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// In place: r[i] (16 rows of 16 floats) becomes column i, as four 8 x 8 blocks.
inline void v16_transpose(V16 r[16]) {
  __m256 a[8], b[8], c[8], d[8];  // rows 0-7 low / high halves, rows 8-15 low / high halves
  for (int i = 0; i < 8; ++i) a[i] = r[i].lo, b[i] = r[i].hi, c[i] = r[8 + i].lo, d[i] = r[8 + i].hi;
  transpose8(a), transpose8(b), transpose8(c), transpose8(d);
  for (int i = 0; i < 8; ++i) r[i] = {a[i], c[i]}, r[8 + i] = {b[i], d[i]};
}

#endif

}  // namespace specjax
