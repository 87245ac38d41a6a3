/* A small persistent pthread pool. One job at a time (ops of a context run one after another);
 * tasks are handed out through an atomic counter so uneven tasks balance themselves. The calling
 * thread works too, as worker 0, so a pool of n threads starts n - 1 of them.
 *
 * Decode issues many short ops back to back and a condition-variable wake-up costs tens of
 * microseconds, so idle workers can spin on the job counter before sleeping: DEEPINFER_CPU_SPIN
 * (loop iterations, default 0). It pays on a dedicated machine and hurts on an oversubscribed
 * one (measured: 2 shared vCPUs got slower), hence off by default. */
#include <stdlib.h>
#include <time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "di_cpu.h"


/* no PAUSE: hypervisors with pause-loop exiting deschedule a vCPU that spins on it */
static inline void cpu_relax(void) { __asm__ __volatile__("" ::: "memory"); }

struct DI_Pool {
    int             n, spin;
    _Atomic int     hot;      /* spin up to hot_ns between jobs while set (pool_hot) */
    uint64_t        hot_ns;
    int64_t         par_min;  /* jobs smaller than this run on the caller alone */
    pthread_t*      threads;
    pthread_mutex_t run_mu;   /* serializes pool_run callers sharing one context */
    pthread_mutex_t mu;
    pthread_cond_t  cv_start, cv_done;
    _Atomic uint64_t gen;
    _Atomic int     stop, active, sleepers;
    di_task_fn      fn;
    void*           arg;
    int64_t         ntasks;
    _Atomic int64_t next;
};

typedef struct { DI_Pool* p; int id; } WorkerArg;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Spin while *gen == seen: DEEPINFER_CPU_SPIN iterations, or while the pool is hot up to hot_ns of
 * wall time. The bound matters: on a machine whose vCPUs are shared (or oversubscribed), a worker
 * spinning without end steals the time the caller needs and a step gets 10x slower (measured). */
static void spin_wait(DI_Pool* p, _Atomic uint64_t* gen, uint64_t seen) {
    for (int i = 0; i < p->spin && atomic_load(gen) == seen && !atomic_load(&p->stop); i++) cpu_relax();
    if (!atomic_load_explicit(&p->hot, memory_order_relaxed) || atomic_load(gen) != seen) return;
    uint64_t t0 = now_ns();
    for (int i = 1; atomic_load(gen) == seen && !atomic_load(&p->stop); i++) {
        cpu_relax();
        if ((i & 255) == 0 && (now_ns() - t0 > p->hot_ns || !atomic_load_explicit(&p->hot, memory_order_relaxed)))
            return;
    }
}

static void spin_until_done(DI_Pool* p) {
    for (int i = 0; i < p->spin && atomic_load(&p->active) > 0; i++) cpu_relax();
    if (!atomic_load_explicit(&p->hot, memory_order_relaxed)) return;
    uint64_t t0 = now_ns();
    for (int i = 1; atomic_load(&p->active) > 0; i++) {
        cpu_relax();
        if ((i & 255) == 0 && now_ns() - t0 > p->hot_ns) return;
    }
}

static void work(DI_Pool* p, int id) {
    for (;;) {
        int64_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= p->ntasks) break;
        p->fn(p->arg, i, id);
    }
}

static void* worker_main(void* a) {
    WorkerArg wa = *(WorkerArg*)a;
    free(a);
    DI_Pool* p = wa.p;
    uint64_t seen = 0;
    for (;;) {
        spin_wait(p, &p->gen, seen);
        if (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
            pthread_mutex_lock(&p->mu);
            p->sleepers++;
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->cv_start, &p->mu);
            p->sleepers--;
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = atomic_load(&p->gen);
        work(p, wa.id);
        if (atomic_fetch_sub(&p->active, 1) == 1) {
            pthread_mutex_lock(&p->mu);  /* the caller checks `active` under mu: no lost wake-up */
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

DI_Pool* pool_create(int nthreads) {
    DI_Pool* p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    if (nthreads < 1) nthreads = 1;
    p->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!p->threads) { free(p); return NULL; }
    pthread_mutex_init(&p->run_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_start, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    p->n = 1;
    const char* sp = getenv("DEEPINFER_CPU_SPIN");
    p->spin = sp ? atoi(sp) : 0;
    if (p->spin < 0) p->spin = 0;
    const char* hs = getenv("DEEPINFER_CPU_HOT_SPIN_US");
    long hot_us = hs ? atol(hs) : 50;
    p->hot_ns = (uint64_t)(hot_us > 0 ? hot_us : 0) * 1000u;
    const char* pm = getenv("DEEPINFER_CPU_PAR_MIN");
    p->par_min = pm ? atoll(pm) : 65536;
    for (int i = 1; i < nthreads; i++) {
        WorkerArg* wa = malloc(sizeof(*wa));
        if (!wa) break;
        wa->p = p;
        wa->id = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) { free(wa); break; }
        p->n++;  /* fewer threads than asked is still a working pool */
    }
    return p;
}

void pool_destroy(DI_Pool* p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->cv_start);
    pthread_cond_destroy(&p->cv_done);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
    free(p->threads);
    free(p);
}

int pool_size(const DI_Pool* p) { return p ? p->n : 1; }

void pool_hot(DI_Pool* p, int hot) {
    if (p) atomic_store(&p->hot, hot);
}

void pool_run(DI_Pool* p, int64_t ntasks, di_task_fn fn, void* arg, int64_t amount) {
    if (ntasks <= 0) return;
    if (!p || p->n == 1 || ntasks == 1 || amount < p->par_min) {
        for (int64_t i = 0; i < ntasks; i++) fn(arg, i, 0);
        return;
    }
    pthread_mutex_lock(&p->run_mu);
    p->fn = fn;
    p->arg = arg;
    p->ntasks = ntasks;
    atomic_store(&p->next, 0);
    atomic_store(&p->active, p->n - 1);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->gen, 1);  /* publishes fn/arg/ntasks to spinning workers */
    if (p->sleepers) pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    work(p, 0);
    spin_until_done(p);
    if (atomic_load(&p->active) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->active) > 0) pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->run_mu);
}
