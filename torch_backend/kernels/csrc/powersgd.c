/* Fused CPU form of PowerSGD's projection basis (hvd_gradcomp/orthogonalize.py, basis_rows):
 * Gram-Schmidt, twice, over the r rows of a small factor, with the reference's guards.
 *
 * Plain C99, compiled by torch_backend/kernels/cbuild.py (no -ffast-math, no FMA contraction)
 * and called through ctypes (torch_backend/kernels/cpu_powersgd.py). Every rank that runs it
 * gets the same bits (a fixed order of operations); against the reference composition the
 * results are within float32 rounding: dot products and norms are summed here in double, in
 * index order, where PyTorch sums float32 in its own order. */
#include <math.h>
#include <stdint.h>

#define TINY 1e-30f
#define HGC_MAX_RANK 64 /* r <= this (cpu_powersgd.py runs the reference above it) */

/* max |x[i]|, NaN if any x[i] is NaN (torch.amax) */
static float peak(const float *x, int64_t n)
{
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        top = (a > top || a != a) ? a : top;
    }
    return top;
}

static double dot(const float *a, const float *b, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += (double)a[i] * (double)b[i];
    return s;
}

/* pt, fillt: float32 [r, n] (row j: column j of P and of the fill); out: float32 [r, n], the
 * basis' columns as rows. For each row j in order (orthogonalize.py's steps):
 *   0. (basis) an exactly zero row (finite peak 0) takes the fill's row instead;
 *   1. scaled by 1 / max(peak, 1e-30) (NaN stays NaN); norm0 = its norm;
 *   2. twice: c_k = <row_k, v> for the rows k < j already made, then v -= sum_k c_k row_k;
 *   3. v *= 1 / max(|v|, 1e-30) if |v| > norm0 rel_tol, else 0 (NaN * 0 stays NaN).
 * Returns 0, or -1 (nothing written) for r > HGC_MAX_RANK. */
int64_t hgc_basis(const float *pt, const float *fillt, int64_t n, int64_t r, float rel_tol, float *out)
{
    if (r > HGC_MAX_RANK)
        return -1; /* nothing written: the caller runs the reference */
    for (int64_t j = 0; j < r; j++) {
        const float *src = pt + j * n;
        float top = peak(src, n);
        if (isfinite(top) && !(top > 0.0f))
            src = fillt + j * n;
        float t = peak(src, n);
        t = (t > TINY || t != t) ? t : TINY; /* torch.maximum: NaN propagates */
        float scale = 1.0f / t;
        float *v = out + j * n;
        for (int64_t i = 0; i < n; i++)
            v[i] = src[i] * scale;
        float norm0 = (float)sqrt(dot(v, v, n));
        for (int pass = 0; pass < 2 && j > 0; pass++) {
            float c[HGC_MAX_RANK]; /* the coefficients from the same v, then the update */
            for (int64_t k = 0; k < j; k++)
                c[k] = (float)dot(out + k * n, v, n);
            for (int64_t i = 0; i < n; i++) {
                double s = 0.0;
                for (int64_t k = 0; k < j; k++)
                    s += (double)out[k * n + i] * (double)c[k];
                v[i] = v[i] - (float)s;
            }
        }
        float norm = (float)sqrt(dot(v, v, n));
        float keep = norm > norm0 * rel_tol ? 1.0f / (norm > TINY ? norm : TINY) : 0.0f;
        for (int64_t i = 0; i < n; i++)
            v[i] = v[i] * keep;
    }
    return 0;
}


/* _agree_kernel (powersgd.py, step 8): payload float32 [len], its last 6 values the all-reduced
 * control (c_e, c_o, S1, S2 of fingerprint 1, S1, S2 of fingerprint 2). keep_out: 1.0f where no
 * spread is > 0 or one is NaN (torch.max propagates NaN, and NaN > 0 is false), else 0.0f;
 * spread = c_e c_o, and S2 ((c_e + c_o) (1 - tol)) - S1 S1 per fingerprint, in float32 as the
 * reference; tol_factor = 1 - tol. ok_out: 1 if the payload's float32 sum is finite, summed
 * here in double: the same verdict but where finite values sum to within float32 rounding of
 * its largest value. */
void hgc_powersgd_agree(const float *payload, int64_t len, float tol_factor, float *keep_out,
                        uint8_t *ok_out)
{
    const float *c = payload + len - 6;
    float ce = c[0], co = c[1];
    float v[3] = {ce * co, 0.0f, 0.0f};
    for (int f = 0; f < 2; f++) {
        float s1 = c[2 + 2 * f], s2 = c[3 + 2 * f];
        v[1 + f] = s2 * ((ce + co) * tol_factor) - s1 * s1;
    }
    int nan = 0, bad = 0;
    for (int i = 0; i < 3; i++) {
        nan |= v[i] != v[i];
        bad |= v[i] > 0.0f;
    }
    *keep_out = (bad && !nan) ? 0.0f : 1.0f;
    double sum = 0.0;
    for (int64_t i = 0; i < len; i++)
        sum += (double)payload[i];
    *ok_out = (uint8_t)(sum == sum && fabs(sum) <= 3.4028234663852886e38);
}
