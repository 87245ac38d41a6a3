/*
 * libdi_expert_reader: the expert cache's disk reads, off the Python interpreter.
 *
 * Why: a streamed expert is read from the checkpoint in pieces by several threads, and each piece is
 * sent to the device as soon as it is in pinned memory. Done by Python threads, every piece cost a
 * queue hand-off, a wake-up and the GIL around the copy call (tens of microseconds each), and the
 * main thread -- the one deciding the next layer's loads on the device's critical path -- waited for
 * that GIL (benchmarks/results/expert_map_cuda_h100_20261206_ee1c4c8: 4 MiB pieces took 48 ms a
 * token at 50% capacity, 1 MiB pieces 136 ms, for the same bytes). Here the readers are native
 * threads: pread into the load's pinned bounce buffer, then the backend's own ABI entries
 * (mem_copy_async, event_record), called through the function pointers the runtime hands over.
 * The library knows no GPU API: it is vendor-neutral as the runtime is.
 *
 * A job is one expert load: its pieces (contiguous ranges of the expert's image, each read from one
 * or more file segments) are taken by the readers in priority order (0 first; submission order
 * within a priority), so a step's misses pass prefetches queued before them. A job is done once
 * every piece is read and its copy issued (or skipped: cancelled, or after an error); its event is
 * then recorded on the copy stream if any copy went out. Cancelling stops further copies: once
 * er_cancel returns, no copy of the job is issued any more.
 *
 * Without a copy function (dst NULL) a job reads straight into `bounce` (host-memory backends,
 * whose slots are host memory).
 *
 * Built by CMake next to the CPU backend (runtime/native/CMakeLists.txt); loaded with cffi by
 * deepinfer.model.expert_cache.native. Errors never abort: they are reported per job as text.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define ER_EXPORT __attribute__((visibility("default")))
#define ER_LEVELS 3
#define ER_MSG 256

/* the ABI's entries, as DI_Api declares them (contexts, streams and events are opaque here) */
typedef int32_t (*er_copy_fn)(void* ctx, void* dst, const void* src, uint64_t bytes, int32_t kind, void* stream);
typedef int32_t (*er_record_fn)(void* ctx, void* event, void* stream);
typedef const char* (*er_last_error_fn)(void* ctx);

typedef struct er_seg {
    int32_t fd;
    int32_t reserved;
    uint64_t file_off;   /* where the bytes are in the file */
    uint64_t at;         /* where they go in the image */
    uint64_t len;
} er_seg;

typedef struct er_job er_job;
typedef struct er_pool er_pool;

struct er_job {
    pthread_mutex_t mu;        /* guards the fields below it, and orders cancel against copies */
    pthread_cond_t cv;
    int refs;                  /* the caller's and, until the last piece, the pool's */
    int cancelled, failed, copied, done;
    uint64_t done_order;       /* 1 for the pool's first job done, 2 for the next, ... */
    uint32_t left;             /* pieces not yet finished */
    char msg[ER_MSG];
    /* immutable after submit */
    int32_t priority;
    uint32_t n_pieces;
    uint32_t next_piece;       /* under the pool's lock: the next piece a reader takes */
    er_job* next;              /* the pool's queue */
    uint8_t* bounce;
    uint8_t* dst;
    void* event;
    uint32_t* piece_first;     /* n_pieces + 1: piece i is segs[piece_first[i], piece_first[i + 1]) */
    uint64_t* piece_at;
    uint64_t* piece_len;
    er_seg* segs;
};

struct er_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    er_job* head[ER_LEVELS];
    er_job* tail[ER_LEVELS];
    int stop;
    int hold;                  /* readers take no piece while set (er_pool_hold) */
    int64_t delay_us;          /* before each piece's read (er_pool_delay): a slow disk, for tests */
    uint64_t n_done;           /* jobs done so far (atomic) */
    int n_threads;
    pthread_t* threads;
    void* ctx;
    er_copy_fn copy;
    er_record_fn record;
    er_last_error_fn last_error;
    void* stream;
    int32_t kind;
};

static void job_unref(er_job* j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0) {
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j);
    }
}

/* every segment of one piece into the bounce buffer; 0, or -1 with msg set */
static int read_piece(er_job* j, uint32_t p, char* msg) {
    for (uint32_t s = j->piece_first[p]; s < j->piece_first[p + 1]; ++s) {
        const er_seg* g = &j->segs[s];
        uint64_t done = 0;
        while (done < g->len) {
            ssize_t got = pread(g->fd, j->bounce + g->at + done, (size_t)(g->len - done), (off_t)(g->file_off + done));
            if (got < 0) {
                if (errno == EINTR) continue;
                snprintf(msg, ER_MSG, "reading an expert at byte %llu of its file (fd %d): %s",
                         (unsigned long long)(g->file_off + done), g->fd, strerror(errno));
                return -1;
            }
            if (got == 0) {
                snprintf(msg, ER_MSG, "short read of an expert at byte %llu of its file (fd %d): the file is "
                         "shorter than its safetensors header says (truncated?)",
                         (unsigned long long)(g->file_off + done), g->fd);
                return -1;
            }
            done += (uint64_t)got;
        }
    }
    return 0;
}

static void fail(er_job* j, const char* msg) {   /* under j->mu */
    if (!j->failed && !j->cancelled) {
        j->failed = 1;
        snprintf(j->msg, ER_MSG, "%s", msg);
    }
}

static void run_piece(er_pool* pool, er_job* j, uint32_t p) {
    char msg[ER_MSG];
    pthread_mutex_lock(&j->mu);
    int skip = j->cancelled || j->failed;
    pthread_mutex_unlock(&j->mu);
    int64_t delay = __atomic_load_n(&pool->delay_us, __ATOMIC_RELAXED);
    if (!skip && delay > 0) {
        struct timespec d = {(time_t)(delay / 1000000), (long)(delay % 1000000) * 1000};
        nanosleep(&d, NULL);
    }
    int err = skip ? 0 : read_piece(j, p, msg);

    pthread_mutex_lock(&j->mu);
    if (err)
        fail(j, msg);
    else if (!skip && !j->cancelled && !j->failed && j->dst && pool->copy) {
        uint64_t at = j->piece_at[p];
        int32_t st = pool->copy(pool->ctx, j->dst + at, j->bounce + at, j->piece_len[p], pool->kind, pool->stream);
        if (st) {
            const char* why = pool->last_error ? pool->last_error(pool->ctx) : NULL;
            snprintf(msg, ER_MSG, "mem_copy_async of an expert's piece failed (status %d): %s", st, why ? why : "");
            fail(j, msg);
        } else {
            j->copied = 1;
        }
    }
    int last = --j->left == 0;
    if (last) {
        if (j->copied && j->event && pool->record) {
            int32_t st = pool->record(pool->ctx, j->event, pool->stream);
            if (st) {
                const char* why = pool->last_error ? pool->last_error(pool->ctx) : NULL;
                snprintf(msg, ER_MSG, "event_record after an expert's copies failed (status %d): %s", st,
                         why ? why : "");
                /* the copies went out but nothing marks their end: the caller must not reuse the
                 * bounce buffer on this job's word, so this is reported even for a cancelled job */
                j->failed = 1;
                snprintf(j->msg, ER_MSG, "%s", msg);
            }
        }
        /* atomic, not pool->mu: er_pool_destroy takes the pool's lock, then a job's */
        j->done_order = __atomic_add_fetch(&pool->n_done, 1, __ATOMIC_RELAXED);
        j->done = 1;
        pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&j->mu);
    if (last)
        job_unref(j);    /* the pool's reference */
}

static void* worker(void* arg) {
    er_pool* pool = arg;
    for (;;) {
        pthread_mutex_lock(&pool->mu);
        er_job* j = NULL;
        uint32_t p = 0;
        for (;;) {
            for (int l = 0; l < ER_LEVELS && !j && (!pool->hold || pool->stop); ++l) {
                if (pool->head[l]) {
                    j = pool->head[l];
                    p = j->next_piece++;
                    if (j->next_piece == j->n_pieces) {   /* its last piece: off the queue */
                        pool->head[l] = j->next;
                        if (!pool->head[l]) pool->tail[l] = NULL;
                    }
                }
            }
            if (j || pool->stop) break;
            pthread_cond_wait(&pool->cv, &pool->mu);
        }
        pthread_mutex_unlock(&pool->mu);
        if (!j) return NULL;     /* stopped and drained */
        run_piece(pool, j, p);
    }
}

ER_EXPORT er_pool* er_pool_create(int32_t n_threads, void* ctx, er_copy_fn copy, er_record_fn record,
                                  er_last_error_fn last_error, void* stream, int32_t kind) {
    if (n_threads < 1 || n_threads > 256) return NULL;
    er_pool* pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv, NULL);
    pool->ctx = ctx;
    pool->copy = copy;
    pool->record = record;
    pool->last_error = last_error;
    pool->stream = stream;
    pool->kind = kind;
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!pool->threads) {
        free(pool);
        return NULL;
    }
    for (int i = 0; i < n_threads; ++i) {
        if (pthread_create(&pool->threads[i], NULL, worker, pool) != 0) {
            pthread_mutex_lock(&pool->mu);
            pool->stop = 1;
            pthread_cond_broadcast(&pool->cv);
            pthread_mutex_unlock(&pool->mu);
            for (int k = 0; k < i; ++k) pthread_join(pool->threads[k], NULL);
            free(pool->threads);
            free(pool);
            return NULL;
        }
        pool->n_threads = i + 1;
    }
    return pool;
}

/* hold != 0: the readers take no new piece until it is 0 again (the pieces they hold finish) */
ER_EXPORT void er_pool_hold(er_pool* pool, int32_t hold) {
    pthread_mutex_lock(&pool->mu);
    pool->hold = hold != 0;
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
}

/* every piece read waits delay_us first: a slow disk, for tests of the waits it causes */
ER_EXPORT void er_pool_delay(er_pool* pool, int64_t delay_us) {
    __atomic_store_n(&pool->delay_us, delay_us < 0 ? 0 : delay_us, __ATOMIC_RELAXED);
}

/* Cancels what is queued, lets the readers finish the pieces they hold, joins them. Jobs stay
 * valid (done) until the caller releases them. */
ER_EXPORT void er_pool_destroy(er_pool* pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    for (int l = 0; l < ER_LEVELS; ++l)
        for (er_job* j = pool->head[l]; j; j = j->next) {
            pthread_mutex_lock(&j->mu);
            j->cancelled = 1;
            pthread_mutex_unlock(&j->mu);
        }
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_threads; ++i) pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv);
    free(pool->threads);
    free(pool);
}

/* One load: n_pieces pieces (piece_first has n_pieces + 1 entries into segs), read into bounce,
 * each piece [piece_at, +piece_len) of the image then copied to dst + piece_at (dst NULL: no copy).
 * The arrays are copied. Returns NULL on bad arguments or no memory. */
ER_EXPORT er_job* er_submit(er_pool* pool, int32_t priority, const er_seg* segs, const uint32_t* piece_first,
                            const uint64_t* piece_at, const uint64_t* piece_len, uint32_t n_pieces,
                            uint8_t* bounce, uint8_t* dst, void* event) {
    if (!pool || n_pieces == 0 || !bounce || !segs || !piece_first || !piece_at || !piece_len) return NULL;
    uint32_t n_segs = piece_first[n_pieces];
    if (piece_first[0] != 0) return NULL;
    for (uint32_t p = 0; p < n_pieces; ++p)
        if (piece_first[p + 1] < piece_first[p]) return NULL;
    size_t bytes = sizeof(er_job) + (n_pieces + 1) * sizeof(uint32_t) + 2 * n_pieces * sizeof(uint64_t) +
                   n_segs * sizeof(er_seg) + 16;
    er_job* j = calloc(1, bytes);
    if (!j) return NULL;
    uint8_t* tail = (uint8_t*)(j + 1);
    j->segs = (er_seg*)tail;                              /* 8-aligned: er_job's size is */
    tail += n_segs * sizeof(er_seg);
    j->piece_at = (uint64_t*)tail;
    tail += n_pieces * sizeof(uint64_t);
    j->piece_len = (uint64_t*)tail;
    tail += n_pieces * sizeof(uint64_t);
    j->piece_first = (uint32_t*)tail;
    memcpy(j->segs, segs, n_segs * sizeof(er_seg));
    memcpy(j->piece_at, piece_at, n_pieces * sizeof(uint64_t));
    memcpy(j->piece_len, piece_len, n_pieces * sizeof(uint64_t));
    memcpy(j->piece_first, piece_first, (n_pieces + 1) * sizeof(uint32_t));
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;     /* er_wait's deadline on the monotonic clock: a clock change moves no wait */
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    j->refs = 2;
    j->left = n_pieces;
    j->n_pieces = n_pieces;
    j->priority = priority < 0 ? 0 : priority >= ER_LEVELS ? ER_LEVELS - 1 : priority;
    j->bounce = bounce;
    j->dst = dst;
    j->event = event;

    pthread_mutex_lock(&pool->mu);
    if (pool->stop) {
        pthread_mutex_unlock(&pool->mu);
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j);
        return NULL;
    }
    int l = j->priority;
    if (pool->tail[l]) pool->tail[l]->next = j;
    else pool->head[l] = j;
    pool->tail[l] = j;
    /* one wake-up per piece, up to every reader */
    if (n_pieces >= (uint32_t)pool->n_threads) pthread_cond_broadcast(&pool->cv);
    else for (uint32_t p = 0; p < n_pieces; ++p) pthread_cond_signal(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    return j;
}

/* 1 once every piece is finished (read and copy issued, or skipped), else 0 */
ER_EXPORT int32_t er_done(er_job* j) {
    pthread_mutex_lock(&j->mu);
    int d = j->done;
    pthread_mutex_unlock(&j->mu);
    return d;
}

/* waits up to timeout_us (< 0: no limit) for the job to be done; returns er_done */
ER_EXPORT int32_t er_wait(er_job* j, int64_t timeout_us) {
    pthread_mutex_lock(&j->mu);
    if (!j->done && timeout_us != 0) {
        if (timeout_us < 0) {
            while (!j->done) pthread_cond_wait(&j->cv, &j->mu);
        } else {
            struct timespec until;
            clock_gettime(CLOCK_MONOTONIC, &until);
            until.tv_sec += (time_t)(timeout_us / 1000000);
            until.tv_nsec += (long)(timeout_us % 1000000) * 1000;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec += 1;
                until.tv_nsec -= 1000000000L;
            }
            while (!j->done)
                if (pthread_cond_timedwait(&j->cv, &j->mu, &until) == ETIMEDOUT) break;
        }
    }
    int d = j->done;
    pthread_mutex_unlock(&j->mu);
    return d;
}

/* no copy of the job is issued after this returns (a piece's copy in progress finishes first) */
ER_EXPORT void er_cancel(er_job* j) {
    pthread_mutex_lock(&j->mu);
    j->cancelled = 1;
    pthread_mutex_unlock(&j->mu);
}

/* the job's place among the pool's finished jobs (1: the first done), 0 while it runs */
ER_EXPORT uint64_t er_done_order(er_job* j) {
    pthread_mutex_lock(&j->mu);
    uint64_t o = j->done ? j->done_order : 0;
    pthread_mutex_unlock(&j->mu);
    return o;
}

/* 1 if any copy went out (the event is then recorded once the job is done) */
ER_EXPORT int32_t er_copied(er_job* j) {
    pthread_mutex_lock(&j->mu);
    int c = j->copied;
    pthread_mutex_unlock(&j->mu);
    return c;
}

/* the job's error into buf (empty: none); 1 if it failed */
ER_EXPORT int32_t er_error(er_job* j, char* buf, uint64_t size) {
    pthread_mutex_lock(&j->mu);
    int f = j->failed;
    if (size) snprintf(buf, (size_t)size, "%s", f ? j->msg : "");
    pthread_mutex_unlock(&j->mu);
    return f;
}

/* the caller is done with the job (it may still be running: the pool keeps it alive until then) */
ER_EXPORT void er_release(er_job* j) {
    if (j) job_unref(j);
}
