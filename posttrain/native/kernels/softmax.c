/* The masked softmax of the training attention's matmul path (posttrain/models/prefix_attention.py,
 * `_Softmax`) and its backward, bf16 in and bf16 out, one pass over each row.
 *
 * PyTorch runs the forward as five passes over an fp32 copy of the scores (cast, scale, add the mask,
 * softmax, cast back) and the backward as two; here each row is read once into L1 and written once.
 * The mask of every row is a prefix of its keys: a query attends its prompt's keys then its own causally,
 * and a padding query (past its product's end) its prompt's and all its product's keys. So each row
 * attends keys [0, limit): one count per (product, query), shared by the heads.
 *
 * Layouts (row-major, contiguous): scores, probs, grad, out (M, H, L, S) bf16; limit (M, L) int32 with
 * 0 < limit <= S. The softmax is taken in fp32 over scores · scale (as PyTorch: the max subtracted, then
 * exp, sum and divide), keys at or past the limit get 0. The backward writes
 * scale · p · (g − Σ p·g) with the sum and products in fp32 and one rounding to bf16. S is at most
 * MAX_KEYS (a row's exponentials wait in a stack buffer between the sum and the divide).
 *
 * With AVX2 and FMA the rows run 8 wide (on AVX-512 CPUs too: one vector path, the one tested on the
 * machines that build it), the tail of each row and CPUs without AVX2 in plain C.
 */
#define MAX_KEYS 16384

static inline int row_limit(const int32_t *limit, long r, int H, int L, int S) {
    const long per_product = (long)H * L;
    int lim = limit[(r / per_product) * L + (r % L)];
    return lim < 0 ? 0 : (lim > S ? S : lim);
}

static void softmax_row(const uint16_t *x, int lim, int S, float scale, uint16_t *p, float *buf) {
    if (lim == 0) {
        memset(p, 0, sizeof(uint16_t) * (size_t)S);
        return;
    }
    int i = 0;
    float top = -INFINITY, sum = 0.0f;
#if USE_AVX2
    const __m256 vs = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= lim; i += 8) vmax = _mm256_max_ps(vmax, _mm256_mul_ps(load8_bf16(x + i), vs));
    top = hmax8(vmax);
#endif
    for (; i < lim; i++) {
        const float v = bf16_to_f32(x[i]) * scale;
        top = v > top ? v : top;
    }
    i = 0;
#if USE_AVX2
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    for (; i + 8 <= lim; i += 8) {
        const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_mul_ps(load8_bf16(x + i), vs), vtop));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(buf + i, e);
    }
    sum = hsum8(vsum);
#endif
    for (; i < lim; i++) {
        buf[i] = exp_nonpositive(bf16_to_f32(x[i]) * scale - top);
        sum += buf[i];
    }
    const float inv = 1.0f / sum;
    i = 0;
#if USE_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= lim; i += 8) store8_bf16(p + i, _mm256_mul_ps(_mm256_loadu_ps(buf + i), vinv));
#endif
    for (; i < lim; i++) p[i] = f32_to_bf16(buf[i] * inv);
    if (lim < S) memset(p + lim, 0, sizeof(uint16_t) * (size_t)(S - lim));
}

static void softmax_backward_row(const uint16_t *p, const uint16_t *g, int lim, int S, float scale, uint16_t *out) {
    int i = 0;
    float dot = 0.0f;
#if USE_AVX2
    __m256 vdot = _mm256_setzero_ps();
    for (; i + 8 <= lim; i += 8) vdot = _mm256_fmadd_ps(load8_bf16(p + i), load8_bf16(g + i), vdot);
    dot = hsum8(vdot);
#endif
    for (; i < lim; i++) dot += bf16_to_f32(p[i]) * bf16_to_f32(g[i]);
    i = 0;
#if USE_AVX2
    const __m256 vd = _mm256_set1_ps(dot), vs = _mm256_set1_ps(scale);
    for (; i + 8 <= lim; i += 8) {
        const __m256 pv = _mm256_mul_ps(load8_bf16(p + i), vs);
        store8_bf16(out + i, _mm256_mul_ps(pv, _mm256_sub_ps(load8_bf16(g + i), vd)));
    }
#endif
    for (; i < lim; i++) out[i] = f32_to_bf16(bf16_to_f32(p[i]) * scale * (bf16_to_f32(g[i]) - dot));
    if (lim < S) memset(out + lim, 0, sizeof(uint16_t) * (size_t)(S - lim));
}

/* probs = softmax(scores · scale) over each row's first limit keys, 0 past them; 0, or -1 when S is
 * not in 1..MAX_KEYS */
int posttrain_masked_softmax_bf16(long M, int H, int L, int S, const uint16_t *scores, const int32_t *limit,
                                  float scale, uint16_t *probs, int threads) {
    if (S <= 0 || S > MAX_KEYS) return -1;
    const long rows = M * H * L;
#pragma omp parallel num_threads(threads)
    {
        float buf[MAX_KEYS];
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++)
            softmax_row(scores + r * S, row_limit(limit, r, H, L, S), S, scale, probs + r * S, buf);
    }
    return 0;
}

/* out = scale · probs · (grad − Σ probs · grad) per row over its first limit keys, 0 past them */
int posttrain_masked_softmax_backward_bf16(long M, int H, int L, int S, const uint16_t *probs, const uint16_t *grad,
                                           const int32_t *limit, float scale, uint16_t *out, int threads) {
    if (S <= 0 || S > MAX_KEYS) return -1;
    const long rows = M * H * L;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++)
        softmax_backward_row(probs + r * S, grad + r * S, row_limit(limit, r, H, L, S), S, scale, out + r * S);
    return 0;
}

int posttrain_softmax_vector_path(void) { return USE_AVX2; }

int posttrain_softmax_max_keys(void) { return MAX_KEYS; }
