"""C source of the CPU kernel of the bf16 rung (compiled by :mod:`.cpu` at first use).

The kernel reproduces :meth:`optladder.optimizers.adamw.LadderAdamW._step_param` for
float32 params and bfloat16 moments operation by operation, in the order and with the
fused multiply-adds that torch's vectorized CPU kernels use (``lerp``, ``add`` with
``alpha`` and ``addcmul`` end in an ``fmadd``; ``mul``, ``div`` and ``addcdiv`` round
each operation),
so params and moments match the eager oracle bit for bit. It needs no torch headers:
Python passes raw pointers through ctypes.

``target_clones`` builds the loop for AVX-512, AVX2+FMA and baseline x86-64; the dynamic
loader picks one at load time from the CPU's features. The loop body is plain C that gcc
vectorizes (one 32-bit hash per element for the stochastic rounding).
"""

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#define OL_GRAD_F32 0
#define OL_GRAD_BF16 1
#define OL_GRAD_F16 2

/* One param: raw pointers and the scalars that depend on its own step count. */
typedef struct {
    float *param;
    const void *grad;
    uint16_t *exp_avg;     /* bfloat16 bit patterns */
    uint16_t *exp_avg_sq;  /* bfloat16 bit patterns */
    int64_t numel;
    int64_t grad_dtype;    /* OL_GRAD_* */
    uint32_t key;          /* rounding.element_key(seed, step, param_index) */
    float step_size;       /* -lr / bias_correction1, rounded to float */
    float bc2_sqrt;        /* sqrt(bias_correction2), rounded to float */
    int32_t hyper;         /* index of its group's scalars in the hypers table */
} ol_param_t;

/* Scalars shared by the group, each rounded to float as torch rounds a Python scalar. */
typedef struct {
    float lerp_weight;     /* 1 - beta1 */
    float beta2;
    float one_minus_beta2;
    float eps;
    float decay;           /* 1 - lr * weight_decay (decoupled), else 1 */
    float weight_decay;    /* coupled weight decay, else 0 */
    int32_t coupled;       /* 1: grad += wd * param */
    int32_t decoupled;     /* 1: param *= decay */
    int32_t maximize;
    int32_t stochastic;    /* 1: stochastic rounding, 0: round to nearest even */
} ol_hyper_t;

static inline uint32_t ol_hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

static inline uint32_t ol_f2u(float f) { union { float f; uint32_t u; } c; c.f = f; return c.u; }
static inline float ol_u2f(uint32_t u) { union { float f; uint32_t u; } c; c.u = u; return c.f; }

static inline uint16_t ol_round_sr(float x, uint32_t r16) {
    uint32_t u = ol_f2u(x);
    uint32_t r = (u + r16) & 0xFFFF0000u;
    uint32_t n = (u & 0xFFFF0000u) | 0x00400000u;
    return (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u ? n : r) >> 16);
}

static inline uint16_t ol_round_ne(float x) {
    uint32_t u = ol_f2u(x);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}

/* The update of elements [lo, hi) of one param. GRAD_DTYPE and STOCH are constants in
   every call site, so each instance is a branch-free loop that gcc vectorizes. */
static inline __attribute__((always_inline)) void ol_body(
    const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi,
    const int grad_dtype, const int stoch)
{
    float *restrict param = P->param;
    uint16_t *restrict m16 = P->exp_avg;
    uint16_t *restrict v16 = P->exp_avg_sq;
    const float *restrict g32 = (const float *)P->grad;
    const uint16_t *restrict g16 = (const uint16_t *)P->grad;
    const _Float16 *restrict gh = (const _Float16 *)P->grad;
    const uint32_t key = P->key;
    const float step_size = P->step_size, bc2_sqrt = P->bc2_sqrt;
    const float w = H->lerp_weight, b2 = H->beta2, omb2 = H->one_minus_beta2;
    const float eps = H->eps, decay = H->decay, wd = H->weight_decay;
    const int coupled = H->coupled, maximize = H->maximize;
    const int small = w < 0.5f;
    const float coeff = small ? w : w - 1.0f;
    for (int64_t i = lo; i < hi; i++) {
        float g;
        if (grad_dtype == OL_GRAD_F32) g = g32[i];
        else if (grad_dtype == OL_GRAD_BF16) g = ol_u2f((uint32_t)g16[i] << 16);
        else g = (float)gh[i];
        g = maximize ? -g : g;
        float p = param[i] * decay;
        g = coupled ? fmaf(p, wd, g) : g;
        float m = ol_u2f((uint32_t)m16[i] << 16);
        float v = ol_u2f((uint32_t)v16[i] << 16);
        m = fmaf(coeff, g - m, small ? m : g);
        v = fmaf(omb2 * g, g, v * b2);
        float denom = sqrtf(v) / bc2_sqrt + eps;
        p = p + (step_size * m) / denom;
        param[i] = p;
        if (stoch) {
            uint32_t bits = ol_hash32((uint32_t)i + key);
            m16[i] = ol_round_sr(m, bits & 0xFFFFu);
            v16[i] = ol_round_sr(v, bits >> 16);
        } else {
            m16[i] = ol_round_ne(m);
            v16[i] = ol_round_ne(v);
        }
    }
}

#define OL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

OL_CLONES
static void ol_range(const ol_param_t *P, const ol_hyper_t *H, int64_t lo, int64_t hi) {
    int gd = (int)P->grad_dtype;
    if (H->stochastic) {
        if (gd == OL_GRAD_F32) ol_body(P, H, lo, hi, OL_GRAD_F32, 1);
        else if (gd == OL_GRAD_BF16) ol_body(P, H, lo, hi, OL_GRAD_BF16, 1);
        else ol_body(P, H, lo, hi, OL_GRAD_F16, 1);
    } else {
        if (gd == OL_GRAD_F32) ol_body(P, H, lo, hi, OL_GRAD_F32, 0);
        else if (gd == OL_GRAD_BF16) ol_body(P, H, lo, hi, OL_GRAD_BF16, 0);
        else ol_body(P, H, lo, hi, OL_GRAD_F16, 0);
    }
}

typedef struct {
    const ol_param_t *params;
    int64_t n_params;
    const ol_hyper_t *hypers;
    const int64_t *offsets;  /* offsets[k]: first element of param k; offsets[n] = total */
    int64_t begin, end;      /* range in the concatenation of all params' elements */
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
        if (lo < hi) ol_range(P, &job->hypers[P->hyper], lo, hi);
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

/* Update every param of the table (params of several groups: each names its group's
   scalars in hypers). offsets: n_params + 1 entries, allocated by the caller (the
   prepare phase) and filled here, so this call allocates nothing. Returns 0, or -1 if a
   worker thread could not start (then the update ran on fewer threads: the result is
   the same). */
int ol_adamw_bf16_step(const ol_param_t *params, int64_t n_params,
                       const ol_hyper_t *hypers, int32_t n_threads, int64_t *offsets) {
    if (n_params <= 0) return 0;
    offsets[0] = 0;
    for (int64_t k = 0; k < n_params; k++) offsets[k + 1] = offsets[k] + params[k].numel;
    const int64_t total = offsets[n_params];
    ol_job_t base = {params, n_params, hypers, offsets, 0, total};
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

int ol_abi_version(void) { return 2; }
"""
