/* Token log-probabilities and entropies from a language model's logits, and the log-probs' gradient, one
 * row (one position's V logits) at a time (posttrain/losses/logprobs.py: `token_logprobs`,
 * `entropy_from_logits`).
 *
 * PyTorch's ops make a dozen passes over an fp32 copy of each chunk of logits (the cast, the max, the
 * shifted exponentials, their sum, the gather; the backward casts, subtracts, exponentiates, scales,
 * scatters and casts back; the entropy casts, takes a softmax, a logsumexp and a product). At a real
 * vocabulary (49,152 for SmolLM2, 150k for Qwen) that is hundreds of MB of traffic a step. Here the
 * forward reads a row twice (its max, then the exponentials' sums; the row stays in L2 between the two)
 * and the backward reads it once and writes its gradient once, in the logits' dtype.
 *
 * Layout: the logits are a grid of R × C rows of V values, row (r, c) at element offset r·sr + c·sc,
 * its V values contiguous; bf16 (`bf16` 1) or fp32. tokens, logp, lse, entropy, grad: R·C values,
 * row-major (r, c). Per row, in fp32 with the max subtracted (as PyTorch's logsumexp):
 *   m = max z,  s = Σ e^(z−m),  lse = m + log s,  logp = z_y − lse,  H = log s − Σ e^(z−m)·(z−m) / s.
 * tokens may be NULL (no logp), entropy may be NULL (none written). The backward writes
 * g·(onehot(y) − e^(z−lse)) as PyTorch's ops do: −g·p everywhere, then g added at y, one rounding.
 * e^x is common.h's polynomial (relative error ~2e-7), where PyTorch's is within an ulp or two.
 *
 * With AVX-512 the rows run 16 wide; without it (or built -DPOSTTRAIN_GENERIC) plain-C loops that the
 * compiler vectorises (`omp simd`).
 */

static inline float logit_at(const void *row, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* m (the row's max), s = Σ e^(z−m) and t = Σ e^(z−m)·(z−m) of one row */
static void row_sums(const void *row, int bf16, long V, float *m_out, float *s_out, float *t_out) {
    float top = -INFINITY, s = 0.0f, t = 0.0f;
    long i = 0;
#if USE_AVX512
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i < V; i += 16) {
        const int n = V - i < 16 ? (int)(V - i) : 16;
        const __mmask16 live = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
        vmax = _mm512_mask_max_ps(vmax, live, vmax, load16(row, i, bf16, n));
    }
    top = _mm512_reduce_max_ps(vmax);
    const __m512 vtop = _mm512_set1_ps(top);
    const __m512 vfloor = _mm512_set1_ps(-88.0f);
    __m512 vs = _mm512_setzero_ps(), vt = _mm512_setzero_ps();
    for (i = 0; i < V; i += 16) {
        const int n = V - i < 16 ? (int)(V - i) : 16;
        const __mmask16 live = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
        const __m512 d = _mm512_maskz_sub_ps(live, load16(row, i, bf16, n), vtop);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16_nonpositive(d));
        vs = _mm512_add_ps(vs, e);
        vt = _mm512_fmadd_ps(e, _mm512_max_ps(d, vfloor), vt); /* e is 0 where d is -inf */
    }
    s = _mm512_reduce_add_ps(vs);
    t = _mm512_reduce_add_ps(vt);
#else
#pragma omp simd reduction(max : top)
    for (i = 0; i < V; i++) {
        const float z = logit_at(row, bf16, i);
        top = z > top ? z : top;
    }
#pragma omp simd reduction(+ : s, t)
    for (i = 0; i < V; i++) {
        const float d = logit_at(row, bf16, i) - top;
        const float e = exp_nonpositive(d);
        s += e;
        t += e * fmaxf(d, -88.0f);  /* e is 0 where d is -inf */
    }
#endif
    *m_out = top;
    *s_out = s;
    *t_out = t;
}

/* The gradient of one row: out = −g·e^(z−lse), then out[y] += g; in the logits' dtype */
static void row_backward(const void *row, int bf16, long V, long y, float lse, float g, void *out) {
    long i = 0;
#if USE_AVX512
    const __m512 vlse = _mm512_set1_ps(lse), vneg = _mm512_set1_ps(-g);
    for (; i < V; i += 16) {
        const int n = V - i < 16 ? (int)(V - i) : 16;
        const __m512 p = exp16_nonpositive(_mm512_sub_ps(load16(row, i, bf16, n), vlse));
        store16(out, i, bf16, n, _mm512_mul_ps(p, vneg));
    }
#else
    if (bf16) {
        uint16_t *o = (uint16_t *)out;
#pragma omp simd
        for (i = 0; i < V; i++) o[i] = f32_to_bf16(-g * exp_nonpositive(logit_at(row, 1, i) - lse));
    } else {
        float *o = (float *)out;
#pragma omp simd
        for (i = 0; i < V; i++) o[i] = -g * exp_nonpositive(logit_at(row, 0, i) - lse);
    }
#endif
    if (y >= 0) {
        const float at = -g * exp_nonpositive(logit_at(row, bf16, y) - lse) + g;
        if (bf16) ((uint16_t *)out)[y] = f32_to_bf16(at);
        else ((float *)out)[y] = at;
    }
}

/* logp (where tokens), lse, entropy (where not NULL) of every row; 0, or -1 on a bad argument */
int posttrain_token_logprobs(long R, long C, long V, long sr, long sc, const void *logits, int bf16,
                             const int64_t *tokens, float *logp, float *lse, float *entropy, int threads) {
    if (V <= 0 || R < 0 || C < 0) return -1;
    const size_t width = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long k = 0; k < R * C; k++) {
        const char *row = (const char *)logits + ((k / C) * sr + (k % C) * sc) * (long)width;
        float m, s, t;
        row_sums(row, bf16, V, &m, &s, &t);
        const float log_s = logf(s);
        const float l = m + log_s;
        if (lse) lse[k] = l;
        if (tokens) logp[k] = logit_at(row, bf16, tokens[k]) - l;
        if (entropy) entropy[k] = log_s - t / s;
    }
    return 0;
}

/* out (R·C rows of V, contiguous, the logits' dtype) = grad · (onehot(token) − softmax) of every row */
int posttrain_token_logprobs_backward(long R, long C, long V, long sr, long sc, const void *logits, int bf16,
                                      const int64_t *tokens, const float *lse, const float *grad, void *out,
                                      int threads) {
    if (V <= 0 || R < 0 || C < 0) return -1;
    const size_t width = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long k = 0; k < R * C; k++) {
        const char *row = (const char *)logits + ((k / C) * sr + (k % C) * sc) * (long)width;
        row_backward(row, bf16, V, tokens[k], lse[k], grad[k], (char *)out + k * V * (long)width);
    }
    return 0;
}

/* The gradient of log-probs read several to a row (`row_token_logprobs`): entry j is token tokens[j] of row
 * rows[j] with gradient grad[j]; the entries of row k are order[starts[k] .. starts[k+1]) (sorted by row).
 * out (K rows of V, contiguous) = −total_k · softmax(row k) + Σ_j grad[j] at tokens[j], total_k = Σ_j grad[j],
 * in fp32 and rounded once (an entry whose token a later entry of its row repeats is summed with it) */
int posttrain_row_logprobs_backward(long K, long V, long stride, const void *logits, int bf16, const float *lse,
                                    const int64_t *starts, const int64_t *order, const int64_t *tokens,
                                    const float *grad, void *out, int threads) {
    if (V <= 0 || K < 0) return -1;
    const size_t width = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long k = 0; k < K; k++) {
        const char *row = (const char *)logits + k * stride * (long)width;
        char *dst = (char *)out + k * V * (long)width;
        float total = 0.0f;
        for (int64_t e = starts[k]; e < starts[k + 1]; e++) total += grad[order[e]];
        row_backward(row, bf16, V, -1, lse[k], total, dst);
        for (int64_t e = starts[k]; e < starts[k + 1]; e++) {
            const int64_t t = tokens[order[e]];
            int seen = 0;
            for (int64_t f = starts[k]; f < e && !seen; f++) seen = tokens[order[f]] == t;
            if (seen) continue;
            float sum = 0.0f;
            for (int64_t f = e; f < starts[k + 1]; f++)
                if (tokens[order[f]] == t) sum += grad[order[f]];
            const float at = -total * exp_nonpositive(logit_at(row, bf16, t) - lse[k]) + sum;
            if (bf16) ((uint16_t *)dst)[t] = f32_to_bf16(at);
            else ((float *)dst)[t] = at;
        }
    }
    return 0;
}

int posttrain_logprobs_vector_path(void) { return USE_AVX512; }
