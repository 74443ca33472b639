/* Fused CPU loops of signSGD's encode (with the last step's residual), receive and decode kernels
 * (hvd_gradcomp/signsgd_kernels.py; the steps are hvd_gradcomp/signsgd.py's module docstring).
 *
 * Plain C99, no Python or torch headers: torch_backend/kernels/cpu_signsgd.py compiles this file
 * once per machine (torch_backend/kernels/cbuild.py: cc -O3 -march=native -ffp-contract=off, no
 * -ffast-math) and calls it through ctypes with the data pointers of contiguous tensors. Every
 * float operation is the reference's, in float32, written out in a fixed order (no FMA
 * contraction, nothing reassociated), so the results are the same bits at any vector width and
 * on every rank; only the per-block sums |p| add up in another order than PyTorch's sum (16
 * partial sums per block's part of a run, coordinate k into partial k % 16, combined pairwise,
 * runs in a fixed order). Plain stores but for p (NT_MIN, NT_MAX).
 *
 * Layouts (hvd_gradcomp/lanes.py): the P sign bits sit planar in W = ceil(P / lanes) int32
 * words, coordinate k in lane k / W of word k % W, at bit guard + (k / W) width; the nb (code,
 * has data) pairs likewise in the statistics words (value 2b + t in lane (2b + t) / Ws of word
 * (2b + t) % Ws); then the control words 1 << guard (contributes) and bad << guard.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__) || defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ACC 16   /* partial sums a block's part of a run, coordinate k into partial k % ACC (a fixed
                  * number: results independent of the vector width) */
#define TILE 16384 /* sign words an encode tile (64 KiB of the payload, in L2): each lane's TILE
                    * coordinates of a tile are contiguous, so each lane's streams of g, e and p
                    * (3 x lanes streams) run 64 KiB before they jump (at 256 words the jumps
                    * cost about a third of the encode) */
#define DTILE 4096 /* words a decode tile: their exact values on the stack (16 KiB) */
#define NT_MIN (1 << 20) /* coordinates: the encode's p, when at least this long (4 MiB, twice L2),
                          * is written with non-temporal stores, 64 bytes at a time where they are
                          * aligned (nothing reads p before the next step's encode): a store that
                          * first reads its line (read for ownership) from memory costs about three
                          * times a plain read here (one thread, AMD EPYC: 26 MB read 1.9 ms, read
                          * and written in place 2.2, read into another array 8-12, into another
                          * with streaming stores 2.9). Not the decode's output: the engine reads
                          * its bucket right after, from cache where plain stores left it. */
#define NT_MAX (1 << 23) /* coordinates: nor a p above 32 MiB, glibc's largest mmap threshold: such a
                          * buffer comes fresh from mmap at each allocation, each page just zeroed by
                          * the kernel and in cache, where streaming stores cost more than plain
                          * ones (38 MB of fresh pages written: 25-28 ms against 16-19 here) */

/* 16 floats of v to dst (64-byte aligned): non-temporal where the target has such stores, the same
 * values either way; fence() orders them before the kernel returns. 32 bytes a store even with
 * AVX-512: the compiler computes v in 32-byte vectors (its preferred width), and a 64-byte load of
 * two such stores cannot take their data (the encode on 6.5M coordinates: 4.7-4.9 ms this way,
 * 5.0-5.2 with 64-byte stores). */
static inline void put16(float *restrict dst, const float *restrict v)
{
#if defined(__AVX__)
    _mm256_stream_ps(dst, _mm256_loadu_ps(v));
    _mm256_stream_ps(dst + 8, _mm256_loadu_ps(v + 8));
#elif defined(__SSE2__)
    for (int q = 0; q < 16; q += 4)
        _mm_stream_ps(dst + q, _mm_loadu_ps(v + q));
#else
    memcpy(dst, v, 16 * sizeof(float));
#endif
}

static inline void fence(void)
{
#if defined(__SSE2__) || defined(__AVX__) || defined(__AVX512F__)
    _mm_sfence();
#endif
}

/* lanes.exact_words of one all-reduced word, modulo 2**32: the word under Sum (or without guard
 * bits); under Average the multiple of 2**guard next to n w away from zero (w >= 0 here: the
 * lanes are uncentred, every sum is non-negative; a negative word rounds down, as there). */
static inline uint32_t exact32(int32_t w, uint32_t n, uint32_t low, int as_is)
{
    if (as_is)
        return (uint32_t)w;
    uint32_t nw = (uint32_t)w * n;
    return (w < 0 ? nw : nw + low) & ~low;
}

/* The exact 64-bit value, for the control words (lanes.read_control). */
static inline int64_t exact64(int64_t w, int64_t n, int64_t guard, int as_is)
{
    if (as_is || guard == 0)
        return w;
    int64_t bias = (int64_t)1 << 40, scaled = w * n + bias;
    int64_t up = ((scaled + (((int64_t)1 << guard) - 1)) >> guard) << guard;
    int64_t down = (scaled >> guard) << guard;
    return (w < 0 ? down : up) - bias;
}

/* p = x (+ e) over [0, m) of one block's part of a run, whose first coordinate is lo, e being
 * step 6's residual of the kept p' (q) and its block's S' (s): e = (q + s) - [q >= 0] (s 2), as
 * signsgd_kernels.pending. p stored in c, its bit (p >= 0) added at `shift` into the lane words
 * a, |p| into partial part[(lo + i) % ACC]. `has_e` and `nt` are constants at each call, so the
 * inlined loop is specialised (x + 0 would turn -0.0 into +0.0 in p); nt: c + i is 64-byte
 * aligned where (lo + i) % ACC is 0, and those 16 values go out by put16. */
static inline float corrected_value(float x, float q, float s, float s2, int has_e)
{
    if (!has_e)
        return x;
    float bit = q >= 0.0f ? 1.0f : 0.0f;
    return x + ((q + s) - bit * s2);
}

static inline void bits_and_sums(const float *restrict x, const float *restrict q, float s, int has_e, int nt,
                                 float *restrict c, uint32_t *restrict a, int64_t lo, int64_t m, unsigned shift,
                                 float part[ACC])
{
    int64_t i = 0, head = (ACC - lo % ACC) % ACC;
    float s2 = s * 2.0f;
    for (; i < m && i < head; i++) {
        float v = corrected_value(x[i], has_e ? q[i] : 0.0f, s, s2, has_e);
        c[i] = v;
        a[i] += (uint32_t)(v >= 0.0f) << shift;
        part[(lo + i) % ACC] = part[(lo + i) % ACC] + fabsf(v);
    }
    for (; i + ACC <= m; i += ACC) {
        float v[ACC];
        /* 2 KiB ahead into L1 (the hardware prefetcher restarts at each run; in model A's DDP
         * step the encode took 8.6-9.3 ms with these, 9.7-11.7 without) */
        __builtin_prefetch(x + i + 512, 0, 3);
        if (has_e)
            __builtin_prefetch(q + i + 512, 0, 3);
        for (int k = 0; k < ACC; k++) {
            v[k] = corrected_value(x[i + k], has_e ? q[i + k] : 0.0f, s, s2, has_e);
            a[i + k] += (uint32_t)(v[k] >= 0.0f) << shift;
            part[k] = part[k] + fabsf(v[k]);
        }
        if (nt)
            put16(c + i, v);
        else
            for (int k = 0; k < ACC; k++)
                c[i + k] = v[k];
    }
    for (int k = 0; i < m; i++, k++) {
        float v = corrected_value(x[i], has_e ? q[i] : 0.0f, s, s2, has_e);
        c[i] = v;
        a[i] += (uint32_t)(v >= 0.0f) << shift;
        part[k] = part[k] + fabsf(v);
    }
}

/* ---- _encode_kernel (steps 1-3) ----
 *
 * x: float32 [d]; kept: float32 [d], the last committed step's p, or NULL (no error feedback);
 * kept_scale: float32 [nb], that step's agreed S (read with kept); finite_p: the incoming flag
 * (one byte) or NULL (none: the sum alone decides); corrected: out float32 [P], p = x + e, zeros
 * past d; payload: out int32 [W + Ws + 2]. inv_block, inv_last: 1/B and 1/(coordinates of the
 * last block), rounded to float32 as PyTorch rounds those scalars. Per block b, sums[b] = sum
 * |p| (runs of a tile in the order visited), s_b = sums[b] inv; ok = finite and the float32
 * sum of the sums (in block order) finite; the pair (code, 1) where ok and s_b > 1e-30, code =
 * clamp(rint(log2f(s_b) 4) + 512, 1, 1023) (rint rounds half to even, as torch.round; log2f may
 * differ from PyTorch's log2 by a rounding), else (0, 0). Returns ok, or -1 when the nb floats of
 * scratch could not be allocated (nothing usable written then). */
int32_t hgc_signsgd_encode(const float *restrict x, int64_t d, const float *restrict kept,
                           const float *restrict kept_scale, int64_t P,
                           int64_t B, const uint8_t *finite_p, float inv_block, float inv_last,
                           float *restrict corrected, int32_t *restrict payload, int64_t lanes, int64_t width,
                           int64_t guard, int64_t s_lanes, int64_t s_width)
{
    int64_t nb = P / B, W = (P + lanes - 1) / lanes;
    float *sums = calloc((size_t)(nb > 0 ? nb : 1), sizeof(float));
    if (!sums)
        return -1;
    uint32_t *restrict words = (uint32_t *)payload; /* the lanes add up in place */
    /* coordinate k's p at a line start when k % 16 is 0 */
    int nt = P >= NT_MIN && P <= NT_MAX && ((uintptr_t)corrected & 63u) == 0;
    for (int64_t i0 = 0; i0 < W; i0 += TILE) {
        int64_t t = W - i0 < TILE ? W - i0 : TILE;
        memset(words + i0, 0, (size_t)t * sizeof(uint32_t));
        for (int64_t j = 0; j < lanes; j++) {
            int64_t start = j * W + i0;
            if (start >= P)
                break;
            int64_t end = start + t < P ? start + t : P;
            unsigned shift = (unsigned)(guard + j * width);
            /* p, its bit and the block sums of the run in one pass, block by block: each
             * block's part of the run adds up in ACC partial sums (coordinate k into partial
             * k % ACC), combined pairwise, then into sums[b] in run order */
            int64_t real = end < d ? end : d;
            for (int64_t s = start; s < end;) {
                int64_t b = s / B;
                int64_t e = (b + 1) * B < end ? (b + 1) * B : end;
                int64_t r = e < real ? e : real; /* the gradient's part of [s, e) */
                uint32_t *restrict a = words + i0 + (s - start);
                float *restrict c = corrected + s;
                const float *restrict xs = x + s;
                int64_t m = r > s ? r - s : 0;
                float part[ACC] = {0};
                float sb = kept ? kept_scale[b] : 0.0f;
                if (kept && nt)
                    bits_and_sums(xs, kept + s, sb, 1, 1, c, a, s, m, shift, part);
                else if (kept)
                    bits_and_sums(xs, kept + s, sb, 1, 0, c, a, s, m, shift, part);
                else if (nt)
                    bits_and_sums(xs, xs, 0.0f, 0, 1, c, a, s, m, shift, part);
                else
                    bits_and_sums(xs, xs, 0.0f, 0, 0, c, a, s, m, shift, part);
                for (int64_t i = m; i < e - s; i++) { /* the padding: p = 0, bit 1, nothing to the sum */
                    c[i] = 0.0f;
                    a[i] += (uint32_t)1 << shift;
                }
                for (int w = ACC / 2; w >= 1; w /= 2)
                    for (int q = 0; q < w; q++)
                        part[q] = part[q] + part[q + w];
                sums[b] = sums[b] + part[0];
                s = e;
            }
        }
    }
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++)
        total = total + sums[b];
    int ok = (finite_p ? *finite_p != 0 : 1) && isfinite(total);
    int32_t *restrict stats = payload + W;
    int64_t m = 2 * nb, Ws = (m + s_lanes - 1) / s_lanes;
    for (int64_t i = 0; i < Ws; i++)
        stats[i] = 0;
    for (int64_t k = 0; k < m; k++) {
        int64_t b = k / 2;
        float s = sums[b] * (b == nb - 1 ? inv_last : inv_block);
        int usable = ok && s > 1e-30f;
        uint32_t v = 0;
        if (usable && (k & 1))
            v = 1;
        else if (usable) {
            float code = rintf(log2f(s) * 4.0f) + 512.0f;
            code = code < 1.0f ? 1.0f : (code > 1023.0f ? 1023.0f : code);
            v = (uint32_t)code;
        }
        stats[k % Ws] = (int32_t)((uint32_t)stats[k % Ws] + (v << (guard + (k / Ws) * s_width)));
    }
    payload[W + Ws] = (int32_t)((uint32_t)1 << guard);
    payload[W + Ws + 1] = (int32_t)((uint32_t)(ok ? 0 : 1) << guard);
    free(sums);
    fence();
    return ok;
}

/* ---- _receive_kernel but for exp2 (steps 4-5's small words) ----
 *
 * payload: the all-reduced int32 words; the statistics at [W, W + Ws), the two control words
 * after. summed: 1 (Sum), 0 (Average), -1 (unknown: the count word's verdict, "inferred").
 * counts: out int64 [2] (contributors c, ranks not finite); inferred_out: out byte; e: out
 * float32 [nb], ((code_sum - have 512) / max(have, 1)) * 0.25 as the reference's float32 mean,
 * -inf where no rank had data (PyTorch's exp2 of it is the agreed scale, 0 there). */
void hgc_signsgd_receive(const int32_t *restrict payload, int64_t W, int64_t nb, int64_t n, int64_t guard,
                         int64_t s_lanes, int64_t s_width, int64_t summed, int64_t *restrict counts,
                         uint8_t *restrict inferred_out, float *restrict e)
{
    int64_t Ws = (2 * nb + s_lanes - 1) / s_lanes;
    const int32_t *stats = payload + W, *tail = payload + W + Ws;
    int inferred = (int64_t)tail[0] > ((int64_t)1 << guard);
    int is_sum = summed < 0 ? inferred : (int)summed;
    counts[0] = exact64(tail[0], n, guard, is_sum) >> guard;
    counts[1] = exact64(tail[1], n, guard, is_sum) >> guard;
    *inferred_out = (uint8_t)inferred;
    int64_t mask = ((int64_t)1 << s_width) - 1;
    for (int64_t b = 0; b < nb; b++) {
        int64_t v[2];
        for (int t = 0; t < 2; t++) {
            int64_t k = 2 * b + t;
            v[t] = (exact64(stats[k % Ws], n, guard, is_sum) >> (guard + (k / Ws) * s_width)) & mask;
        }
        float code_sum = (float)v[0], have = (float)v[1];
        float mean = (code_sum - have * 512.0f) / (have > 1.0f ? have : 1.0f);
        e[b] = have > 0.5f ? mean * 0.25f : -INFINITY;
    }
}

/* ---- _decode_kernel (steps 4-5) ----
 *
 * payload: the all-reduced words (the first W the sign lanes); scale: float32 [nb], the agreed
 * S; count_p, bad_p: int64; inferred_p: one byte; summed as in hgc_signsgd_receive; inv_n: 1/n
 * rounded to float32. Per block f = (Sum ? S : S inv_n) + (bad > 0 ? NaN : 0); for coordinate
 * k of block b, V = lane (k / W) of the exact word k % W, out[k] = float(V) (f 2) - f float(c),
 * then times `factor` (a second float32 rounding, as the reference's separate product) when
 * has_factor. Only coordinates k < D are written (D <= P: out may hold just the gradient's d). */
static inline void decode_run(const uint32_t *restrict ex, float *restrict out, int64_t m, unsigned shift,
                              uint32_t mask, float a, float fc, int has_factor, float factor)
{
    for (int64_t k = 0; k < m; k++) {
        float v = (float)(int32_t)((ex[k] >> shift) & mask) * a - fc;
        out[k] = has_factor ? v * factor : v;
    }
}

void hgc_signsgd_decode(const int32_t *restrict payload, int64_t P, int64_t D, int64_t B,
                        const float *restrict scale, int64_t lanes, int64_t width, int64_t guard, int64_t n,
                        int64_t summed, const int64_t *count_p, const int64_t *bad_p, const uint8_t *inferred_p,
                        float inv_n, int has_factor, float factor, float *restrict out)
{
    int64_t W = (P + lanes - 1) / lanes;
    int is_sum = summed < 0 ? (*inferred_p != 0) : (int)summed;
    int as_is = is_sum || guard == 0;
    float count = (float)*count_p, poison = *bad_p > 0 ? NAN : 0.0f;
    uint32_t low = (uint32_t)(((uint64_t)1 << guard) - 1), mask = (uint32_t)(((uint64_t)1 << width) - 1);
    uint32_t ex[DTILE];
    for (int64_t i0 = 0; i0 < W; i0 += DTILE) {
        int64_t t = W - i0 < DTILE ? W - i0 : DTILE;
        if (as_is) {
            for (int64_t i = 0; i < t; i++)
                ex[i] = (uint32_t)payload[i0 + i];
        } else {
            for (int64_t i = 0; i < t; i++)
                ex[i] = exact32(payload[i0 + i], (uint32_t)n, low, 0);
        }
        for (int64_t j = 0; j < lanes; j++) {
            int64_t start = j * W + i0;
            if (start >= D)
                break;
            int64_t end = start + t < D ? start + t : D;
            unsigned shift = (unsigned)(guard + j * width);
            for (int64_t s = start; s < end;) {
                int64_t b = s / B;
                int64_t e = (b + 1) * B < end ? (b + 1) * B : end;
                float f = (is_sum ? scale[b] : scale[b] * inv_n) + poison;
                if (has_factor)
                    decode_run(ex + (s - start), out + s, e - s, shift, mask, f * 2.0f, f * count, 1, factor);
                else
                    decode_run(ex + (s - start), out + s, e - s, shift, mask, f * 2.0f, f * count, 0, 1.0f);
                s = e;
            }
        }
    }
}
