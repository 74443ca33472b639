/* Fused CPU loop of TopKC's _correct_kernel (hvd_gradcomp/topkc.py, steps 1 and 5).
 *
 * Plain C99, compiled and loaded as csrc/thc.c (torch_backend/kernels/cbuild.py): no -ffast-math,
 * no FMA contraction, so every float operation is the one written here, in its order, and the
 * results do not depend on the vector width the compiler picks.
 *
 * For chunk i and coordinate idx = i chunk + k (the reference's operations, float32, decay
 * rounded to float32 by the caller):
 *   g = flat[idx]; c = g + (decayed ? residual[idx] decay : residual[idx])   (error feedback)
 *                  c = g                                                      (without)
 *   guess = c (blocking), else (decayed ? c decay : c) + g
 *   both 0 in the padding (idx >= d), as the reference's zero tail;
 *   score_i = sqrt(sum of guess**2)**2 (the reference squares a float32 norm), non-finite as 0
 *   when blocking. The sum of squares runs in 16 partial sums combined pairwise (PyTorch sums in
 *   its own order: the scores agree within float32 rounding, not bit for bit).
 * chunks (float32 [m chunk]) is written unless NULL (the caller's view of flat when c = g);
 * guess likewise (NULL when it is chunks: blocking). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define ACC 16

static float squares(const float *restrict v, int64_t n)
{
    float acc[ACC] = {0};
    int64_t i = 0;
    for (; i + ACC <= n; i += ACC)
        for (int k = 0; k < ACC; k++)
            acc[k] = acc[k] + v[i + k] * v[i + k];
    for (int k = 0; k < ACC && i < n; i++, k++)
        acc[k] = acc[k] + v[i] * v[i];
    for (int w = ACC / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++)
            acc[k] = acc[k] + acc[k + w];
    return acc[0];
}

/* One chunk's c and guess over [0, n) (n <= chunk: the real coordinates), flags constant in
 * each call so that every variant is a branch-free loop. */
static inline void correct_run(const float *restrict g, const float *restrict e,
                               float *restrict c_out, float *restrict guess_out, int64_t n,
                               int ef, int decayed, float decay, int blocking)
{
    for (int64_t k = 0; k < n; k++) {
        float gk = g[k];
        float c = ef ? gk + (decayed ? e[k] * decay : e[k]) : gk;
        if (c_out)
            c_out[k] = c;
        if (!blocking)
            guess_out[k] = (decayed ? c * decay : c) + gk;
    }
}

void hgc_topkc_correct(const float *restrict flat, const float *restrict residual, int64_t d,
                       int64_t m, int64_t chunk, int64_t ef, int64_t decayed, float decay,
                       int64_t blocking, float *restrict chunks, float *restrict guess,
                       float *restrict scores)
{
    for (int64_t i = 0; i < m; i++) {
        int64_t base = i * chunk;
        int64_t n = d - base < chunk ? d - base : chunk;
        float *c_out = chunks ? chunks + base : NULL;
        float *g_out = blocking ? NULL : guess + base;
        const float *e = ef ? residual + base : NULL;
        if (ef && decayed)
            correct_run(flat + base, e, c_out, g_out, n, 1, 1, decay, (int)blocking);
        else if (ef)
            correct_run(flat + base, e, c_out, g_out, n, 1, 0, 1.0f, (int)blocking);
        else
            correct_run(flat + base, NULL, c_out, g_out, n, 0, (int)decayed, decay, (int)blocking);
        for (int64_t k = n; k < chunk; k++) { /* the zero tail */
            if (c_out)
                c_out[k] = 0.0f;
            if (g_out)
                g_out[k] = 0.0f;
        }
        /* the scored values: guess, or c when blocking (then flat itself where c = g) */
        const float *v = blocking ? (c_out ? c_out : flat + base) : g_out;
        float s = squares(v, blocking && !c_out ? n : chunk);
        float norm = sqrtf(s);
        float score = norm * norm;
        if (blocking && !isfinite(score))
            score = 0.0f;
        scores[i] = score;
    }
}
