/* STREAM-like bandwidth probe for `derivgen bench` (part of derivgen, not generated). */
#include <stdint.h>

#if defined(__SSE2__) || defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#define DG_PRAGMA(x) _Pragma(#x)
#else
#define DG_PRAGMA(x)
#endif

/* b = a, ordinary stores; bytes moved are counted as 2 * n * sizeof(float) */
void dg_copy(const float *restrict a, float *restrict b, int64_t n, int nthreads)
{
    int nth = nthreads > 0 ? nthreads : 1;
    (void)nth;
    DG_PRAGMA(omp parallel for schedule(static) num_threads(nth))
    for (int64_t i = 0; i < n; ++i) b[i] = a[i];
}

/* b = a with non-temporal (streaming) stores, as the kernels write large outputs;
 * counted as 2 * n * sizeof(float) */
void dg_copy_stream(const float *restrict a, float *restrict b, int64_t n, int nthreads)
{
    int nth = nthreads > 0 ? nthreads : 1;
    const int64_t chunk = 4096;
    (void)nth;
    DG_PRAGMA(omp parallel for schedule(static) num_threads(nth))
    for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
        int64_t i = c * chunk;
        const int64_t e = i + chunk < n ? i + chunk : n;
#if defined(__AVX512F__)
        for (; i < e && ((uintptr_t)(b + i) & 63u) != 0; ++i) b[i] = a[i];
        for (; i + 16 <= e; i += 16) _mm512_stream_ps(b + i, _mm512_loadu_ps(a + i));
#elif defined(__AVX__)
        for (; i < e && ((uintptr_t)(b + i) & 31u) != 0; ++i) b[i] = a[i];
        for (; i + 8 <= e; i += 8) _mm256_stream_ps(b + i, _mm256_loadu_ps(a + i));
#elif defined(__SSE2__)
        for (; i < e && ((uintptr_t)(b + i) & 15u) != 0; ++i) b[i] = a[i];
        for (; i + 4 <= e; i += 4) _mm_stream_ps(b + i, _mm_loadu_ps(a + i));
#endif
        for (; i < e; ++i) b[i] = a[i];
    }
#if defined(__SSE2__) || defined(__AVX__) || defined(__AVX512F__)
    _mm_sfence();
#endif
}
