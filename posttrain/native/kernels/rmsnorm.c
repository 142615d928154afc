/* The fused RMSNorm (posttrain/models/fused_norm.py, `_RMSNorm`) on fp32 rows: the forward's scaling and cast,
 * and the backward, one pass over each row each.
 *
 * Forward: out = bf16(w · (x · rstd)), each product rounded to fp32 and the result to bf16 (round to nearest
 * even) as PyTorch's two multiplies and its cast round them, so bit-identical to those three passes; rstd is
 * computed by PyTorch's own ops (`pow`, `mean`, `rsqrt`: their reduction order is theirs to keep).
 *
 * With x̂ = x · rstd (rstd = 1/√(mean(x²) + eps), saved by the forward) and g = grad · w:
 *   grad_x = rstd · (g − x̂ · mean(g · x̂))      per row
 *   grad_w = Σ_rows grad · x̂                    per column
 * PyTorch runs this as eight elementwise passes and two reductions over fp32 copies of the rows; here each
 * row is read once (x and grad), its gradient written once, and it stays in L1 between its two loops. The
 * row's sum is in fp32 (as PyTorch's); the column sums of grad_w in fp64, one accumulator row per thread,
 * added in thread order at the end. grad_x or grad_w may be NULL (not wanted).
 *
 * Plain C under `omp simd`: the compiler vectorises it for the CPU it builds on (-march=native).
 */
#include <stdlib.h>

static void rms_norm_backward_row(int D, const float *x, const float *w, float rstd, const void *grad, int grad_bf16,
                                  float *grad_x, double *acc) {
    const uint16_t *g16 = (const uint16_t *)grad;
    const float *g32 = (const float *)grad;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int j = 0; j < D; j++) {
        const float g = grad_bf16 ? bf16_to_f32(g16[j]) : g32[j];
        dot += g * w[j] * (x[j] * rstd);
    }
    if (acc) {
#pragma omp simd
        for (int j = 0; j < D; j++) {
            const float g = grad_bf16 ? bf16_to_f32(g16[j]) : g32[j];
            acc[j] += (double)(g * (x[j] * rstd));
        }
    }
    if (grad_x) {
        const float mean = dot / (float)D;
#pragma omp simd
        for (int j = 0; j < D; j++) {
            const float g = grad_bf16 ? bf16_to_f32(g16[j]) : g32[j];
            grad_x[j] = (g * w[j] - (x[j] * rstd) * mean) * rstd;
        }
    }
}

/* rows × D; 0, -1 for D out of range, -2 when the accumulators cannot be allocated */
int posttrain_rms_norm_backward(long rows, int D, const float *x, const float *weight, const float *rstd,
                                const void *grad, int grad_bf16, float *grad_x, float *grad_w, int threads) {
    if (D <= 0) return -1;
    if (threads < 1) threads = 1;
    double *acc = NULL;
    if (grad_w) {
        acc = (double *)calloc((size_t)threads * (size_t)D, sizeof(double));
        if (!acc) return -2;
    }
    const size_t gsize = grad_bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel num_threads(threads)
    {
        double *mine = acc ? acc + (size_t)omp_get_thread_num() * (size_t)D : NULL;
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++)
            rms_norm_backward_row(D, x + r * D, weight, rstd[r], (const char *)grad + (size_t)r * D * gsize, grad_bf16,
                                  grad_x ? grad_x + r * D : NULL, mine);
    }
    if (grad_w) {
        for (int j = 0; j < D; j++) {
            double s = 0.0;
            for (int t = 0; t < threads; t++) s += acc[(size_t)t * D + j];
            grad_w[j] = (float)s;
        }
        free(acc);
    }
    return 0;
}

/* rows × D: out = bf16(w · (x · rstd)) (the forward's last three passes as one); 0, or -1 for D out of range */
int posttrain_rms_norm_scale_bf16(long rows, int D, const float *x, const float *weight, const float *rstd,
                                  uint16_t *out, int threads) {
    if (D <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        const float s = rstd[r];
        uint16_t *o = out + r * D;
#pragma omp simd
        for (int j = 0; j < D; j++) o[j] = f32_to_bf16(weight[j] * (xr[j] * s));
    }
    return 0;
}
