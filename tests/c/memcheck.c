/* Pure-C driver for valgrind memcheck: calls generated kernels through their
 * headers (no Python), with odd sizes, and frees everything. */
#include <stdio.h>
#include <stdlib.h>

#include "layernorm.h"
#include "batchnorm.h"
#include "online_layernorm.h"

static float *fill(size_t n, float scale)
{
    float *a = malloc(n * sizeof *a);
    for (size_t i = 0; i < n; ++i) a[i] = scale * (float)((i * 7919u) % 101u) / 101.0f - 0.3f;
    return a;
}

int main(void)
{
    int bad = 0;
    {   /* layernorm: 5 rows of 13 */
        const int64_t R = 5, D = 13;
        float *x = fill(R * D, 2.f), *g = fill(D, 1.f), *b = fill(D, 1.f), *dy = fill(R * D, 1.f);
        float *y = malloc(R * D * sizeof *y), *dx = malloc(R * D * sizeof *dx);
        float *dg = malloc(D * sizeof *dg), *db = malloc(D * sizeof *db);
        double *mean = malloc(R * sizeof *mean), *var = malloc(R * sizeof *var), *rstd = malloc(R * sizeof *rstd);
        bad |= layernorm_train_forward_f32(R, 1, D, 1, x, g, b, 1e-5, y, mean, var, rstd, 1);
        bad |= layernorm_train_backward_f32(R, 1, D, 1, x, dy, g, b, 1e-5, mean, var, rstd, dx, dg, db, 1);
        free(x); free(g); free(b); free(dy); free(y); free(dx); free(dg); free(db); free(mean); free(var); free(rstd);
    }
    {   /* batchnorm: N=3, C=4, S=5, training then eval */
        const int64_t N = 3, C = 4, S = 5, n = N * C * S;
        double *x = malloc(n * sizeof *x), *dy = malloc(n * sizeof *dy), *y = malloc(n * sizeof *y), *dx = malloc(n * sizeof *dx);
        double g[4] = {1, 2, 3, 4}, b[4] = {0, 1, 0, 1}, rm[4] = {0}, rv[4] = {1, 1, 1, 1}, dg[4], db[4];
        double mean[4], var[4], rstd[4];
        for (int64_t i = 0; i < n; ++i) { x[i] = (double)(i % 7) - 2.5; dy[i] = (double)(i % 3); }
        bad |= batchnorm_train_forward_f64(N, C, 1, S, x, g, b, 1e-5, 0.1, rm, rv, y, mean, var, rstd, 2);
        bad |= batchnorm_train_backward_f64(N, C, 1, S, x, dy, g, b, 1e-5, 0.1, mean, var, rstd, dx, dg, db, 2);
        bad |= batchnorm_eval_forward_f64(N, C, 1, S, x, g, b, 1e-5, 0.1, rm, rv, y, mean, var, rstd, 2);
        bad |= batchnorm_eval_backward_f64(N, C, 1, S, x, dy, g, b, 1e-5, 0.1, mean, var, rstd, dx, dg, db, 2);
        free(x); free(dy); free(y); free(dx);
    }
    {   /* online layernorm: 3 rows of 6, scalar previous moments */
        const int64_t R = 3, D = 6;
        float *x = fill(R * D, 3.f), *g = fill(D, 1.f), *b = fill(D, 1.f), *dy = fill(R * D, 1.f);
        float pm = 0.1f, ps = 1.2f, y[18], dx[18], dg[6], db[6], dpm[3], dps[3];
        double st[5][3];        /* row_mean, mean, Aux1 = mean((x - mean)^2), sample_std, std */
        bad |= online_layernorm_train_forward_f32(R, 1, D, 1, x, g, b, 0.3, 0.0, &pm, 0, &ps, 0, y,
                                                  st[0], st[1], st[2], st[3], st[4], 1);
        bad |= online_layernorm_train_backward_f32(R, 1, D, 1, x, dy, g, b, 0.3, 0.0, &pm, 0, &ps, 0,
                                                   st[0], st[1], st[2], st[3], st[4], dx, dg, db, dpm, dps, 1);
        free(x); free(g); free(b); free(dy);
    }
    printf("memcheck driver: %s\n", bad ? "kernel error" : "ok");
    return bad != 0;
}
