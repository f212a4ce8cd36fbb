"""C source of the CPU kernel of optladder's AdamW (compiled by :mod:`.cpu` at first use).

The kernel reproduces :func:`optladder.optimizers.eager.eager_step` operation by operation,
for float32, bfloat16 and float16 params and grads and float32 or bfloat16 moments, in
the order and with the fused multiply-adds that torch's vectorized CPU kernels use
(``lerp``, ``add`` with ``alpha`` and ``addcmul`` end in an ``fmadd``; ``mul``, ``div`` and
``addcdiv`` round each operation; the square root is the IEEE one, which the eager path
gets by taking it in float64), so params and moments match the eager oracle bit for bit.
It is compiled with ``-ffp-contract=off``: only the ``fmaf`` calls written here fuse. It
needs no torch headers: Python passes raw pointers through ctypes.

``target_clones`` builds the loop for AVX-512, AVX2+FMA and baseline x86-64; the dynamic
loader picks one at load time from the CPU's features. The loop body is plain C that gcc
vectorizes (one 32-bit hash per element for the moments' stochastic rounding, one more
for a low-precision param's). On x86-64 the params run instead through the same
operations written with intrinsics: ``ol_range_v4`` (AVX-512 F/BW/DQ/VL, 16 lanes) on
x86-64-v4 CPUs, ``ol_range_v3`` (AVX2, FMA, F16C, 8 lanes) on x86-64-v3 ones. gcc's
vectorization of the C loop was compute-bound on both (about 150 instructions per 16
elements on AVX2; ~0.52 ns per element on one Zen 4 core against ~0.42 for
``ol_range_v4``, float32 params with stochastically rounded bfloat16 moments in L3), and
it does not vectorize float16 params at all (4-7 ns per element there, against 0.5-0.9
on either intrinsics path). Their bits are the C loop's, which defines them;
``ol_adamw_step``'s ``simd`` argument caps the path taken, so tests check every path
against the oracle.
"""

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#define OL_F32 0
#define OL_BF16 1
#define OL_F16 2

/* One param: raw pointers, dtypes, and the scalars of its own step count. The table is
   built once per param set (Python reuses it between steps and rewrites only the grad
   pointer, the grad dtype and the per-step fields). */
typedef struct {
    void *param;           /* OL_* param_dtype */
    const void *grad;      /* OL_* grad_dtype */
    void *exp_avg;         /* float32, or bfloat16 bit patterns */
    void *exp_avg_sq;
    double *step;          /* the param's 0-d float64 step count (ol_read/bump_steps) */
    int64_t numel;
    int64_t param_index;   /* position over all param groups (the random bits' counter) */
    int32_t grad_dtype;
    int32_t param_dtype;
    uint32_t step_key;     /* rounding.step_key(seed, step) of this param's new step */
    float step_size;       /* -lr / bias_correction1, rounded to float */
    float bc2_sqrt;        /* sqrt(bias_correction2), rounded to float */
    int32_t hyper_index;   /* its param group's options: hyper[hyper_index] of the call */
} ol_param_t;

/* Scalars shared by a param group, each rounded to float as torch rounds a Python
   scalar (one per group of the table: ol_param_t.hyper_index). */
typedef struct {
    float lerp_weight;     /* 1 - beta1 */
    float beta2;
    float one_minus_beta2;
    float eps;
    float decay;           /* 1 - lr * weight_decay (decoupled), else 1 */
    float weight_decay;    /* coupled weight decay, else 0 */
    int32_t coupled;       /* 1: grad += wd * param */
    int32_t maximize;
    int32_t moment_dtype;  /* OL_F32 or OL_BF16 */
    int32_t stochastic;    /* bf16 moments: 1 stochastic rounding, 0 nearest even */
    int32_t param_stochastic; /* bf16/f16 params: 1 stochastic rounding, 0 nearest even */
    int32_t pad;
} ol_hyper_t;

static inline uint32_t ol_hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

static inline uint32_t ol_mix(uint32_t a, uint32_t b) { return ol_hash32((a * 0x9E3779B9u) ^ b); }

#define OL_PARAM_STREAM 0x1B873593u  /* rounding.PARAM_STREAM */

static inline uint32_t ol_f2u(float f) { union { float f; uint32_t u; } c; c.f = f; return c.u; }
static inline float ol_u2f(uint32_t u) { union { float f; uint32_t u; } c; c.u = u; return c.f; }

/* float32 -> bfloat16, stochastic with 16 random bits. NaN -> the quiet NaN of its high
   half (bit 22 set): adding the bits could carry a NaN into the sign (0x7FFFxxxx) or,
   truncated, leave an infinity (0x7F80xxxx). The NaN test is the float compare x != x
   (one vector compare) and the low half is dropped by the shift alone: 5 vector
   operations per value where (u + r) & 0xFFFF0000, (u & 0xFFFF0000) | 0x00400000 and an
   integer test (u & 0x7FFFFFFF) > 0x7F800000 took 8, for the same bits. */
static inline uint16_t ol_bf16_sr(float x, uint32_t r16) {
    uint32_t u = ol_f2u(x);
    uint32_t r = u + r16;
    uint32_t n = u | 0x00400000u;
    return (uint16_t)((x != x ? n : r) >> 16);
}

static inline uint16_t ol_bf16_ne(float x) {
    uint32_t u = ol_f2u(x);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}

static inline uint16_t ol_f16_bits(_Float16 h) {
    union { _Float16 h; uint16_t u; } c;
    c.h = h;
    return c.u;
}

/* float32 -> float16, stochastic with 32 random bits r (rounding.stochastic_round_f16):
   |x| >= 2**-14 drops 13 bits, 2**-24 <= |x| < 2**-14 drops 126 - exponent bits (the
   subnormal quantum 2**-24), smaller |x| becomes 2**-24 with probability about
   |x| / 2**-24 (24 bits of r), else 0. NaN -> 0x7E00 with its sign. The rounded float32
   value is a float16 value, so the final conversion is exact. */
static inline uint16_t ol_f16_sr(float x, uint32_t r) {
    uint32_t u = ol_f2u(x);
    uint32_t a = u & 0x7FFFFFFFu, s = u & 0x80000000u;
    uint32_t e = a >> 23;
    uint32_t sh = e >= 113u ? 13u : (e >= 103u ? 126u - e : 23u);
    uint32_t mask = (1u << sh) - 1u;
    uint32_t big = (a + (r & mask)) & ~mask;
    float t = ol_u2f(a) * 281474976710656.0f;   /* |x| * 2**48: |x| / 2**-24 in units of 2**-24 */
    uint32_t tiny = (float)(r >> 8) < t ? 0x33800000u : 0u;  /* 2**-24 or 0 */
    uint32_t y = s | (e >= 103u ? big : tiny);
    uint16_t h = ol_f16_bits((_Float16)ol_u2f(y));
    return a > 0x7F800000u ? (uint16_t)((s >> 16) | 0x7E00u) : h;
}

/* The update of elements [lo, hi) of one param. Every argument after hi is a constant
   in each call site, so each instance is a branch-free loop that gcc vectorizes. */
static inline __attribute__((always_inline)) void ol_body(
    const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi,
    const int gd, const int pd, const int md, const int stoch, const int pstoch)
{
    float *restrict p32 = (float *)P->param;
    uint16_t *restrict p16 = (uint16_t *)P->param;
    _Float16 *restrict ph = (_Float16 *)P->param;
    uint16_t *restrict m16 = (uint16_t *)P->exp_avg;
    uint16_t *restrict v16 = (uint16_t *)P->exp_avg_sq;
    float *restrict m32 = (float *)P->exp_avg;
    float *restrict v32 = (float *)P->exp_avg_sq;
    const float *restrict g32 = (const float *)P->grad;
    const uint16_t *restrict g16 = (const uint16_t *)P->grad;
    const _Float16 *restrict gh = (const _Float16 *)P->grad;
    const uint32_t key = ol_mix(ol_mix(P->step_key, (uint32_t)P->param_index),
                                (uint32_t)((uint64_t)P->param_index >> 32));
    const uint32_t pkey = ol_mix(key, OL_PARAM_STREAM);
    const float step_size = P->step_size, bc2_sqrt = P->bc2_sqrt;
    const float w = H->lerp_weight, b2 = H->beta2, omb2 = H->one_minus_beta2;
    const float eps = H->eps, decay = H->decay, wd = H->weight_decay;
    const int coupled = H->coupled, maximize = H->maximize;
    const int small = w < 0.5f;
    const float coeff = small ? w : w - 1.0f;
    const uint32_t sign = maximize ? 0x80000000u : 0u;  /* -g is a sign flip */
    uint32_t ctr = (uint32_t)lo;  /* (uint32_t)i, counted in 32 bits */
    for (int64_t i = lo; i < hi; i++, ctr++) {
        float g;
        if (gd == OL_F32) g = g32[i];
        else if (gd == OL_BF16) g = ol_u2f((uint32_t)g16[i] << 16);
        else g = (float)gh[i];
        g = ol_u2f(ol_f2u(g) ^ sign);
        float p;
        if (pd == OL_F32) p = p32[i];
        else if (pd == OL_BF16) p = ol_u2f((uint32_t)p16[i] << 16);
        else p = (float)ph[i];
        p = p * decay;
        g = coupled ? fmaf(p, wd, g) : g;
        float m, v;
        if (md == OL_F32) { m = m32[i]; v = v32[i]; }
        else { m = ol_u2f((uint32_t)m16[i] << 16); v = ol_u2f((uint32_t)v16[i] << 16); }
        m = fmaf(coeff, g - m, small ? m : g);
        v = fmaf(omb2 * g, g, v * b2);
        float denom = sqrtf(v) / bc2_sqrt + eps;
        p = p + (step_size * m) / denom;
        if (pd == OL_F32) p32[i] = p;
        else if (pd == OL_BF16) {
            p16[i] = pstoch ? ol_bf16_sr(p, ol_hash32(ctr + pkey) & 0xFFFFu)
                            : ol_bf16_ne(p);
        } else {
            uint16_t *restrict ph16 = (uint16_t *)P->param;
            ph16[i] = pstoch ? ol_f16_sr(p, ol_hash32(ctr + pkey))
                             : ol_f16_bits((_Float16)p);
        }
        if (md == OL_F32) { m32[i] = m; v32[i] = v; }
        else if (stoch) {
            uint32_t bits = ol_hash32(ctr + key);
            m16[i] = ol_bf16_sr(m, bits & 0xFFFFu);
            v16[i] = ol_bf16_sr(v, bits >> 16);
        } else {
            m16[i] = ol_bf16_ne(m);
            v16[i] = ol_bf16_ne(v);
        }
    }
}

#define OL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

/* One instance per (grad dtype, param dtype, moment format, param rounding). */
#define OL_G(pd, md, st, ps) \
    do { \
        if (gd == OL_F32) ol_body(P, H, lo, hi, OL_F32, pd, md, st, ps); \
        else if (gd == OL_BF16) ol_body(P, H, lo, hi, OL_BF16, pd, md, st, ps); \
        else ol_body(P, H, lo, hi, OL_F16, pd, md, st, ps); \
    } while (0)
#define OL_M(pd, ps) \
    do { \
        if (H->moment_dtype == OL_F32) OL_G(pd, OL_F32, 0, ps); \
        else if (H->stochastic) OL_G(pd, OL_BF16, 1, ps); \
        else OL_G(pd, OL_BF16, 0, ps); \
    } while (0)

OL_CLONES
static void ol_range(const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi) {
    const int gd = P->grad_dtype, pd = P->param_dtype, ps = H->param_stochastic;
    if (pd == OL_F32) OL_M(OL_F32, 0);
    else if (pd == OL_BF16) { if (ps) OL_M(OL_BF16, 1); else OL_M(OL_BF16, 0); }
    else { if (ps) OL_M(OL_F16, 1); else OL_M(OL_F16, 0); }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The same update written with AVX2/FMA/F16C intrinsics, for x86-64-v3 CPUs without
   AVX-512 (where the v4 clone of ol_range runs). gcc's vectorization of ol_body on 8
   lanes came to about 150 instructions per 16 elements (the 64-bit index packed down
   for the hash, every 16-bit narrowing masked twice, the loop-invariant selects as
   blends, registers spilled), enough to make the loop compute-bound on AVX2 where the
   memory stream allows ~0.7 ns per element: this loop does the same operations, in the
   same order and rounding, on 16 elements per iteration in about 90. The bits are
   ol_body's (the scalar helpers above define them; the tail of a range runs ol_range). */
#include <immintrin.h>
#define OL_HAVE_V3 1
#define OL_PREFETCH 256  /* elements: 1 KiB ahead in a float32 stream, 512 B in a 16-bit one */
#define OL_V3 static inline __attribute__((target("avx2,fma,f16c"), always_inline))
#define OL_F16_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* 8 values of dtype dt from base[i..i+8), as float32 (exact) */
OL_V3 __m256 ol8_load(const void *base, int64_t i, const int dt) {
    if (dt == OL_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dt == OL_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

OL_V3 __m256i ol8_hash32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* ol_bf16_sr on 8 lanes: the bfloat16 in the low half of each 32-bit lane */
OL_V3 __m256i ol8_bf16_sr(__m256 x, __m256i r16) {
    __m256i u = _mm256_castps_si256(x);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 r = _mm256_castsi256_ps(_mm256_add_epi32(u, r16));
    __m256 n = _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)));
    return _mm256_srli_epi32(_mm256_castps_si256(_mm256_blendv_ps(r, n, nan)), 16);
}

/* ol_bf16_sr on 8 lanes none of which is NaN: the rounding alone */
OL_V3 __m256i ol8_bf16_sr_num(__m256 x, __m256i r16) {
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r16), 16);
}

/* ol_bf16_ne on 8 lanes */
OL_V3 __m256i ol8_bf16_ne(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_srli_epi32(r, 16);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
        _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}

/* ol_f16_sr on 8 lanes (32 random bits each), as ol16v_f16_sr: the float16 bits */
OL_V3 __m128i ol8_f16_sr(__m256 x, __m256i r) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    /* a float16 normal or an infinity in every lane: 2**-14 <= |x| <= inf */
    const __m256i plain = _mm256_and_si256(_mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x387FFFFF)),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800001), a));
    if (_mm256_movemask_ps(_mm256_castsi256_ps(plain)) == 0xFF) {
        const __m256i low13 = _mm256_set1_epi32(0x1FFF);
        const __m256i y = _mm256_andnot_si256(
            low13, _mm256_add_epi32(u, _mm256_and_si256(r, low13)));
        return _mm256_cvtps_ph(_mm256_castsi256_ps(y), OL_F16_NEAREST);
    }
    const __m256i s = _mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u));
    const __m256i e = _mm256_srli_epi32(a, 23);
    const __m256i quantum = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(102));
    const __m256i normal = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(112));
    __m256i sh = _mm256_blendv_epi8(_mm256_set1_epi32(23),
                                    _mm256_sub_epi32(_mm256_set1_epi32(126), e), quantum);
    sh = _mm256_blendv_epi8(sh, _mm256_set1_epi32(13), normal);
    const __m256i mask = _mm256_sub_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(1), sh),
                                          _mm256_set1_epi32(1));
    const __m256i big = _mm256_andnot_si256(mask, _mm256_add_epi32(a, _mm256_and_si256(r, mask)));
    const __m256 t = _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(281474976710656.0f));
    const __m256 up = _mm256_cmp_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), t, _CMP_LT_OQ);
    const __m256i tiny = _mm256_and_si256(_mm256_castps_si256(up), _mm256_set1_epi32(0x33800000));
    const __m256i y = _mm256_or_si256(s, _mm256_blendv_epi8(tiny, big, quantum));
    const __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(y), OL_F16_NEAREST);
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    const __m256i n = _mm256_or_si256(_mm256_srli_epi32(s, 16), _mm256_set1_epi32(0x7E00));
    const __m128i n16 = _mm_packus_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan),
                                          _mm256_extracti128_si256(nan, 1));
    return _mm_blendv_epi8(h, n16, nan16);
}

/* 16 values of dtype dt from base[i..i+16) as float32 (exact), in two vectors: d[0] the
   elements 0-7 and d[1] 8-15, or with perm d[0] the elements 0-3, 8-11 and d[1] 4-7,
   12-15: bfloat16 by one unpack each (instead of a widening and a shift), float32 by
   128-bit loads and inserts from memory (float16 only in order) */
OL_V3 void ol16_load(__m256 d[2], const void *base, int64_t i, const int dt, const int perm) {
    if (perm && dt == OL_BF16) {
        __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        d[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
        d[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
    } else if (perm && dt == OL_F32) {
        const float *f = (const float *)base + i;
        d[0] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(f)),
                                    _mm_loadu_ps(f + 8), 1);
        d[1] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(f + 4)),
                                    _mm_loadu_ps(f + 12), 1);
    } else {
        d[0] = ol8_load(base, i, dt);
        d[1] = ol8_load(base, i + 8, dt);
    }
}

/* 16 float32 to dst[0..16) from two vectors in ol16_load's order */
OL_V3 void ol16_store_f32(float *dst, __m256 a, __m256 b, const int perm) {
    if (perm) {
        _mm_storeu_ps(dst, _mm256_castps256_ps128(a));
        _mm_storeu_ps(dst + 4, _mm256_castps256_ps128(b));
        _mm_storeu_ps(dst + 8, _mm256_extractf128_ps(a, 1));
        _mm_storeu_ps(dst + 12, _mm256_extractf128_ps(b, 1));
    } else {
        _mm256_storeu_ps(dst, a);
        _mm256_storeu_ps(dst + 8, b);
    }
}

/* 16 bfloat16 from the low halves of a and b, in ol16_load's order */
OL_V3 void ol16_store_bf16(uint16_t *dst, __m256i a, __m256i b, const int perm) {
    __m256i pk = _mm256_packus_epi32(a, b);  /* per 128-bit lane: a0-3 b0-3 | a4-7 b4-7 */
    if (!perm) pk = _mm256_permute4x64_epi64(pk, 0xD8);
    _mm256_storeu_si256((__m256i *)dst, pk);
}

/* Elements [lo, lo + 16 k) of ol_body(P, H, lo, hi, gd, pd, md, stoch, pstoch) for
   float32 or bfloat16 params; returns where it stopped. */
OL_V3 int64_t ol_body_v3(
    const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi,
    const int gd, const int pd, const int md, const int stoch, const int pstoch)
{
    /* with bfloat16 moments (and no float16 grads), every vector holds the elements in
       ol16_load's perm order: measured on Zen 3, float32 params with bf16 moments ~5 %
       faster, bfloat16 params with float32 moments ~6 % slower (so not there) */
    const int perm = gd != OL_F16 && pd != OL_F16 && md == OL_BF16;
    void *const param = P->param;
    const void *const grad = P->grad;
    float *const m32 = (float *)P->exp_avg, *const v32 = (float *)P->exp_avg_sq;
    uint16_t *const m16 = (uint16_t *)P->exp_avg, *const v16 = (uint16_t *)P->exp_avg_sq;
    const uint32_t key = ol_mix(ol_mix(P->step_key, (uint32_t)P->param_index),
                                (uint32_t)((uint64_t)P->param_index >> 32));
    const uint32_t pkey = ol_mix(key, OL_PARAM_STREAM);
    const float w = H->lerp_weight;
    const int coupled = H->coupled, maximize = H->maximize, small = w < 0.5f;
    /* small ? m : g as a blend on an all-ones (small) or all-zeros mask */
    const __m256 pick_m = _mm256_castsi256_ps(_mm256_set1_epi32(small ? -1 : 0));
    const __m256 step_size = _mm256_set1_ps(P->step_size), bc2 = _mm256_set1_ps(P->bc2_sqrt);
    const __m256 coeff = _mm256_set1_ps(small ? w : w - 1.0f);
    const __m256 b2 = _mm256_set1_ps(H->beta2), omb2 = _mm256_set1_ps(H->one_minus_beta2);
    const __m256 eps = _mm256_set1_ps(H->eps), decay = _mm256_set1_ps(H->decay);
    const __m256 wd = _mm256_set1_ps(H->weight_decay);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF), sixteen = _mm256_set1_epi32(16);
    const __m256i half = _mm256_set1_epi32(perm ? 4 : 8);  /* lane offset of d[1] */
    const __m256i lanes = perm ? _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11)
                               : _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    /* the hash inputs (uint32_t)i + key and (uint32_t)i + pkey of the lanes of d[0] */
    __m256i ctr = _mm256_add_epi32(_mm256_set1_epi32((int)((uint32_t)lo + key)), lanes);
    __m256i pctr = _mm256_add_epi32(_mm256_set1_epi32((int)((uint32_t)lo + pkey)), lanes);
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256 G[2], Q[2], M[2], V[2];
        __m256i pr[2], mr[2], vr[2];
        /* Software prefetch OL_PREFETCH elements ahead in every stream: measured in a
           torch process on an AVX2 EPYC, 16M float32 params with bf16 moments went from
           0.90-1.0 to 0.80-0.84 ns per element (64M: 1.06 to 0.80); a prefetch past the
           end is harmless (it never faults). */
        _mm_prefetch((const char *)grad + (i + OL_PREFETCH) * (gd == OL_F32 ? 4 : 2), _MM_HINT_T0);
        _mm_prefetch((const char *)param + (i + OL_PREFETCH) * (pd == OL_F32 ? 4 : 2), _MM_HINT_T0);
        _mm_prefetch((const char *)m32 + (i + OL_PREFETCH) * (md == OL_F32 ? 4 : 2), _MM_HINT_T0);
        _mm_prefetch((const char *)v32 + (i + OL_PREFETCH) * (md == OL_F32 ? 4 : 2), _MM_HINT_T0);
        ol16_load(G, grad, i, gd, perm);
        ol16_load(Q, param, i, pd, perm);
        ol16_load(M, m32, i, md, perm);
        ol16_load(V, v32, i, md, perm);
        for (int h = 0; h < 2; h++) {
            __m256 g = G[h], m = M[h], v = V[h];
            if (maximize) g = _mm256_xor_ps(g, sign);
            __m256 p = _mm256_mul_ps(Q[h], decay);
            if (coupled) g = _mm256_fmadd_ps(p, wd, g);
            m = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, m), _mm256_blendv_ps(g, m, pick_m));
            v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(v, b2));
            __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
            p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m), denom));
            Q[h] = p; M[h] = m; V[h] = v;
        }
        if (pd == OL_F32) ol16_store_f32((float *)param + i, Q[0], Q[1], perm);
        if (pd == OL_F16) {  /* in order (perm is 0) */
            for (int h = 0; h < 2; h++) {
                const __m256i pc = h ? _mm256_add_epi32(pctr, half) : pctr;
                _mm_storeu_si128((__m128i *)((uint16_t *)param + i + 8 * h),
                                 pstoch ? ol8_f16_sr(Q[h], ol8_hash32(pc))
                                        : _mm256_cvtps_ph(Q[h], OL_F16_NEAREST));
            }
        }
        if (md == OL_F32) {
            ol16_store_f32(m32 + i, M[0], M[1], perm);
            ol16_store_f32(v32 + i, V[0], V[1], perm);
        }
        /* The random bits, then the roundings. A NaN m or v makes p NaN (m enters p
           through a product and a quotient, v through the denominator), so when no p
           of the 16 is NaN (one compare of both halves), no value to round is NaN and
           the stochastic rounding is the addition and the shift alone; otherwise (rare)
           each value takes ol8_bf16_sr's NaN test. */
        __m256i pb[2], mb[2], vb[2];
        for (int h = 0; h < 2; h++) {
            if (pd == OL_BF16 && pstoch)
                pb[h] = _mm256_and_si256(ol8_hash32(h ? _mm256_add_epi32(pctr, half) : pctr), lo16);
            if (md == OL_BF16 && stoch) {
                __m256i bits = ol8_hash32(h ? _mm256_add_epi32(ctr, half) : ctr);
                mb[h] = _mm256_and_si256(bits, lo16);
                vb[h] = _mm256_srli_epi32(bits, 16);
            }
        }
        const int any_sr = (pd == OL_BF16 && pstoch) || (md == OL_BF16 && stoch);
        int clean = 0;
        if (any_sr) {
            __m256 nan = _mm256_cmp_ps(Q[0], Q[1], _CMP_UNORD_Q);  /* Q[0] or Q[1] NaN */
            clean = _mm256_testz_ps(nan, nan);
        }
        if (__builtin_expect(clean, 1)) {
            for (int h = 0; h < 2; h++) {
                if (pd == OL_BF16)
                    pr[h] = pstoch ? ol8_bf16_sr_num(Q[h], pb[h]) : ol8_bf16_ne(Q[h]);
                if (md == OL_BF16 && stoch) {
                    mr[h] = ol8_bf16_sr_num(M[h], mb[h]);
                    vr[h] = ol8_bf16_sr_num(V[h], vb[h]);
                }
            }
        } else {
            for (int h = 0; h < 2; h++) {
                if (pd == OL_BF16) pr[h] = pstoch ? ol8_bf16_sr(Q[h], pb[h]) : ol8_bf16_ne(Q[h]);
                if (md == OL_BF16 && stoch) {
                    mr[h] = ol8_bf16_sr(M[h], mb[h]);
                    vr[h] = ol8_bf16_sr(V[h], vb[h]);
                }
            }
        }
        if (md == OL_BF16 && !stoch)
            for (int h = 0; h < 2; h++) { mr[h] = ol8_bf16_ne(M[h]); vr[h] = ol8_bf16_ne(V[h]); }
        if (pd == OL_BF16) ol16_store_bf16((uint16_t *)param + i, pr[0], pr[1], perm);
        if (md == OL_BF16) {
            ol16_store_bf16(m16 + i, mr[0], mr[1], perm);
            ol16_store_bf16(v16 + i, vr[0], vr[1], perm);
        }
        ctr = _mm256_add_epi32(ctr, sixteen);
        pctr = _mm256_add_epi32(pctr, sixteen);
    }
    return i;
}

/* The body of ol_range_v3 and ol_range_v4: one instance of body (ol_body_v3 or
   ol_body_v4) per grad dtype, param dtype, moment format and rounding, as ol_range's;
   the tail of the range (under one iteration's elements) runs ol_range. */
#define OL_SIMD_G(body, pd, md, st, ps) \
    do { \
        if (gd == OL_F32) i = body(P, H, lo, hi, OL_F32, pd, md, st, ps); \
        else if (gd == OL_BF16) i = body(P, H, lo, hi, OL_BF16, pd, md, st, ps); \
        else i = body(P, H, lo, hi, OL_F16, pd, md, st, ps); \
    } while (0)
#define OL_SIMD_M(body, pd, ps) \
    do { \
        if (H->moment_dtype == OL_F32) OL_SIMD_G(body, pd, OL_F32, 0, ps); \
        else if (H->stochastic) OL_SIMD_G(body, pd, OL_BF16, 1, ps); \
        else OL_SIMD_G(body, pd, OL_BF16, 0, ps); \
    } while (0)
#define OL_SIMD_RANGE(body) \
    do { \
        const int gd = P->grad_dtype, pd = P->param_dtype; \
        int64_t i = lo; \
        if (pd == OL_F32) OL_SIMD_M(body, OL_F32, 0); \
        else if (pd == OL_BF16 && H->param_stochastic) OL_SIMD_M(body, OL_BF16, 1); \
        else if (pd == OL_BF16) OL_SIMD_M(body, OL_BF16, 0); \
        else if (H->param_stochastic) OL_SIMD_M(body, OL_F16, 1); \
        else OL_SIMD_M(body, OL_F16, 0); \
        if (i < hi) ol_range(P, H, i, hi); \
    } while (0)

/* ol_range on x86-64-v3 (float32, bfloat16 and float16 params) */
__attribute__((target("avx2,fma,f16c")))
static void ol_range_v3(const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi) {
    OL_SIMD_RANGE(ol_body_v3);
}

/* The same update with AVX-512 intrinsics (F, BW, DQ, VL), for x86-64-v4 CPUs: 16 lanes
   a vector, 32 elements an iteration, in element order. gcc's vectorization of ol_body
   for the v4 clone ran at ~0.53 ns per element on one Zen 4 core in L2 as in L3
   (compute-bound); this loop takes ~0.42-0.44 there (float32 params, stochastically
   rounded bfloat16 moments): the NaN test of the roundings once per 32 elements on the
   new params, each 16-bit store one two-source permute of the high halves. The bits are
   ol_body's (the tail of a range runs ol_range). */
#define OL_V4_TARGET "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"
#define OL_V4 static inline __attribute__((target(OL_V4_TARGET), always_inline))

/* 16 values of dtype dt from base[i..i+16) as float32 (exact) */
OL_V4 __m512 ol16v_load(const void *base, int64_t i, const int dt) {
    if (dt == OL_F32) return _mm512_loadu_ps((const float *)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (dt == OL_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

OL_V4 __m512i ol16v_hash32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* ol_bf16_sr on 16 lanes none of which is NaN, before the shift: the addition alone */
OL_V4 __m512i ol16v_bf16_sr_num(__m512 x, __m512i r16) {
    return _mm512_add_epi32(_mm512_castps_si512(x), r16);
}

/* ol_bf16_sr on 16 lanes, before the shift: the bfloat16 in the high half of each lane */
OL_V4 __m512i ol16v_bf16_sr(__m512 x, __m512i r16) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(_mm512_add_epi32(u, r16), nan, u, _mm512_set1_epi32(0x00400000));
}

/* ol_bf16_ne on 16 lanes, before the shift: the bfloat16 in the high half of each lane */
OL_V4 __m512i ol16v_bf16_ne(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
}

/* ol_f16_sr on 16 lanes (32 random bits each): the same integer and float steps, and
   the final conversion exact (the rounded value is a float16 value). When every lane is
   a float16 normal or an infinity (2**-14 <= |x| <= inf: the usual case), the rounding
   is (u + (r & 0x1FFF)) & ~0x1FFF, the sign carried along (no carry reaches it). */
OL_V4 __m256i ol16v_f16_sr(__m512 x, __m512i r) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 plain = _mm512_cmple_epu32_mask(
        _mm512_sub_epi32(a, _mm512_set1_epi32(0x38800000)), _mm512_set1_epi32(0x47000000));
    if (plain == 0xFFFF) {
        const __m512i low13 = _mm512_set1_epi32(0x1FFF);
        const __m512i y = _mm512_andnot_si512(
            low13, _mm512_add_epi32(u, _mm512_and_si512(r, low13)));
        return _mm512_cvtps_ph(_mm512_castsi512_ps(y), OL_F16_NEAREST);
    }
    const __m512i s = _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u));
    const __m512i e = _mm512_srli_epi32(a, 23);
    const __mmask16 normal = _mm512_cmpge_epu32_mask(e, _mm512_set1_epi32(113));
    const __mmask16 quantum = _mm512_cmpge_epu32_mask(e, _mm512_set1_epi32(103));
    __m512i sh = _mm512_mask_sub_epi32(_mm512_set1_epi32(23), quantum, _mm512_set1_epi32(126), e);
    sh = _mm512_mask_mov_epi32(sh, normal, _mm512_set1_epi32(13));
    const __m512i mask = _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), sh),
                                          _mm512_set1_epi32(1));
    const __m512i big = _mm512_andnot_si512(mask, _mm512_add_epi32(a, _mm512_and_si512(r, mask)));
    const __m512 t = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(281474976710656.0f));
    const __mmask16 up = _mm512_cmp_ps_mask(
        _mm512_cvtepi32_ps(_mm512_srli_epi32(r, 8)), t, _CMP_LT_OQ);
    const __m512i tiny = _mm512_maskz_mov_epi32(up, _mm512_set1_epi32(0x33800000));
    const __m512i y = _mm512_or_si512(s, _mm512_mask_blend_epi32(quantum, tiny, big));
    const __m256i h = _mm512_cvtps_ph(_mm512_castsi512_ps(y), OL_F16_NEAREST);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
    const __m256i n = _mm512_cvtepi32_epi16(
        _mm512_or_si512(_mm512_srli_epi32(s, 16), _mm512_set1_epi32(0x7E00)));
    return _mm256_mask_mov_epi16(h, nan, n);
}

/* (_Float16)x on 16 lanes: round to nearest even, as the C loop's conversion */
OL_V4 __m256i ol16v_f16_ne(__m512 x) {
    return _mm512_cvtps_ph(x, OL_F16_NEAREST);
}

/* the high halves of a's 16 lanes, then b's, to dst[0..32): one two-source permute
   instead of two shifts and two narrowing moves */
OL_V4 void ol16v_store_bf16(uint16_t *dst, __m512i a, __m512i b) {
    const __m512i odd = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    _mm512_storeu_si512((void *)dst, _mm512_permutex2var_epi16(a, odd, b));
}

/* Elements [lo, lo + 32 k) of ol_body(P, H, lo, hi, gd, pd, md, stoch, pstoch) for
   float32 or bfloat16 params; returns where it stopped. */
OL_V4 int64_t ol_body_v4(
    const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi,
    const int gd, const int pd, const int md, const int stoch, const int pstoch)
{
    void *const param = P->param;
    const void *const grad = P->grad;
    float *const m32 = (float *)P->exp_avg, *const v32 = (float *)P->exp_avg_sq;
    uint16_t *const m16 = (uint16_t *)P->exp_avg, *const v16 = (uint16_t *)P->exp_avg_sq;
    const uint32_t key = ol_mix(ol_mix(P->step_key, (uint32_t)P->param_index),
                                (uint32_t)((uint64_t)P->param_index >> 32));
    const uint32_t pkey = ol_mix(key, OL_PARAM_STREAM);
    const float w = H->lerp_weight;
    const int coupled = H->coupled, maximize = H->maximize, small = w < 0.5f;
    const __mmask16 pick_m = small ? 0xFFFF : 0;  /* small ? m : g, lane by lane */
    const __m512 step_size = _mm512_set1_ps(P->step_size), bc2 = _mm512_set1_ps(P->bc2_sqrt);
    const __m512 coeff = _mm512_set1_ps(small ? w : w - 1.0f);
    const __m512 b2 = _mm512_set1_ps(H->beta2), omb2 = _mm512_set1_ps(H->one_minus_beta2);
    const __m512 eps = _mm512_set1_ps(H->eps), decay = _mm512_set1_ps(H->decay);
    const __m512 wd = _mm512_set1_ps(H->weight_decay);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u), lo16 = _mm512_set1_epi32(0xFFFF);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16), thirty_two = _mm512_set1_epi32(32);
    /* the hash inputs (uint32_t)i + key and (uint32_t)i + pkey of the first 16 lanes */
    __m512i ctr = _mm512_add_epi32(_mm512_set1_epi32((int)((uint32_t)lo + key)), lanes);
    __m512i pctr = _mm512_add_epi32(_mm512_set1_epi32((int)((uint32_t)lo + pkey)), lanes);
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        __m512 Q[2], M[2], V[2];
        __m512i pr[2], mr[2], vr[2];
        for (int h = 0; h < 2; h++) {
            const int64_t j = i + 16 * h;
            __m512 g = ol16v_load(grad, j, gd);
            if (maximize) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
            __m512 p = _mm512_mul_ps(ol16v_load(param, j, pd), decay);
            if (coupled) g = _mm512_fmadd_ps(p, wd, g);
            __m512 m = md == OL_F32 ? _mm512_loadu_ps(m32 + j) : ol16v_load(m16, j, OL_BF16);
            __m512 v = md == OL_F32 ? _mm512_loadu_ps(v32 + j) : ol16v_load(v16, j, OL_BF16);
            m = _mm512_fmadd_ps(coeff, _mm512_sub_ps(g, m), _mm512_mask_blend_ps(pick_m, g, m));
            v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, _mm512_mul_ps(v, b2));
            const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
            p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
            Q[h] = p; M[h] = m; V[h] = v;
            if (pd == OL_F32) _mm512_storeu_ps((float *)param + j, p);
            if (pd == OL_F16) {
                const __m512i pc = h ? _mm512_add_epi32(pctr, sixteen) : pctr;
                _mm256_storeu_si256((__m256i *)((uint16_t *)param + j),
                                    pstoch ? ol16v_f16_sr(p, ol16v_hash32(pc)) : ol16v_f16_ne(p));
            }
            if (md == OL_F32) {
                _mm512_storeu_ps(m32 + j, m);
                _mm512_storeu_ps(v32 + j, v);
            }
        }
        /* The random bits, then the roundings. A NaN m or v makes p NaN (m enters p
           through a product and a quotient, v through the denominator), so when no p
           of the 32 is NaN (two compares), no value to round is NaN and the stochastic
           rounding is the addition alone; otherwise (rare) each value takes
           ol_bf16_sr's NaN test. */
        __m512i pb[2], mb[2], vb[2];
        for (int h = 0; h < 2; h++) {
            if (pd == OL_BF16 && pstoch) {
                const __m512i pc = h ? _mm512_add_epi32(pctr, sixteen) : pctr;
                pb[h] = _mm512_and_si512(ol16v_hash32(pc), lo16);
            }
            if (md == OL_BF16 && stoch) {
                const __m512i bits = ol16v_hash32(h ? _mm512_add_epi32(ctr, sixteen) : ctr);
                mb[h] = _mm512_and_si512(bits, lo16);
                vb[h] = _mm512_srli_epi32(bits, 16);
            }
        }
        const int any_sr = (pd == OL_BF16 && pstoch) || (md == OL_BF16 && stoch);
        const int clean = any_sr && (_mm512_cmp_ps_mask(Q[0], Q[0], _CMP_UNORD_Q)
                                     | _mm512_cmp_ps_mask(Q[1], Q[1], _CMP_UNORD_Q)) == 0;
        for (int h = 0; h < 2; h++) {
            if (pd == OL_BF16)
                pr[h] = !pstoch ? ol16v_bf16_ne(Q[h])
                        : clean ? ol16v_bf16_sr_num(Q[h], pb[h]) : ol16v_bf16_sr(Q[h], pb[h]);
            if (md == OL_BF16 && stoch) {
                mr[h] = clean ? ol16v_bf16_sr_num(M[h], mb[h]) : ol16v_bf16_sr(M[h], mb[h]);
                vr[h] = clean ? ol16v_bf16_sr_num(V[h], vb[h]) : ol16v_bf16_sr(V[h], vb[h]);
            } else if (md == OL_BF16) {
                mr[h] = ol16v_bf16_ne(M[h]);
                vr[h] = ol16v_bf16_ne(V[h]);
            }
        }
        if (pd == OL_BF16) ol16v_store_bf16((uint16_t *)param + i, pr[0], pr[1]);
        if (md == OL_BF16) {
            ol16v_store_bf16(m16 + i, mr[0], mr[1]);
            ol16v_store_bf16(v16 + i, vr[0], vr[1]);
        }
        ctr = _mm512_add_epi32(ctr, thirty_two);
        pctr = _mm512_add_epi32(pctr, thirty_two);
    }
    return i;
}

/* ol_range on x86-64-v4 (float32, bfloat16 and float16 params) */
__attribute__((target(OL_V4_TARGET)))
static void ol_range_v4(const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi) {
    OL_SIMD_RANGE(ol_body_v4);
}

/* The hand-written paths this CPU runs: 2 = ol_range_v4 (the AVX-512 of the v4 clone),
   1 = ol_range_v3 (AVX2, FMA and F16C), 0 = none (ol_range alone). */
static int ol_cpu_simd(void) {
    __builtin_cpu_init();
    int v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
             && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
             && __builtin_cpu_supports("avx512cd");
    int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
             && __builtin_cpu_supports("f16c");
    return v3 && v4 ? 2 : v3 ? 1 : 0;
}
#endif

typedef struct {
    const ol_param_t *params;
    int64_t n_params;
    const ol_hyper_t *hyper;  /* the groups' options, indexed by hyper_index */
    const int64_t *offsets;  /* offsets[k]: first element of param k; offsets[n] = total */
    int64_t begin, end;      /* range in the concatenation of all params' elements */
    int simd;                /* float32 and bfloat16 params: 2 ol_range_v4, 1 ol_range_v3,
                                0 ol_range (float16 params: always ol_range) */
} ol_job_t;

static void *ol_run(void *arg) {
    const ol_job_t *job = (const ol_job_t *)arg;
    /* the first param that overlaps [begin, end): binary search in the offsets */
    int64_t lo_k = 0, hi_k = job->n_params;
    while (hi_k - lo_k > 1) {
        int64_t mid = (lo_k + hi_k) / 2;
        if (job->offsets[mid] <= job->begin) lo_k = mid; else hi_k = mid;
    }
    for (int64_t k = lo_k; k < job->n_params && job->offsets[k] < job->end; k++) {
        const ol_param_t *P = &job->params[k];
        int64_t offset = job->offsets[k];
        int64_t lo = job->begin > offset ? job->begin - offset : 0;
        int64_t hi = job->end - offset < P->numel ? job->end - offset : P->numel;
        if (lo >= hi) continue;
        const ol_hyper_t *H = &job->hyper[P->hyper_index];
#ifdef OL_HAVE_V3
        if (job->simd == 2) { ol_range_v4(P, H, lo, hi); continue; }
        if (job->simd == 1) { ol_range_v3(P, H, lo, hi); continue; }
#endif
        ol_range(P, H, lo, hi);
    }
    return NULL;
}

#define OL_MAX_THREADS 256
#define OL_TASK 131072  /* elements per work item: 512 KiB of float32 params */

#ifndef _OPENMP
static void ol_split(ol_job_t *job, int64_t total, int64_t t, int64_t n_parts,
                     int64_t align) {
    int64_t per = (total + n_parts - 1) / n_parts;
    per = (per + align - 1) / align * align;
    job->begin = t * per < total ? t * per : total;
    job->end = (t + 1) * per < total ? (t + 1) * per : total;
}
#endif

/* Built with -fopenmp, the shared object needs libgomp.so.1, which resolves to the
   OpenMP runtime torch has already loaded: the kernel runs on torch's own (warm) worker
   threads instead of competing with them. Without OpenMP it starts pthreads. */

int ol_simd_level(void);

/* Update every param of the table, each with the options of its group
   (hyper[params[k].hyper_index]: the table may hold params of many groups, stepped in
   one call). offsets has n_params + 1 entries (the prefix sums of the numels, built by
   the caller with the table: the kernel allocates nothing).
   simd caps the hand-written path taken (2, 1 or 0, see ol_cpu_simd; every path writes
   the same bits). Returns 0, or -1 if a worker thread could not start (then the update
   ran on fewer threads: the result is the same). */
int ol_adamw_step(const ol_param_t *params, int64_t n_params, const int64_t *offsets,
                  const ol_hyper_t *hyper, int32_t n_threads, int32_t simd) {
    if (n_params <= 0) return 0;
    const int64_t total = offsets[n_params];
    const int level = ol_simd_level();
    ol_job_t base = {params, n_params, hyper, offsets, 0, total, simd < level ? simd : level};
    if (n_threads < 1) n_threads = 1;
    if (n_threads > OL_MAX_THREADS) n_threads = OL_MAX_THREADS;
    int rc = 0;
    if (n_threads == 1) {
        ol_run(&base);
    } else {
#ifdef _OPENMP
        /* Work items handed out dynamically: a thread that gets preempted (2 cores
           shared with a data loader) does not hold the others up. */
        int64_t n_tasks = (total + OL_TASK - 1) / OL_TASK;
        #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
        for (int64_t t = 0; t < n_tasks; t++) {
            ol_job_t job = base;
            job.begin = t * OL_TASK;
            job.end = (t + 1) * OL_TASK < total ? (t + 1) * OL_TASK : total;
            ol_run(&job);
        }
#else
        ol_job_t jobs[OL_MAX_THREADS];
        pthread_t tids[OL_MAX_THREADS];
        int started[OL_MAX_THREADS];
        for (int t = 0; t < n_threads; t++) {
            jobs[t] = base;
            ol_split(&jobs[t], total, t, n_threads, 64);
            started[t] = 0;
        }
        for (int t = 1; t < n_threads; t++) {
            if (jobs[t].begin >= jobs[t].end) continue;
            started[t] = pthread_create(&tids[t], NULL, ol_run, &jobs[t]) == 0;
        }
        ol_run(&jobs[0]);
        for (int t = 1; t < n_threads; t++) {
            if (started[t]) pthread_join(tids[t], NULL);
            else if (jobs[t].begin < jobs[t].end) { ol_run(&jobs[t]); rc = -1; }
        }
#endif
    }
    return rc;
}

/* The step counts of the table, read into out[n] and bumped together (one call each per
   step instead of one torch call per param). A row whose param has no grad this step
   (numel 0 and grad NULL: the kernel steps none of its elements) is not counted; a
   zero-size param with a grad has a non-NULL grad pointer (KernelTable.set_grads). */
void ol_read_steps(const ol_param_t *params, int64_t n, double *out) {
    for (int64_t k = 0; k < n; k++) out[k] = *params[k].step;
}

void ol_bump_steps(const ol_param_t *params, int64_t n) {
    for (int64_t k = 0; k < n; k++)
        if (params[k].numel > 0 || params[k].grad != NULL) *params[k].step += 1.0;
}

/* The highest hand-written path this CPU runs (see ol_cpu_simd): 2, 1 or 0. */
int ol_simd_level(void) {
#ifdef OL_HAVE_V3
    static int level = -1;  /* a fact of the CPU, not configuration: computed once */
    if (level < 0) level = ol_cpu_simd();
    return level;
#else
    return 0;
#endif
}

int ol_abi_version(void) { return 6; }
"""
