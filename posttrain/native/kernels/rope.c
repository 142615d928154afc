/* Rotary position embedding (Su et al. 2021, "RoFormer") as the Llama family's `apply_rotary_pos_emb` runs under
 * bf16 autocast (posttrain/models/fused_attention.py): the projection's bf16 output times fp32 cos and sin.
 *
 * `transformers` computes q·cos + rotate_half(q)·sin as five passes over the (tokens, heads, D) tensor, with the
 * products promoted to fp32 (cos and sin are fp32), rotate_half a negation and a concatenation, and the backward
 * as as many again. Here one pass each way, per token and head, over the two halves of D:
 *   forward   out[i]       = x[i]·cos[i] + (−x[i+D/2])·sin[i]           i < D/2, fp32 out
 *             out[i+D/2]   = x[i+D/2]·cos[i+D/2] + x[i]·sin[i+D/2]
 *   backward  dx[i]        = dy[i]·cos[i] + dy[i+D/2]·sin[i+D/2]         bf16 out
 *             dx[i+D/2]    = dy[i+D/2]·cos[i+D/2] − dy[i]·sin[i]
 * The forward rounds each product to fp32 and then their sum, as PyTorch's two multiplies and one add do, so its
 * output is bit-identical to theirs: no fused multiply-add may join them (fp-contract off, below). The backward
 * sums in fp32 and rounds once to bf16 where autograd rounds each path's gradient to bf16 and adds them in bf16.
 *
 * x: (rows, heads·D) bf16, row stride x_stride elements; cos, sin: (rows, D) fp32, contiguous (a token's angles,
 * every head's); out, dy: (rows, heads·D) fp32, contiguous; dx: (rows, heads·D) bf16, contiguous. Threads split
 * the rows; the loops vectorise under `omp simd` for the CPU the build runs on (-march=native).
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

int posttrain_rope_forward(long rows, int heads, int d, const uint16_t *x, long x_stride, const float *cos,
                           const float *sin, float *out, int threads) {
    if (d <= 0 || d % 2) return -1;
    const int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int h = 0; h < heads; h++) {
            const uint16_t *xr = x + r * x_stride + (long)h * d;
            float *o = out + (r * heads + h) * (long)d;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = bf16_to_f32(xr[i]), b = bf16_to_f32(xr[i + half]);
                const float lo_c = a * c[i], lo_s = -b * s[i];
                const float hi_c = b * c[i + half], hi_s = a * s[i + half];
                o[i] = lo_c + lo_s;
                o[i + half] = hi_c + hi_s;
            }
        }
    }
    return 0;
}

int posttrain_rope_backward(long rows, int heads, int d, const float *dy, const float *cos, const float *sin,
                            uint16_t *dx, int threads) {
    if (d <= 0 || d % 2) return -1;
    const int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < rows; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int h = 0; h < heads; h++) {
            const float *g = dy + (r * heads + h) * (long)d;
            uint16_t *o = dx + (r * heads + h) * (long)d;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                o[i] = f32_to_bf16(g[i] * c[i] + g[i + half] * s[i + half]);
                o[i + half] = f32_to_bf16(g[i + half] * c[i + half] - g[i] * s[i]);
            }
        }
    }
    return 0;
}
