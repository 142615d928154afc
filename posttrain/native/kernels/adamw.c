/* AdamW's step over one fp32 parameter (posttrain/native/adamw.py), with the gradient's clip factor folded
 * in and, where asked, the bf16 copy of the updated parameter written in the same pass: the copy the training
 * forward's matmuls read under bf16 autocast (posttrain/models/weight_copies.py) instead of casting every
 * weight from fp32 again each forward.
 *
 * The arithmetic is PyTorch's own fused CPU AdamW (`torch.optim.AdamW(fused=True)`, aten's FusedAdamKernel),
 * operation for operation and rounding for rounding in its 16-wide loop, so the parameters and moments it writes
 * are bit-identical to that kernel's (tests/test_native_adamw.py). It takes whole blocks of 16 elements: a
 * tensor's last n % 16, which PyTorch steps in a scalar loop of its own rounding, the caller steps with PyTorch's
 * kernel. The gradient is first multiplied by `coef` as `clip_grads_with_norm_` multiplies it (1: as it is):
 *   g  = grad * coef
 *   p  = p * (1 - lr * wd)                                    where wd != 0
 *   m  = lerp(m, g, 1 - beta1)                               PyTorch's lerp: fma(w, g - m, m) for w < 0.5
 *   v  = fma((1 - beta2) * g, g, v * beta2)                  as PyTorch's build contracts its 16-wide loop's
 *   p  = p + (-lr / bc1 * m) / (sqrt(v) / sqrt(bc2) + eps)
 *   copy = bf16(p)                                            round to nearest even, as PyTorch casts
 * with every constant computed in double and rounded to fp32 once, as PyTorch does. No other product and sum
 * is contracted into a fused multiply-add (fp-contract off for this file's functions).
 *
 * Bytes per element: read p, g, m, v (16), write p, m, v (12) and the copy (2); the gradient is not written
 * (PyTorch's clip writes it scaled; the stage drops it right after the step).
 */
#define CHUNK 8192 /* elements per thread task: a multiple of 16 */

typedef struct {
    float coef, decay, lerp_w, sq_w, beta2, bc2_sqrt, eps, neg_step;
    int decays, small_w;
} adamw_consts;

__attribute__((optimize("fp-contract=off")))
static inline float adamw_one(float p, float g, float *m_io, float *v_io, const adamw_consts *c) {
    g = g * c->coef;
    if (c->decays) p = p * c->decay;
    float m = *m_io;
    m = c->small_w ? fmaf(c->lerp_w, g - m, m) : fmaf(c->lerp_w - 1.0f, g - m, g);
    const float v = fmaf(c->sq_w * g, g, *v_io * c->beta2);
    *m_io = m;
    *v_io = v;
    const float denom = sqrtf(v) / c->bc2_sqrt + c->eps;
    return p + c->neg_step * m / denom;
}

__attribute__((optimize("fp-contract=off")))
static void adamw_span(long lo, long hi, float *param, const float *grad, float *exp_avg, float *exp_avg_sq,
                       uint16_t *copy, const adamw_consts *c) {
    long i = lo;
#if USE_AVX512
    const __m512 coef = _mm512_set1_ps(c->coef), decay = _mm512_set1_ps(c->decay), w = _mm512_set1_ps(c->lerp_w),
                 w1 = _mm512_set1_ps(c->lerp_w - 1.0f), sq_w = _mm512_set1_ps(c->sq_w), b2 = _mm512_set1_ps(c->beta2),
                 bc2s = _mm512_set1_ps(c->bc2_sqrt), eps = _mm512_set1_ps(c->eps), step = _mm512_set1_ps(c->neg_step);
    const int aligned = copy != NULL && ((uintptr_t)(copy + lo) & 31u) == 0;
    for (; i + 16 <= hi; i += 16) {
        __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grad + i), coef);
        __m512 p = _mm512_loadu_ps(param + i);
        if (c->decays) p = _mm512_mul_ps(p, decay);
        __m512 m = _mm512_loadu_ps(exp_avg + i);
        const __m512 d = _mm512_sub_ps(g, m);
        m = c->small_w ? _mm512_fmadd_ps(w, d, m) : _mm512_fmadd_ps(w1, d, g);
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(sq_w, g), g, _mm512_mul_ps(_mm512_loadu_ps(exp_avg_sq + i), b2));
        _mm512_storeu_ps(exp_avg + i, m);
        _mm512_storeu_ps(exp_avg_sq + i, v);
        const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2s), eps);
        p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(step, m), denom));
        _mm512_storeu_ps(param + i, p);
        if (copy) { /* streamed: read by the next forward, not by anything before it */
            const __m256i b = _mm512_cvtepi32_epi16(round16_bf16(p));
            if (aligned) _mm256_stream_si256((__m256i *)(copy + i), b);
            else _mm256_storeu_si256((__m256i *)(copy + i), b);
        }
    }
    if (aligned) _mm_sfence();
#endif
    for (; i < hi; i++) {  /* the plain-C build's loop: the same operations, one element at a time */
        const float p = adamw_one(param[i], grad[i], exp_avg + i, exp_avg_sq + i, c);
        param[i] = p;
        if (copy) copy[i] = f32_to_bf16(p);
    }
}

/* One tensor's step over n elements, a multiple of 16 (the caller steps the rest with PyTorch's own kernel);
 * `copy` may be NULL. Returns 0, or 1 where n is not a multiple of 16. */
int posttrain_adamw_step(long n, float *param, const float *grad, float *exp_avg, float *exp_avg_sq, uint16_t *copy,
                         double lr, double beta1, double beta2, double eps, double weight_decay,
                         double bias_correction1, double bias_correction2, float coef, int threads) {
    if (n % 16 != 0) return 1;
    adamw_consts c;
    c.coef = coef;
    c.decays = weight_decay != 0.0;
    c.decay = (float)(1.0 - lr * weight_decay);
    c.lerp_w = (float)(1.0 - beta1);
    c.small_w = fabsf(c.lerp_w) < 0.5f;
    c.sq_w = (float)(1.0 - beta2);
    c.beta2 = (float)beta2;
    c.bc2_sqrt = (float)sqrt(bias_correction2);
    c.eps = (float)eps;
    c.neg_step = (float)(-(lr / bias_correction1));
    const long tasks = (n + CHUNK - 1) / CHUNK;
    if (threads <= 1 || tasks <= 1) {
        adamw_span(0, n, param, grad, exp_avg, exp_avg_sq, copy, &c);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tasks; t++) {
        const long lo = t * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        adamw_span(lo, hi, param, grad, exp_avg, exp_avg_sq, copy, &c);
    }
    return 0;
}

/* 1 where this build runs the AVX-512 loop, 0 for the plain-C one */
int posttrain_adamw_vector_path(void) { return USE_AVX512; }
