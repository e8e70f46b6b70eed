/* The host Adam(W) step of offload_fsdp (compiled_step.py builds, loads and checks it).

   One loop per piece: reads the bf16 or fp32 grad, the fp32 master and the moments once,
   writes the master, the moments (fp32, bf16 round-to-nearest or bf16 stochastic rounding)
   and the bf16 param staging once, with the arithmetic of torch's CPU fused Adam kernel
   operation for operation (bit-identical results). Every dtype combination gets its own
   specialised loop (always_inline with literal flags), so the compiler vectorises each
   without per-element branches. Where the CPU has AVX512_BF16 the vector body is written
   with intrinsics instead (adam_vec16, below): the same operations, fewer for the bf16 casts. */
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
/* The vector body written with AVX-512 intrinsics, where the CPU has AVX512_BF16: the same
   operations as adam_range (TAIL=0) lane by lane, so the same bits, but the round-to-nearest
   bf16 casts (the bf16 moments and the param staging) are one vcvtneps2bf16 each instead of
   ~8 integer ops, and the staging leaves registers straight in streaming stores (no block
   copy). That compute is what kept the bf16-moment step above its memory roofline: the
   loop moves 20 B/param but ran at the speed of the 28 B/param fp32-moment loop.
   vcvtneps2bf16 differs from c10::BFloat16 only on NaN (payload and sign kept, c10 gives
   0x7fc0) and on denormal inputs (flushed to zero): a vector holding either (rare) takes
   the integer path. */
#include <immintrin.h>
#define HAVE_AVX512_BF16_BODY 1
#define PREFETCH 512  /* elements: 2 KiB ahead in the fp32 master */

static inline __m512 bf16x16_load(const uint16_t* src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)src)), 16));
}

static inline __m256i bf16x16_rne_int(__m512 x) {  /* f32_to_bf16_rne, lane by lane */
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m256i bf16x16_rne(__m512 x) {
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    const __mmask16 odd = _mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80);  /* QNaN, denormal, SNaN */
    if (__builtin_expect(odd != 0, 0)) r = _mm256_mask_blend_epi16(odd, r, bf16x16_rne_int(x));
    return r;
}

static inline __m256i bf16x16_sr(__m512 x, const uint16_t* noise) {  /* f32_to_bf16_sr, lane by lane */
    const __m512i n = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)noise));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), n), 16));
}

static inline __m512 moment_load16(const void* base, int64_t i, int mode) {
    return mode == 0 ? _mm512_loadu_ps((const float*)base + i) : bf16x16_load((const uint16_t*)base + i);
}

static inline void moment_store16(void* base, int64_t i, __m512 x, int mode, const uint16_t* noise) {
    if (mode == 0) _mm512_storeu_ps((float*)base + i, x);
    else _mm256_storeu_si256((__m256i*)((uint16_t*)base + i), mode == 1 ? bf16x16_rne(x) : bf16x16_sr(x, noise + i));
}

/* Elements [lo, hi) (hi - lo a multiple of 16); with ST, a->stage + lo is 32-byte aligned. */
static inline __attribute__((always_inline)) void adam_vec16(
        const adam_args* a, int64_t lo, int64_t hi, const int GBF, const int MM, const int VM, const int ST, const int L2) {
    float* restrict p = a->param;
    const void* restrict g = a->grad;
    void* restrict m = a->exp_avg;
    void* restrict v = a->exp_avg_sq;
    uint16_t* restrict stage = a->stage;
    const __m512 gsign = _mm512_set1_ps(a->gsign), decay = _mm512_set1_ps(a->decay), wd = _mm512_set1_ps(a->wd);
    const __m512 beta2 = _mm512_set1_ps(a->beta2), c2 = _mm512_set1_ps(a->c2), bc2_sqrt = _mm512_set1_ps(a->bc2_sqrt);
    const __m512 eps = _mm512_set1_ps(a->eps), step_size = _mm512_set1_ps(a->step_size);
    const __m512 coeff = _mm512_set1_ps(a->lerp_small ? a->lerp_w : a->lerp_w - 1.0f);
    const int lerp_small = a->lerp_small;
    for (int64_t i = lo; i < hi; i += 16) {
        /* One software prefetch per 64-byte line of each read stream, PREFETCH elements
           ahead: with 2-byte moments the hardware prefetcher alone left the loop ~15%
           above its roofline (measured: 1.17x -> 1.04x on one thread); prefetches past
           the end are harmless (they never fault). */
        _mm_prefetch((const char*)(p + i + PREFETCH), _MM_HINT_T0);
        if (!GBF || (i & 31) == 0) _mm_prefetch((const char*)g + (i + PREFETCH) * (GBF ? 2 : 4), _MM_HINT_T0);
        if (!MM || (i & 31) == 0) _mm_prefetch((const char*)m + (i + PREFETCH) * (MM ? 2 : 4), _MM_HINT_T0);
        if (!VM || (i & 31) == 0) _mm_prefetch((const char*)v + (i + PREFETCH) * (VM ? 2 : 4), _MM_HINT_T0);
        __m512 gi = GBF ? bf16x16_load((const uint16_t*)g + i) : _mm512_loadu_ps((const float*)g + i);
        gi = _mm512_mul_ps(gi, gsign);
        __m512 pi = _mm512_loadu_ps(p + i);
        if (L2) gi = _mm512_fmadd_ps(pi, wd, gi); else pi = _mm512_mul_ps(pi, decay);
        __m512 mi = moment_load16(m, i, MM);
        mi = _mm512_fmadd_ps(coeff, _mm512_sub_ps(gi, mi), lerp_small ? mi : gi);
        const __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(c2, gi), gi, _mm512_mul_ps(moment_load16(v, i, VM), beta2));
        const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2_sqrt), eps);
        pi = _mm512_sub_ps(pi, _mm512_div_ps(_mm512_mul_ps(step_size, mi), denom));
        _mm512_storeu_ps(p + i, pi);
        moment_store16(m, i, mi, MM, a->noise_m);
        moment_store16(v, i, vi, VM, a->noise_v);
        if (ST) _mm256_stream_si256((__m256i*)(stage + i), bf16x16_rne(pi));
    }
}

static inline __attribute__((always_inline)) void adam_body(
        const adam_args* a, int64_t body, const int GBF, const int MM, const int VM, const int ST, const int L2) {
    int64_t lo = 0;
    if (ST) {  /* plain stores up to a 32-byte boundary of the staging, then streaming stores */
        while (lo < body && ((uintptr_t)(a->stage + lo) & 31)) lo++;
        adam_range(a, 0, lo, 0, GBF, MM, VM, ST, L2, a->stage, 0);
    }
    const int64_t vec_end = lo + (body - lo) / 16 * 16;
    adam_vec16(a, lo, vec_end, GBF, MM, VM, ST, L2);
    adam_range(a, vec_end, body, 0, GBF, MM, VM, ST, L2, a->stage, 0);
}
#endif

/* The last n % vec_width elements are torch's scalar tail, which rounds differently: a few
   elements, so one generic (not specialised, not vectorised) loop serves every combination. */
static __attribute__((noinline, optimize("no-tree-vectorize"))) void adam_tail(const adam_args* a, int64_t lo) {
    adam_range(a, lo, a->n, 1, a->grad_bf16, a->m_mode, a->v_mode, a->has_stage, a->l2, a->stage, 0);
}

static inline __attribute__((always_inline)) void adam_loop(
        const adam_args* a, const int GBF, const int MM, const int VM, const int ST, const int L2) {
    const int64_t body = a->n - a->n % a->vec_width;
#if defined(HAVE_AVX512_BF16_BODY)
    adam_body(a, body, GBF, MM, VM, ST, L2);
    if (body < a->n) adam_tail(a, body);
    return;
#endif
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

/* 1 when the AVX512_BF16 intrinsic body is compiled in (tests check both bodies). */
int offload_fsdp_adam_avx512_body(void) {
#if defined(HAVE_AVX512_BF16_BODY)
    return 1;
#else
    return 0;
#endif
}

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
