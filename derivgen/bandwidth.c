/* STREAM-like bandwidth probe for `derivgen bench` (part of derivgen, not generated). */
#include <stdint.h>

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

/* a = b + s * c, ordinary stores; counted as 3 * n * sizeof(float) */
void dg_triad(float *restrict a, const float *restrict b, const float *restrict c, float s, int64_t n, int nthreads)
{
    int nth = nthreads > 0 ? nthreads : 1;
    (void)nth;
    DG_PRAGMA(omp parallel for schedule(static) num_threads(nth))
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}
