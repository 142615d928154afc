/* The gated MLP's elementwise middle, h = silu(gate) * up (posttrain/models/fused_mlp.py), bf16 in and bf16
 * out, one pass each way: the forward's product (`posttrain_swiglu_forward_bf16`), and its backward.
 *
 * PyTorch runs it as five passes, each allocating an intermediate-width bf16 tensor: silu(gate) recomputed,
 * silu(gate) * up (for the down projection's weight gradient), grad * silu(gate), grad * up, and
 * silu_backward over that. Here each element is read once (gate, up, grad) and its three results written
 * once:
 *   prod      = bf16(bf16(silu(g)) * u)                 the forward's product, as the forward rounded it
 *   grad_up   = bf16(dh * bf16(silu(g)))                its gradient through up
 *   grad_gate = bf16(dh * u * s * (1 + g * (1 - s)))    through gate, s = sigmoid(g)
 * with every product in fp32 and one rounding per result (PyTorch rounds dh * u to bf16 before
 * silu_backward; here it stays fp32). `prod` may be NULL (the caller does not need it).
 *
 * sigmoid(g) = 1 / (1 + e^-g) for g >= 0 and e^g / (1 + e^g) below, so the exponential is always of a
 * non-positive number (common.h's). AVX-512 CPUs run 16 wide; others the plain-C loop, which the compiler
 * vectorises for the CPU it builds on (`omp simd`, -march=native).
 */
#define CHUNK 4096 /* elements per thread task */

/* sigmoid(g), and silu(g) rounded to bf16 and back, as the forward's activation */
static inline float sigmoid_of(float g) {
    const float e = exp_nonpositive(g >= 0.0f ? -g : g);
    return (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

static inline float grad_gate_of(float g, float u, float dh, float s) { return dh * u * s * (1.0f + g * (1.0f - s)); }

#if USE_AVX512
/* for 16 gates g: sigmoid(g) into *s, and silu(g) = g · sigmoid(g) rounded to bf16 and back, as the forward's
 * activation (the exponential only of -|g|) */
static inline __m512 silu16_rounded(__m512 g, __m512 *s) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    const __mmask16 neg = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
    const __m512 e = exp16_nonpositive(_mm512_mask_blend_ps(neg, _mm512_sub_ps(zero, g), g));
    *s = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
    return _mm512_castsi512_ps(_mm512_slli_epi32(round16_bf16(_mm512_mul_ps(g, *s)), 16));
}
#endif

static void swiglu_backward_span(long lo, long hi, const uint16_t *gate, const uint16_t *up, const uint16_t *grad,
                                 uint16_t *prod, uint16_t *grad_gate, uint16_t *grad_up) {
    long i = lo;
#if USE_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i < hi; i += 16) {
        const int n = hi - i >= 16 ? 16 : (int)(hi - i);
        const __m512 g = load16(gate, i, 1, n), u = load16(up, i, 1, n), dh = load16(grad, i, 1, n);
        __m512 s;
        const __m512 act = silu16_rounded(g, &s);
        if (prod) store16(prod, i, 1, n, _mm512_mul_ps(act, u));
        store16(grad_up, i, 1, n, _mm512_mul_ps(dh, act));
        const __m512 ds = _mm512_mul_ps(s, _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
        store16(grad_gate, i, 1, n, _mm512_mul_ps(_mm512_mul_ps(dh, u), ds));
    }
#else
    if (prod) {
#pragma omp simd
        for (long j = i; j < hi; j++) {
            const float g = bf16_to_f32(gate[j]), u = bf16_to_f32(up[j]), dh = bf16_to_f32(grad[j]);
            const float s = sigmoid_of(g), act = bf16_to_f32(f32_to_bf16(g * s));
            prod[j] = f32_to_bf16(act * u);
            grad_up[j] = f32_to_bf16(dh * act);
            grad_gate[j] = f32_to_bf16(grad_gate_of(g, u, dh, s));
        }
    } else {
#pragma omp simd
        for (long j = i; j < hi; j++) {
            const float g = bf16_to_f32(gate[j]), u = bf16_to_f32(up[j]), dh = bf16_to_f32(grad[j]);
            const float s = sigmoid_of(g), act = bf16_to_f32(f32_to_bf16(g * s));
            grad_up[j] = f32_to_bf16(dh * act);
            grad_gate[j] = f32_to_bf16(grad_gate_of(g, u, dh, s));
        }
    }
#endif
}

/* the forward's product alone, h = bf16(bf16(silu(g)) * u), for n elements — PyTorch's two ops
 * (F.silu, then the product) in one pass, rounded as they round. Below g = -87.3 e^g is no normal fp32
 * and the exponential returns 0: silu is 0 there, PyTorch's g / (1 + e^-g) under 1e-36 */
static void swiglu_forward_span(long lo, long hi, const uint16_t *gate, const uint16_t *up, uint16_t *out) {
    long i = lo;
#if USE_AVX512
    for (; i < hi; i += 16) {
        const int n = hi - i >= 16 ? 16 : (int)(hi - i);
        __m512 s;
        store16(out, i, 1, n, _mm512_mul_ps(silu16_rounded(load16(gate, i, 1, n), &s), load16(up, i, 1, n)));
    }
#else
#pragma omp simd
    for (long j = i; j < hi; j++) {
        const float g = bf16_to_f32(gate[j]), u = bf16_to_f32(up[j]);
        out[j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(g * sigmoid_of(g))) * u);
    }
#endif
}

int posttrain_swiglu_forward_bf16(long n, const uint16_t *gate, const uint16_t *up, uint16_t *out, int threads) {
    const long chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < chunks; c++) {
        const long lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        swiglu_forward_span(lo, hi, gate, up, out);
    }
    return 0;
}

/* the three results above for n elements; 0 */
int posttrain_swiglu_backward_bf16(long n, const uint16_t *gate, const uint16_t *up, const uint16_t *grad,
                                   uint16_t *prod, uint16_t *grad_gate, uint16_t *grad_up, int threads) {
    const long chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < chunks; c++) {
        const long lo = c * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        swiglu_backward_span(lo, hi, gate, up, grad, prod, grad_gate, grad_up);
    }
    return 0;
}

int posttrain_swiglu_vector_path(void) { return USE_AVX512; }
