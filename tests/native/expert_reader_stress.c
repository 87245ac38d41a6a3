/* A stress driver for runtime/native/expert_reader.c, built by tests/test_native_reader_stress.py
 * (with ThreadSanitizer where the compiler has it): many loads on 8 readers at three priorities,
 * a fifth of them given up while queued or in flight. Every load must end; a load never given up
 * must deliver its bytes whole; an event is recorded exactly when some copy went out. The copy and
 * record entries stand in for a backend's (a memcpy; a counter). Exit status 0: all held. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct er_seg { int32_t fd; int32_t reserved; uint64_t file_off; uint64_t at; uint64_t len; } er_seg;
typedef struct er_pool er_pool;
typedef struct er_job er_job;
er_pool* er_pool_create(int32_t, void*, void*, void*, void*, void*, int32_t);
void er_pool_destroy(er_pool*);
er_job* er_submit(er_pool*, int32_t, const er_seg*, const uint32_t*, const uint64_t*, const uint64_t*, uint32_t,
                  uint8_t*, uint8_t*, void*);
int32_t er_wait(er_job*, int64_t);
void er_cancel(er_job*);
int32_t er_copied(er_job*);
int32_t er_error(er_job*, char*, uint64_t);
void er_release(er_job*);

static int32_t copy(void* ctx, void* dst, const void* src, uint64_t n, int32_t kind, void* stream) {
    (void)ctx; (void)kind; (void)stream;
    memcpy(dst, src, n);
    return 0;
}

static int32_t record(void* ctx, void* event, void* stream) {
    (void)ctx; (void)stream;
    __atomic_add_fetch((int*)event, 1, __ATOMIC_RELAXED);
    return 0;
}

int main(int argc, char** argv) {
    enum { N = 1 << 18, PIECES = 16, J = 300 };
    if (argc < 2) return 2;
    uint8_t* data = malloc(N);
    for (int i = 0; i < N; ++i) data[i] = (uint8_t)(i * 7 + 3);
    FILE* f = fopen(argv[1], "wb");
    if (!f || fwrite(data, 1, N, f) != N) return 2;
    fclose(f);
    int fd = open(argv[1], O_RDONLY);
    er_pool* pool = er_pool_create(8, NULL, (void*)copy, (void*)record, NULL, NULL, 1);
    if (fd < 0 || !pool) return 2;
    er_seg segs[PIECES];
    uint32_t first[PIECES + 1];
    uint64_t at[PIECES], len[PIECES];
    for (int i = 0; i < PIECES; ++i) {
        uint64_t o = (uint64_t)i * (N / PIECES);
        segs[i] = (er_seg){fd, 0, o, o, N / PIECES};
        first[i] = (uint32_t)i;
        at[i] = o;
        len[i] = N / PIECES;
    }
    first[PIECES] = PIECES;
    static er_job* jobs[J];
    static uint8_t* bounce[J];
    static uint8_t* dst[J];
    static int events[J], given_up[J];
    for (int j = 0; j < J; ++j) {
        bounce[j] = malloc(N);
        dst[j] = calloc(1, N);
        jobs[j] = er_submit(pool, j % 3, segs, first, at, len, PIECES, bounce[j], dst[j], &events[j]);
        if (!jobs[j]) return 2;
        if (j % 5 == 0) { er_cancel(jobs[j]); given_up[j] = 1; }              /* while queued */
        if (j % 7 == 0 && j) { er_cancel(jobs[j - 1]); given_up[j - 1] = 1; } /* maybe in flight */
    }
    int bad = 0;
    for (int j = 0; j < J; ++j) {
        char msg[256];
        er_wait(jobs[j], -1);
        if (er_error(jobs[j], msg, sizeof msg)) { fprintf(stderr, "load %d: %s\n", j, msg); bad++; }
        int copied = er_copied(jobs[j]);
        if (copied != __atomic_load_n(&events[j], __ATOMIC_RELAXED)) {
            fprintf(stderr, "load %d: copied %d but %d events\n", j, copied, events[j]);
            bad++;
        }
        if (!given_up[j] && (!copied || memcmp(dst[j], data, N))) {
            fprintf(stderr, "load %d: bytes not delivered\n", j);
            bad++;
        }
        er_release(jobs[j]);
        free(bounce[j]);
        free(dst[j]);
    }
    er_pool_destroy(pool);
    close(fd);
    free(data);
    printf("%d loads, %d failures\n", J, bad);
    return bad != 0;
}
