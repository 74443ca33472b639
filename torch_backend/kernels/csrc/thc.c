/* Fused CPU loops of THC's rotate, quantise and decode kernels (hvd_gradcomp/thc_kernels.py).
 *
 * Plain C99 (plus GCC/clang vector types for the first butterfly stages, with a C99 fallback
 * that gives the same bits), no Python or torch headers: torch_backend/kernels/cpu_thc.py
 * compiles this file once per machine (torch_backend/kernels/cbuild.py: cc -O3 -march=native
 * -ffp-contract=off, no -ffast-math) and calls it through ctypes with the data pointers of
 * contiguous tensors. Each function is one pass over memory for
 * its kernel; the per-coordinate float arithmetic is the reference's, operation for operation, in
 * float32 (the constants arrive already rounded to float32, as PyTorch rounds a Python scalar in
 * a float32 op), except for the Walsh-Hadamard transform, which is a butterfly here and dense
 * 32 x 32 products in the reference (hvd_gradcomp/hadamard.py): same matrix, other roundings.
 *
 * Every float operation is written out in a fixed order and nothing is reassociated (no
 * -ffast-math, no FMA contraction): the compiler may vectorise the loops at any width, but each
 * lane computes the same IEEE operations, so the results are the same bits on every machine
 * (x86 or ARM, SSE2 or AVX-512), and the same on every rank of a job.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Partial sums and maxima kept in this many independent lanes (a fixed number, so that the
 * result does not depend on the vector width the compiler picks). */
#define ACC 16

/* ---- Walsh-Hadamard transform of one block, in place ----
 *
 * Unnormalised, Sylvester order: H_2n = [[H_n, H_n], [H_n, -H_n]], i.e. the stage of stride h
 * maps (x[j], x[j+h]) to (x[j] + x[j+h], x[j] - x[j+h]) for every j with bit h clear. The
 * stages run in ascending order of h, always (they commute only in exact arithmetic); how they
 * are grouped into passes over the block changes no operation: two stages in one radix-4 pass
 * (one load and one store per coordinate for both), and strides 1, 2, 4, 8 inside registers of 16
 * floats where the compiler has __builtin_shufflevector (GCC >= 12, clang), else in scalar
 * code: the same additions and subtractions, the same bits. HGC_SCALAR_WHT forces the scalar
 * form (the tests compare the two). */
#if !defined(HGC_SCALAR_WHT) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define HGC_VECTOR_WHT 16
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u16 __attribute__((vector_size(64)));

/* Strides 1, 2, 4 and 8 on 16 contiguous floats. For stride h, b is v with each pair (j, j+h)
 * swapped and v' is v with the upper element of each pair negated (a sign-bit flip, exact):
 * b + v' is x[j+h] + x[j] = x[j] + x[j+h] in the lower element and x[j] + (-x[j+h]) =
 * x[j] - x[j+h] in the upper one, the scalar form's results bit for bit; one shuffle a stage. */
static void wht16(float *p)
{
#define S 0x80000000u
    const u16 m1 = {0, S, 0, S, 0, S, 0, S, 0, S, 0, S, 0, S, 0, S};
    const u16 m2 = {0, 0, S, S, 0, 0, S, S, 0, 0, S, S, 0, 0, S, S};
    const u16 m4 = {0, 0, 0, 0, S, S, S, S, 0, 0, 0, 0, S, S, S, S};
    const u16 m8 = {0, 0, 0, 0, 0, 0, 0, 0, S, S, S, S, S, S, S, S};
#undef S
    v16 v, b;
    memcpy(&v, p, sizeof v);
    b = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    v = b + (v16)((u16)v ^ m1);
    b = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = b + (v16)((u16)v ^ m2);
    b = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = b + (v16)((u16)v ^ m4);
    b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = b + (v16)((u16)v ^ m8);
    memcpy(p, &v, sizeof v);
}
#endif

/* Strides h and 2h in one pass. */
static void radix4(float *restrict x, int64_t n, int64_t h)
{
    for (int64_t i = 0; i < n; i += 4 * h) {
        float *restrict p = x + i;
        for (int64_t j = 0; j < h; j++) {
            float a = p[j], b = p[j + h], c = p[j + 2 * h], d = p[j + 3 * h];
            float s0 = a + b, d0 = a - b, s1 = c + d, d1 = c - d;
            p[j] = s0 + s1;
            p[j + h] = d0 + d1;
            p[j + 2 * h] = s0 - s1;
            p[j + 3 * h] = d0 - d1;
        }
    }
}

/* Stride h alone. */
static void radix2(float *restrict x, int64_t n, int64_t h)
{
    for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; j++) {
            float a = x[j], b = x[j + h];
            x[j] = a + b;
            x[j + h] = a - b;
        }
}

static void wht(float *restrict x, int64_t n)
{
    int64_t h = 1;
#ifdef HGC_VECTOR_WHT
    if (n >= 16) {
        for (int64_t i = 0; i < n; i += 16)
            wht16(x + i);
        h = 16;
    }
#endif
    for (; 4 * h <= n; h *= 4)
        radix4(x, n, h);
    if (h < n) /* log2(n / h) odd: one stage left, h = n / 2 */
        radix2(x, n, h);
}

/* ---- per-block range (thc_kernels._own_range) ----
 * scale > 0: ||v|| * scale, the norm as float32 sqrt of a float32 sum of squares (it overflows
 * to inf where PyTorch's does: squares beyond float32); scale == 0: max |v|, NaN if any v is
 * NaN (torch.amax propagates NaN). */
static float own_range(const float *restrict v, int64_t n, float scale)
{
    if (scale > 0.0f) {
        float acc[ACC] = {0};
        int64_t i = 0;
        for (; i + ACC <= n; i += ACC)
            for (int k = 0; k < ACC; k++)
                acc[k] = acc[k] + v[i + k] * v[i + k];
        for (int k = 0; k < ACC && i < n; i++, k++)
            acc[k] = acc[k] + v[i] * v[i];
        /* pairwise combination in a fixed order */
        for (int w = ACC / 2; w >= 1; w /= 2)
            for (int k = 0; k < w; k++)
                acc[k] = acc[k] + acc[k + w];
        return sqrtf(acc[0]) * scale;
    }
    float top[ACC];
    for (int k = 0; k < ACC; k++)
        top[k] = 0.0f;
    int64_t i = 0;
    /* a NaN, once taken, stays: (a > NaN) and (a != a) are false for any number a */
    for (; i + ACC <= n; i += ACC)
        for (int k = 0; k < ACC; k++) {
            float a = fabsf(v[i + k]);
            top[k] = (a > top[k] || a != a) ? a : top[k];
        }
    for (int k = 0; k < ACC && i < n; i++, k++) {
        float a = fabsf(v[i]);
        top[k] = (a > top[k] || a != a) ? a : top[k];
    }
    float m = top[0];
    for (int k = 1; k < ACC; k++)
        m = (top[k] > m || top[k] != top[k]) ? top[k] : m;
    return m;
}

/* ---- _rotate_kernel: y = H D pad(x) + e (flushed), held, wanted ----
 *
 * x: float32 [d] (d <= P); diag: float32 [P]; residual: float32 [P] or NULL (no error
 * feedback); y: out float32 [P]; held: out float32 [P] or NULL (no flush bound); wanted: out
 * float32 [nb]. own_scale: T / sqrt(B) rounded to float32 (0: the block peak); flush: the bound
 * factor rounded to float32. Each block is formed in y (in cache), transformed, then finished. */
void hgc_thc_rotate(const float *restrict x, int64_t d, const float *restrict diag, int64_t P,
                    int64_t B, const float *restrict residual, float *restrict y,
                    float *restrict held, float *restrict wanted, float own_scale, float flush)
{
    int64_t nb = P / B;
    for (int64_t b = 0; b < nb; b++) {
        int64_t base = b * B;
        float *restrict yb = y + base;
        const float *restrict db = diag + base;
        int64_t have = d - base;
        have = have < 0 ? 0 : (have > B ? B : have);
        for (int64_t j = 0; j < have; j++)
            yb[j] = x[base + j] * db[j];
        for (int64_t j = have; j < B; j++) /* the padding: 0 * diag, as the reference's pad */
            yb[j] = 0.0f * db[j];
        wht(yb, B);
        if (held) {
            /* step 1's bound: flush x the range the rotated gradient alone wants; none (inf)
             * where that is not positive (no gradient, or NaN) */
            float bound = own_range(yb, B, own_scale) * flush;
            bound = bound > 0.0f ? bound : INFINITY;
            float lo = -bound;
            const float *restrict eb = residual + base;
            float *restrict hb = held + base;
            for (int64_t j = 0; j < B; j++) {
                float e = eb[j];
                float f = e < lo ? lo : e; /* torch.maximum then minimum: NaN stays NaN */
                f = f > bound ? bound : f;
                hb[j] = e - f;
                yb[j] = yb[j] + f;
            }
        } else if (residual) {
            const float *restrict eb = residual + base;
            for (int64_t j = 0; j < B; j++)
                yb[j] = yb[j] + eb[j];
        }
        wanted[b] = own_range(yb, B, own_scale);
    }
}

/* ---- _quantize_kernel: levels in planar lanes, residual, saturation count ----
 *
 * One coordinate k of block b = k / B, column c = k % B (thc_kernels._quantize_kernel):
 *   delta = R_b grid, inv = R_b > 0 ? 1 / max(delta, tiny) : 0, off = R_b > 0 ? off_live : -1
 *   u = y inv + off; saturated += (u < sat_lo) + (u > sat_hi)
 *   q = floor(clamp(u, lo, hi) + bits_as_float(rows[b] ^ cols[c]))
 *   residual = (y - q delta) + R_b [+ held]
 * q converts to int32 as x86's cvttps2dq and PyTorch there do: NaN (a non-finite y, whose
 * levels the "not finite" control word makes unread) becomes INT32_MIN.
 * Word i of the levels holds coordinate j * W + i in lane j (W = ceil(P / lanes) words):
 *   word = sum_j (q << (guard + j width)) - offset, in wrapping 32-bit arithmetic (PyTorch's
 *   int32 shifts and sums; lanes.pack). */
struct qparams {
    float grid, tiny, off_live, lo, hi, sat_lo, sat_hi;
};

#define TILE 256

static inline float bits_to_float(int32_t i)
{
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

/* The per-coordinate loop for one block's part [s, s + n): flags known at compile time in each
 * caller below, so that every variant is a branch-free loop the compiler vectorises. */
static inline int32_t quantize_run(const float *restrict y, const float *restrict held,
                                   float *restrict residual, const int32_t *restrict cb,
                                   int32_t *restrict o, int64_t n, float top, float delta,
                                   float inv, float off, int32_t row, const struct qparams *p,
                                   int keep, int add_held)
{
    int32_t sat = 0;
    float lo = p->lo, hi = p->hi, sat_lo = p->sat_lo, sat_hi = p->sat_hi;
    for (int64_t k = 0; k < n; k++) {
        float v = y[k];
        float u = v * inv + off;
        sat += (u < sat_lo) + (u > sat_hi);
        float c = u < lo ? lo : u; /* torch.clamp: NaN stays NaN */
        c = c > hi ? hi : c;
        float q = floorf(c + bits_to_float(row ^ cb[k]));
        /* NaN as -2**31: x86's conversion of NaN, defined here for every target */
        o[k] = (int32_t)(q == q ? q : -2147483648.0f);
        if (keep) {
            float r = (v - q * delta) + top;
            if (add_held)
                r = r + held[k];
            residual[k] = r;
        }
    }
    return sat;
}

static int64_t quantize_segment(const float *restrict y, const float *restrict held,
                                const float *restrict ranges, int64_t B,
                                const int32_t *restrict rows, const int32_t *restrict cols,
                                float *restrict residual, int64_t start, int64_t end,
                                int32_t *restrict out, const struct qparams *p)
{
    int64_t saturated = 0;
    for (int64_t s = start; s < end;) {
        int64_t b = s / B;
        int64_t e = (b + 1) * B < end ? (b + 1) * B : end;
        float top = ranges[b];
        int live = top > 0.0f;
        float delta = top * p->grid;
        float clamped = delta < p->tiny ? p->tiny : delta; /* clamp_min: NaN stays NaN */
        float inv = live ? 1.0f / clamped : 0.0f;
        float off = live ? p->off_live : -1.0f;
        const int32_t *restrict cb = cols + (s - b * B);
        int32_t *restrict o = out + (s - start);
        if (!residual)
            saturated += quantize_run(y + s, NULL, NULL, cb, o, e - s, top, delta, inv, off, rows[b], p, 0, 0);
        else if (!held)
            saturated += quantize_run(y + s, NULL, residual + s, cb, o, e - s, top, delta, inv, off, rows[b], p,
                                      1, 0);
        else
            saturated += quantize_run(y + s, held + s, residual + s, cb, o, e - s, top, delta, inv, off, rows[b],
                                      p, 1, 1);
        s = e;
    }
    return saturated;
}

int64_t hgc_thc_quantize(const float *restrict y, const float *restrict held,
                         const float *restrict ranges, int64_t P, int64_t B,
                         const int32_t *restrict rows, const int32_t *restrict cols,
                         float *restrict residual, int32_t *restrict words, int64_t lanes,
                         int64_t width, int64_t guard, int64_t offset, float grid, float tiny,
                         float off_live, float lo, float hi, float sat_lo, float sat_hi)
{
    struct qparams p = {grid, tiny, off_live, lo, hi, sat_lo, sat_hi};
    int64_t W = (P + lanes - 1) / lanes, saturated = 0;
    int32_t q[TILE];
    uint32_t acc[TILE];
    for (int64_t i0 = 0; i0 < W; i0 += TILE) {
        int64_t t = W - i0 < TILE ? W - i0 : TILE;
        for (int64_t j = 0; j < lanes; j++) {
            int64_t start = j * W + i0;
            if (start >= P)
                break;
            int64_t end = start + t < P ? start + t : P;
            saturated += quantize_segment(y, held, ranges, B, rows, cols, residual, start, end,
                                          q, &p);
            unsigned shift = (unsigned)(guard + j * width);
            int64_t n = end - start;
            if (j == 0) {
                for (int64_t k = 0; k < n; k++)
                    acc[k] = ((uint32_t)q[k] << shift) - (uint32_t)offset;
            } else {
                for (int64_t k = 0; k < n; k++)
                    acc[k] += (uint32_t)q[k] << shift;
            }
        }
        memcpy(words + i0, acc, (size_t)t * sizeof(int32_t));
    }
    return saturated;
}

/* ---- _decode_kernel: exact sums, lanes, scale, inverse rotation ----
 *
 * payload: the all-reduced int32 words (the first W = ceil(P / lanes) are the levels);
 * summed: 1 (Sum), 0 (Average) or -1 (unknown: *inferred, the count word's verdict);
 * count, bad: int64 0-d; mismatch, inferred: bool 0-d (one byte). For coordinate k in lane j of
 * word i (k = j W + i):
 *   exact = word under Sum; under Average the multiple of 2**guard next to n word away from
 *   zero (lanes.exact_words), plus count offset;
 *   S = (exact >> (guard + j width)) & (2**width - 1)
 *   value = (float(S) - (float(count) half_top + (bad > 0 ? NaN : 0))) (R_b (grid scale))
 *   with scale = mismatch ? 0 : (summed ? 1 : inv_n); then per block out = (H_B value) diag,
 *   times factor (a second float32 rounding, as the reference's separate product) when has_factor.
 * Only coordinates k < D are written to out (D <= P: out may hold just the gradient's d, an
 * engine's bucket slice); a block that crosses D is decoded in scratch and its head copied.
 * S reads bits 0..31 of exact only (guard + lanes width <= 32), so exact is formed modulo 2**32,
 * in uint32: n word rounded to a multiple of 2**guard (up for word >= 0, down for a negative
 * word) has the same low 32 bits as the reference's int64 value (rounding to a multiple of
 * 2**guard < 2**32 commutes with reduction modulo 2**32, and its 2**40 bias is 0 modulo 2**32),
 * and so has the sum with count offset.
 * own (lanes for the other ranks only, lanes.others_words; NULL otherwise): this rank's words as
 * sent, int32 [W]; then S = ((exact - own) >> shift & mask) + (own >> shift & mask), exact and
 * own taken modulo 2**32 (offset 0). */
static inline void decode_run(const int32_t *restrict wp, const int32_t *restrict op, float *restrict o,
                              int64_t m, int exact_as_is, uint32_t n, uint32_t low, uint32_t add,
                              unsigned shift, uint32_t mask, int wide, float offset_f, float a)
{
    for (int64_t k = 0; k < m; k++) {
        uint32_t w = (uint32_t)wp[k], x;
        if (exact_as_is) {
            x = w;
        } else {
            uint32_t nw = w * n;
            x = (wp[k] < 0 ? nw : nw + low) & ~low;
        }
        uint32_t lane;
        if (op) {
            uint32_t mine = (uint32_t)op[k];
            lane = (((x - mine) >> shift) & mask) + ((mine >> shift) & mask);
        } else {
            lane = ((x + add) >> shift) & mask;
        }
        /* a lane below 2**31 converts as int32 (cheaper), a 32-bit lane as unsigned: the same
         * integer, the same correctly rounded float */
        float t = wide ? (float)lane : (float)(int32_t)lane;
        o[k] = (t - offset_f) * a;
    }
}

int32_t hgc_thc_decode(const int32_t *restrict payload, const float *restrict ranges, int64_t P,
                       int64_t D, int64_t B, const float *restrict diag, int64_t lanes, int64_t width,
                       int64_t guard, int64_t offset, int64_t n, int64_t summed,
                       const int64_t *count_p, const int64_t *bad_p, const uint8_t *mismatch_p,
                       const uint8_t *inferred_p, float grid, float half_top, float inv_n,
                       int has_factor, float factor, const int32_t *restrict own, float *restrict out)
{
    int64_t W = (P + lanes - 1) / lanes;
    int is_sum = summed < 0 ? (*inferred_p != 0) : (int)summed;
    int64_t count = *count_p;
    int exact_as_is = is_sum || guard == 0;
    float scale = *mismatch_p ? 0.0f : (is_sum ? 1.0f : inv_n);
    float gs = grid * scale;
    float offset_f = (float)count * half_top + (*bad_p > 0 ? NAN : 0.0f);
    uint32_t add = (uint32_t)((uint64_t)count * (uint64_t)offset);
    uint32_t low = (uint32_t)(((uint64_t)1 << guard) - 1);
    uint32_t mask = width >= 32 ? 0xFFFFFFFFu : (uint32_t)(((uint64_t)1 << width) - 1);
    int wide = width >= 32;
    float *scratch = NULL; /* the block that crosses D, when out stops there */
    if (D < P && D % B) {
        scratch = malloc((size_t)B * sizeof(float));
        if (!scratch)
            return -1;
    }
    for (int64_t b = 0; b * B < D; b++) {
        float a = ranges[b] * gs;
        float *restrict ob = (b + 1) * B <= D ? out + b * B : scratch;
        for (int64_t s = b * B; s < (b + 1) * B;) {
            int64_t j = s / W;
            int64_t e = (j + 1) * W < (b + 1) * B ? (j + 1) * W : (b + 1) * B;
            unsigned shift = (unsigned)(guard + j * width);
            const int32_t *restrict wp = payload + (s - j * W);
            const int32_t *restrict op = own ? own + (s - j * W) : NULL;
            float *restrict o = ob + (s - b * B);
            if (own)
                decode_run(wp, op, o, e - s, exact_as_is, (uint32_t)n, low, add, shift, mask, wide, offset_f, a);
            else if (exact_as_is && !wide)
                decode_run(wp, NULL, o, e - s, 1, (uint32_t)n, low, add, shift, mask, 0, offset_f, a);
            else if (!wide)
                decode_run(wp, NULL, o, e - s, 0, (uint32_t)n, low, add, shift, mask, 0, offset_f, a);
            else
                decode_run(wp, NULL, o, e - s, exact_as_is, (uint32_t)n, low, add, shift, mask, 1, offset_f, a);
            s = e;
        }
        wht(ob, B);
        const float *restrict db = diag + b * B;
        if (has_factor) {
            for (int64_t k = 0; k < B; k++)
                ob[k] = (ob[k] * db[k]) * factor;
        } else {
            for (int64_t k = 0; k < B; k++)
                ob[k] = ob[k] * db[k];
        }
        if (ob == scratch)
            memcpy(out + b * B, scratch, (size_t)(D - b * B) * sizeof(float));
    }
    free(scratch);
    return 0;
}


/* ---- _noise_kernel (rng.bits32 and thc_kernels._noise_bits): step 3's random bits ----
 *
 * For counter i in [0, blocks + block), in uint32 arithmetic (the reference's int64 ops mod
 * 2**32): k = key mod 2**32, x = i + k 0x9E3779B9, h = lowbias32(lowbias32(x) ^ k), bits = h >> 9;
 * rows[i] = bits | 0x3F800000 (i < blocks), cols[i - blocks] = bits (the rest). Integer math:
 * the reference's bits exactly. key: an int64 read here (no host read on the Python side). */
static uint32_t lowbias32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

void hgc_thc_noise(const int64_t *key, int64_t blocks, int64_t block, int32_t *rows, int32_t *cols)
{
    uint32_t k = (uint32_t)((uint64_t)*key & 0xFFFFFFFFu);
    uint32_t offset = k * 0x9E3779B9u;
    for (int64_t i = 0; i < blocks + block; i++) {
        uint32_t bits = lowbias32(lowbias32((uint32_t)i + offset) ^ k) >> 9;
        if (i < blocks)
            rows[i] = (int32_t)(bits | 0x3F800000u);
        else
            cols[i - blocks] = (int32_t)bits;
    }
}

/* ---- the statistics and control words (lanes.py), one call each instead of a dozen ops ----
 *
 * exact_word: lanes.exact_words for one all-reduced word w: w under Sum (or without guard
 * bits); under Average the multiple of 2**guard next to n w away from zero, with the
 * reference's 2**40 bias (so every shift is of a non-negative value). */
static inline int64_t exact_word(int64_t w, int64_t n, int64_t guard, int is_sum)
{
    if (is_sum || guard == 0)
        return w;
    int64_t bias = (int64_t)1 << 40, scaled = w * n + bias;
    int64_t up = ((scaled + (((int64_t)1 << guard) - 1)) >> guard) << guard;
    int64_t down = (scaled >> guard) << guard;
    return (w < 0 ? down : up) - bias;
}

/* lanes.pack_scales after _rotate_kernel's finite check: returns finite (*finite_p, true where
 * finite_p is NULL, and every wanted[b] finite); words: out int32 [ceil(2 nb / lanes)], the (log code, has data) pairs of
 * the nb scales (NULL: none written), pair b as values 2b and 2b + 1, value k in lane k / W of word k % W above
 * guard bits. A pair is (0, 0) unless finite and wanted[b] > 1e-30 (TINY_SCALE); else code =
 * clamp(rint(log2f(wanted[b]) * 4) + 512, 1, 1023), in float32 as the reference (rint rounds
 * half to even, as torch.round; log2f may differ from PyTorch's log2 by rounding). */
int32_t hgc_thc_scales(const float *restrict wanted, int64_t nb, const uint8_t *finite_p,
                       int64_t lanes, int64_t width, int64_t guard, int32_t *restrict words)
{
    int finite = finite_p ? *finite_p != 0 : 1;
    for (int64_t b = 0; b < nb; b++)
        finite &= isfinite(wanted[b]) != 0;
    if (!words) /* range="current": the check alone */
        return finite;
    int64_t m = 2 * nb, W = (m + lanes - 1) / lanes;
    for (int64_t i = 0; i < W; i++)
        words[i] = 0;
    for (int64_t k = 0; k < m; k++) {
        float s = wanted[k / 2];
        int usable = finite && s > 1e-30f;
        uint32_t v = 0;
        if (usable && (k & 1))
            v = 1;
        else if (usable) {
            float c = rintf(log2f(s) * 4.0f) + 512.0f;
            c = c < 1.0f ? 1.0f : (c > 1023.0f ? 1023.0f : c);
            v = (uint32_t)c;
        }
        words[k % W] = (int32_t)((uint32_t)words[k % W] + (v << (guard + (k / W) * width)));
    }
    return finite;
}

/* _quantize_kernel's tail of the payload: the nstats statistics words, then the four control
 * words (1, not finite, s, s**2) << guard, each wrapped to int32 as the reference's cast. */
void hgc_thc_tail(int32_t *restrict out, const int32_t *restrict stats, int64_t nstats,
                  const int64_t *fingerprint, const uint8_t *finite_p, int64_t guard)
{
    if (nstats)
        memcpy(out, stats, (size_t)nstats * sizeof(int32_t));
    int64_t s = *fingerprint;
    int64_t v[4] = {1, *finite_p ? 0 : 1, s, s * s};
    for (int i = 0; i < 4; i++)
        out[nstats + i] = (int32_t)(uint32_t)((uint64_t)v[i] << guard);
}

/* _receive_kernel: tail = the 4 all-reduced control words; counts: out int64 [2] (count, bad);
 * flags: out uint8 [2] (mismatch s2 count != s1**2, inferred "the count word says Sum");
 * summed 1 / 0 / -1 (unknown: the inferred verdict). */
void hgc_thc_receive(const int32_t *restrict tail, int64_t n, int64_t guard, int64_t summed,
                     int64_t *restrict counts, uint8_t *restrict flags)
{
    int inferred = (int64_t)tail[0] > ((int64_t)1 << guard);
    int is_sum = summed < 0 ? inferred : (int)summed;
    int64_t c[4];
    for (int i = 0; i < 4; i++)
        c[i] = exact_word(tail[i], n, guard, is_sum) >> guard;
    counts[0] = c[0];
    counts[1] = c[1];
    flags[0] = c[3] * c[0] != c[2] * c[2];
    flags[1] = (uint8_t)inferred;
}

/* _finish_kernel but for exp2: from the nb pairs of all-reduced statistics words (lanes.
 * agreed_scales: exact words, lanes), e[b] = ((code_sum - have 512) / max(have, 1)) / 4 in
 * float32 (the reference's mean and scale), -inf where no rank had data (exp2 gives 0); and the
 * small fields, fields = (step, realigned, saturated) after the step, ok = bad == 0 (all
 * unchanged when not ok). */
void hgc_thc_finish(const int32_t *restrict words, int64_t nb, int64_t lanes, int64_t width,
                    int64_t guard, int64_t n, int64_t summed, const uint8_t *inferred_p,
                    float *restrict e, const int64_t *step, const int64_t *realigned,
                    const int64_t *saturated, const int64_t *new_saturated, const int64_t *bad,
                    const uint8_t *mismatch_p, int64_t *restrict fields, uint8_t *ok_p)
{
    int is_sum = summed < 0 ? (*inferred_p != 0) : (int)summed;
    int64_t W = (2 * nb + lanes - 1) / lanes, mask = ((int64_t)1 << width) - 1;
    for (int64_t b = 0; b < nb; b++) {
        int64_t v[2];
        for (int t = 0; t < 2; t++) {
            int64_t k = 2 * b + t;
            v[t] = (exact_word(words[k % W], n, guard, is_sum) >> (guard + (k / W) * width)) & mask;
        }
        float code_sum = (float)v[0], have = (float)v[1];
        float mean = (code_sum - have * 512.0f) / (have > 1.0f ? have : 1.0f);
        e[b] = have > 0.5f ? mean * 0.25f : -INFINITY;
    }
    int ok = *bad == 0, mismatch = *mismatch_p != 0;
    fields[0] = ok ? (mismatch ? 0 : *step + 1) : *step;
    fields[1] = ok ? *realigned + mismatch : *realigned;
    fields[2] = ok ? *new_saturated : *saturated;
    *ok_p = (uint8_t)ok;
}

/* ---- _encode_kernel: steps 1-5 in one call (range="previous") ----
 *
 * hgc_thc_rotate, hgc_thc_scales, hgc_thc_noise, hgc_thc_quantize and hgc_thc_tail in turn,
 * the same loops and so the same bits as the five calls, with the statistics written straight
 * into their place in the payload and the per-block scratch (wanted ranges, random rows and
 * columns) allocated here. finite_p: NULL for "finite" (the scheme leaves the check to the
 * block ranges). payload: out int32 [W + nstats + 4]; y: out float32 [P], or NULL (a scratch of
 * its own, freed here: no error feedback keeps it); held, residual_out:
 * out float32 [P] or NULL (no flush bound, no error feedback); saturated_out: out int64, the
 * saturation count. Returns that count, or -1 if the scratch could not be allocated (nothing
 * written then). */
int64_t hgc_thc_encode(const float *restrict x, int64_t d, const float *restrict diag, int64_t P,
                       int64_t B, const float *restrict residual, float *restrict y,
                       float *restrict held, float own_scale, float flush, const uint8_t *finite_p,
                       int64_t s_lanes, int64_t s_width, int64_t s_guard, int64_t nstats, const int64_t *key,
                       const int64_t *fingerprint, const float *restrict ranges,
                       float *restrict residual_out, int32_t *restrict payload, int64_t lanes,
                       int64_t width, int64_t guard, int64_t offset, float grid, float tiny,
                       float off_live, float lo, float hi, float sat_lo, float sat_hi,
                       int64_t *saturated_out)
{
    int64_t nb = P / B, W = (P + lanes - 1) / lanes;
    float *wanted = malloc((size_t)nb * sizeof(float));
    int32_t *rows = malloc((size_t)(nb + B) * sizeof(int32_t));
    float *scratch = y ? NULL : malloc((size_t)P * sizeof(float));
    if (!wanted || !rows || !(y || scratch)) {
        free(wanted);
        free(rows);
        free(scratch);
        return -1;
    }
    if (!y)
        y = scratch;
    hgc_thc_rotate(x, d, diag, P, B, residual, y, held, wanted, own_scale, flush);
    uint8_t finite = finite_p ? *finite_p : 1;
    finite = (uint8_t)hgc_thc_scales(wanted, nb, &finite, s_lanes, s_width, s_guard,
                                     nstats ? payload + W : NULL);
    hgc_thc_noise(key, nb, B, rows, rows + nb);
    int64_t saturated = hgc_thc_quantize(y, held, ranges, P, B, rows, rows + nb, residual_out, payload,
                                         lanes, width, guard, offset, grid, tiny, off_live, lo, hi,
                                         sat_lo, sat_hi);
    hgc_thc_tail(payload + W + nstats, NULL, 0, fingerprint, &finite, guard);
    free(wanted);
    free(rows);
    free(scratch);
    *saturated_out = saturated;
    return saturated;
}
