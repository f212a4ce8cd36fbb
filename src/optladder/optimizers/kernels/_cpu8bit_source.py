"""C source of the CPU kernel of the 8bit rung (a library of its own, built by :mod:`.cpu8bit`).

The kernel steps AdamW on params whose moments are kept in bitsandbytes' block-wise 8-bit
format (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022), so
its state is the state of ``bitsandbytes.optim.AdamW8bit``: ``state1`` / ``state2`` uint8
codes into the code books ``qmap1`` (signed dynamic map, for ``exp_avg``) and ``qmap2``
(unsigned dynamic map, for ``exp_avg_sq``), and one float32 ``absmax1`` / ``absmax2`` per
256-element block. Params under bitsandbytes' ``min_8bit_size`` keep float32 ``state1`` /
``state2``; the kernel steps those too, with bitsandbytes' 32-bit update.

Per 256-element block, in one pass over memory: decode each code with the block's old
absmax (``qmap[code] * absmax``), update ``exp_avg``, ``exp_avg_sq`` and the param in
float32 as bitsandbytes' CPU fallback (``backends/cpu/ops.py``) writes it, keep the block's
new moments in a 1 KiB stack buffer each, take the new absmax (``max |.|``), and encode
each value as the nearest code of the book. "Nearest" is bitsandbytes' reference rule
(its torch backend's ``quantize_blockwise``: ``x * (1 / max(absmax, 1e-38))``, or ``x /
max(absmax, 1e-38)`` in a partial last block, whose absmax is then written clamped to
1e-38 too, clamped to [-1, 1], then the number of midpoints between adjacent codes that
lie below it, so a tie goes to the lower code); the midpoints (``bounds``, 255 values
and a +inf) are computed in Python when the step is prepared, with a ~22 KiB table per
book that gives the count from a float's top 16 bits and one comparison, and the
AVX-512 encoder's 0.6 KiB of tables, read by register permutes
(``cpu8bit.code_table``); the unsigned
book's first bound is set to 0 so that a positive ``exp_avg_sq`` never becomes 0 (see
``cpu8bit.code_bounds``). Zero is a code of both books, so a moment that is exactly 0
stays exactly 0 (bitsandbytes' native CPU quantizer, an approximate table search, maps it
to a small non-zero code).

Nothing is allocated: work items (runs of whole blocks of one param) are listed by the
caller, and handed out to ``n_threads`` threads of torch's OpenMP pool (or pthreads).
Symbols carry the ``ol8_`` prefix (``ol8v_`` for AVX-512, ``ol8a_`` for AVX2).
"""

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <math.h>
#include <pthread.h>

#define OL8_F32 0
#define OL8_BF16 1
#define OL8_F16 2
#define OL8_BLOCK 256

/* One param with its state and the scalars of its own step (see cpu8bit.py). */
typedef struct {
    void *param;
    const void *grad;
    void *state1;            /* uint8 codes, or float32 exp_avg when not quantized */
    void *state2;            /* uint8 codes, or float32 exp_avg_sq */
    float *absmax1;          /* one per 256-element block; unused when not quantized */
    float *absmax2;
    const float *qmap1;      /* 256 codes, ascending */
    const float *qmap2;
    const float *bounds1;    /* 255 midpoints of adjacent codes, then +inf */
    const float *bounds2;
    const int32_t *table1;   /* the encoder's start table (see ol8_encode) */
    const int32_t *table2;
    int64_t numel;
    int32_t param_dtype;     /* OL8_* */
    int32_t grad_dtype;      /* OL8_* */
    int32_t quantized;       /* 1: 8-bit state, 0: float32 state */
    int32_t coupled;         /* 1: grad += weight_decay * param (Adam) */
    int32_t decoupled;       /* 1: param *= decay (AdamW) */
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float eps;               /* 8-bit: eps; float32 state: eps * bc2_sqrt */
    float step_size;         /* 8-bit: -lr / bc1; float32 state: -lr * bc2_sqrt / bc1 */
    float bc2_sqrt;          /* sqrt(1 - beta2**step) */
    float decay;             /* 1 - lr * weight_decay */
    float weight_decay;      /* the coupled decay coefficient */
} ol8_param_t;

/* A run of whole 256-element blocks of one param. */
typedef struct {
    int64_t param;
    int64_t first_block;
    int64_t n_blocks;
} ol8_item_t;

static inline float ol8_u2f(uint32_t u) { union { float f; uint32_t u; } c; c.u = u; return c.f; }
static inline uint32_t ol8_f2u(float f) { union { float f; uint32_t u; } c; c.f = f; return c.u; }
/* clamp by comparison: one instruction each, where libm's fminf/fmaxf are calls */
static inline float ol8_clamp1(float x) { x = x < -1.0f ? -1.0f : x; return x > 1.0f ? 1.0f : x; }

static inline __attribute__((always_inline)) float ol8_load(const void *p, int dtype, int64_t i) {
    if (dtype == OL8_F32) return ((const float *)p)[i];
    if (dtype == OL8_BF16) return ol8_u2f((uint32_t)((const uint16_t *)p)[i] << 16);
    return (float)((const _Float16 *)p)[i];
}

/* Round to nearest even, as torch's copy_ from float32 rounds. */
static inline __attribute__((always_inline)) void ol8_store(
        void *p, int dtype, int64_t i, float x) {
    if (dtype == OL8_F32) {
        ((float *)p)[i] = x;
    } else if (dtype == OL8_BF16) {
        uint32_t u = ol8_f2u(x);
        uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) r = (u >> 16) | 0x40u;  /* NaN stays NaN */
        ((uint16_t *)p)[i] = (uint16_t)r;
    } else {
        ((_Float16 *)p)[i] = (_Float16)x;
    }
}

/* The number of bounds below x, for x in [-1, 1] (or NaN), given x and its bits u: the
   index of the nearest code, ties to the lower one, by one lookup in the start table
   (cpu8bit.code_table) and one comparison. Buckets are the floats sharing their top 16
   bits (sign, exponent, 7 mantissa bits), clamped below to the prefix lo - 1 (bucket 0:
   every magnitude below lo, where only a bound of 0 may lie) and above to the prefix of
   1.0 (with NaN). Each bucket holds at most one bound (checked when the table is made).
   table[0] = lo, table[1] = w (buckets per sign), table[2] = the bits of bucket 0's
   bound for x >= +0 (0.0f or +inf), table[3] = -1 if any bound is negative (else 0:
   every x <= -0 shares one entry), then w entries for x >= +0 and w for x <= -0; entry
   = count | low16 << 8: the bounds below the smallest float of the bucket, and the low
   16 bits of the bound inside it (of the bucket's largest float if none, so that the
   comparison never counts it). A NaN is encoded as 255 (torch.bucketize, bitsandbytes'
   reference, sorts NaN last). */
static inline __attribute__((always_inline)) uint8_t ol8_encode(
        const int32_t *restrict entries, int32_t lo, int32_t w, uint32_t t2, int32_t t3,
        int32_t u, float x) {
    /* branch-free: signs and bucket-0 hits are data-dependent (mispredicted branches
       cost more than the whole lookup) */
    int32_t j = ((u >> 16) & 0x7FFF) - lo + 1;
    j = j < 0 ? 0 : j;
    j = j > w - 1 ? w - 1 : j;
    const int32_t neg = u >> 31;                         /* -1 for x <= -0, else 0 */
    const int32_t e = entries[j + (neg & (w + (j & t3) - j))];
    uint32_t bu = ((uint32_t)u & 0xFFFF0000u) | ((uint32_t)e >> 8);
    const uint32_t b0 = (0x7F800000u & (uint32_t)neg) | (t2 & ~(uint32_t)neg);
    bu = j == 0 ? b0 : bu;
    const int32_t k = (e & 0xFF) + (ol8_u2f(bu) < x);
    return (uint8_t)(x != x ? 255 : k);  /* NaN: last, as torch.bucketize sorts it */
}

/* The same count by binary search on the bounds alone (conversions: no table needed). */
static inline __attribute__((always_inline)) uint8_t ol8_search(const float *bounds, float x) {
    if (x != x) return 255;  /* NaN: last, as torch.bucketize sorts it */
    int32_t k = 0;
    k += bounds[k + 127] < x ? 128 : 0;
    k += bounds[k + 63] < x ? 64 : 0;
    k += bounds[k + 31] < x ? 32 : 0;
    k += bounds[k + 15] < x ? 16 : 0;
    k += bounds[k + 7] < x ? 8 : 0;
    k += bounds[k + 3] < x ? 4 : 0;
    k += bounds[k + 1] < x ? 2 : 0;
    k += bounds[k] < x ? 1 : 0;
    return (uint8_t)k;
}

/* Widen n values of src (from element lo) into out, as float32.
   Bit patterns move through integer buffers read back through another pointer type, not
   through in-register casts, which keep gcc from vectorizing the loops. */
static inline __attribute__((always_inline)) void ol8_widen(
        const void *src, int dtype, int64_t lo, int64_t n, float *restrict out) {
    if (dtype == OL8_BF16) {
        const uint16_t *restrict s = (const uint16_t *)src + lo;
        uint32_t *restrict o = (uint32_t *)out;
        for (int64_t i = 0; i < n; i++) o[i] = (uint32_t)s[i] << 16;
    } else {
        const _Float16 *restrict s = (const _Float16 *)src + lo;
        for (int64_t i = 0; i < n; i++) out[i] = (float)s[i];
    }
}

/* Round n float32 values to dtype (nearest even, as torch's copy_) into dst from lo. */
static inline __attribute__((always_inline)) void ol8_narrow(
        void *dst, int dtype, int64_t lo, int64_t n, const float *restrict in) {
    if (dtype == OL8_BF16) {
        const uint32_t *restrict u = (const uint32_t *)in;
        uint16_t *restrict d = (uint16_t *)dst + lo;
        for (int64_t i = 0; i < n; i++) {
            uint32_t x = u[i];
            uint32_t r = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
            uint32_t q = (x >> 16) | 0x40u;  /* NaN stays NaN */
            d[i] = (uint16_t)((x & 0x7FFFFFFFu) > 0x7F800000u ? q : r);
        }
    } else {
        _Float16 *restrict d = (_Float16 *)dst + lo;
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)in[i];
    }
}

/* ---- AVX2 encode: ol8_encode on 8 lanes, one gather from the start table per 8 values
   (integer operations and one ordered float comparison: the same codes as the scalar
   loop, tested). Used on CPUs with AVX2, FMA and F16C for partial blocks and state
   conversions (ol_quantize_blockwise); whole blocks take the AVX2 block path below. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define OL8_AVX2 __attribute__((target("avx2")))

static int ol8_avx2_ok(void) {
    static int ok = -1;  /* a fact of the CPU, not configuration: computed once */
    if (ok < 0) {
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    }
    return ok;
}

/* Codes of x[0 .. n - n % 8) into out; returns how many were written. */
OL8_AVX2 __attribute__((noinline)) static int64_t ol8a_encode(
        const int32_t *table, const float *x, int64_t n, uint8_t *out) {
    const __m256i lo1 = _mm256_set1_epi32(table[0] - 1), w = _mm256_set1_epi32(table[1]);
    const __m256i wm1 = _mm256_set1_epi32(table[1] - 1), t3 = _mm256_set1_epi32(table[3]);
    const __m256i t2 = _mm256_set1_epi32(table[2]), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i zero = _mm256_setzero_si256(), low8 = _mm256_set1_epi32(0xFF);
    const __m256i top16 = _mm256_set1_epi32((int32_t)0xFFFF0000u);
    const int64_t whole = n - n % 8;
    for (int64_t i = 0; i < whole; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        const __m256i u = _mm256_castps_si256(xv);
        __m256i j = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x7FFF));
        j = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(j, lo1), zero), wm1);
        const __m256i neg = _mm256_srai_epi32(u, 31);
        const __m256i jn = _mm256_add_epi32(w, _mm256_and_si256(j, t3));
        const __m256i idx = _mm256_blendv_epi8(j, jn, neg);
        const __m256i e = _mm256_i32gather_epi32(table + 4, idx, 4);
        __m256i bound = _mm256_or_si256(_mm256_and_si256(u, top16), _mm256_srli_epi32(e, 8));
        bound = _mm256_blendv_epi8(bound, _mm256_blendv_epi8(t2, inf, neg),
                                   _mm256_cmpeq_epi32(j, zero));
        const __m256 below = _mm256_cmp_ps(_mm256_castsi256_ps(bound), xv, _CMP_LT_OQ);
        __m256i k = _mm256_sub_epi32(_mm256_and_si256(e, low8), _mm256_castps_si256(below));
        k = _mm256_blendv_epi8(k, low8, _mm256_castps_si256(_mm256_cmp_ps(xv, xv, _CMP_UNORD_Q)));
        const __m128i k16 = _mm_packus_epi32(_mm256_castsi256_si128(k),
                                             _mm256_extracti128_si256(k, 1));
        _mm_storel_epi64((__m128i *)(out + i), _mm_packus_epi16(k16, k16));
    }
    return whole;
}

/* Prefetch block b's param, grad and codes (nothing past the param's end); the AVX2
   block path calls it OL8_PREFETCH_BLOCKS blocks ahead, the AVX-512 path
   OL8V_PREFETCH_BLOCKS. With its data in cache the prefetches' 40 instructions a block
   cost the AVX-512 path ~3 % (AMD Zen 5, 64K params), and on Zen 4 its blocks ran at the
   core's pace when stepped back to back (no prefetch there 1.04-1.08x faster at 16M and
   64M, session 13). But a step follows other work that leaves the caches full of other
   data (the step_time benchmark: torch's fused AdamW over as many params; a training step: the
   forward and backward passes), and there the hardware prefetchers fall behind the
   block loop on Zen 5: 4 blocks ahead made the AVX-512 path 1.2-1.34x faster at 64M
   float32 params and 1.03-1.17x at 16M (one tensor and the transformer-like list, 1
   thread, each call after a torch fused AdamW step over as many params, paired medians;
   docs/performance.md), while one line per stream 16 or 32 blocks ahead gained nothing
   (so the page walks alone are not the cost). */
#define OL8_PREFETCH_BLOCKS 2
#define OL8V_PREFETCH_BLOCKS 4
static inline __attribute__((always_inline)) void ol8_prefetch(
        const ol8_param_t *P, int64_t b, int pd, int gd) {
    const int64_t lo = b * OL8_BLOCK;
    if (lo + OL8_BLOCK > P->numel) return;
    const int psize = pd == OL8_F32 ? 4 : 2, gsize = gd == OL8_F32 ? 4 : 2;
    const char *p = (const char *)P->param + lo * psize;
    const char *g = (const char *)P->grad + lo * gsize;
    for (int i = 0; i < OL8_BLOCK * psize; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
    for (int i = 0; i < OL8_BLOCK * gsize; i += 64) _mm_prefetch(g + i, _MM_HINT_T0);
    for (int i = 0; i < OL8_BLOCK; i += 64) {
        _mm_prefetch((const char *)P->state1 + lo + i, _MM_HINT_T0);
        _mm_prefetch((const char *)P->state2 + lo + i, _MM_HINT_T0);
    }
}
#else
static int ol8_avx2_ok(void) { return 0; }
static int64_t ol8a_encode(const int32_t *t, const float *x, int64_t n, uint8_t *o) {
    (void)t; (void)x; (void)n; (void)o;
    return 0;
}
#endif

/* absmax = max |x| of n values by their bits (a NaN wins, as torch's max), then each
   value scaled, clamped to [-1, 1] and encoded in place (with the start table, or by
   binary search where table is NULL; avx2: the start table's encode on 8 lanes, for a
   CPU with AVX2). The scaling is the torch backend's: a whole block by
   x * (1 / max(absmax, 1e-38)), a partial (last) block by x / max(absmax, 1e-38) (one
   float32 step apart for some x, which can change a code), whose absmax it also returns
   clamped to 1e-38 (a NaN stays NaN). Returns the block's absmax. */
static inline __attribute__((always_inline)) float ol8_quantize(
        float *restrict x, int64_t n, const int32_t *table, const float *bounds,
        uint8_t *restrict out, int avx2) {
    const uint32_t *restrict xu = (const uint32_t *)x;
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = xu[i] & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    const float absmax = ol8_u2f(top);
    const float d = absmax > 1e-38f ? absmax : 1e-38f;
    const float r = 1.0f / d;
    if (n == OL8_BLOCK) {
        for (int64_t i = 0; i < n; i++) x[i] = ol8_clamp1(x[i] * r);
    } else {
        for (int64_t i = 0; i < n; i++) x[i] = ol8_clamp1(x[i] / d);
    }
    const int32_t *restrict xi = (const int32_t *)x;
    if (table != NULL) {
        const int32_t lo = table[0], w = table[1], t3 = table[3];
        const uint32_t t2 = (uint32_t)table[2];
        const int32_t *restrict entries = table + 4;
        const int64_t done = avx2 ? ol8a_encode(table, x, n, out) : 0;
        for (int64_t i = done; i < n; i++)
            out[i] = ol8_encode(entries, lo, w, t2, t3, xi[i], x[i]);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = ol8_search(bounds, x[i]);
    }
    return n == OL8_BLOCK || absmax != absmax ? absmax : d;
}

/* One block of an 8-bit param: elements [lo, lo + n) of block b. */
static inline __attribute__((always_inline)) void ol8_block_q(
        const ol8_param_t *P, int64_t b, int pd, int gd, int coupled, int decoupled,
        int avx2) {
    const int64_t lo = b * OL8_BLOCK;
    const int64_t n = P->numel - lo < OL8_BLOCK ? P->numel - lo : OL8_BLOCK;
    uint8_t *restrict c1 = (uint8_t *)P->state1 + lo;
    uint8_t *restrict c2 = (uint8_t *)P->state2 + lo;
    const float a1 = P->absmax1[b], a2 = P->absmax2[b];
    const float *restrict q1 = P->qmap1, *restrict q2 = P->qmap2;
    const float b1 = P->beta1, omb1 = P->one_minus_beta1;
    const float b2 = P->beta2, omb2 = P->one_minus_beta2;
    const float eps = P->eps, step_size = P->step_size, bc2 = P->bc2_sqrt;
    const float decay = P->decay, wd = P->weight_decay;
    float gbuf[OL8_BLOCK], pbuf[OL8_BLOCK], m[OL8_BLOCK], v[OL8_BLOCK];
    const float *restrict gs = gbuf;
    float *restrict ps = pbuf;
    if (gd == OL8_F32) gs = (const float *)P->grad + lo;
    else ol8_widen(P->grad, gd, lo, n, gbuf);
    if (pd == OL8_F32) ps = (float *)P->param + lo;
    else ol8_widen(P->param, pd, lo, n, pbuf);
    /* decode first (table loads), then the update over plain arrays: a loop without
       lookups, which gcc vectorizes (one loop with both ran scalar, its divisions and
       square root one element at a time) */
    for (int64_t i = 0; i < n; i++) {
        m[i] = q1[c1[i]] * a1;
        v[i] = q2[c2[i]] * a2;
    }
    for (int64_t i = 0; i < n; i++) {
        float g = gs[i];
        float p = ps[i];
        if (coupled) g = fmaf(p, wd, g);
        float mi = m[i];
        float vi = v[i];
        mi = fmaf(g, omb1, mi * b1);            /* mul_(beta1).add_(g, alpha=1-beta1) */
        vi = fmaf(omb2 * g, g, vi * b2);        /* mul_(beta2).addcmul_(g, g, 1-beta2) */
        float denom = sqrtf(vi) / bc2 + eps;
        if (decoupled) p = p * decay;
        ps[i] = p + (step_size * mi) / denom;   /* addcdiv_(m, denom, -lr/bc1) */
        m[i] = mi;
        v[i] = vi;
    }
    if (pd != OL8_F32) ol8_narrow(P->param, pd, lo, n, pbuf);
    P->absmax1[b] = ol8_quantize(m, n, P->table1, P->bounds1, c1, avx2);
    P->absmax2[b] = ol8_quantize(v, n, P->table2, P->bounds2, c2, avx2);
}

/* Elements [lo, hi) of a param with float32 state: bitsandbytes' 32-bit Adam update. */
static inline __attribute__((always_inline)) void ol8_range_f32(
        const ol8_param_t *P, int64_t lo, int64_t hi, int pd, int gd, int coupled,
        int decoupled) {
    float *restrict s1 = (float *)P->state1, *restrict s2 = (float *)P->state2;
    const void *restrict grad = P->grad;
    void *restrict param = P->param;
    const float b1 = P->beta1, omb1 = P->one_minus_beta1;
    const float b2 = P->beta2, omb2 = P->one_minus_beta2;
    const float eps = P->eps, step_size = P->step_size;
    const float decay = P->decay, wd = P->weight_decay;
    for (int64_t i = lo; i < hi; i++) {
        float g = ol8_load(grad, gd, i);
        float p = ol8_load(param, pd, i);
        if (coupled) g = fmaf(p, wd, g);
        float mi = fmaf(g, omb1, s1[i] * b1);
        float vi = fmaf(omb2 * g, g, s2[i] * b2);
        if (decoupled) p = p * decay;
        float update = mi / (sqrtf(vi) + eps);  /* eps holds eps * bc2_sqrt here */
        p = fmaf(update, step_size, p);         /* add_(update, alpha=step_size) */
        ol8_store(param, pd, i, p);
        s1[i] = mi;
        s2[i] = vi;
    }
}

/* ---- AVX-512 path: the same operations in the same order on 16 lanes, so the same
   bits as the scalar loops above (IEEE add, mul, div, sqrt and fma are exact per lane;
   tests compare both paths bit for bit). Used for whole 256-element blocks on CPUs with
   AVX-512 F/BW/DQ/VL and VBMI (the decode's byte permutes: Ice Lake, AMD Zen 4 and
   later; Skylake-X takes the AVX2 path); partial blocks and other CPUs take the scalar
   loops. Per block: the codes decoded 64 at a time by byte permutes (ol8v_decode64),
   the update with the absmax taken in the same loop, then the encode 64 values at a
   time by register permutes (ol8v_quantize64; the start table read by scalar loads,
   ol8v_quantize, for a book its tables cannot serve); the block OL8V_PREFETCH_BLOCKS
   ahead prefetched (see ol8_prefetch). The permute encode made the whole step
   1.25-1.28x faster at 1M float32 params and 1.40x at 16M (1 thread, AMD EPYC Zen 4:
   1.23 -> 0.96-0.98 and 1.50 -> 1.07 ns per element). */
#if defined(__x86_64__) && defined(__GNUC__)
#define OL8_HAVE_AVX512 1
#include <immintrin.h>
#define OL8_AVX512 \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,fma,f16c")))
#define OL8_AVX512_INLINE OL8_AVX512 static inline __attribute__((always_inline))

static int ol8_avx512_ok(void) {
    static int ok = -1;  /* a fact of the CPU, not configuration: computed once */
    if (ok < 0) {
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vbmi");
    }
    return ok;
}

OL8_AVX512_INLINE __m512 ol8v_load(const void *p, int dtype, int64_t i) {
    if (dtype == OL8_F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dtype == OL8_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* As ol8_store: round to nearest even, a NaN stays NaN. */
OL8_AVX512_INLINE void ol8v_store(void *p, int dtype, int64_t i, __m512 x) {
    if (dtype == OL8_F32) {
        _mm512_storeu_ps((float *)p + i, x);
        return;
    }
    __m256i h;
    if (dtype == OL8_BF16) {
        const __m512i u = _mm512_castps_si512(x);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        h = _mm512_cvtepi32_epi16(r);
    } else {
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
}

/* Byte planes of a code book, for ol8v_decode64: plane j holds byte j of each code's
   float32 bits (4 x 256 bytes, read as zmm rows by the VBMI byte permutes). */
typedef struct {
    uint8_t b[4][OL8_BLOCK] __attribute__((aligned(64)));
} ol8v_planes_t;

static inline __attribute__((always_inline)) void ol8v_planes(const float *q, ol8v_planes_t *pl) {
    for (int i = 0; i < OL8_BLOCK; i++) {
        const uint32_t u = ol8_f2u(q[i]);
        for (int j = 0; j < 4; j++) pl->b[j][i] = (uint8_t)(u >> (8 * j));
    }
}

/* The byte order of ol8v_decode64 and ol8v_quantize64: byte 16L + 4r + d holds value
   16r + 4L + d (an involution). */
OL8_AVX512_INLINE __m512i ol8v_order(void) {
    return _mm512_set_epi8(
        63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12,
        59, 58, 57, 56, 43, 42, 41, 40, 27, 26, 25, 24, 11, 10, 9, 8,
        55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,
        51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
}

/* The float32 values of a 256-entry book's byte planes at the 64 byte indices of k, as
   4 x 16 floats in the unpacks' order (byte 16L + 4r + d of k gives float 16r + 4L + d):
   per plane two two-source byte permutes and a blend on the index's top bit. */
OL8_AVX512_INLINE void ol8v_planes64(const ol8v_planes_t *pl, __m512i k, __m512 out[4]) {
    const __mmask64 top = _mm512_movepi8_mask(k);
    __m512i B[4];
    for (int j = 0; j < 4; j++) {
        const __m512i *row = (const __m512i *)pl->b[j];
        const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(row), k,
                                                    _mm512_load_si512(row + 1));
        const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(row + 2), k,
                                                    _mm512_load_si512(row + 3));
        B[j] = _mm512_mask_blend_epi8(top, lo, hi);
    }
    const __m512i w01lo = _mm512_unpacklo_epi8(B[0], B[1]);
    const __m512i w01hi = _mm512_unpackhi_epi8(B[0], B[1]);
    const __m512i w23lo = _mm512_unpacklo_epi8(B[2], B[3]);
    const __m512i w23hi = _mm512_unpackhi_epi8(B[2], B[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01lo, w23lo));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01lo, w23lo));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01hi, w23hi));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01hi, w23hi));
}

/* q[c[0 .. 64)] as 4 x 16 floats (out[r] = codes 16r .. 16r + 16), without gathers or
   scalar loads: each byte plane of the book is looked up for 64 codes at once by two
   VBMI byte permutes (128 entries each) and a blend on the code's top bit, and the four
   planes' bytes are interleaved into floats by unpacks. The unpacks interleave within
   128-bit lanes, so the codes are first permuted to come out in order: output float
   16r + 4L + d comes from byte 16L + 4r + d. */
OL8_AVX512_INLINE void ol8v_decode64(const ol8v_planes_t *pl, const uint8_t *c, __m512 out[4]) {
    ol8v_planes64(pl, _mm512_permutexvar_epi8(ol8v_order(), _mm512_loadu_si512(c)), out);
}

/* t[k[0 .. 16)] by scalar loads into lanes: on AMD Zen 4 a gather instead made the
   whole step 1.45 times slower (2.18 against 1.49 ns per element). */
OL8_AVX512_INLINE __m512i ol8v_lookup16(const int32_t *t, const int32_t *k) {
    __m128i q[4];
    for (int h = 0; h < 4; h++) {
        uint64_t k01, k23;  /* two indices per load */
        __builtin_memcpy(&k01, k + 4 * h, 8);
        __builtin_memcpy(&k23, k + 4 * h + 2, 8);
        __m128i x = _mm_cvtsi32_si128(t[(uint32_t)k01]);
        x = _mm_insert_epi32(x, t[k01 >> 32], 1);
        x = _mm_insert_epi32(x, t[(uint32_t)k23], 2);
        q[h] = _mm_insert_epi32(x, t[k23 >> 32], 3);
    }
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(q[0]), q[1], 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(q[2]), q[3], 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* ol8_quantize of one whole block whose max |x| bits are the lanes of top: scaled by
   x * (1 / max(absmax, 1e-38)), clamped (max/min keep a NaN, as ol8_clamp1), encoded
   as ol8_encode encodes. Two passes over the block: the scaled values and their start
   table indices, then the entries (scalar loads) and the codes. */
OL8_AVX512_INLINE float ol8v_quantize(
        float *restrict x, __m512i top, const int32_t *table, uint8_t *restrict out) {
    const float absmax = ol8_u2f(_mm512_reduce_max_epu32(top));
    const __m512 r = _mm512_set1_ps(1.0f / (absmax > 1e-38f ? absmax : 1e-38f));
    const __m512 lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f);
    const __m512i lo1 = _mm512_set1_epi32(table[0] - 1), w = _mm512_set1_epi32(table[1]);
    const __m512i wm1 = _mm512_set1_epi32(table[1] - 1), t3 = _mm512_set1_epi32(table[3]);
    const __m512i t2 = _mm512_set1_epi32(table[2]), inf = _mm512_set1_epi32(0x7F800000);
    const __m512i low8 = _mm512_set1_epi32(0xFF);
    const __m512i top16 = _mm512_set1_epi32((int32_t)0xFFFF0000u);
    const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF), mag15 = _mm512_set1_epi32(0x7FFF);
    const __m512i lo16 = _mm512_set1_epi32(table[0] << 16);
    const int32_t *entries = table + 4;
    int32_t idx[OL8_BLOCK] __attribute__((aligned(64)));
    for (int i = 0; i < OL8_BLOCK; i += 16) {
        const __m512 xs = _mm512_mul_ps(_mm512_load_ps(x + i), r);
        /* as ol8_clamp1: max(a, b) is a > b ? a : b, min(a, b) a < b ? a : b, so a NaN
           (second) stays NaN */
        const __m512 xv = _mm512_min_ps(hi, _mm512_max_ps(lo, xs));
        _mm512_store_ps(x + i, xv);
        const __m512i u = _mm512_castps_si512(xv);
        __m512i j = _mm512_and_si512(_mm512_srli_epi32(u, 16), mag15);
        /* clamped to [0, w - 1] on the low 16 bits (the high 16 are 0): a saturating
           subtraction, then a min (for NaN, whose prefix is above 1.0's) */
        j = _mm512_min_epu16(_mm512_subs_epu16(j, lo1), wm1);
        const __m512i jn = _mm512_add_epi32(w, _mm512_and_si512(j, t3));
        _mm512_store_si512(idx + i, _mm512_mask_mov_epi32(j, _mm512_movepi32_mask(u), jn));
    }
    for (int i = 0; i < OL8_BLOCK; i += 16) {
        const __m512 xv = _mm512_load_ps(x + i);
        const __m512i u = _mm512_castps_si512(xv);
        const __m512i ev = ol8v_lookup16(entries, idx + i);
        __m512i bound = _mm512_or_si512(_mm512_and_si512(u, top16), _mm512_srli_epi32(ev, 8));
        const __mmask16 neg = _mm512_movepi32_mask(u);
        const __mmask16 bucket0 = _mm512_cmpgt_epi32_mask(lo16, _mm512_and_si512(u, mag));
        bound = _mm512_mask_mov_epi32(bound, bucket0, _mm512_mask_mov_epi32(t2, neg, inf));
        const __mmask16 below = _mm512_cmp_ps_mask(_mm512_castsi512_ps(bound), xv, _CMP_LT_OQ);
        __m512i k = _mm512_and_si512(ev, low8);
        k = _mm512_mask_add_epi32(k, below, k, _mm512_set1_epi32(1));
        k = _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q), low8);
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(k));
    }
    return absmax;
}

/* ---- The encode by byte permutes (ol8v_quantize64): no table reads from memory per
   value. Per 64 values, the top 16 bits of each scaled value (sign, exponent e, 7
   mantissa bits m7), gathered by two word permutes, give a bucket key: a per-(sign,
   exponent) entry (a word permute on e & 31) holds a base and a shift s, key = base +
   (m7 >> s), at most 512 keys; the shifts were chosen when the table was made
   (cpu8bit.code_table) so that each bucket holds at most one bound. A 512-byte table
   gives the bounds below the bucket (c0, four 128-entry byte permutes), the bound
   inside it (or the next one above) is bounds[c0], looked up by byte planes as
   ol8v_decode64 looks up codes, and the code is c0 + (bounds[c0] < x): the number of
   bounds below x, as ol8_encode counts it (tested bit for bit). Magnitudes under the
   smallest exponent slot E0 are raised to it on the words (one bucket: only a bound of 0
   can lie there); a NaN (quiet: the scaling quiets it) has e = 255, which shares slot 31
   with 1.0 (e = 127) but not its bucket (m7 >= 64 against m7 = 0): c0 = 255 and
   bounds[255] = +inf, never below. The tables (after the start table, see
   cpu8bit.code_table): a flag (1: usable), E0, 64 uint16 entries (32 for x >= +0, 32
   for x <= -0) and 512 bytes of c0; a book they cannot serve (flag 0) takes
   ol8v_quantize. */
typedef struct {
    ol8v_planes_t bounds;       /* byte planes of the 256 bounds (255 midpoints, +inf) */
    uint8_t c0[512] __attribute__((aligned(64)));  /* per key: the bounds below its bucket */
    uint16_t slot[64] __attribute__((aligned(64)));  /* per (sign, e & 31): base | s << 9 */
    uint16_t e0;                /* E0 << 7: the smallest magnitude word (E0 >= 96) */
} ol8v_encoder_t;

/* The encoder of a start table's book, or 0 where its tables are not usable. */
static inline int ol8v_encoder(const int32_t *table, const float *bounds, ol8v_encoder_t *enc) {
    const int32_t *v = table + 4 + 2 * table[1];
    if (v[0] != 1) return 0;
    ol8v_planes(bounds, &enc->bounds);
    enc->e0 = (uint16_t)(v[1] << 7);
    __builtin_memcpy(enc->slot, v + 2, sizeof enc->slot);
    __builtin_memcpy(enc->c0, v + 2 + 32, sizeof enc->c0);
    return 1;
}

/* First pass over 64 values of x: scaled by r and, if clamp, clamped (as ol8v_quantize;
   stored back into x), then c0 of each value's bucket into cb, in ol8v_decode64's byte
   order. pos: every value of x is >= +0 or a NaN (of either sign; see ol8v_pos2), so the
   negative side's slots are never needed: a -NaN's word, its sign kept, reads slot 31
   (e & 31 of 0x1FF) and m7 >= 64, the quiet NaN's bucket, as the magnitude would. */
OL8_AVX512_INLINE void ol8v_counts64(float *restrict x, __m512 r, const ol8v_encoder_t *enc,
                                     uint8_t *restrict cb, int clamp, int pos) {
    const __m512 lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f);
    /* word 2i + 1 of two zmm of floats: the top 16 bits of float i */
    const __m512i top_words = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i order = ol8v_order();
    const __m512i key_lo = _mm512_add_epi8(order, order);  /* a key's low byte, in order */
    const __m512i key_hi = _mm512_add_epi8(key_lo, _mm512_set1_epi8(1));
    const __m512i mag = _mm512_set1_epi16(0x7FFF), m7 = _mm512_set1_epi16(0x7F);
    const __m512i e0 = _mm512_set1_epi16((short)enc->e0);
    const __m512i tpos = _mm512_load_si512(enc->slot), tneg = _mm512_load_si512(enc->slot + 32);
    const __m512i *c = (const __m512i *)enc->c0;
    __m512 X[4];
    for (int q = 0; q < 4; q++) {
        /* as ol8_clamp1: max(a, b) is a > b ? a : b, min(a, b) a < b ? a : b, so a NaN
           (second) stays NaN */
        X[q] = _mm512_mul_ps(_mm512_load_ps(x + 16 * q), r);
        if (clamp) X[q] = _mm512_min_ps(hi, _mm512_max_ps(lo, X[q]));
        _mm512_store_ps(x + 16 * q, X[q]);
    }
    __m512i K[2];
    for (int h = 0; h < 2; h++) {
        const __m512i W = _mm512_permutex2var_epi16(
            _mm512_castps_si512(X[2 * h]), top_words, _mm512_castps_si512(X[2 * h + 1]));
        const __m512i Wm = _mm512_max_epu16(pos ? W : _mm512_and_si512(W, mag), e0);
        const __m512i e = _mm512_srli_epi16(Wm, 7);  /* the permutes read e & 31 */
        __m512i T = _mm512_permutexvar_epi16(e, tpos);
        if (!pos) T = _mm512_mask_permutexvar_epi16(T, _mm512_movepi16_mask(W), e, tneg);
        K[h] = _mm512_add_epi16(T, _mm512_srlv_epi16(_mm512_and_si512(Wm, m7),
                                                     _mm512_srli_epi16(T, 9)));
    }
    /* the keys' bytes in order; bit 7 and 8 pick one of four 128-entry quarters of c0 */
    const __m512i kl = _mm512_permutex2var_epi8(K[0], key_lo, K[1]);
    const __m512i kh = _mm512_permutex2var_epi8(K[0], key_hi, K[1]);
    const __mmask64 b7 = _mm512_movepi8_mask(kl);
    const __mmask64 b8 = _mm512_test_epi8_mask(kh, _mm512_set1_epi8(1));
    __m512i q[4];
    for (int j = 0; j < 4; j++)
        q[j] = _mm512_permutex2var_epi8(_mm512_load_si512(c + 2 * j), kl,
                                        _mm512_load_si512(c + 2 * j + 1));
    _mm512_store_si512(cb, _mm512_mask_blend_epi8(b8, _mm512_mask_blend_epi8(b7, q[0], q[1]),
                                                   _mm512_mask_blend_epi8(b7, q[2], q[3])));
}

/* Second pass over 64 values: code = c0 + (bounds[c0] < x), stored in value order. */
OL8_AVX512_INLINE void ol8v_codes64(const float *restrict x, const ol8v_encoder_t *enc,
                                    const uint8_t *restrict cb, uint8_t *restrict out) {
    const __m512i c0 = _mm512_load_si512(cb);
    __m512 b[4];
    ol8v_planes64(&enc->bounds, c0, b);
    const __mmask16 k0 = _mm512_cmp_ps_mask(b[0], _mm512_load_ps(x), _CMP_LT_OQ);
    const __mmask16 k1 = _mm512_cmp_ps_mask(b[1], _mm512_load_ps(x + 16), _CMP_LT_OQ);
    const __mmask16 k2 = _mm512_cmp_ps_mask(b[2], _mm512_load_ps(x + 32), _CMP_LT_OQ);
    const __mmask16 k3 = _mm512_cmp_ps_mask(b[3], _mm512_load_ps(x + 48), _CMP_LT_OQ);
    const __mmask64 below = _mm512_kunpackd(_mm512_kunpackw(k3, k2), _mm512_kunpackw(k1, k0));
    const __m512i k = _mm512_permutexvar_epi8(ol8v_order(), c0);  /* into value order */
    _mm512_storeu_si512(out, _mm512_mask_add_epi8(k, below, k, _mm512_set1_epi8(1)));
}

/* ol8v_quantize with the encoder's tables: the same scaling, clamp and codes. Two passes
   of 64 values (c0, then the codes): one pass per 64 values ran slower (its chain of
   permutes, each ~5 cycles, left the core idle). pos: every value of x is >= +0 or a NaN
   (ol8v_counts64). */
OL8_AVX512_INLINE float ol8v_quantize64(float *restrict x, __m512i top,
                                        const ol8v_encoder_t *enc, uint8_t *restrict out,
                                        int pos) {
    const float absmax = ol8_u2f(_mm512_reduce_max_epu32(top));
    const __m512 r = _mm512_set1_ps(1.0f / (absmax > 1e-38f ? absmax : 1e-38f));
    uint8_t cb[OL8_BLOCK] __attribute__((aligned(64)));
    /* A finite absmax leaves no NaN or Inf, and |x * r| at most a float32 step over 1
       (r is 1 / absmax rounded): the clamp changes no count, as every midpoint lies in
       (-1, 1) (cpu8bit._vector_tables checks), and is left out (4% of the encode). */
    if (pos) {
        if (absmax < __builtin_inff()) {
            for (int i = 0; i < OL8_BLOCK; i += 64) ol8v_counts64(x + i, r, enc, cb + i, 0, 1);
        } else {
            for (int i = 0; i < OL8_BLOCK; i += 64) ol8v_counts64(x + i, r, enc, cb + i, 1, 1);
        }
    } else if (absmax < __builtin_inff()) {
        for (int i = 0; i < OL8_BLOCK; i += 64) ol8v_counts64(x + i, r, enc, cb + i, 0, 0);
    } else {
        for (int i = 0; i < OL8_BLOCK; i += 64) ol8v_counts64(x + i, r, enc, cb + i, 1, 0);
    }
    for (int i = 0; i < OL8_BLOCK; i += 64) ol8v_codes64(x + i, enc, cb + i, out + i);
    return absmax;
}

OL8_AVX512_INLINE __m512i ol8v_abs_bits(__m512 x) {
    return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
}

/* ol8_block_q of a whole block b, on 16 lanes, 64 elements at a time (the decode's
   width); pl1, pl2: the byte planes of qmap1 and qmap2; e1, e2: the encoders of the two
   books (ol8v_quantize64), or NULL (ol8v_quantize, the start table's encode); pos2:
   see ol8v_pos2 (with this block's absmax2 >= +0, every exp_avg_sq value is >= +0 or a
   NaN). */
OL8_AVX512_INLINE void ol8v_block_q(
        const ol8_param_t *P, const ol8v_planes_t *pl1, const ol8v_planes_t *pl2,
        const ol8v_encoder_t *e1, const ol8v_encoder_t *e2, int64_t b, int pd, int gd,
        int coupled, int decoupled, int pos2) {
    const int64_t lo = b * OL8_BLOCK;
    uint8_t *restrict c1 = (uint8_t *)P->state1 + lo;
    uint8_t *restrict c2 = (uint8_t *)P->state2 + lo;
    const __m512 a1 = _mm512_set1_ps(P->absmax1[b]), a2 = _mm512_set1_ps(P->absmax2[b]);
    const __m512 b1 = _mm512_set1_ps(P->beta1), omb1 = _mm512_set1_ps(P->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(P->beta2), omb2 = _mm512_set1_ps(P->one_minus_beta2);
    const __m512 eps = _mm512_set1_ps(P->eps), step_size = _mm512_set1_ps(P->step_size);
    const __m512 bc2 = _mm512_set1_ps(P->bc2_sqrt);
    const __m512 decay = _mm512_set1_ps(P->decay), wd = _mm512_set1_ps(P->weight_decay);
    /* locals, not P's fields: the param stores would make gcc reload those */
    const void *grad = P->grad;
    void *param = P->param;
    float m[OL8_BLOCK] __attribute__((aligned(64))), v[OL8_BLOCK] __attribute__((aligned(64)));
    __m512i top1 = _mm512_setzero_si512(), top2 = _mm512_setzero_si512();
    for (int i0 = 0; i0 < OL8_BLOCK; i0 += 64) {
        __m512 d1[4], d2[4];
        ol8v_decode64(pl1, c1 + i0, d1);
        ol8v_decode64(pl2, c2 + i0, d2);
        for (int r = 0; r < 4; r++) {
            const int i = i0 + 16 * r;
            __m512 mi = _mm512_mul_ps(d1[r], a1);
            __m512 vi = _mm512_mul_ps(d2[r], a2);
            __m512 g = ol8v_load(grad, gd, lo + i);
            __m512 p = ol8v_load(param, pd, lo + i);
            if (coupled) g = _mm512_fmadd_ps(p, wd, g);
            mi = _mm512_fmadd_ps(g, omb1, _mm512_mul_ps(mi, b1));
            vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, _mm512_mul_ps(vi, b2));
            const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
            if (decoupled) p = _mm512_mul_ps(p, decay);
            p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, mi), denom));
            ol8v_store(param, pd, lo + i, p);
            _mm512_store_ps(m + i, mi);
            _mm512_store_ps(v + i, vi);
            top1 = _mm512_max_epu32(top1, ol8v_abs_bits(mi));
            top2 = _mm512_max_epu32(top2, ol8v_abs_bits(vi));
        }
    }
    pos2 = pos2 && !(ol8_f2u(P->absmax2[b]) >> 31);
    P->absmax1[b] = e1 ? ol8v_quantize64(m, top1, e1, c1, 0)
                       : ol8v_quantize(m, top1, P->table1, c1);
    P->absmax2[b] = e2 ? ol8v_quantize64(v, top2, e2, c2, pos2)
                       : ol8v_quantize(v, top2, P->table2, c2);
}

/* Whether exp_avg_sq is >= +0 or a NaN after every update of this call, where a block's
   absmax2 has its sign bit clear: beta2, 1 - beta2 and every code of qmap2 with the sign
   bit clear. Then b2 * (q * absmax2) is >= +0 or NaN, (omb2 * g) * g has the sign of omb2
   (g's sign twice) or is NaN, and their sum (fma) is >= +0 or NaN: no -0.0, no negative
   value, in any rounding mode. */
static inline int ol8v_pos2(const ol8_param_t *P) {
    if ((ol8_f2u(P->beta2) | ol8_f2u(P->one_minus_beta2)) >> 31) return 0;
    for (int i = 0; i < 256; i++)
        if (ol8_f2u(P->qmap2[i]) >> 31) return 0;
    return 1;
}


/* A partial last block: the scalar loop (one copy for every dtype and weight decay). */
OL8_AVX512 __attribute__((noinline)) static void ol8v_partial_block(
        const ol8_param_t *P, int64_t b) {
    ol8_block_q(P, b, P->param_dtype, P->grad_dtype, P->coupled, P->decoupled, 1);
}

/* The blocks [first, end) of a quantized param; a partial last block goes scalar. */
OL8_AVX512_INLINE void ol8v_blocks_wd(
        const ol8_param_t *P, int64_t first, int64_t end, int pd, int gd, int coupled,
        int decoupled) {
    ol8v_planes_t pl1, pl2;
    ol8v_planes(P->qmap1, &pl1);
    ol8v_planes(P->qmap2, &pl2);
    ol8v_encoder_t enc1, enc2;
    const ol8v_encoder_t *e1 = ol8v_encoder(P->table1, P->bounds1, &enc1) ? &enc1 : NULL;
    const ol8v_encoder_t *e2 = ol8v_encoder(P->table2, P->bounds2, &enc2) ? &enc2 : NULL;
    const int pos2 = ol8v_pos2(P);
    for (int64_t b = first; b < end; b++) {
        ol8_prefetch(P, b + OL8V_PREFETCH_BLOCKS, pd, gd);
        if ((b + 1) * OL8_BLOCK <= P->numel)
            ol8v_block_q(P, &pl1, &pl2, e1, e2, b, pd, gd, coupled, decoupled, pos2);
        else ol8v_partial_block(P, b);
    }
}

OL8_AVX512_INLINE void ol8v_blocks_typed(const ol8_param_t *P, int64_t first, int64_t end,
                                         int pd, int gd) {
    if (P->coupled) ol8v_blocks_wd(P, first, end, pd, gd, 1, 0);
    else if (P->decoupled) ol8v_blocks_wd(P, first, end, pd, gd, 0, 1);
    else ol8v_blocks_wd(P, first, end, pd, gd, 0, 0);
}

OL8_AVX512 __attribute__((noinline)) static void ol8v_blocks(
        const ol8_param_t *P, int64_t first, int64_t end) {
    const int pd = P->param_dtype, gd = P->grad_dtype;
    if (pd == OL8_F32 && gd == OL8_F32) ol8v_blocks_typed(P, first, end, OL8_F32, OL8_F32);
    else if (pd == OL8_BF16 && gd == OL8_BF16) ol8v_blocks_typed(P, first, end, OL8_BF16, OL8_BF16);
    else if (pd == OL8_F16 && gd == OL8_F16) ol8v_blocks_typed(P, first, end, OL8_F16, OL8_F16);
    else ol8v_blocks_typed(P, first, end, pd, gd);
}

/* ol_quantize_blockwise's block, on 16 lanes (a whole block, with a start table; enc:
   its book's encoder, or NULL). */
OL8_AVX512 __attribute__((noinline)) static float ol8v_quantize_block(
        const void *src, int dtype, int64_t lo, const int32_t *table,
        const ol8v_encoder_t *enc, uint8_t *out) {
    float x[OL8_BLOCK] __attribute__((aligned(64)));
    __m512i top = _mm512_setzero_si512();
    for (int i = 0; i < OL8_BLOCK; i += 16) {
        const __m512 v = ol8v_load(src, dtype, lo + i);
        _mm512_store_ps(x + i, v);
        top = _mm512_max_epu32(top, ol8v_abs_bits(v));
    }
    return enc ? ol8v_quantize64(x, top, enc, out, 0) : ol8v_quantize(x, top, table, out);
}
#else
static int ol8_avx512_ok(void) { return 0; }
#endif

/* ---- AVX2 path for whole blocks: ol8_block_q on 8 lanes, the same operations in the
   same order (the same bits, tested), with the decode by gathers from the code books,
   the absmax taken in the update loop, and the encode of ol8a_encode. */
#if defined(__x86_64__) && defined(__GNUC__)
#define OL8_HAVE_AVX2_BLOCKS 1
#define OL8_AVX2F __attribute__((target("avx2,fma,f16c")))
#define OL8_AVX2F_INLINE OL8_AVX2F static inline __attribute__((always_inline))

OL8_AVX2F_INLINE __m256 ol8a_load(const void *p, int dtype, int64_t i) {
    if (dtype == OL8_F32) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dtype == OL8_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* As ol8_store: round to nearest even, a NaN stays NaN. */
OL8_AVX2F_INLINE void ol8a_store(void *p, int dtype, int64_t i, __m256 x) {
    if (dtype == OL8_F32) {
        _mm256_storeu_ps((float *)p + i, x);
        return;
    }
    __m128i h;
    if (dtype == OL8_BF16) {
        const __m256i u = _mm256_castps_si256(x);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
        const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        const __m256i nan = _mm256_cmpgt_epi32(
            _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
        const __m256i v = _mm256_blendv_epi8(r, q, nan);
        h = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    } else {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

/* The max of the 8 lanes' unsigned values. */
OL8_AVX2F_INLINE uint32_t ol8a_hmax(__m256i t) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* t[k[0 .. 8)] by scalar loads into lanes (see ol8a_lookup8). */
OL8_AVX2F_INLINE __m256i ol8a_lookup8i(const int32_t *t, const int32_t *k) {
    uint64_t k01, k23, k45, k67;  /* two indices per load */
    __builtin_memcpy(&k01, k, 8);
    __builtin_memcpy(&k23, k + 2, 8);
    __builtin_memcpy(&k45, k + 4, 8);
    __builtin_memcpy(&k67, k + 6, 8);
    __m128i lo = _mm_cvtsi32_si128(t[(uint32_t)k01]);
    lo = _mm_insert_epi32(lo, t[k01 >> 32], 1);
    lo = _mm_insert_epi32(lo, t[(uint32_t)k23], 2);
    lo = _mm_insert_epi32(lo, t[k23 >> 32], 3);
    __m128i hi = _mm_cvtsi32_si128(t[(uint32_t)k45]);
    hi = _mm_insert_epi32(hi, t[k45 >> 32], 1);
    hi = _mm_insert_epi32(hi, t[(uint32_t)k67], 2);
    hi = _mm_insert_epi32(hi, t[k67 >> 32], 3);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* ol8_quantize of one whole block whose max |x| bits are the lanes of top: scaled by
   x * (1 / max(absmax, 1e-38)), clamped (max/min keep a NaN, as ol8_clamp1), encoded
   as ol8_encode encodes (the start table read by scalar loads, not gathers). Three
   passes over the block: the scaled values' table indices, the entries, the codes. */
OL8_AVX2F_INLINE float ol8a_quantize(
        float *restrict x, __m256i top, const int32_t *table, uint8_t *restrict out) {
    const float absmax = ol8_u2f(ol8a_hmax(top));
    const __m256 r = _mm256_set1_ps(1.0f / (absmax > 1e-38f ? absmax : 1e-38f));
    const __m256 lo = _mm256_set1_ps(-1.0f), hi = _mm256_set1_ps(1.0f);
    const __m256i lo1 = _mm256_set1_epi32(table[0] - 1), w = _mm256_set1_epi32(table[1]);
    const __m256i wm1 = _mm256_set1_epi32(table[1] - 1), t3 = _mm256_set1_epi32(table[3]);
    const __m256i t2 = _mm256_set1_epi32(table[2]), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i zero = _mm256_setzero_si256(), low8 = _mm256_set1_epi32(0xFF);
    const __m256i top16 = _mm256_set1_epi32((int32_t)0xFFFF0000u);
    const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF), mag15 = _mm256_set1_epi32(0x7FFF);
    const __m256i lo16 = _mm256_set1_epi32(table[0] << 16);
    const int32_t *entries = table + 4;
    int32_t idx[OL8_BLOCK] __attribute__((aligned(32)));
    for (int i = 0; i < OL8_BLOCK; i += 8) {
        const __m256 xs = _mm256_mul_ps(_mm256_load_ps(x + i), r);
        const __m256 xv = _mm256_min_ps(hi, _mm256_max_ps(lo, xs));
        _mm256_store_ps(x + i, xv);
        const __m256i u = _mm256_castps_si256(xv);
        __m256i j = _mm256_and_si256(_mm256_srli_epi32(u, 16), mag15);
        j = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(j, lo1), zero), wm1);
        const __m256i jn = _mm256_add_epi32(w, _mm256_and_si256(j, t3));
        const __m256i sel = _mm256_castps_si256(_mm256_blendv_ps(   /* by the sign bit */
            _mm256_castsi256_ps(j), _mm256_castsi256_ps(jn), xv));
        _mm256_store_si256((__m256i *)(idx + i), sel);
    }
    for (int i = 0; i < OL8_BLOCK; i += 8) {
        const __m256 xv = _mm256_load_ps(x + i);
        const __m256i u = _mm256_castps_si256(xv);
        const __m256i ev = ol8a_lookup8i(entries, idx + i);
        __m256i bound = _mm256_or_si256(_mm256_and_si256(u, top16), _mm256_srli_epi32(ev, 8));
        const __m256i bucket0 = _mm256_cmpgt_epi32(lo16, _mm256_and_si256(u, mag));
        const __m256i b0 = _mm256_castps_si256(_mm256_blendv_ps(   /* by the sign bit */
            _mm256_castsi256_ps(t2), _mm256_castsi256_ps(inf), xv));
        bound = _mm256_blendv_epi8(bound, b0, bucket0);
        const __m256 below = _mm256_cmp_ps(_mm256_castsi256_ps(bound), xv, _CMP_LT_OQ);
        __m256i k = _mm256_sub_epi32(_mm256_and_si256(ev, low8), _mm256_castps_si256(below));
        k = _mm256_blendv_epi8(k, low8, _mm256_castps_si256(_mm256_cmp_ps(xv, xv, _CMP_UNORD_Q)));
        const __m128i k16 = _mm_packus_epi32(_mm256_castsi256_si128(k),
                                             _mm256_extracti128_si256(k, 1));
        _mm_storel_epi64((__m128i *)(out + i), _mm_packus_epi16(k16, k16));
    }
    return absmax;
}

/* q[c[0 .. 8)] by scalar loads into lanes: on AMD Zen 3 about 0.3 ns per value where
   a gather takes 0.45. */
OL8_AVX2F_INLINE __m256 ol8a_lookup8(const float *q, const uint8_t *c) {
    const int32_t *t = (const int32_t *)q;
    uint64_t k;  /* the 8 codes in one load, split by shifts (loads are the bottleneck) */
    __builtin_memcpy(&k, c, 8);
    __m128i lo = _mm_cvtsi32_si128(t[k & 0xFF]);
    lo = _mm_insert_epi32(lo, t[(k >> 8) & 0xFF], 1);
    lo = _mm_insert_epi32(lo, t[(k >> 16) & 0xFF], 2);
    lo = _mm_insert_epi32(lo, t[(k >> 24) & 0xFF], 3);
    __m128i hi = _mm_cvtsi32_si128(t[(k >> 32) & 0xFF]);
    hi = _mm_insert_epi32(hi, t[(k >> 40) & 0xFF], 1);
    hi = _mm_insert_epi32(hi, t[(k >> 48) & 0xFF], 2);
    hi = _mm_insert_epi32(hi, t[k >> 56], 3);
    return _mm256_castsi256_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

OL8_AVX2F_INLINE __m256i ol8a_abs_bits(__m256 x) {
    return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
}

/* ol8_block_q of a whole block b, on 8 lanes. */
OL8_AVX2F_INLINE void ol8a_block_q(
        const ol8_param_t *P, int64_t b, int pd, int gd, int coupled, int decoupled) {
    const int64_t lo = b * OL8_BLOCK;
    uint8_t *restrict c1 = (uint8_t *)P->state1 + lo;
    uint8_t *restrict c2 = (uint8_t *)P->state2 + lo;
    const __m256 a1 = _mm256_set1_ps(P->absmax1[b]), a2 = _mm256_set1_ps(P->absmax2[b]);
    const __m256 b1 = _mm256_set1_ps(P->beta1), omb1 = _mm256_set1_ps(P->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(P->beta2), omb2 = _mm256_set1_ps(P->one_minus_beta2);
    const __m256 eps = _mm256_set1_ps(P->eps), step_size = _mm256_set1_ps(P->step_size);
    const __m256 bc2 = _mm256_set1_ps(P->bc2_sqrt);
    const __m256 decay = _mm256_set1_ps(P->decay), wd = _mm256_set1_ps(P->weight_decay);
    const float *q1 = P->qmap1, *q2 = P->qmap2;
    float m[OL8_BLOCK] __attribute__((aligned(32))), v[OL8_BLOCK] __attribute__((aligned(32)));
    __m256i top1 = _mm256_setzero_si256(), top2 = _mm256_setzero_si256();
    for (int i = 0; i < OL8_BLOCK; i += 8) {
        __m256 mi = _mm256_mul_ps(ol8a_lookup8(q1, c1 + i), a1);
        __m256 vi = _mm256_mul_ps(ol8a_lookup8(q2, c2 + i), a2);
        __m256 g = ol8a_load(P->grad, gd, lo + i);
        __m256 p = ol8a_load(P->param, pd, lo + i);
        if (coupled) g = _mm256_fmadd_ps(p, wd, g);
        mi = _mm256_fmadd_ps(g, omb1, _mm256_mul_ps(mi, b1));
        vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(vi, b2));
        const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
        if (decoupled) p = _mm256_mul_ps(p, decay);
        p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, mi), denom));
        ol8a_store(P->param, pd, lo + i, p);
        _mm256_store_ps(m + i, mi);
        _mm256_store_ps(v + i, vi);
        top1 = _mm256_max_epu32(top1, ol8a_abs_bits(mi));
        top2 = _mm256_max_epu32(top2, ol8a_abs_bits(vi));
    }
    P->absmax1[b] = ol8a_quantize(m, top1, P->table1, c1);
    P->absmax2[b] = ol8a_quantize(v, top2, P->table2, c2);
}

/* A partial last block: the scalar loop, one copy for every dtype and weight decay form
   (a per-form copy in each ol8a_blocks_wd would add compile time, not speed). */
OL8_AVX2F __attribute__((noinline)) static void ol8a_partial_block(
        const ol8_param_t *P, int64_t b) {
    ol8_block_q(P, b, P->param_dtype, P->grad_dtype, P->coupled, P->decoupled, 1);
}

/* The blocks [first, end) of a quantized param; a partial last block goes scalar. */
OL8_AVX2F_INLINE void ol8a_blocks_wd(
        const ol8_param_t *P, int64_t first, int64_t end, int pd, int gd, int coupled,
        int decoupled) {
    for (int64_t b = first; b < end; b++) {
        ol8_prefetch(P, b + OL8_PREFETCH_BLOCKS, pd, gd);
        if ((b + 1) * OL8_BLOCK <= P->numel) ol8a_block_q(P, b, pd, gd, coupled, decoupled);
        else ol8a_partial_block(P, b);
    }
}

OL8_AVX2F_INLINE void ol8a_blocks_typed(const ol8_param_t *P, int64_t first, int64_t end,
                                        int pd, int gd) {
    if (P->coupled) ol8a_blocks_wd(P, first, end, pd, gd, 1, 0);
    else if (P->decoupled) ol8a_blocks_wd(P, first, end, pd, gd, 0, 1);
    else ol8a_blocks_wd(P, first, end, pd, gd, 0, 0);
}

OL8_AVX2F __attribute__((noinline)) static void ol8a_blocks(
        const ol8_param_t *P, int64_t first, int64_t end) {
    const int pd = P->param_dtype, gd = P->grad_dtype;
    if (pd == OL8_F32 && gd == OL8_F32) ol8a_blocks_typed(P, first, end, OL8_F32, OL8_F32);
    else if (pd == OL8_BF16 && gd == OL8_BF16) ol8a_blocks_typed(P, first, end, OL8_BF16, OL8_BF16);
    else if (pd == OL8_F16 && gd == OL8_F16) ol8a_blocks_typed(P, first, end, OL8_F16, OL8_F16);
    else ol8a_blocks_typed(P, first, end, pd, gd);
}
#endif

/* The scalar loops: a baseline, and on AVX2 and AVX-512 CPUs the partial blocks and
   float32-state params only, so no AVX-512 clone (it would add a third of the library's
   compile time). */
#define OL8_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))

static inline __attribute__((always_inline)) void ol8_item_wd(
        const ol8_param_t *P, const ol8_item_t *it, int pd, int gd, int coupled,
        int decoupled, int avx2) {
    if (P->quantized) {
        for (int64_t b = it->first_block; b < it->first_block + it->n_blocks; b++)
            ol8_block_q(P, b, pd, gd, coupled, decoupled, avx2);
    } else {
        int64_t lo = it->first_block * OL8_BLOCK;
        int64_t hi = (it->first_block + it->n_blocks) * OL8_BLOCK;
        if (hi > P->numel) hi = P->numel;
        ol8_range_f32(P, lo, hi, pd, gd, coupled, decoupled);
    }
}

/* The weight-decay form as a constant, so that each loop body is branch-free. */
static inline __attribute__((always_inline)) void ol8_item_typed(
        const ol8_param_t *P, const ol8_item_t *it, int pd, int gd, int avx2) {
    if (P->coupled) ol8_item_wd(P, it, pd, gd, 1, 0, avx2);
    else if (P->decoupled) ol8_item_wd(P, it, pd, gd, 0, 1, avx2);
    else ol8_item_wd(P, it, pd, gd, 0, 0, avx2);
}

OL8_CLONES
static void ol8_item(const ol8_param_t *params, const ol8_item_t *it, int simd) {
    const ol8_param_t *P = &params[it->param];
#ifdef OL8_HAVE_AVX512
    if (simd == 2 && P->quantized && P->table1 != NULL && P->table2 != NULL) {
        ol8v_blocks(P, it->first_block, it->first_block + it->n_blocks);
        return;
    }
#endif
#ifdef OL8_HAVE_AVX2_BLOCKS
    if (simd == 1 && P->quantized && P->table1 != NULL && P->table2 != NULL) {
        ol8a_blocks(P, it->first_block, it->first_block + it->n_blocks);
        return;
    }
#endif
    const int pd = P->param_dtype, gd = P->grad_dtype;
    /* grads of the param's own dtype are the common case: specialize those */
    const int avx2 = simd >= 1;
    if (pd == OL8_F32 && gd == OL8_F32) ol8_item_typed(P, it, OL8_F32, OL8_F32, avx2);
    else if (pd == OL8_BF16 && gd == OL8_BF16) ol8_item_typed(P, it, OL8_BF16, OL8_BF16, avx2);
    else if (pd == OL8_F16 && gd == OL8_F16) ol8_item_typed(P, it, OL8_F16, OL8_F16, avx2);
    else ol8_item_typed(P, it, pd, gd, avx2);
}

#define OL8_MAX_THREADS 256

typedef struct {
    const ol8_param_t *params;
    const ol8_item_t *items;
    int64_t n_items;
    int64_t first, stride;
    int simd;
} ol8_job_t;

static void *ol8_run(void *arg) {
    const ol8_job_t *job = (const ol8_job_t *)arg;
    for (int64_t t = job->first; t < job->n_items; t += job->stride)
        ol8_item(job->params, &job->items[t], job->simd);
    return NULL;
}

/* The SIMD paths this CPU runs: 2 = AVX-512 with VBMI (whole blocks), 1 = AVX2 with FMA
   and F16C (whole blocks), 0 = none. */
static int ol8_simd_level(void) { return ol8_avx512_ok() ? 2 : ol8_avx2_ok() ? 1 : 0; }

/* Step every listed item. simd is the highest path to take: 0 keeps to the scalar
   loops (tests compare the paths), 1 allows AVX2, 2 AVX-512, each where the CPU has it
   (a lower level is taken otherwise). Returns 0, or -1 if a worker thread
   could not start (then the items ran on fewer threads: the result is the same).
   Allocates nothing. */
int ol_adamw8bit_step(const ol8_param_t *params, const ol8_item_t *items, int64_t n_items,
                      int32_t n_threads, int32_t simd) {
    if (n_items <= 0) return 0;
    simd = simd < 0 ? 0 : simd > ol8_simd_level() ? ol8_simd_level() : simd;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > OL8_MAX_THREADS) n_threads = OL8_MAX_THREADS;
    if (n_threads > n_items) n_threads = (int32_t)n_items;
    int rc = 0;
    if (n_threads == 1) {
        ol8_job_t job = {params, items, n_items, 0, 1, simd};
        ol8_run(&job);
        return 0;
    }
#ifdef _OPENMP
    #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int64_t t = 0; t < n_items; t++) ol8_item(params, &items[t], simd);
#else
    ol8_job_t jobs[OL8_MAX_THREADS];
    pthread_t tids[OL8_MAX_THREADS];
    int started[OL8_MAX_THREADS];
    for (int t = 0; t < n_threads; t++) {
        ol8_job_t job = {params, items, n_items, t, n_threads, simd};
        jobs[t] = job;
        started[t] = 0;
    }
    for (int t = 1; t < n_threads; t++)
        started[t] = pthread_create(&tids[t], NULL, ol8_run, &jobs[t]) == 0;
    ol8_run(&jobs[0]);
    for (int t = 1; t < n_threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else { ol8_run(&jobs[t]); rc = -1; }
    }
#endif
    return rc;
}

/* Encode n values (float32, bfloat16 or float16) as codes of the book whose bounds are
   given, one absmax per 256-element block: the kernel's own rule, for state conversions
   (table may be NULL: binary search). simd: as ol_adamw8bit_step's. Allocates nothing. */
int ol_quantize_blockwise(const void *src, int32_t dtype, int64_t n, const int32_t *table,
                          const float *bounds, uint8_t *out, float *absmax, int32_t n_threads,
                          int32_t simd) {
    const int64_t blocks = (n + OL8_BLOCK - 1) / OL8_BLOCK;
    if (n_threads < 1) n_threads = 1;
    simd = simd < 0 || table == NULL ? 0 : simd > ol8_simd_level() ? ol8_simd_level() : simd;
#ifdef OL8_HAVE_AVX512
    ol8v_encoder_t encoder;  /* read-only below, shared by the threads */
    const ol8v_encoder_t *enc =
        simd == 2 && ol8v_encoder(table, bounds, &encoder) ? &encoder : NULL;
#endif
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * OL8_BLOCK;
        const int64_t len = n - lo < OL8_BLOCK ? n - lo : OL8_BLOCK;
#ifdef OL8_HAVE_AVX512
        if (simd == 2 && len == OL8_BLOCK) {
            absmax[b] = ol8v_quantize_block(src, dtype, lo, table, enc, out + lo);
            continue;
        }
#endif
        float x[OL8_BLOCK];
        if (dtype == OL8_F32) {
            const float *s = (const float *)src + lo;
            for (int64_t i = 0; i < len; i++) x[i] = s[i];
        } else {
            ol8_widen(src, dtype, lo, len, x);
        }
        absmax[b] = ol8_quantize(x, len, table, bounds, out + lo, simd >= 1);
    }
    return 0;
}

int64_t ol_adamw8bit_param_size(void) { return (int64_t)sizeof(ol8_param_t); }
int64_t ol_adamw8bit_item_size(void) { return (int64_t)sizeof(ol8_item_t); }
int ol_adamw8bit_simd(void) { return ol8_simd_level(); }
"""
