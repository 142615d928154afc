/* The decode step's work between its matmuls, for the fused decoder (posttrain/rollout/fused.py):
 * the attention of one layer (below), the RMSNorm and the SwiGLU product (at the end).
 *
 * Attention of one decode step (one new token per row) for one layer, in one call.
 *
 * `DecodePlan` (posttrain/rollout/fused.py) calls it once per layer in place of six PyTorch ops: two
 * complex multiplies (RoPE on the new queries and key), a copy (the new value into the cache),
 * `baddbmm` (scores + pad mask), `softmax` and `bmm` (the value sum). Those run the 2 × 64 by 64 × S
 * products of each (row, KV head) as separate small GEMMs and stream the cache from memory at a third of
 * its bandwidth on a 2-core AMD EPYC; here each (row, KV head) is one work item that reads its keys
 * and values once, with the query heads of its GQA group side by side.
 *
 * Layouts (fp32 unless a flag says bf16; all row-major, contiguous):
 *   qkv     (rows, qkv_stride)  the row's projections: hq query heads, hkv keys, hkv values, each d wide,
 *                               rotary pairs side by side (fused.py departure 4)
 *   rot     (rows, d/2, 2)      the row's (cos, sin) per rotary pair at its position
 *   k, v    (cache_rows, hkv, cap, d) the layer's KV cache, fp32 or bf16 (kv_bf16); slot `slot` is written
 *                               here (the key rotated, rounded to bf16 once in a bf16 cache)
 *   row_of  (rows,) int64       the cache row of each row, or NULL for row r = cache row r: finished rows
 *                               leave the batch without copying the cache (compaction is a new row_of)
 *   pk, pv  (cache_rows / share, hkv, plen, d) or NULL (plen 0): keys and values every row reads before
 *                               its own — a prompt's, held once for the `share` samples of it (cache row
 *                               c reads prefix row c / share)
 *   bias    (rows, plen + cap)  0 where the row may attend, -inf at its pads: the prefix's plen slots,
 *                               then the row's own; own slot `slot` must be 0
 *   out     (rows, out_stride)  the attention output, hq heads of d
 *   scratch (threads, scratch_floats(hq / hkv, plen + cap, d))
 * The scores are scaled by `scaling` (the query is, before its products), the softmax subtracts each
 * row's max, and exp is a degree-6 polynomial after Cody–Waite reduction by ln 2 (relative error
 * ~2e-7), 0 below e^-87.3.
 *
 * Built by posttrain/native (for posttrain/rollout/cpu/ckernels.py) with the machine's compiler (-O3 -march=native -fopenmp);
 * OpenMP resolves to the runtime PyTorch already loaded, so both share one thread pool. With AVX-512
 * (F, BW, VL) the loops are vector code written out; without it (or with -DPOSTTRAIN_GENERIC) the
 * same loops are plain C that the compiler vectorises as it can.
 */
/* posttrain/native/kernels/common.h comes first: includes, USE_AVX512, bf16 casts, exp, load16/store16 */

#define MAX_HEAD_DIM 512
#define MAX_GROUP 64
#define PREFETCH_ROWS 8 /* keys/values this many positions ahead are prefetched (AVX-512 path) */
#ifndef WEIGHT_PREFETCH
#define WEIGHT_PREFETCH 64 /* the matmuls prefetch this many k-steps (4 KB) of a column block ahead; 16
                              and 32 measured slower on the AMD EPYC */
#endif


/* One of the row's head vectors (`col` is its first column in qkv), as fp32, rotated and scaled
 * unless `plain`. */
static void load_head(const void *qkv, int qkv_bf16, long qkv_stride, int r, long col, int d,
                      const float *cs, float scale, int plain, float *dst) {
    float src[MAX_HEAD_DIM];
    if (qkv_bf16) {
        const uint16_t *s = (const uint16_t *)qkv + r * qkv_stride + col;
        for (int j = 0; j < d; j++) src[j] = bf16_to_f32(s[j]);
    } else {
        memcpy(src, (const float *)qkv + r * qkv_stride + col, sizeof(float) * (size_t)d);
    }
    if (plain) {
        memcpy(dst, src, sizeof(float) * (size_t)d);
        return;
    }
    for (int j = 0; j < d / 2; j++) {
        float a = src[2 * j], b = src[2 * j + 1], c = cs[2 * j], s = cs[2 * j + 1];
        dst[2 * j] = (a * c - b * s) * scale;
        dst[2 * j + 1] = (a * s + b * c) * scale;
    }
}

#if USE_AVX512
/* lane i of the result: the sum of the 16 lanes of a_i */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    /* per 128-bit chunk, interleaved partial sums of a0 and a1 (of a2 and a3) */
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    /* per chunk, one partial sum of each of a0 … a3 in lanes 0 … 3 */
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

static inline float kv_at(const void *base, long i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The n positions of keys (or values) one row attends to: the first na at `a` (the shared prefix), the rest
 * at `b` (its own cache), `bytes` each. Position t is read wherever it lies, in one loop over all n: the sums
 * are the same, in the same order, as over one cache holding both. */
typedef struct {
    const char *a, *b;
    int na, n;
    long bytes;
} segments;

static inline const char *at(const segments *s, int t) {
    return t < s->na ? s->a + (long)t * s->bytes : s->b + (long)(t - s->na) * s->bytes;
}

/* probabilities p (group × cap, the first K->n of each row) ← softmax(q · Kᵀ + bias); returns 1/Σ per row in inv */
static void scores_softmax(const float *q, const segments *K, int kv_bf16, const float *bias, int group, int d,
                           int cap, float *p, float *inv) {
    const int S = K->n;
#if USE_AVX512
    const int nd = d / 16;
    int t = 0;
    /* four keys at a time: their four dot products are summed across lanes together (`sum4`: 13 operations
     * where four horizontal sums take 32, on four independent chains) */
    for (; t + 4 <= S; t += 4) {
        const char *k0 = at(K, t), *k1 = at(K, t + 1), *k2 = at(K, t + 2), *k3 = at(K, t + 3);
        for (int i = 0; i < 4; i++) {
            const char *ahead = at(K, t + i + PREFETCH_ROWS);  /* past the end: a prefetch never faults */
            for (long c = 0; c < K->bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
        }
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * d;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c = 0; c < nd; c++) {
                const __m512 qc = _mm512_loadu_ps(qg + 16 * c);
                a0 = _mm512_fmadd_ps(qc, load16(k0, 16 * c, kv_bf16, 16), a0);
                a1 = _mm512_fmadd_ps(qc, load16(k1, 16 * c, kv_bf16, 16), a1);
                a2 = _mm512_fmadd_ps(qc, load16(k2, 16 * c, kv_bf16, 16), a2);
                a3 = _mm512_fmadd_ps(qc, load16(k3, 16 * c, kv_bf16, 16), a3);
            }
            _mm_storeu_ps(p + g * cap + t, _mm_add_ps(sum4(a0, a1, a2, a3), _mm_loadu_ps(bias + t)));
        }
    }
    for (; t < S; t++) {
        const char *k = at(K, t), *ahead = at(K, t + PREFETCH_ROWS);
        for (long c = 0; c < K->bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
        for (int g = 0; g < group; g++) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < nd; c++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + 16 * c), load16(k, 16 * c, kv_bf16, 16), a);
            p[g * cap + t] = _mm512_reduce_add_ps(a) + bias[t];
        }
    }
    for (int g = 0; g < group; g++) {
        float *pg = p + g * cap;
        const __mmask16 tail = (__mmask16)((1u << (S % 16)) - 1u);
        const int body = S - S % 16;
        __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int t = 0; t < body; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(pg + t));
        if (tail) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, pg + body));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        for (int t = 0; t < body; t += 16) {
            __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(pg + t), top));
            _mm512_storeu_ps(pg + t, e);
            sum = _mm512_add_ps(sum, e);
        }
        if (tail) {
            __m512 e = _mm512_maskz_mov_ps(tail, exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, pg + body), top)));
            _mm512_mask_storeu_ps(pg + body, tail, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
#else
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * d;
        float *pg = p + g * cap, top = -INFINITY, sum = 0.0f;
        for (int t = 0; t < S; t++) {
            const char *k = at(K, t);
            float s = 0.0f;
            for (int j = 0; j < d; j++) s += qg[j] * kv_at(k, j, kv_bf16);
            pg[t] = s + bias[t];
            top = pg[t] > top ? pg[t] : top;
        }
        for (int t = 0; t < S; t++) {
            pg[t] = exp_nonpositive(pg[t] - top);
            sum += pg[t];
        }
        inv[g] = 1.0f / sum;
    }
#endif
}

#if USE_AVX512
/* `ng` (≤ 4, a compile-time constant after inlining) query heads × 64 values of d from column c0: each value
 * row is loaded once for all of them, and the ng · 4 sums are independent chains */
static inline __attribute__((always_inline)) void value_heads(const int ng, const float *p, const float *inv,
                                                               const segments *V, int kv_bf16, int d, int cap,
                                                               int c0, float *acc) {
    __m512 a[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < ng; g++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) a[g][c] = _mm512_setzero_ps();
    const long col = (long)(16 * c0) << (2 - kv_bf16); /* bytes */
    for (int t = 0; t < V->n; t++) {
        const char *v = at(V, t) + col;
        _mm_prefetch(at(V, t + PREFETCH_ROWS) + col, _MM_HINT_T0);
        __m512 x[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) x[c] = load16(v, 16 * c, kv_bf16, 16);
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) {
            const __m512 w = _mm512_set1_ps(p[(long)g * cap + t]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) a[g][c] = _mm512_fmadd_ps(w, x[c], a[g][c]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < ng; g++) {
        const __m512 s = _mm512_set1_ps(inv[g]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (long)g * d + 16 * (c0 + c), _mm512_mul_ps(a[g][c], s));
    }
}
#endif

/* acc (group × d) ← Σ_t p[g, t] · V[t] · inv[g] */
static void value_sum(const float *p, const float *inv, const segments *V, int kv_bf16, int group, int d, int cap,
                      float *acc) {
    const int S = V->n;
#if USE_AVX512
    const int nd = d / 16;
    if (nd % 4 == 0) { /* up to four query heads at a time, four vectors of d each */
        for (int c0 = 0; c0 < nd; c0 += 4)
            for (int g0 = 0; g0 < group; g0 += 4) {
                const float *pg = p + (long)g0 * cap, *ig = inv + g0;
                float *ag = acc + (long)g0 * d;
                switch (group - g0 < 4 ? group - g0 : 4) {
                    case 1: value_heads(1, pg, ig, V, kv_bf16, d, cap, c0, ag); break;
                    case 2: value_heads(2, pg, ig, V, kv_bf16, d, cap, c0, ag); break;
                    case 3: value_heads(3, pg, ig, V, kv_bf16, d, cap, c0, ag); break;
                    default: value_heads(4, pg, ig, V, kv_bf16, d, cap, c0, ag); break;
                }
            }
        return;
    }
    for (int c0 = 0; c0 < nd; c0 += 4) { /* four vectors of d at a time stay in registers */
        const int nc = nd - c0 < 4 ? nd - c0 : 4;
        const long col = (long)(16 * c0) << (2 - kv_bf16); /* bytes */
        for (int g = 0; g < group; g++) {
            const float *pg = p + g * cap;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int t = 0; t < S; t++) {
                const char *v = at(V, t) + col;
                if (g == 0) _mm_prefetch(at(V, t + PREFETCH_ROWS) + col, _MM_HINT_T0);
                const __m512 w = _mm512_set1_ps(pg[t]);
                a0 = _mm512_fmadd_ps(w, load16(v, 0, kv_bf16, 16), a0);
                if (nc > 1) a1 = _mm512_fmadd_ps(w, load16(v, 16, kv_bf16, 16), a1);
                if (nc > 2) a2 = _mm512_fmadd_ps(w, load16(v, 32, kv_bf16, 16), a2);
                if (nc > 3) a3 = _mm512_fmadd_ps(w, load16(v, 48, kv_bf16, 16), a3);
            }
            const __m512 s = _mm512_set1_ps(inv[g]);
            float *o = acc + g * d + 16 * c0;
            _mm512_storeu_ps(o, _mm512_mul_ps(a0, s));
            if (nc > 1) _mm512_storeu_ps(o + 16, _mm512_mul_ps(a1, s));
            if (nc > 2) _mm512_storeu_ps(o + 32, _mm512_mul_ps(a2, s));
            if (nc > 3) _mm512_storeu_ps(o + 48, _mm512_mul_ps(a3, s));
        }
    }
#else
    for (int g = 0; g < group; g++) {
        float *ag = acc + g * d;
        for (int j = 0; j < d; j++) ag[j] = 0.0f;
        for (int t = 0; t < S; t++) {
            const float w = p[g * cap + t];
            const char *v = at(V, t);
            for (int j = 0; j < d; j++) ag[j] += w * kv_at(v, j, kv_bf16);
        }
        for (int j = 0; j < d; j++) ag[j] *= inv[g];
    }
#endif
}

/* The floats of scratch one thread needs. */
long posttrain_scratch_floats(int group, int cap, int d) {
    return (long)group * (cap + 2L * d);
}

/* 1 when the AVX-512 code was compiled in, 0 for the plain-C loops. */
int posttrain_vector_path(void) {
    return USE_AVX512;
}

/* Returns 0, or -1 when a size is outside what this kernel handles (the caller checks first). */
int posttrain_decode_attention(int rows, int hq, int hkv, int d, int cap, int slot,
                               const void *qkv, int qkv_bf16, long qkv_stride, const float *rot,
                               void *k_cache, void *v_cache, int kv_bf16, const int64_t *row_of,
                               const void *prefix_k, const void *prefix_v, int plen, int share, const float *bias,
                               float scaling, void *out, int out_bf16, long out_stride, float *scratch,
                               int threads) {
    if (hkv <= 0 || hq % hkv || hq / hkv > MAX_GROUP || d > MAX_HEAD_DIM || d % 16 || slot < 0 || slot >= cap
        || plen < 0 || share < 1 || (plen > 0 && (prefix_k == NULL || prefix_v == NULL)))
        return -1;
    const int group = hq / hkv, width = plen + cap;   /* width: a row of bias and of the probabilities */
    const long bytes = (long)d << (2 - kv_bf16);       /* one position of one head */
    const long per_thread = posttrain_scratch_floats(group, width, d);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long item = 0; item < (long)rows * hkv; item++) {
        const int r = (int)(item / hkv), h = (int)(item % hkv);
        const long cr = row_of ? (long)row_of[r] : r;
        float *q = scratch + (long)omp_get_thread_num() * per_thread; /* group × d */
        float *acc = q + (long)group * d;                              /* group × d */
        float *p = acc + (long)group * d;                              /* group × width */
        float inv[MAX_GROUP];
        const float *cs = rot + (long)r * d;
        char *K = (char *)k_cache + (cr * hkv + h) * cap * bytes, *V = (char *)v_cache + (cr * hkv + h) * cap * bytes;
        const long shared = ((cr / share) * hkv + h) * plen * bytes;  /* the prefix row's (KV head)'s first byte */
        const segments keys = {plen ? (const char *)prefix_k + shared : NULL, K, plen, plen + slot + 1, bytes};
        const segments values = {plen ? (const char *)prefix_v + shared : NULL, V, plen, plen + slot + 1, bytes};
        float fresh[2 * MAX_HEAD_DIM];                               /* the new key (rotated) and value */
        for (int g = 0; g < group; g++)
            load_head(qkv, qkv_bf16, qkv_stride, r, (long)(h * group + g) * d, d, cs, scaling, 0, q + g * d);
        load_head(qkv, qkv_bf16, qkv_stride, r, (long)(hq + h) * d, d, cs, 1.0f, 0, fresh);
        load_head(qkv, qkv_bf16, qkv_stride, r, (long)(hq + hkv + h) * d, d, cs, 1.0f, 1, fresh + d);
        for (int j = 0; j < d; j++) {
            if (kv_bf16) {
                ((uint16_t *)K)[(long)slot * d + j] = f32_to_bf16(fresh[j]);
                ((uint16_t *)V)[(long)slot * d + j] = f32_to_bf16(fresh[d + j]);
            } else {
                ((float *)K)[(long)slot * d + j] = fresh[j];
                ((float *)V)[(long)slot * d + j] = fresh[d + j];
            }
        }
        scores_softmax(q, &keys, kv_bf16, bias + (long)r * width, group, d, width, p, inv);
        value_sum(p, inv, &values, kv_bf16, group, d, width, acc);
        for (int g = 0; g < group; g++) {
            const long col = (long)(h * group + g) * d;
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + r * out_stride + col;
                for (int j = 0; j < d; j++) o[j] = f32_to_bf16(acc[g * d + j]);
            } else {
                memcpy((float *)out + r * out_stride + col, acc + (long)g * d, sizeof(float) * (size_t)d);
            }
        }
    }
    return 0;
}


/* x ← h / √(mean h² + eps) per row (the norm's weight is folded into the next matmul, fused.py
 * departure 3); h and x are (rows, hidden), fp32 or bf16 each, arithmetic in fp32. */
int posttrain_rms_norm(int rows, int hidden, const void *h, int h_bf16, float eps, void *x, int x_bf16,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((long)rows * hidden >= 32768)
    for (int r = 0; r < rows; r++) {
        const long base = (long)r * hidden;
#if USE_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; j < hidden; j += 16) {
            __m512 v = load16(h, base + j, h_bf16, hidden - j);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)hidden + eps));
        for (int j = 0; j < hidden; j += 16)
            store16(x, base + j, x_bf16, hidden - j, _mm512_mul_ps(load16(h, base + j, h_bf16, hidden - j), scale));
#else
        float sum = 0.0f;
        for (int j = 0; j < hidden; j++) {
            float v = h_bf16 ? bf16_to_f32(((const uint16_t *)h)[base + j]) : ((const float *)h)[base + j];
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int j = 0; j < hidden; j++) {
            float v = (h_bf16 ? bf16_to_f32(((const uint16_t *)h)[base + j]) : ((const float *)h)[base + j]) * scale;
            if (x_bf16) ((uint16_t *)x)[base + j] = f32_to_bf16(v);
            else ((float *)x)[base + j] = v;
        }
#endif
    }
    return 0;
}

/* act ← silu(gate) · up, where a row of gu (rows, 2·inter) is [gate | up], fp32 or bf16 (act the
 * same), arithmetic in fp32 and one rounding at the end; silu(g) = g / (1 + e^-g), written with
 * e^-|g| so the exponential never overflows. */
int posttrain_silu_mul(int rows, int inter, const void *gu, void *act, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if ((long)rows * inter >= 32768)
    for (int r = 0; r < rows; r++) {
        const long in = (long)r * 2 * inter, out = (long)r * inter;
#if USE_AVX512
        for (int j = 0; j < inter; j += 16) {
            const int n = inter - j;
            __m512 g = load16(gu, in + j, bf16, n), u = load16(gu, in + inter + j, bf16, n);
            __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
            store16(act, out + j, bf16, n, _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(e, _mm512_set1_ps(1.0f))), u));
        }
#else
        for (int j = 0; j < inter; j++) {
            float g = bf16 ? bf16_to_f32(((const uint16_t *)gu)[in + j]) : ((const float *)gu)[in + j];
            float u = bf16 ? bf16_to_f32(((const uint16_t *)gu)[in + inter + j]) : ((const float *)gu)[in + inter + j];
            float e = exp_nonpositive(-fabsf(g));
            float v = (g >= 0.0f ? g : g * e) / (1.0f + e) * u;
            if (bf16) ((uint16_t *)act)[out + j] = f32_to_bf16(v);
            else ((float *)act)[out + j] = v;
        }
#endif
    }
    return 0;
}

/* ---- bf16 matmul for the decode step's projections: y = x·Wᵀ (+ b) (+ y) ------------------------------
 * W (n, k) bf16 is packed once per weight build into blocks of 16 output columns, each block k/2
 * pairs deep: packed[((n / 16)·(k/2) + k/2-index)·32 + (n % 16)·2 + k % 2] (zero columns pad n up to
 * a multiple of 16). One AVX512-BF16 dot-product instruction then multiplies a pair of x's elements,
 * broadcast, by the same pair of 16 columns, accumulating in fp32; up to 16 rows of x share each
 * weight load, so a block of weights is read from memory once per call and from cache for more rows.
 * Threads split the column blocks. The result is rounded to bf16 once (after the bias and, with
 * `accumulate`, the residual it is added to). Requires k even. Without AVX512-BF16 the same layout is
 * multiplied by plain C (for tests; the tuner does not offer it there). */
#if USE_AVX512 && defined(__AVX512BF16__)
#define USE_BF16_DOT 1
#else
#define USE_BF16_DOT 0
#endif

int posttrain_bf16_dot_path(void) {
    return USE_BF16_DOT;
}

/* Elements of a packed (n, k) weight, either dtype: n rounded up to whole blocks of 16 columns. */
long posttrain_packed_elements(int n, int k) {
    return (long)((n + 15) / 16) * 16 * k;
}

/* The engine's bf16 weight copies (fused.py: refresh): out (rows, cols) bf16 ← row src_rows[r] (r when NULL) of
 * the fp32 weight w (·, cols), times norm (cols) where not NULL — the norm weight folded into the columns —
 * each product rounded once to bf16, to nearest even: the bits torch.mul(w, norm, out=<bf16>) and a bf16 cast
 * write (NaN stays NaN, not PyTorch's one NaN pattern). One pass, where PyTorch's mixed-dtype multiply reads
 * the fp32 weight at ~6 GB/s. */
int posttrain_fold_bf16(int rows, int cols, const float *w, const int64_t *src_rows, const float *norm,
                        uint16_t *out, int threads) {
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int r = 0; r < rows; r++) {
            const float *src = w + (src_rows ? src_rows[r] : (int64_t)r) * (long)cols;
            uint16_t *dst = out + (long)r * cols;
            int c = 0;
#if USE_AVX512
            if (((uintptr_t)dst & 31) == 0)  /* whole aligned halves of lines, streamed: no read of what they replace */
                for (; c + 16 <= cols; c += 16) {
                    __m512 v = _mm512_loadu_ps(src + c);
                    if (norm) v = _mm512_mul_ps(v, _mm512_loadu_ps(norm + c));
                    _mm256_stream_si256((__m256i *)(dst + c), _mm512_cvtepi32_epi16(round16_bf16(v)));
                }
            for (; c < cols; c += 16) {
                const int n = cols - c < 16 ? cols - c : 16;
                __m512 v = load16(src, c, 0, n);
                if (norm) v = _mm512_mul_ps(v, load16(norm, c, 0, n));
                store16(dst, c, 1, n, v);
            }
#endif
            for (; c < cols; c++) dst[c] = f32_to_bf16(norm ? src[c] * norm[c] : src[c]);
        }
#if USE_AVX512
        _mm_sfence();  /* this thread's streamed stores land before the caller reads them */
#endif
    }
    return 0;
}

/* A 32-bit word of a weight's storage: a bf16 pair or a float, read and written whole (may_alias: the storage
 * is bf16 or float; aligned(2): a bf16 pair need not start on 4 bytes) */
typedef uint32_t __attribute__((may_alias, aligned(2))) word32;

#if USE_AVX512
/* r[c] ← column c of the 16 × 16 matrix of 32-bit words whose row j is r[j] (in 128-bit lanes: 32-bit then
 * 64-bit interleaves transpose each lane's 4 × 4 blocks, then two rounds of lane shuffles move the blocks) */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int j = 0; j < 16; j += 2) {
        t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {  /* r[j + m], lane L: word 4L + m of rows j … j + 3 */
        r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
        r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
        r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
        r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    for (int m = 0; m < 4; m++) {  /* column 4L + m: lane L of r[m], r[4 + m], r[8 + m], r[12 + m] */
        const __m512i y0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), y1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
        const __m512i y2 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44), y3 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
        t[m] = _mm512_shuffle_i32x4(y0, y2, 0x88);
        t[4 + m] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
        t[8 + m] = _mm512_shuffle_i32x4(y1, y3, 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
    }
    for (int j = 0; j < 16; j++) r[j] = t[j];
}

/* Lines first … first + 15 of a packed block (16 words each: word j from row j, 0 where src[j] is NULL) from
 * words first … first + 15 of the 16 rows `src` (32-bit words: a bf16 pair, or a float). */
static inline void pack_lines16(const word32 *const src[16], long first, word32 *dst, int stream) {
    __m512i r[16];
    for (int j = 0; j < 16; j++) r[j] = src[j] ? _mm512_loadu_si512((const void *)(src[j] + first)) : _mm512_setzero_si512();
    transpose16(r);
    if (stream)  /* whole aligned lines past the caches: no read of the lines they replace */
        for (int c = 0; c < 16; c++) _mm512_stream_si512((void *)(dst + (first + c) * 16), r[c]);
    else
        for (int c = 0; c < 16; c++) _mm512_storeu_si512((void *)(dst + (first + c) * 16), r[c]);
}
#endif

/* Packed block b, lines 0 … words − 1: line i holds word i of rows 16b … 16b + 15 of w (rows of `words` 32-bit
 * words: bf16 pairs or floats; rows past n read as 0). */
static void pack_block(int n, long words, const word32 *w, int b, word32 *dst) {
    const word32 *src[16];
    for (int j = 0; j < 16; j++) src[j] = b * 16 + j < n ? w + (long)(b * 16 + j) * words : NULL;
    long i = 0;
#if USE_AVX512
    const int stream = ((uintptr_t)dst & 63) == 0;
    for (; i + 16 <= words; i += 16) pack_lines16(src, i, dst, stream);  /* 16 lines at a time: a register transpose */
    if (stream) _mm_sfence();
#endif
    for (; i < words; i++)
        for (int j = 0; j < 16; j++) dst[i * 16 + j] = src[j] ? src[j][i] : 0u;
}

int posttrain_pack_bf16(int n, int k, const uint16_t *w, uint16_t *packed, int threads) {
    if (k % 2) return -1;
    const int blocks = (n + 15) / 16, pairs = k / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; b++)
        pack_block(n, pairs, (const word32 *)w, b, (word32 *)(packed + (long)b * pairs * 32));
    return 0;
}

#if USE_BF16_DOT
/* rows R (≤ 8, a compile-time constant after inlining) × `nb` (1 or 2) blocks of 16 columns: each
 * broadcast pair of x feeds 2 dot products, each weight load R. Prefetches: `ahead`, this pass's own
 * weights WEIGHT_PREFETCH k-steps ahead into L1; `next` (or NULL), the next two blocks into L2 — two cache
 * lines a k-step, as much as the next pass of two blocks reads (x86 prefetches never fault, so the last
 * pass of a matrix may name lines past its end). */
static inline __attribute__((always_inline)) void gemm_block(const int R, const int nb, int pairs, const uint16_t *x,
                                                              long x_stride, const uint16_t *wb, long w_step,
                                                              const int ahead, const uint16_t *next, __m512 *acc) {
#pragma GCC unroll 16
    for (int m = 0; m < 2 * R; m++) acc[m] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        if (ahead) {
            _mm_prefetch((const char *)(wb + (long)(p + WEIGHT_PREFETCH) * 32), _MM_HINT_T0);
            if (nb > 1) _mm_prefetch((const char *)(wb + w_step + (long)(p + WEIGHT_PREFETCH) * 32), _MM_HINT_T0);
        }
        if (next) {
            _mm_prefetch((const char *)(next + (long)p * 64), _MM_HINT_T1);
            _mm_prefetch((const char *)(next + (long)p * 64 + 32), _MM_HINT_T1);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wb + (long)p * 32));
        const __m512bh w1 = nb > 1 ? (__m512bh)_mm512_loadu_si512((const void *)(wb + w_step + (long)p * 32)) : w0;
#pragma GCC unroll 8
        for (int m = 0; m < R; m++) {
            int32_t pair;
            memcpy(&pair, x + m * x_stride + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[m] = _mm512_dpbf16_ps(acc[m], xb, w0);
            if (nb > 1) acc[R + m] = _mm512_dpbf16_ps(acc[R + m], xb, w1);
        }
    }
}

/* Rows 0 … R − 1 of column block `b` of the output: out[m] (+)= acc[m] + bias, rounded to bf16 once (the
 * columns past n are not written). Shared by both bf16 matmuls. */
static inline void store_block(const int R, const __m512 *acc, int n, int b, const uint16_t *bias, uint16_t *out,
                               long out_stride, int accumulate) {
    const int c = n - b * 16 < 16 ? n - b * 16 : 16;
    const __mmask16 live = (__mmask16)(c == 16 ? 0xffffu : (1u << c) - 1u);
    const __m512 bv = bias ? load16(bias, (long)b * 16, 1, c) : _mm512_setzero_ps();
    for (int m = 0; m < R; m++) {
        uint16_t *o = out + (long)m * out_stride + (long)b * 16;
        __m512 y = _mm512_add_ps(acc[m], bv);
        if (accumulate) y = _mm512_add_ps(y, load16(o, 0, 1, c));
        _mm256_mask_storeu_epi16(o, live, (__m256i)_mm512_cvtneps_pbh(y));
    }
}

static void gemm_rows(int R, int nb, int pairs, const uint16_t *x, long x_stride, const uint16_t *wb, long w_step,
                      int ahead, const uint16_t *next, __m512 *acc) {
#define CASE(r)                                                                                \
    case r:                                                                                    \
        if (nb > 1) gemm_block(r, 2, pairs, x, x_stride, wb, w_step, ahead, next, acc);        \
        else gemm_block(r, 1, pairs, x, x_stride, wb, w_step, ahead, next, acc);               \
        break;
    switch (R) { /* one specialisation per row count, so the accumulators stay in registers */
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        default: break;
    }
#undef CASE
}
#endif

int posttrain_gemm_bf16(int rows, int n, int k, const uint16_t *x, long x_stride, const uint16_t *packed,
                        const uint16_t *bias, uint16_t *out, long out_stride, int accumulate, int threads) {
    if (k % 2) return -1;
    const int blocks = (n + 15) / 16, pairs = k / 2;
#if USE_BF16_DOT
    const int pairs_of_blocks = (blocks + 1) / 2;
    const long w_step = (long)pairs * 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int pb = 0; pb < pairs_of_blocks; pb++) {
        const int b = 2 * pb, nb = b + 1 < blocks ? 2 : 1;
        const uint16_t *wb = packed + (long)b * pairs * 32;
        /* Two blocks of weights are read once per 8 rows: the first pass from memory, the rest from cache.
         * The next two blocks are fetched into L2 during the second pass (during the only one, from up to 8
         * rows), so the next first pass does not wait on memory: tiny-30m's decode matmuls at 16 rows,
         * weights streaming, 6.9 → 5.1–5.5 ms a pass, at 8 rows 4.4 → 2.7–2.9 (docs/performance.md). */
        const uint16_t *next = pb + 1 < pairs_of_blocks ? wb + 2 * w_step : NULL;
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const int R = rows - r0 < 8 ? rows - r0 : 8;
            __m512 acc[16];
            gemm_rows(R, nb, pairs, x + (long)r0 * x_stride, x_stride, wb, w_step, r0 == 0,
                      (r0 == 8 || rows <= 8) ? next : NULL, acc);
            for (int q = 0; q < nb; q++)
                store_block(R, acc + q * R, n, b + q, bias, out + (long)r0 * out_stride, out_stride, accumulate);
        }
    }
#else
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; b++) {
        const uint16_t *wb = packed + (long)b * pairs * 32;
        const int cols = n - b * 16 < 16 ? n - b * 16 : 16;
        for (int m = 0; m < rows; m++) {
            for (int j = 0; j < cols; j++) {
                float s = 0.0f;
                for (int p = 0; p < pairs; p++)
                    s += bf16_to_f32(x[(long)m * x_stride + 2 * p]) * bf16_to_f32(wb[(long)p * 32 + 2 * j])
                       + bf16_to_f32(x[(long)m * x_stride + 2 * p + 1]) * bf16_to_f32(wb[(long)p * 32 + 2 * j + 1]);
                uint16_t *o = out + (long)m * out_stride + (long)b * 16 + j;
                if (bias) s += bf16_to_f32(bias[(long)b * 16 + j]);
                if (accumulate) s += bf16_to_f32(*o);
                *o = f32_to_bf16(s);
            }
        }
    }
#endif
    return 0;
}

/* ---- the same bf16 matmul on AMX tiles (Intel Xeon, Sapphire Rapids and later): form `amx` ----------------
 * A packed block's pair lines (16 columns × one bf16 pair, 64 bytes) are the rows of an AMX B tile, so the
 * layout above serves both kernels. Each thread takes groups of 4 column blocks; per group and per 16 rows,
 * tiles 0–3 accumulate the 4 blocks' (≤ 16 rows × 16 columns) fp32 sums, tile 4 holds ≤ 16 rows × 32 k of x,
 * tiles 5–7 the blocks' next 16 pairs (one `tdpbf16ps` multiplies 16 pairs deep). A k not a multiple of 32
 * ends with its last < 16 pairs on the AVX512-BF16 dot products. Weights are read once per 16 rows. Sums are
 * fp32 in another order than the AVX-512 kernel's; the epilogue (bias, residual, one rounding) is the same.
 * `posttrain_amx_path` asks Linux for the tile state once per process (`arch_prctl`, which fails where the CPU
 * has no AMX): 0 where it refuses or the build has no AMX, and the matmul then returns -1. */
#if USE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define USE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define USE_AMX 0
#endif

int posttrain_amx_path(void) {
#if USE_AMX
    static int ready = -1;  /* a race here only asks twice: the permission is the process's */
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return ready;
#else
    return 0;
#endif
}

#if USE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* Tiles for M rows: 0–3 sums (M × 16 fp32), 4 x (M × 32 bf16), 5–7 weights (16 pair lines). Loading a
 * configuration zeroes every tile. */
static void amx_configure(int M) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 5 ? (uint8_t)M : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* sums[q][m] += the last `rest` pairs (from pair `first`) of row m of x times block q, on AVX512-BF16 */
static void amx_rest(int nb, int M, int first, int rest, const uint16_t *x, long x_stride, const uint16_t *wb,
                     long w_step, float sums[4][16][16]) {
    for (int q = 0; q < nb; q++)
        for (int m = 0; m < M; m++) {
            __m512 acc = _mm512_load_ps(sums[q][m]);
            for (int p = first; p < first + rest; p++) {
                int32_t pair;
                memcpy(&pair, x + m * x_stride + 2 * p, sizeof pair);
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair),
                                       (__m512bh)_mm512_loadu_si512((const void *)(wb + q * w_step + (long)p * 32)));
            }
            _mm512_store_ps(sums[q][m], acc);
        }
}
#endif

int posttrain_gemm_bf16_amx(int rows, int n, int k, const uint16_t *x, long x_stride, const uint16_t *packed,
                            const uint16_t *bias, uint16_t *out, long out_stride, int accumulate, int threads) {
#if USE_AMX
    if (k % 2 || !posttrain_amx_path()) return -1;
    const int blocks = (n + 15) / 16, pairs = k / 2, steps = pairs / 16, groups = (blocks + 3) / 4;
    const long w_step = (long)pairs * 32, xb = x_stride * 2;  /* a block's elements; x's row stride in bytes */
#pragma omp parallel num_threads(threads)
    {
        float sums[4][16][16] __attribute__((aligned(64)));
        int configured = 0;
#pragma omp for schedule(static)
        for (int gi = 0; gi < groups; gi++) {
            const int b0 = 4 * gi, nb = blocks - b0 < 4 ? blocks - b0 : 4;
            const uint16_t *wb = packed + (long)b0 * w_step;
            for (int r0 = 0; r0 < rows; r0 += 16) {
                const int M = rows - r0 < 16 ? rows - r0 : 16;
                const uint16_t *xr = x + (long)r0 * x_stride;
                if (M != configured) {
                    amx_configure(M);
                    configured = M;
                }
                if (nb == 4) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int s = 0; s < steps; s++) {
                        const uint16_t *w = wb + (long)s * 512;  /* 16 pair lines of 32 */
                        _tile_loadd(4, xr + 32 * s, xb);
                        _tile_loadd(5, w, 64);
                        _tile_dpbf16ps(0, 4, 5);
                        _tile_loadd(6, w + w_step, 64);
                        _tile_dpbf16ps(1, 4, 6);
                        _tile_loadd(7, w + 2 * w_step, 64);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_loadd(5, w + 3 * w_step, 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                    _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
                    _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64);
                } else {
                    for (int q = 0; q < nb; q++) {
                        _tile_zero(0);
                        for (int s = 0; s < steps; s++) {
                            _tile_loadd(4, xr + 32 * s, xb);
                            _tile_loadd(5, wb + q * w_step + (long)s * 512, 64);
                            _tile_dpbf16ps(0, 4, 5);
                        }
                        _tile_stored(0, sums[q], 64);
                    }
                }
                if (pairs % 16) amx_rest(nb, M, 16 * steps, pairs % 16, xr, x_stride, wb, w_step, sums);
                for (int q = 0; q < nb; q++) {
                    __m512 acc[16];
                    for (int m = 0; m < M; m++) acc[m] = _mm512_load_ps(sums[q][m]);
                    store_block(M, acc, n, b0 + q, bias, out + (long)r0 * out_stride, out_stride, accumulate);
                }
            }
        }
        if (configured) _tile_release();
    }
    return 0;
#else
    (void)rows; (void)n; (void)k; (void)x; (void)x_stride; (void)packed; (void)bias; (void)out; (void)out_stride;
    (void)accumulate; (void)threads;
    return -1;
#endif
}

/* ---- fp32 matmul, the same scheme: y = x·Wᵀ (+ b) (+ y) -------------------------------------------------
 * W (n, k) fp32 packed in blocks of 16 output columns: packed[((n / 16)·k + k-index)·16 + n % 16]. One
 * FMA multiplies a broadcast element of x by 16 columns; up to 8 rows share each weight load, two
 * column blocks at a time. Without AVX-512 the same layout is multiplied by plain C. */
int posttrain_pack_f32(int n, int k, const float *w, float *packed, int threads) {
    const int blocks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; b++)
        pack_block(n, k, (const word32 *)w, b, (word32 *)(packed + (long)b * k * 16));
    return 0;
}

#if USE_AVX512
static inline __attribute__((always_inline)) void gemm_f32_block(const int R, const int nb, int k, const float *x,
                                                                  long x_stride, const float *wb, long w_step,
                                                                  __m512 *acc) {
#pragma GCC unroll 16
    for (int m = 0; m < 2 * R; m++) acc[m] = _mm512_setzero_ps();
    for (int i = 0; i < k; i++) {
        _mm_prefetch((const char *)(wb + (long)(i + WEIGHT_PREFETCH) * 16), _MM_HINT_T0);
        if (nb > 1) _mm_prefetch((const char *)(wb + w_step + (long)(i + WEIGHT_PREFETCH) * 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wb + (long)i * 16);
        const __m512 w1 = nb > 1 ? _mm512_loadu_ps(wb + w_step + (long)i * 16) : w0;
#pragma GCC unroll 8
        for (int m = 0; m < R; m++) {
            const __m512 xb = _mm512_set1_ps(x[m * x_stride + i]);
            acc[m] = _mm512_fmadd_ps(xb, w0, acc[m]);
            if (nb > 1) acc[R + m] = _mm512_fmadd_ps(xb, w1, acc[R + m]);
        }
    }
}

static void gemm_f32_rows(int R, int nb, int k, const float *x, long x_stride, const float *wb, long w_step,
                          __m512 *acc) {
#define CASE(r)                                                                \
    case r:                                                                    \
        if (nb > 1) gemm_f32_block(r, 2, k, x, x_stride, wb, w_step, acc);     \
        else gemm_f32_block(r, 1, k, x, x_stride, wb, w_step, acc);            \
        break;
    switch (R) {
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        default: break;
    }
#undef CASE
}
#endif

int posttrain_gemm_f32(int rows, int n, int k, const float *x, long x_stride, const float *packed,
                       const float *bias, float *out, long out_stride, int accumulate, int threads) {
    const int blocks = (n + 15) / 16;
#if USE_AVX512
    const int pairs_of_blocks = (blocks + 1) / 2;
    const long w_step = (long)k * 16;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int pb = 0; pb < pairs_of_blocks; pb++) {
        const int b = 2 * pb, nb = b + 1 < blocks ? 2 : 1;
        const float *wb = packed + (long)b * k * 16;
        for (int r0 = 0; r0 < rows; r0 += 8) {
            const int R = rows - r0 < 8 ? rows - r0 : 8;
            __m512 acc[16];
            gemm_f32_rows(R, nb, k, x + (long)r0 * x_stride, x_stride, wb, w_step, acc);
            for (int q = 0; q < nb; q++) {
                const int c = n - (b + q) * 16 < 16 ? n - (b + q) * 16 : 16;
                const __mmask16 live = (__mmask16)(c == 16 ? 0xffffu : (1u << c) - 1u);
                const __m512 bv = bias ? _mm512_maskz_loadu_ps(live, bias + (long)(b + q) * 16) : _mm512_setzero_ps();
                for (int m = 0; m < R; m++) {
                    float *o = out + (long)(r0 + m) * out_stride + (long)(b + q) * 16;
                    __m512 y = _mm512_add_ps(acc[q * R + m], bv);
                    if (accumulate) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(live, o));
                    _mm512_mask_storeu_ps(o, live, y);
                }
            }
        }
    }
#else
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; b++) {
        const float *wb = packed + (long)b * k * 16;
        const int cols = n - b * 16 < 16 ? n - b * 16 : 16;
        for (int m = 0; m < rows; m++) {
            for (int j = 0; j < cols; j++) {
                float s = 0.0f;
                for (int i = 0; i < k; i++) s += x[(long)m * x_stride + i] * wb[(long)i * 16 + j];
                float *o = out + (long)m * out_stride + (long)b * 16 + j;
                *o = s + (bias ? bias[(long)b * 16 + j] : 0.0f) + (accumulate ? *o : 0.0f);
            }
        }
    }
#endif
    return 0;
}
