/* What every kernel source under posttrain/native/kernels starts with: the build
 * (posttrain/native/__init__.py) puts this file ahead of the kernel's own source, as one translation unit.
 *
 * bf16 <-> fp32 as PyTorch casts, e^x for x <= 0 (a score minus its row's max: a degree-6 polynomial after
 * Cody-Waite reduction by ln 2, relative error ~2e-7, 0 below e^-87.3), and with AVX-512 (F, BW, VL) the
 * 16-wide forms and masked loads and stores of fp32 or bf16 arrays (USE_AVX512); with AVX2 and FMA (AVX-512
 * CPUs have them too) 8-wide forms (USE_AVX2). With -DPOSTTRAIN_GENERIC both are 0 and the kernels take
 * their plain-C loops (the tests check those against the vector code).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(POSTTRAIN_GENERIC)
#include <immintrin.h>
#define USE_AVX512 1
#else
#define USE_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(POSTTRAIN_GENERIC)
#include <immintrin.h>
#define USE_AVX2 1 /* the 8-wide forms below, for kernels that have an AVX2 path (AVX-512 CPUs have AVX2) */
#else
#define USE_AVX2 0
#endif

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as PyTorch casts; NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* e^x for x <= 0 (a score minus its row's max). Branch-free and without library calls (the rounding is
 * the 1.5 * 2^23 trick, round to nearest even as nearbyintf), so loops over it vectorise under `omp simd` */
static inline float exp_nonpositive(float x) {
    const float c = x < -87.3f ? -87.3f : x;
    const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, c));
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r + 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;  /* 2^n; memcpy, not a union: vectorises */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.3f ? 0.0f : p * scale;
}

#if USE_AVX512
static inline __m512 exp16_nonpositive(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}
#endif

#if USE_AVX512
/* 16 values (the first n) of a fp32 or bf16 array, as fp32; the rest 0 */
static inline __m512 load16(const void *base, long i, int bf16, int n) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    if (!bf16) return _mm512_maskz_loadu_ps(m, (const float *)base + i);
    __m256i b = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* 16 fp32 values rounded to bf16, to nearest even (no NaN here): each lane's bf16 bits in its low 16 */
static inline __m512i round16_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
}

/* the first n of 16 fp32 values into a fp32 or bf16 array (bf16: `round16_bf16`) */
static inline void store16(void *base, long i, int bf16, int n, __m512 v) {
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    if (!bf16) { _mm512_mask_storeu_ps((float *)base + i, m, v); return; }
    _mm256_mask_storeu_epi16((uint16_t *)base + i, m, _mm512_cvtepi32_epi16(round16_bf16(v)));
}
#endif

#if USE_AVX2
/* e^x for 8 values x <= 0, as exp_nonpositive */
static inline __m256 exp8_nonpositive(__m256 x) {
    const __m256 c = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), c);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* 8 bf16 values as fp32 */
static inline __m256 load8_bf16(const uint16_t *src) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

/* 8 fp32 values into bf16, rounded to nearest even (no NaN here) */
static inline void store8_bf16(uint16_t *dst, __m256 v) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128((__m128i *)dst, packed);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif
