/* The host Adam(W) step of offload_fsdp (compiled_step.py builds, loads and checks it).

   One loop per piece: reads the bf16 or fp32 grad, the fp32 master and the moments once,
   writes the master, the moments (fp32, bf16 round-to-nearest or bf16 stochastic rounding)
   and the bf16 param staging once, with the arithmetic of torch's CPU fused Adam kernel
   operation for operation (bit-identical results). Every dtype combination gets its own
   specialised loop (always_inline with literal flags), so the compiler vectorises each
   without per-element branches. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#define STORE_FENCE() _mm_sfence()
#else
#define STORE_FENCE() ((void)0)
#endif

/* The bf16 param staging is only written, never read, by the step. A plain store first
   reads each cache line in (read-for-ownership): 2 more bytes per param on top of the
   28 B/param roofline. So the loop writes staging values into a block in L1 and the block
   goes out with non-temporal (streaming) stores, which skip that read; STORE_FENCE at the
   end of the call makes them visible before anyone (the H2D copy) reads the staging. */
#define STAGE_BLOCK 2048

static inline void stream_u16(uint16_t* restrict dst, const uint16_t* restrict src, int64_t n) {
    int64_t i = 0;
#if defined(__SSE2__)
    for (; i < n && ((uintptr_t)(dst + i) & 63); i++) dst[i] = src[i];  /* to a cache-line boundary */
    for (; i + 8 <= n; i += 8) _mm_stream_si128((__m128i*)(dst + i), _mm_loadu_si128((const __m128i*)(src + i)));
#endif
    for (; i < n; i++) dst[i] = src[i];
}

typedef struct {
    float* param; const void* grad; void* exp_avg; void* exp_avg_sq; uint16_t* stage;
    const uint16_t* noise_m; const uint16_t* noise_v; int64_t n, vec_width;
    float gsign, decay, wd, lerp_w, beta2, c2, bc2_sqrt, eps, step_size;
    int32_t grad_bf16, m_mode, v_mode, has_stage, l2, lerp_small;
} adam_args;

static inline float bf16_to_f32(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_bf16_rne(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN, as c10::BFloat16 */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Adding uniform 16-bit noise to the bits then truncating rounds the magnitude up with
   probability equal to the dropped fraction (as fused_step._stochastic_round_into, whose
   int32 table holds the same values: read here as uint16, 2 bytes per element, not 4). */
static inline uint16_t f32_to_bf16_sr(float f, uint16_t noise) {
    uint32_t u; memcpy(&u, &f, 4);
    u += (uint32_t)noise;
    return (uint16_t)(u >> 16);
}

static inline float load_moment(const void* base, int64_t i, int mode) {
    return mode == 0 ? ((const float*)base)[i] : bf16_to_f32(((const uint16_t*)base)[i]);
}

static inline void store_moment(void* base, int64_t i, float x, int mode, const uint16_t* noise) {
    if (mode == 0) ((float*)base)[i] = x;
    else if (mode == 1) ((uint16_t*)base)[i] = f32_to_bf16_rne(x);
    else ((uint16_t*)base)[i] = f32_to_bf16_sr(x, noise[i]);
}

static inline __attribute__((always_inline)) void adam_range(
        const adam_args* a, int64_t lo, int64_t hi, const int TAIL,
        const int GBF, const int MM, const int VM, const int ST, const int L2,
        uint16_t* restrict stage, const int64_t stage_base) {
    /* stage[i - stage_base] receives the bf16 param of element i (a block buffer or the staging itself) */
    float* restrict p = a->param;
    const void* restrict g = a->grad;
    void* restrict m = a->exp_avg;
    void* restrict v = a->exp_avg_sq;
    const uint16_t* restrict nm = a->noise_m;
    const uint16_t* restrict nv = a->noise_v;
    const float gsign = a->gsign, decay = a->decay, wd = a->wd, beta2 = a->beta2, c2 = a->c2;
    const float bc2_sqrt = a->bc2_sqrt, eps = a->eps, step_size = a->step_size;
    /* torch's lerp: weight w < 0.5 -> m + w*(g-m); else g + (w-1)*(g-m), each one fma */
    const float coeff = a->lerp_small ? a->lerp_w : a->lerp_w - 1.0f;
    const int lerp_small = a->lerp_small;
    for (int64_t i = lo; i < hi; i++) {
        float gi = GBF ? bf16_to_f32(((const uint16_t*)g)[i]) : ((const float*)g)[i];
        gi = gi * gsign;
        float pi = p[i];
        if (L2) gi = fmaf(pi, wd, gi); else pi = pi * decay;
        float mi = load_moment(m, i, MM);
        mi = fmaf(coeff, gi - mi, lerp_small ? mi : gi);
        /* torch's vector body contracts v*b2 + (c2*g)*g into fma(c2*g, g, v*b2); its scalar tail into fma(v, b2, (c2*g)*g) */
        float vi = TAIL ? fmaf(load_moment(v, i, VM), beta2, c2 * gi * gi) : fmaf(c2 * gi, gi, load_moment(v, i, VM) * beta2);
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        pi = pi - step_size * mi / denom;
        p[i] = pi;
        store_moment(m, i, mi, MM, nm);
        store_moment(v, i, vi, VM, nv);
        if (ST) stage[i - stage_base] = f32_to_bf16_rne(pi);
    }
}

/* The last n % vec_width elements are torch's scalar tail, which rounds differently: a few
   elements, so one generic (not specialised, not vectorised) loop serves every combination. */
static __attribute__((noinline, optimize("no-tree-vectorize"))) void adam_tail(const adam_args* a, int64_t lo) {
    adam_range(a, lo, a->n, 1, a->grad_bf16, a->m_mode, a->v_mode, a->has_stage, a->l2, a->stage, 0);
}

static inline __attribute__((always_inline)) void adam_loop(
        const adam_args* a, const int GBF, const int MM, const int VM, const int ST, const int L2) {
    const int64_t body = a->n - a->n % a->vec_width;
    if (ST) {
        uint16_t block[STAGE_BLOCK] __attribute__((aligned(64)));
        for (int64_t lo = 0; lo < body; lo += STAGE_BLOCK) {
            const int64_t hi = lo + STAGE_BLOCK < body ? lo + STAGE_BLOCK : body;
            adam_range(a, lo, hi, 0, GBF, MM, VM, ST, L2, block, lo);
            stream_u16(a->stage + lo, block, hi - lo);
        }
    } else {
        adam_range(a, 0, body, 0, GBF, MM, VM, ST, L2, 0, 0);
    }
    if (body < a->n) adam_tail(a, body);
}

#define KEY(g, m, v, s, l) (((((g) * 3 + (m)) * 3 + (v)) * 2 + (s)) * 2 + (l))
#define C5(g, m, v, s, l) case KEY(g, m, v, s, l): adam_loop(a, g, m, v, s, l); STORE_FENCE(); return 0;
#define CL(g, m, v, s) C5(g, m, v, s, 0) C5(g, m, v, s, 1)
#define CS(g, m, v) CL(g, m, v, 0) CL(g, m, v, 1)
#define CV(g, m) CS(g, m, 0) CS(g, m, 1) CS(g, m, 2)
#define CM(g) CV(g, 0) CV(g, 1) CV(g, 2)

int offload_fsdp_adam(const adam_args* a) {
    switch (KEY(a->grad_bf16, a->m_mode, a->v_mode, a->has_stage, a->l2)) {
        CM(0) CM(1)
    }
    return -1;
}

#if defined(_OPENMP)
/* All items of one bucket on `threads` threads. Built with -fopenmp, this library links
   libgomp.so.1, and the dynamic loader hands it the copy torch already loaded (same
   soname): torch's own worker threads run the items. A second set of threads would fight
   torch's, which keep spinning on the cores for milliseconds after each parallel op.
   Each item runs whole on one thread: its elements and scalar tail are exactly those of
   one fused-kernel tensor, so any schedule gives the same bits. */
int offload_fsdp_adam_batch(const adam_args* items, int64_t count, int threads) {
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(|:failed)
    for (int64_t i = 0; i < count; i++) failed |= offload_fsdp_adam(&items[i]) != 0;
    return failed ? -1 : 0;
}
#else
typedef struct { const adam_args* items; int64_t begin, end; int rc; } adam_share;

static void* adam_run_share(void* arg) {
    adam_share* s = (adam_share*)arg;
    for (int64_t i = s->begin; i < s->end; i++)
        if (offload_fsdp_adam(&s->items[i]) != 0) s->rc = -1;
    return 0;
}

/* Without OpenMP: runs of consecutive items of about equal element count on `threads`
   pthreads (this one included), started and joined per call. */
int offload_fsdp_adam_batch(const adam_args* items, int64_t count, int threads) {
    enum { MAX_THREADS = 256 };
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > count) threads = (int)count;
    if (threads < 1) threads = 1;
    adam_share shares[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int64_t total = 0, acc = 0, next = 0;
    for (int64_t i = 0; i < count; i++) total += items[i].n;
    for (int t = 0; t < threads; t++) {
        shares[t].items = items; shares[t].begin = next; shares[t].rc = 0;
        const int64_t target = total * (t + 1) / threads;
        while (next < count && (acc < target || t == threads - 1)) acc += items[next++].n;
        shares[t].end = next;
    }
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], 0, adam_run_share, &shares[t]) != 0) break;  /* run the rest here */
        started = t;
    }
    adam_run_share(&shares[0]);
    for (int t = started + 1; t < threads; t++) adam_run_share(&shares[t]);
    int rc = shares[0].rc;
    for (int t = 1; t < threads; t++) {
        if (t <= started) pthread_join(tids[t], 0);
        if (shares[t].rc != 0) rc = shares[t].rc;
    }
    return rc;
}
#endif
