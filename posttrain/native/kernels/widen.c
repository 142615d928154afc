/* A bf16 tensor widened to fp32 in one streamed pass (posttrain/native/widen.py): a linear's weight gradient,
 * computed by a bf16 matmul under autocast, handed back in its fp32 parameter's dtype.
 *
 * bf16 → fp32 is exact (the 16 bits become the upper half of the 32, NaN payloads included), so this writes
 * what `Tensor.to(torch.float32)` writes, bit for bit (tests/test_native_widen.py). What differs is how: the
 * fp32 output is written with streaming stores, which skip the read-for-ownership of every destination line —
 * a gradient is read next by the clip's norm after the whole backward, long after it left the cache, so
 * nothing is lost by not caching it. Bytes per element: read 2, write 4 (a cached store also reads the 4).
 */
#define CHUNK 65536 /* elements per thread task: a multiple of 16 */

static void widen_span(long lo, long hi, const uint16_t *src, float *dst) {
    long i = lo;
#if USE_AVX512
    /* the streamed stores want 64-byte aligned lines: scalar up to the first one (PyTorch's allocations are) */
    while (i < hi && ((uintptr_t)(dst + i) & 63) != 0) { dst[i] = bf16_to_f32(src[i]); i++; }
    for (; i + 16 <= hi; i += 16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        _mm512_stream_si512((__m512i *)(dst + i), _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    _mm_sfence();
#endif
    for (; i < hi; i++) dst[i] = bf16_to_f32(src[i]);
}

/* dst[i] = fp32(src[i]) for i < n. Returns 0. */
int posttrain_widen_bf16(long n, const uint16_t *src, float *dst, int threads) {
    const long tasks = (n + CHUNK - 1) / CHUNK;
    if (threads <= 1 || tasks <= 1) {
        widen_span(0, n, src, dst);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < tasks; t++) {
        const long lo = t * CHUNK, hi = lo + CHUNK < n ? lo + CHUNK : n;
        widen_span(lo, hi, src, dst);
    }
    return 0;
}

/* 1 where this build runs the AVX-512 loop, 0 for the plain-C one */
int posttrain_widen_vector_path(void) { return USE_AVX512; }
