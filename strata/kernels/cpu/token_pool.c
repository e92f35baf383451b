/* One token through a few experts on the CPU, with ggml's own dot kernels and a pool of threads
 * that spin between calls.
 *
 * The decode step's CPU share computes one token's 1-3 experts per layer, a few MB, once every
 * few hundred microseconds. A ggml graph for that (mul_mat_id x3, swiglu, mul) pays a barrier
 * after every node and wakes its threads at every call; on the H200's host that held 8 threads
 * to 19-22 GB/s. Here the whole call is three phases with two spinning barriers:
 *
 *   1. every thread quantizes x for itself (to the dot kernel's activation type) and computes
 *      its share of the gate and up rows of all the experts (ggml's vec_dot, one row at a time);
 *   2. the threads that have an expert apply silu(g) * u to it and quantize the result;
 *   3. every thread computes its share of the output rows: Σ_e w_e · down_e[row] · a_e.
 *
 * Workers spin on a generation counter, then sleep on a condition variable once they have
 * spun `spin_us` without work (a decode step calls every layer; an idle server does not).
 * Every spin yields the core after a few thousand pauses: with more threads than free cores a
 * barrier otherwise waits a whole time slice for a descheduled thread (3 threads on 2 cores:
 * 8 ms a call against 0.4 ms with the yield).
 * The dot and quantize functions come from ggml's type traits (ggml_get_type_traits_cpu); this
 * file has no kernel of its own.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static inline void cpu_relax(void) { __asm__ __volatile__("yield"); }
#else
static inline void cpu_relax(void) {}
#endif

/* a spin-wait's step: pause, and past a few thousand spins yield the core, so that a thread
 * descheduled when there are more threads than free cores gets to run and arrive */
static inline void backoff(int *spins) {
    if (++*spins < 4096)
        cpu_relax();
    else
        sched_yield();
}

typedef void (*vec_dot_t)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y,
                          size_t by, int nrc);
typedef void (*from_float_t)(const float *x, void *y, int64_t k);

#define MAX_THREADS 256
#define MAX_EXPERTS 16

/* one matrix kind of the experts (gate, up or down): how to multiply a row by a vector */
typedef struct {
    vec_dot_t dot;
    from_float_t quantize; /* the vector into the dot's activation type */
    size_t row_bytes;      /* one row of the weights */
} part_t;

typedef struct pool {
    int n_threads;
    pthread_t threads[MAX_THREADS];
    long spin_ns;
    atomic_int gen, stop, done, sleepers;
    atomic_int bar_count, bar_gen;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the call */
    int n, d, f;
    part_t part[3];
    const float *x;
    const uint8_t *w[3][MAX_EXPERTS];
    float wt[MAX_EXPERTS];
    float *out;
    /* scratch */
    uint8_t *xq;      /* per thread: x quantized for gate, then for up: 2 * xq_stride */
    size_t xq_stride;
    float *gu;        /* [n, 2f]: gate rows, then up rows */
    float *act;       /* [n, f] */
    uint8_t *aq;      /* [n, aq_stride] */
    size_t aq_stride;
    size_t cap_n, cap_d, cap_f;
} pool_t;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void barrier(pool_t *p) {
    int g = atomic_load_explicit(&p->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&p->bar_count, 1, memory_order_acq_rel) == p->n_threads - 1) {
        atomic_store_explicit(&p->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->bar_gen, 1, memory_order_release);
        return;
    }
    int spins = 0;
    while (atomic_load_explicit(&p->bar_gen, memory_order_acquire) == g)
        backoff(&spins);
}

static void span(int total, int tid, int nth, int *lo, int *hi) {
    int per = total / nth, extra = total % nth;
    *lo = tid * per + (tid < extra ? tid : extra);
    *hi = *lo + per + (tid < extra ? 1 : 0);
}

static void run(pool_t *p, int tid) {
    const int n = p->n, d = p->d, f = p->f, nth = p->n_threads;
    uint8_t *xg = p->xq + (size_t)tid * 2 * p->xq_stride, *xu = xg + p->xq_stride;
    p->part[0].quantize(p->x, xg, d);
    if (p->part[1].quantize != p->part[0].quantize)
        p->part[1].quantize(p->x, xu, d);
    else
        xu = xg;
    int lo, hi;
    span(n * 2 * f, tid, nth, &lo, &hi);
    for (int r = lo; r < hi; r++) {
        int e = r / (2 * f), k = r % (2 * f), which = k < f ? 0 : 1, row = k % f;
        const part_t *pt = &p->part[which];
        pt->dot(d, &p->gu[r], 0, p->w[which][e] + (size_t)row * pt->row_bytes, 0,
                which ? xu : xg, 0, 1);
    }
    barrier(p);
    for (int e = tid; e < n; e += nth) {
        const float *g = p->gu + (size_t)e * 2 * f, *u = g + f;
        float *a = p->act + (size_t)e * f;
        for (int i = 0; i < f; i++)
            a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        p->part[2].quantize(a, p->aq + (size_t)e * p->aq_stride, f);
    }
    barrier(p);
    span(d, tid, nth, &lo, &hi);
    const part_t *pd = &p->part[2];
    for (int row = lo; row < hi; row++) {
        float s = 0.0f;
        for (int e = 0; e < n; e++) {
            float v;
            pd->dot(f, &v, 0, p->w[2][e] + (size_t)row * pd->row_bytes, 0,
                    p->aq + (size_t)e * p->aq_stride, 0, 1);
            s += p->wt[e] * v;
        }
        p->out[row] = s;
    }
}

static void *worker(void *arg) {
    pool_t *p = ((void **)arg)[0];
    int tid = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    int seen = 0;
    for (;;) {
        long t0 = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&p->gen, memory_order_acquire) == seen &&
               !atomic_load_explicit(&p->stop, memory_order_acquire)) {
            backoff(&spins);
            if (spins % 1024 == 0 && now_ns() - t0 > p->spin_ns) {
                pthread_mutex_lock(&p->mu);
                atomic_fetch_add(&p->sleepers, 1);
                while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop))
                    pthread_cond_wait(&p->cv, &p->mu);
                atomic_fetch_sub(&p->sleepers, 1);
                pthread_mutex_unlock(&p->mu);
            }
        }
        if (atomic_load(&p->stop))
            return NULL;
        seen = atomic_load_explicit(&p->gen, memory_order_acquire);
        run(p, tid);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

static void *grow(void *ptr, size_t bytes) {
    void *q = NULL;
    free(ptr);
    if (posix_memalign(&q, 64, bytes ? bytes : 64))
        return NULL;
    return q;
}

/* scratch for n experts of d_model d and d_expert f; 0 on success */
static int reserve(pool_t *p, int n, int d, int f, size_t xq_bytes, size_t aq_bytes) {
    if (n <= (int)p->cap_n && d <= (int)p->cap_d && f <= (int)p->cap_f &&
        xq_bytes <= p->xq_stride && aq_bytes <= p->aq_stride)
        return 0;
    p->cap_n = n > (int)p->cap_n ? (size_t)n : p->cap_n;
    p->cap_d = d > (int)p->cap_d ? (size_t)d : p->cap_d;
    p->cap_f = f > (int)p->cap_f ? (size_t)f : p->cap_f;
    p->xq_stride = ((xq_bytes > p->xq_stride ? xq_bytes : p->xq_stride) + 63) / 64 * 64;
    p->aq_stride = ((aq_bytes > p->aq_stride ? aq_bytes : p->aq_stride) + 63) / 64 * 64;
    p->xq = grow(p->xq, (size_t)p->n_threads * 2 * p->xq_stride);
    p->gu = grow(p->gu, p->cap_n * 2 * p->cap_f * sizeof(float));
    p->act = grow(p->act, p->cap_n * p->cap_f * sizeof(float));
    p->aq = grow(p->aq, p->cap_n * p->aq_stride);
    return p->xq && p->gu && p->act && p->aq ? 0 : -1;
}

pool_t *token_pool_new(int n_threads, long spin_us) {
    if (n_threads < 1 || n_threads > MAX_THREADS)
        return NULL;
    pool_t *p = calloc(1, sizeof(pool_t));
    if (!p)
        return NULL;
    p->n_threads = n_threads;
    p->spin_ns = spin_us * 1000L;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int t = 1; t < n_threads; t++) {
        void **arg = malloc(2 * sizeof(void *));
        arg[0] = p;
        arg[1] = (void *)(intptr_t)t;
        if (pthread_create(&p->threads[t], NULL, worker, arg) != 0) {
            free(arg);
            p->n_threads = t; /* the ones started, stopped by free */
            return p;
        }
    }
    return p;
}

int token_pool_threads(pool_t *p) { return p->n_threads; }

/* out[d] = Σ_e wt[e] · down_e(silu(gate_e x) · up_e x) for n experts whose matrices start at
 * w[part * n + e]; dots[part], quants[part]: ggml's vec_dot of the part's type and from_float
 * of its activation type, row_bytes[part] a weight row, vec_bytes[part] the quantized vector.
 * Returns 0, or -1 when the scratch could not be allocated. */
int token_pool_run(pool_t *p, int n, int d, int f, const float *x, const void **w,
                   const float *wt, float *out, void **dots, void **quants,
                   const size_t *row_bytes, const size_t *vec_bytes) {
    if (n < 1 || n > MAX_EXPERTS)
        return -2;
    size_t xq = vec_bytes[0] > vec_bytes[1] ? vec_bytes[0] : vec_bytes[1];
    if (reserve(p, n, d, f, xq, vec_bytes[2]))
        return -1;
    p->n = n, p->d = d, p->f = f, p->x = x, p->out = out;
    for (int k = 0; k < 3; k++) {
        p->part[k].dot = (vec_dot_t)dots[k];
        p->part[k].quantize = (from_float_t)quants[k];
        p->part[k].row_bytes = row_bytes[k];
        for (int e = 0; e < n; e++)
            p->w[k][e] = (const uint8_t *)w[k * n + e];
    }
    for (int e = 0; e < n; e++)
        p->wt[e] = wt[e];
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    /* seq_cst, as the sleeper's count then check of gen: one of the two sees the other */
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleepers)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run(p, 0);
    int spins = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) != p->n_threads - 1)
        backoff(&spins);
    return 0;
}

void token_pool_free(pool_t *p) {
    if (!p)
        return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int t = 1; t < p->n_threads; t++)
        pthread_join(p->threads[t], NULL);
    free(p->xq);
    free(p->gu);
    free(p->act);
    free(p->aq);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}
