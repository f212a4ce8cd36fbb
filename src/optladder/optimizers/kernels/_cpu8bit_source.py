"""C source of the CPU kernel of the 8bit rung (compiled with the bf16 kernel by :mod:`.cpu`).

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
(its torch backend's ``quantize_blockwise``: ``x * (1 / max(absmax, 1e-38))`` clamped to
[-1, 1], then the number of midpoints between adjacent codes that lie below it, so a tie
goes to the lower code); the midpoints (``bounds``, 255 values and a +inf) are computed in
Python when the step is prepared, with a 127 KiB table per book that starts the count
from a float's top 16 bits (two comparisons finish it); the unsigned book's first bound
is set to 0 so that a positive ``exp_avg_sq`` never becomes 0 (see
``cpu8bit.code_bounds``). Zero is a code of both books, so a moment that is exactly 0
stays exactly 0 (bitsandbytes' native CPU quantizer, an approximate table search, maps it
to a small non-zero code).

Nothing is allocated: work items (runs of whole blocks of one param) are listed by the
caller, and handed out to ``n_threads`` threads of torch's OpenMP pool (or pthreads).
Symbols carry the ``ol8_`` prefix: this source is compiled in one file after the bf16
kernel's.
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
    const int32_t *table1;   /* 2 * 16257: bounds below each float's top 16 bits (below) */
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
   index of the nearest code, ties to the lower one. table[sign * OL8_HALF + top 15
   magnitude bits] counts the bounds below the smallest float with those 16 top bits; at
   most 2 bounds lie among the floats sharing them (checked when the table is made), so
   two steps finish the count (bounds[255] = +inf stops it). */
#define OL8_HALF 16257  /* magnitude prefixes 0 ... 0x3F80 (that of 1.0) */
static inline __attribute__((always_inline)) uint8_t ol8_encode(
        const int32_t *table, const float *bounds, int32_t u, float x) {
    int32_t mag = (u >> 16) & 0x7FFF;
    mag = mag < OL8_HALF - 1 ? mag : OL8_HALF - 1;  /* NaN */
    int32_t k = table[(u < 0 ? OL8_HALF : 0) + mag];
    k += bounds[k] < x;
    k += bounds[k] < x;
    return (uint8_t)k;
}

/* The same count by binary search on the bounds alone (conversions: no table needed). */
static inline __attribute__((always_inline)) uint8_t ol8_search(const float *bounds, float x) {
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

/* absmax = max |x| of n values by their bits (a NaN wins, as torch's max), then each
   value scaled by 1 / max(absmax, 1e-38), clamped to [-1, 1] and encoded in place
   (with the start table, or by binary search where table is NULL). */
static inline __attribute__((always_inline)) float ol8_quantize(
        float *restrict x, int64_t n, const int32_t *table, const float *bounds,
        uint8_t *restrict out) {
    const uint32_t *restrict xu = (const uint32_t *)x;
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = xu[i] & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    const float absmax = ol8_u2f(top);
    const float r = 1.0f / (absmax > 1e-38f ? absmax : 1e-38f);
    for (int64_t i = 0; i < n; i++) x[i] = ol8_clamp1(x[i] * r);
    const int32_t *restrict xi = (const int32_t *)x;
    if (table != NULL) {
        for (int64_t i = 0; i < n; i++) out[i] = ol8_encode(table, bounds, xi[i], x[i]);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = ol8_search(bounds, x[i]);
    }
    return absmax;
}

/* One block of an 8-bit param: elements [lo, lo + n) of block b. */
static inline __attribute__((always_inline)) void ol8_block_q(
        const ol8_param_t *P, int64_t b, int pd, int gd, int coupled, int decoupled) {
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
    for (int64_t i = 0; i < n; i++) {
        float g = gs[i];
        float p = ps[i];
        if (coupled) g = fmaf(p, wd, g);
        float mi = q1[c1[i]] * a1;
        float vi = q2[c2[i]] * a2;
        mi = fmaf(g, omb1, mi * b1);            /* mul_(beta1).add_(g, alpha=1-beta1) */
        vi = fmaf(omb2 * g, g, vi * b2);        /* mul_(beta2).addcmul_(g, g, 1-beta2) */
        float denom = sqrtf(vi) / bc2 + eps;
        if (decoupled) p = p * decay;
        ps[i] = p + (step_size * mi) / denom;   /* addcdiv_(m, denom, -lr/bc1) */
        m[i] = mi;
        v[i] = vi;
    }
    if (pd != OL8_F32) ol8_narrow(P->param, pd, lo, n, pbuf);
    P->absmax1[b] = ol8_quantize(m, n, P->table1, P->bounds1, c1);
    P->absmax2[b] = ol8_quantize(v, n, P->table2, P->bounds2, c2);
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

#define OL8_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

static inline __attribute__((always_inline)) void ol8_item_wd(
        const ol8_param_t *P, const ol8_item_t *it, int pd, int gd, int coupled,
        int decoupled) {
    if (P->quantized) {
        for (int64_t b = it->first_block; b < it->first_block + it->n_blocks; b++)
            ol8_block_q(P, b, pd, gd, coupled, decoupled);
    } else {
        int64_t lo = it->first_block * OL8_BLOCK;
        int64_t hi = (it->first_block + it->n_blocks) * OL8_BLOCK;
        if (hi > P->numel) hi = P->numel;
        ol8_range_f32(P, lo, hi, pd, gd, coupled, decoupled);
    }
}

/* The weight-decay form as a constant, so that each loop body is branch-free. */
static inline __attribute__((always_inline)) void ol8_item_typed(
        const ol8_param_t *P, const ol8_item_t *it, int pd, int gd) {
    if (P->coupled) ol8_item_wd(P, it, pd, gd, 1, 0);
    else if (P->decoupled) ol8_item_wd(P, it, pd, gd, 0, 1);
    else ol8_item_wd(P, it, pd, gd, 0, 0);
}

OL8_CLONES
static void ol8_item(const ol8_param_t *params, const ol8_item_t *it) {
    const ol8_param_t *P = &params[it->param];
    const int pd = P->param_dtype, gd = P->grad_dtype;
    /* grads of the param's own dtype are the common case: specialize those */
    if (pd == OL8_F32 && gd == OL8_F32) ol8_item_typed(P, it, OL8_F32, OL8_F32);
    else if (pd == OL8_BF16 && gd == OL8_BF16) ol8_item_typed(P, it, OL8_BF16, OL8_BF16);
    else if (pd == OL8_F16 && gd == OL8_F16) ol8_item_typed(P, it, OL8_F16, OL8_F16);
    else ol8_item_typed(P, it, pd, gd);
}

#define OL8_MAX_THREADS 256

typedef struct {
    const ol8_param_t *params;
    const ol8_item_t *items;
    int64_t n_items;
    int64_t first, stride;
} ol8_job_t;

static void *ol8_run(void *arg) {
    const ol8_job_t *job = (const ol8_job_t *)arg;
    for (int64_t t = job->first; t < job->n_items; t += job->stride)
        ol8_item(job->params, &job->items[t]);
    return NULL;
}

/* Step every listed item. Returns 0, or -1 if a worker thread could not start (then
   the items ran on fewer threads: the result is the same). Allocates nothing. */
int ol_adamw8bit_step(const ol8_param_t *params, const ol8_item_t *items, int64_t n_items,
                      int32_t n_threads) {
    if (n_items <= 0) return 0;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > OL8_MAX_THREADS) n_threads = OL8_MAX_THREADS;
    if (n_threads > n_items) n_threads = (int32_t)n_items;
    int rc = 0;
    if (n_threads == 1) {
        ol8_job_t job = {params, items, n_items, 0, 1};
        ol8_run(&job);
        return 0;
    }
#ifdef _OPENMP
    #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int64_t t = 0; t < n_items; t++) ol8_item(params, &items[t]);
#else
    ol8_job_t jobs[OL8_MAX_THREADS];
    pthread_t tids[OL8_MAX_THREADS];
    int started[OL8_MAX_THREADS];
    for (int t = 0; t < n_threads; t++) {
        ol8_job_t job = {params, items, n_items, t, n_threads};
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
   (table may be NULL: binary search). Allocates nothing. */
int ol_quantize_blockwise(const void *src, int32_t dtype, int64_t n, const int32_t *table,
                          const float *bounds, uint8_t *out, float *absmax, int32_t n_threads) {
    const int64_t blocks = (n + OL8_BLOCK - 1) / OL8_BLOCK;
    if (n_threads < 1) n_threads = 1;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * OL8_BLOCK;
        const int64_t len = n - lo < OL8_BLOCK ? n - lo : OL8_BLOCK;
        float x[OL8_BLOCK];
        if (dtype == OL8_F32) {
            const float *s = (const float *)src + lo;
            for (int64_t i = 0; i < len; i++) x[i] = s[i];
        } else {
            ol8_widen(src, dtype, lo, len, x);
        }
        absmax[b] = ol8_quantize(x, len, table, bounds, out + lo);
    }
    return 0;
}

int64_t ol_adamw8bit_param_size(void) { return (int64_t)sizeof(ol8_param_t); }
int64_t ol_adamw8bit_item_size(void) { return (int64_t)sizeof(ol8_item_t); }
"""
