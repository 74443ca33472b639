/* Fused CPU loops of TopKC's _correct_kernel, _pack_kernel and _scatter_kernel
 * (hvd_gradcomp/topkc.py, steps 1 and 3-6, and the decode).
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
 * the guess is scored, not kept: scratch (float32 [2 chunk]) holds one chunk's guess and c at a
 * time (c then goes out by stream_out, non-temporal when stream). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define ACC 16

/* dst[0, n) = src[0, n): when stream, with non-temporal stores where the target has them
 * (AVX-512 or AVX) and dst is 64-byte aligned with n a multiple of 16 (a chunk row of an
 * output too large to stay in cache: no read for ownership), else memcpy. The same values
 * either way; stream_fence() orders them before the caller returns. */
static void stream_out(float *restrict dst, const float *restrict src, int64_t n, int64_t stream)
{
#if defined(__AVX512F__) || defined(__AVX__)
    if (stream && ((uintptr_t)dst & 63u) == 0 && (n & 15) == 0) {
        for (int64_t t = 0; t < n; t += 16) {
#if defined(__AVX512F__)
            _mm512_stream_ps(dst + t, _mm512_loadu_ps(src + t));
#else
            _mm256_stream_ps(dst + t, _mm256_loadu_ps(src + t));
            _mm256_stream_ps(dst + t + 8, _mm256_loadu_ps(src + t + 8));
#endif
        }
        return;
    }
#endif
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void stream_fence(void)
{
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
}

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
                       int64_t blocking, float *restrict chunks, float *restrict scratch,
                       float *restrict scores, int64_t stream)
{
    for (int64_t i = 0; i < m; i++) {
        int64_t base = i * chunk;
        int64_t n = d - base < chunk ? d - base : chunk;
        float *c_out = chunks ? scratch + chunk : NULL;
        float *g_out = blocking ? NULL : scratch;
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
        if (c_out)
            stream_out(chunks + base, c_out, chunk, stream);
    }
    stream_fence();
}

/* ---- _pack_kernel and _scatter_kernel (hvd_gradcomp/topkc.py, steps 3-6 and the decode) ----
 *
 * float16 as the payload dtype: float32 -> float16 rounds to nearest, ties to even (as PyTorch's
 * cast); a NaN stays a NaN of its sign with its top mantissa bits (x86's F16C conversion, which
 * PyTorch's vectorised cast uses). float16 -> float32 is exact. */

static uint16_t to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN: quiet, top mantissa bits kept */
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x47800000u) /* >= 65536: inf (65520 and up round there below too) */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* a normal float16: rebias the exponent by 127 - 15 */
        uint32_t r = ax - 0x38000000u;
        uint32_t h = r >> 13, rem = r & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
            h++;
        return (uint16_t)(sign | h);
    }
    /* float16 subnormal or zero: units of 2**-24 */
    uint32_t e = ax >> 23;
    if (e < 102) /* below 2**-25: rounds to 0 */
        return sign;
    uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14 .. 24 */
    uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

static float from_half(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, x;
    if (exp == 0) { /* zero or subnormal: mant 2**-24, exact in float32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31)
        x = sign | 0x7F800000u | (mant << 13);
    else
        x = sign | ((exp + 112u) << 23) | (mant << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* dtype codes: 0 float32, 1 float16. plus0: the payload's "+ 0" of a finite step's poison()
 * (hvd_gradcomp.base): a -0 becomes +0, every other value stays. */
static inline void put(void *out, int64_t i, float v, int64_t dtype, int plus0)
{
    if (dtype) {
        uint16_t h = to_half(v);
        ((uint16_t *)out)[i] = plus0 && h == 0x8000u ? 0 : h;
    } else {
        ((float *)out)[i] = plus0 ? v + 0.0f : v;
    }
}

/* n floats to float16 and back (to_half, from_half), 8 at a time with x86's F16C where the
 * compiler targets it (the same bits: round to nearest even, NaN quieted with its top bits). */
static void halves_out(const float *restrict v, uint16_t *restrict h, int64_t n)
{
    int64_t t = 0;
#ifdef __F16C__
    for (; t + 8 <= n; t += 8)
        _mm_storeu_si128((__m128i *)(h + t), _mm256_cvtps_ph(_mm256_loadu_ps(v + t), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; t < n; t++)
        h[t] = to_half(v[t]);
}

static void halves_in(const uint16_t *restrict h, float *restrict v, int64_t n)
{
    int64_t t = 0;
#ifdef __F16C__
    for (; t + 8 <= n; t += 8)
        _mm256_storeu_ps(v + t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + t))));
#endif
    for (; t < n; t++)
        v[t] = from_half(h[t]);
}

/* -1 if some index is outside [0, m) or repeats (seen: m bytes of scratch, zeroed here). */
static int64_t check_idx(const int64_t *idx, int64_t k, int64_t m, unsigned char *seen)
{
    memset(seen, 0, (size_t)m);
    for (int64_t j = 0; j < k; j++) {
        if (idx[j] < 0 || idx[j] >= m || seen[idx[j]])
            return -1;
        seen[idx[j]] = 1;
    }
    return 0;
}

static void pack_scores(const float *restrict scores, int64_t m, const int64_t *restrict idx, int64_t k,
                        void *restrict payload, int64_t at, int64_t dtype, int plus0);

/* _pack_kernel. For each selected chunk j (row r = idx[j]) and coordinate t, v = chunks[r, t]:
 *   w = v * prescale, clamped to [-limit, limit] when clamp (NaN stays NaN), cast: payload[j chunk + t]
 *   s = float(w) * unscale (the payload value decoded)        -> sent[j chunk + t]   (ef)
 *   chunks[r, t] = v + (s * -1)                                                     (ef)
 *   rescore (ef, not blocking): q = (decayed ? v decay : v) + g - (decayed ? s decay : s),
 *     g = flat[r chunk + t] (0 past d); f = sqrt(sum of q**2 over the chunk) (16 partial sums,
 *     as squares()); scores[r] = scores[r] + (f f - scores[r]).
 * Unless blocking, then (m values at payload[k chunk]): each score, non-finite as 0, over
 * max(largest such score, 1e-30f), cast; and the 16 vote slots (1 in slot vote_slot, else 0).
 * finite (a bool; NULL: none) is poison()'s: every payload value + 0 when it is true (a -0
 * becomes +0; sent is decoded before), NaN everywhere when it is false.
 * Each chunk runs as a few branch-free loops over scratch (float32 [2 chunk]).
 * Returns 0, or -1 when idx holds an index outside [0, m) or a repeated one (nothing written). */
int64_t hgc_topkc_pack(const float *restrict flat, int64_t d, float *restrict chunks, int64_t m,
                       int64_t chunk, const int64_t *restrict idx, int64_t k, float *restrict scores,
                       int64_t ef, int64_t blocking, int64_t decayed, float decay, int64_t dtype,
                       float prescale, float unscale, int64_t clamp, float limit, void *restrict payload,
                       float *restrict sent, float *restrict scratch, unsigned char *restrict seen,
                       const unsigned char *restrict finite)
{
    if (check_idx(idx, k, m, seen))
        return -1;
    int rescore = ef && !blocking, plus0 = finite && *finite;
    float *w = scratch, *dec = scratch + chunk;
    for (int64_t j = 0; j < k; j++) {
        int64_t r = idx[j], base = r * chunk, out = j * chunk;
        float *row = chunks + base;
        int64_t n = d - base < chunk ? d - base : chunk; /* the real coordinates of flat */
        if (clamp)
            for (int64_t t = 0; t < chunk; t++) {
                float x = row[t] * prescale;
                x = x < -limit ? -limit : x;
                w[t] = x > limit ? limit : x;
            }
        else
            for (int64_t t = 0; t < chunk; t++)
                w[t] = row[t] * prescale;
        if (dtype) {
            uint16_t *h = (uint16_t *)payload + out;
            halves_out(w, h, chunk);
            if (ef)
                halves_in(h, dec, chunk);
            if (plus0)
                for (int64_t t = 0; t < chunk; t++)
                    h[t] = h[t] == 0x8000u ? 0 : h[t];
        } else {
            float *p = (float *)payload + out;
            if (plus0)
                for (int64_t t = 0; t < chunk; t++)
                    p[t] = w[t] + 0.0f;
            else
                memcpy(p, w, (size_t)chunk * sizeof(float));
            if (ef)
                memcpy(dec, w, (size_t)chunk * sizeof(float));
        }
        if (!ef)
            continue;
        float *s = sent + out;
        for (int64_t t = 0; t < chunk; t++)
            s[t] = dec[t] * unscale;
        if (rescore) { /* w: the guess less what is owed, from v before the update below */
            const float *g = flat + base;
            if (decayed) {
                for (int64_t t = 0; t < n; t++)
                    w[t] = (row[t] * decay + g[t]) - s[t] * decay;
                for (int64_t t = n; t < chunk; t++)
                    w[t] = (row[t] * decay + 0.0f) - s[t] * decay;
            } else {
                for (int64_t t = 0; t < n; t++)
                    w[t] = (row[t] + g[t]) - s[t];
                for (int64_t t = n; t < chunk; t++)
                    w[t] = (row[t] + 0.0f) - s[t];
            }
            float f = sqrtf(squares(w, chunk));
            scores[r] = scores[r] + (f * f - scores[r]);
        }
        for (int64_t t = 0; t < chunk; t++)
            row[t] = row[t] + s[t] * -1.0f;
    }
    int64_t at = k * chunk, total_len = at + (blocking ? 0 : m + 16);
    if (!blocking)
        pack_scores(scores, m, idx, k, payload, at, dtype, plus0);
    if (finite && !*finite) /* poison: x + NaN */
        for (int64_t i = 0; i < total_len; i++) {
            if (dtype)
                ((uint16_t *)payload)[i] = to_half(from_half(((uint16_t *)payload)[i]) + NAN);
            else
                ((float *)payload)[i] = ((float *)payload)[i] + NAN;
        }
    return 0;
}

/* _pack_kernel's score part and vote (see hgc_topkc_pack) at payload[at ...]. */
static void pack_scores(const float *restrict scores, int64_t m, const int64_t *restrict idx, int64_t k,
                        void *restrict payload, int64_t at, int64_t dtype, int plus0)
{
    float top = 0.0f;
    for (int64_t i = 0; i < m; i++) {
        float v = isfinite(scores[i]) ? scores[i] : 0.0f;
        top = (i == 0 || v > top) ? v : top;
    }
    top = top < 1e-30f ? 1e-30f : top;
    for (int64_t i = 0; i < m; i++)
        put(payload, at + i, (isfinite(scores[i]) ? scores[i] : 0.0f) / top, dtype, plus0);
    /* the vote (_vote_slots): integer arithmetic in uint64, every intermediate below 2**63 */
    uint64_t total = 0;
    for (int64_t j = 0; j < k; j++) {
        uint64_t wj = (((uint64_t)j * 0x9E3779B1u) & 0x7FFFFFFFu) | 1u;
        total += (((uint64_t)idx[j] + 1u) * wj) & 0xFFFFFFFFu;
    }
    uint64_t slot = (((total & 0xFFFFFFFFu) * 0x9E37u) & 0xFFFFFFFFu) >> 28;
    for (int64_t i = 0; i < 16; i++)
        put(payload, at + m + i, (uint64_t)i == slot ? 1.0f : 0.0f, dtype, plus0);
}

/* _scatter_kernel: out (float32 [d]) = zeros, with chunk idx[j] = float(payload[j chunk + t])
 * * scale (t < chunk, truncated at d): one pass over out. scale: 0 after a split vote (split,
 * a bool, non-zero; NULL: no vote), else unscale. row_of: m int64 and row_buf: 2 chunk float32
 * of scratch (rows go out through stream_out, non-temporal when stream). Returns 0, or -1
 * for an index outside [0, m) or a repeated one (nothing written). */
int64_t hgc_topkc_scatter(const void *restrict payload, int64_t dtype, const int64_t *restrict idx,
                          int64_t k, int64_t chunk, int64_t d, const unsigned char *restrict split,
                          float unscale, float *restrict out, int64_t *restrict row_of,
                          float *restrict row_buf, int64_t stream)
{
    int64_t m = (d + chunk - 1) / chunk;
    float scale = split && *split ? 0.0f : unscale;
    for (int64_t i = 0; i < m; i++)
        row_of[i] = -1;
    for (int64_t j = 0; j < k; j++) {
        if (idx[j] < 0 || idx[j] >= m || row_of[idx[j]] >= 0)
            return -1;
        row_of[idx[j]] = j;
    }
    float *zeros = row_buf + chunk; /* chunk 0.0f; row_buf: one decoded row */
    memset(zeros, 0, (size_t)chunk * sizeof(float));
    for (int64_t i = 0; i < m; i++) {
        int64_t base = i * chunk;
        int64_t n = d - base < chunk ? d - base : chunk;
        if (row_of[i] < 0) {
            stream_out(out + base, zeros, n, stream);
            continue;
        }
        int64_t src = row_of[i] * chunk;
        if (dtype) {
            halves_in((const uint16_t *)payload + src, row_buf, n);
            for (int64_t t = 0; t < n; t++)
                row_buf[t] = row_buf[t] * scale;
        } else {
            const float *p = (const float *)payload + src;
            for (int64_t t = 0; t < n; t++)
                row_buf[t] = p[t] * scale;
        }
        stream_out(out + base, row_buf, n, stream);
    }
    stream_fence();
    return 0;
}

/* ---- _top_kernel (hvd_gradcomp/topkc.py): the first k of the stable descending argsort ----
 *
 * Each value gets an order key, a uint32 whose ascending order is the float order, with -0 as
 * +0 (equal, as PyTorch's sort compares them) and every NaN above +inf (PyTorch's sort puts
 * NaN above every number; NaNs tie); the complement of the key is then sorted ascending by a
 * stable LSD radix sort (digits of 11, 11 and 10 bits) starting from index order, so ties keep
 * the lower index first: the reference's permutation exactly. out: int64 [k] (k <= m); keys:
 * 2 m uint32 and idx: 2 m int64 of scratch. */
static inline uint32_t order_key(float f)
{
    uint32_t x;
    if (isnan(f))
        return 0xFFFFFFFFu;
    if (f == 0.0f)
        f = 0.0f;
    memcpy(&x, &f, 4);
    return (x & 0x80000000u) ? ~x : (x | 0x80000000u);
}

void hgc_topkc_top(const float *restrict v, int64_t m, int64_t k, int64_t *restrict out,
                   uint32_t *restrict keys, int64_t *restrict idx)
{
    uint32_t *ka = keys, *kb = keys + m;
    int64_t *ia = idx, *ib = idx + m;
    for (int64_t i = 0; i < m; i++) {
        ka[i] = ~order_key(v[i]);
        ia[i] = i;
    }
    static const int shift[3] = {0, 11, 22};
    int64_t count[2048];
    for (int pass = 0; pass < 3; pass++) {
        int s = shift[pass];
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < m; i++)
            count[(ka[i] >> s) & 0x7FFu]++;
        int64_t at = 0;
        for (int b = 0; b < 2048; b++) {
            int64_t c = count[b];
            count[b] = at;
            at += c;
        }
        for (int64_t i = 0; i < m; i++) {
            int64_t to = count[(ka[i] >> s) & 0x7FFu]++;
            kb[to] = ka[i];
            ib[to] = ia[i];
        }
        uint32_t *kt = ka; ka = kb; kb = kt;
        int64_t *it = ia; ia = ib; ib = it;
    }
    memcpy(out, ia, (size_t)k * sizeof(int64_t));
}
