// One SIMD vector of float32 lanes, for the ISA a kernel source is compiled for: AVX-512 (16
// lanes) or AVX2 with FMA (8 lanes). The kernels are written once against it and load bfloat16
// or float32 into float32 lanes, so one kernel serves both dtypes: bfloat16 is the upper half of
// a float32, widened with a shift and rounded back to nearest even.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace ferry::FERRY_ISA {

using bf16 = c10::BFloat16;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

// float32 -> bfloat16, rounded to nearest even (finite inputs; what torch's cast gives).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store_scalar(float* p, float x) { *p = x; }
inline void store_scalar(bf16* p, float x) { *p = c10::BFloat16(bf16_bits(x), c10::BFloat16::from_bits()); }

#if defined(__AVX512F__)

struct Vec {
  static constexpr int kLanes = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec all(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  // The nearest bfloat16, still as a float32 (what a store to bfloat16 and a load back give).
  Vec bf16_rounded() const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return {_mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
};
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec round_nearest(Vec a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline Vec scale_by_power_of_two(Vec y, Vec n) { return {_mm512_scalef_ps(y.v, n.v)}; }

#elif defined(__AVX2__) && defined(__FMA__)

struct Vec {
  static constexpr int kLanes = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec all(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    // 8 int32 lanes -> 8 uint16: pack within 128-bit halves, then gather the two halves' results.
    const __m256i packed = _mm256_packus_epi32(rounded, rounded);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ordered));
  }
  float sum() const {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  Vec bf16_rounded() const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return {_mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  }
};
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec round_nearest(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec scale_by_power_of_two(Vec y, Vec n) {
  // y * 2^n for integral n in [-127, 127]: add n to the exponent field.
  const __m256i shift = _mm256_slli_epi32(_mm256_cvtps_epi32(n.v), 23);
  return {_mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y.v), shift))};
}

#else
#error "ferry's CPU kernels need AVX-512 or AVX2 with FMA"
#endif

// exp(x), float32-exact to about one ulp: 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2,
// e^r by Cephes' degree-6 polynomial. Clamped to [-87, 88]: below, a result of ~1e-38 (treat
// as 0 where it matters); above, ~1.6e38 rather than inf.
inline Vec exp(Vec x) {
  x = min(max(x, Vec::all(-87.0f)), Vec::all(88.0f));
  Vec n = round_nearest(x * Vec::all(1.44269504088896341f));
  Vec r = fma(n, Vec::all(-0.693359375f), x);
  r = fma(n, Vec::all(2.12194440e-4f), r);
  Vec y = Vec::all(1.9875691500e-4f);
  y = fma(y, r, Vec::all(1.3981999507e-3f));
  y = fma(y, r, Vec::all(8.3334519073e-3f));
  y = fma(y, r, Vec::all(4.1665795894e-2f));
  y = fma(y, r, Vec::all(1.6666665459e-1f));
  y = fma(y, r, Vec::all(5.0000001201e-1f));
  y = fma(y, r * r, r + Vec::all(1.0f));
  return scale_by_power_of_two(y, n);
}

}  // namespace ferry::FERRY_ISA
