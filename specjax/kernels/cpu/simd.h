// AVX-512 helpers shared by the attention kernels (prefill_attention.cc; attention.cc through vec16.h).
#pragma once
#include <immintrin.h>

namespace specjax {

// e^x for x <= 0 (NaN stays NaN): Cephes' expf (range reduction by ln 2 in two parts, a degree-5
// polynomial), ~1 ulp, scaled by 2^n with scalef (no overflow tricks needed below 0).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-103.972084f), x);  // max keeps its second operand when NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// In place: r[i] (16 rows of 16 floats) becomes column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane l: rows 4i..4i+3 at column 4l + c
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 a0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), a1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 b0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 b1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(a0, b0, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(a0, b0, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(a1, b1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(a1, b1, 0xDD);
  }
}

// Lanes of x that are not finite (NaN or infinite).
inline __mmask16 not_finite(__m512 x) {
#if defined(__AVX512DQ__)
  return _mm512_fpclass_ps_mask(x, 0x99);  // QNaN | +inf | -inf | SNaN
#else
  return _mm512_cmp_ps_mask(_mm512_mul_ps(x, _mm512_setzero_ps()), _mm512_setzero_ps(), _CMP_NEQ_UQ);
#endif
}

}  // namespace specjax
