/* A small persistent pthread pool. One job at a time (ops of a context run one after another);
 * tasks are handed out through an atomic counter so uneven tasks balance themselves. The calling
 * thread works too, as worker 0, so a pool of n threads starts n - 1 of them.
 *
 * Workers join a job; the caller never waits for one that has not. A job is open from the moment
 * its fields are published until the caller has run out of tasks; then the caller closes it and
 * waits only for the workers that joined while it was open. On a machine whose vCPUs are shared, a
 * worker that is not scheduled in time simply misses the job (the caller ran its tasks), instead of
 * holding the caller up until the hypervisor runs it.
 *
 * Waking a sleeping worker costs tens of microseconds, more than most decode ops, so:
 *  - jobs smaller than DEEPINFER_CPU_PAR_MIN (pool_run's `amount`) run on the caller alone;
 *  - while the pool is hot (a graph replay: many small ops back to back), idle workers spin up to
 *    DEEPINFER_CPU_HOT_SPIN_US (default 50) between jobs before sleeping, and so does the caller
 *    waiting for joined workers; the bound keeps a spinning thread from starving the others when
 *    the machine is oversubscribed;
 *  - after a replay, idle workers keep spinning for DEEPINFER_CPU_LINGER_US (default 200): the host
 *    usually launches the next graph within that (the next decode step; the next segment of a step
 *    that pauses for the expert cache), which then pays no wake-up;
 *  - DEEPINFER_CPU_SPIN=N adds N spin iterations before any sleep (default 0). */
#include <stdlib.h>
#include <pthread.h>
#include <stdatomic.h>

#include "di_cpu.h"

/* no PAUSE: hypervisors with pause-loop exiting deschedule a vCPU that spins on it */
static inline void cpu_relax(void) { __asm__ __volatile__("" ::: "memory"); }

#define CLOSED (1u << 30)   /* bit of `state`: the job takes no more workers */

struct DI_Pool {
    int             n, spin;
    _Atomic int     hot;      /* spin up to hot_ns between jobs while set (pool_hot) */
    _Atomic uint64_t cool_at; /* after pool_hot(0): workers linger (spin) until this di_now_ns() */
    uint64_t        linger_ns;
    uint64_t        hot_ns;
    int64_t         par_min;  /* jobs smaller than this run on the caller alone */
    pthread_t*      threads;
    pthread_mutex_t run_mu;   /* serializes pool_run callers sharing one context */
    pthread_mutex_t mu;
    pthread_cond_t  cv_start, cv_done;
    _Atomic uint64_t gen;     /* bumped for every job: wakes workers */
    _Atomic unsigned state;   /* workers joined to the current job, | CLOSED once closed */
    _Atomic int     finished; /* joined workers that are done with it */
    _Atomic int     stop, sleepers, done_waiter;
    di_task_fn      fn;
    void*           arg;
    int64_t         ntasks;
    _Atomic int64_t next;
};

typedef struct { DI_Pool* p; int id; } WorkerArg;

static int hot(DI_Pool* p) {
    return atomic_load_explicit(&p->hot, memory_order_relaxed) ||
           di_now_ns() < atomic_load_explicit(&p->cool_at, memory_order_relaxed);
}

/* spin while gen == seen: p->spin iterations, then up to hot_ns of wall time while the pool is hot,
 * or until cool_at while it lingers after a replay */
static int keep_spinning(DI_Pool* p, uint64_t t0) {
    uint64_t now = di_now_ns();
    if (atomic_load_explicit(&p->hot, memory_order_relaxed)) return now - t0 <= p->hot_ns;
    return now < atomic_load_explicit(&p->cool_at, memory_order_relaxed);
}

static void spin_wait(DI_Pool* p, uint64_t seen) {
    for (int i = 0; i < p->spin && atomic_load(&p->gen) == seen && !atomic_load(&p->stop); i++) cpu_relax();
    uint64_t t0 = di_now_ns();
    if (!keep_spinning(p, t0) || atomic_load(&p->gen) != seen) return;
    for (int i = 1; atomic_load(&p->gen) == seen && !atomic_load(&p->stop); i++) {
        cpu_relax();
        if ((i & 255) == 0 && !keep_spinning(p, t0)) return;
    }
}

static void work(DI_Pool* p, int id) {
    for (;;) {
        int64_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= p->ntasks) break;
        p->fn(p->arg, i, id);
    }
}

/* Join the open job, if any: fields published before the job opened are visible after this. */
static int join(DI_Pool* p) {
    unsigned s = atomic_load(&p->state);
    while (!(s & CLOSED))
        if (atomic_compare_exchange_weak(&p->state, &s, s + 1)) return 1;
    return 0;
}

static void* worker_main(void* a) {
    WorkerArg wa = *(WorkerArg*)a;
    free(a);
    DI_Pool* p = wa.p;
    uint64_t seen = 0;
    for (;;) {
        spin_wait(p, seen);
        if (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
            pthread_mutex_lock(&p->mu);
            p->sleepers++;
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->cv_start, &p->mu);
            p->sleepers--;
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        seen = atomic_load(&p->gen);
        if (!join(p)) continue;   /* the caller finished it alone */
        work(p, wa.id);
        atomic_fetch_add(&p->finished, 1);
        if (atomic_load(&p->done_waiter)) {
            pthread_mutex_lock(&p->mu);   /* the caller re-checks under mu: no lost wake-up */
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
    atomic_store(&p->state, CLOSED);
    p->n = 1;
    const char* sp = getenv("DEEPINFER_CPU_SPIN");
    p->spin = sp ? atoi(sp) : 0;
    if (p->spin < 0) p->spin = 0;
    const char* hs = getenv("DEEPINFER_CPU_HOT_SPIN_US");
    long hot_us = hs ? atol(hs) : 50;
    p->hot_ns = (uint64_t)(hot_us > 0 ? hot_us : 0) * 1000u;
    const char* ls = getenv("DEEPINFER_CPU_LINGER_US");
    long linger_us = ls ? atol(ls) : 200;
    p->linger_ns = (uint64_t)(linger_us > 0 ? linger_us : 0) * 1000u;
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

void pool_hot(DI_Pool* p, int on) {
    if (!p) return;
    if (!on) atomic_store(&p->cool_at, di_now_ns() + p->linger_ns);
    atomic_store(&p->hot, on);
}

void pool_run(DI_Pool* p, int64_t ntasks, di_task_fn fn, void* arg, int64_t amount) {
    if (ntasks <= 0) return;
    if (!p || p->n == 1 || ntasks == 1 || amount < p->par_min) {
        for (int64_t i = 0; i < ntasks; i++) fn(arg, i, 0);
        return;
    }
    pthread_mutex_lock(&p->run_mu);
    /* publish the job, then open it (release: a worker that joins sees these fields) */
    p->fn = fn;
    p->arg = arg;
    p->ntasks = ntasks;
    atomic_store(&p->next, 0);
    atomic_store(&p->finished, 0);
    atomic_store(&p->state, 0u);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->gen, 1);
    if (p->sleepers) pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    work(p, 0);
    /* out of tasks: close the job and wait for the workers that joined it */
    int joined = (int)(atomic_fetch_or(&p->state, CLOSED) & ~CLOSED);
    if (atomic_load(&p->finished) < joined) {
        for (int i = 0; i < p->spin && atomic_load(&p->finished) < joined; i++) cpu_relax();
        if (hot(p)) {
            uint64_t t0 = di_now_ns();
            for (int i = 1; atomic_load(&p->finished) < joined; i++) {
                cpu_relax();
                if ((i & 255) == 0 && di_now_ns() - t0 > p->hot_ns) break;
            }
        }
        if (atomic_load(&p->finished) < joined) {
            pthread_mutex_lock(&p->mu);
            atomic_store(&p->done_waiter, 1);
            while (atomic_load(&p->finished) < joined) pthread_cond_wait(&p->cv_done, &p->mu);
            atomic_store(&p->done_waiter, 0);
            pthread_mutex_unlock(&p->mu);
        }
    }
    pthread_mutex_unlock(&p->run_mu);
}
