/* Graph capture on the CPU: record the ops issued on a stream between graph_begin and graph_end,
 * replay them natively on graph_launch.
 *
 * Why: a decode step of a small model is ~140 ops of a few microseconds each, and issuing them one
 * by one from Python (a cffi call, argument marshalling, the interpreter) costs more than the ops.
 * A graph turns the step into one call. It also lets the thread pool stay hot (workers spin instead
 * of sleeping) for exactly the duration of a replay, so tiny ops pay no wake-up.
 *
 * Semantics follow a CUDA graph: while a context captures `stream`, an op or copy issued on that
 * stream is checked (the op's own validation in query mode) and recorded, not run. Work on other
 * streams runs as usual. The replay uses the recorded pointers: the host keeps every buffer alive
 * and in place while the graph exists, and writes new inputs into the same buffers.
 *
 * A node owns a deep copy of its args struct: the DI_Quant descriptors its tensors point to and the
 * per-expert descriptor arrays of moe_experts are borrowed by the ABI for one call only, so they are
 * copied too. Which fields are tensors (and which are arrays, with their count field) comes from
 * the header's op table (DI_ARGS_<op>), so a new op needs nothing here.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deepinfer_abi_check.h"
#include "di_cpu.h"

#define GRAPH_MAGIC 0x44494752u /* "DIGR" */

/* DEEPINFER_CPU_PROFILE=1: time every replayed node, summed per op, printed to stderr when the
 * first context is destroyed, or at exit (where a replayed step spends its time, without Python in
 * the way). */
static int g_profile = -1;
static double g_prof_s[DI_OP_COUNT_V1_6 + 1];
static int64_t g_prof_n[DI_OP_COUNT_V1_6 + 1];
static int64_t g_prof_launches;

void graph_profile_report(void) {
    if (g_profile != 1 || !g_prof_launches) return;
    static int done;
    if (done++) return;
    static const char* names[DI_OP_COUNT_V1_6 + 1] = {
#define N(id, name, T, minor) [id] = #name,
        DI_OPS(N)
#undef N
        [DI_OP_COUNT_V1_6] = "(copy)"};
    double tot = 0;
    for (int i = 0; i <= DI_OP_COUNT_V1_6; i++) tot += g_prof_s[i];
    fprintf(stderr, "deepinfer cpu graph profile: %lld launches, %.1f us per launch\n", (long long)g_prof_launches,
            1e6 * tot / (double)g_prof_launches);
    for (int i = 0; i <= DI_OP_COUNT_V1_6; i++)
        if (g_prof_n[i])
            fprintf(stderr, "  %-16s %6lld calls/launch %9.1f us/launch %5.1f%%\n", names[i],
                    (long long)(g_prof_n[i] / g_prof_launches), 1e6 * g_prof_s[i] / (double)g_prof_launches,
                    100.0 * g_prof_s[i] / tot);
}

/* ------------------------------------------------------------------ tensor fields of each args struct */
typedef struct {
    uint32_t off;        /* offset of the DI_Tensor (or of the const DI_Tensor* of an array) */
    uint32_t count_off;  /* arrays: offset of the int32 count field; 0 for a plain tensor */
    int      array;
} TField;

#define TF(S, f, role, pres, lo, hi, pd, qd) {(uint32_t)offsetof(S, f), 0, 0},
#define AF(S, f, role, pres, lo, hi, pd, qd, cnt) {(uint32_t)offsetof(S, f), (uint32_t)offsetof(S, cnt), 1},
#define FIELDS(id, name, T, minor) static const TField k_f_##name[] = {DI_ARGS_##name(TF, AF, T)};
DI_OPS(FIELDS)
#undef FIELDS
#undef TF
#undef AF

static const struct { const TField* f; int n; } k_fields[DI_OP_COUNT_V1_6] = {
#define E(id, name, T, minor) [id] = {k_f_##name, (int)(sizeof k_f_##name / sizeof k_f_##name[0])},
    DI_OPS(E)
#undef E
};

/* ------------------------------------------------------------------ graphs */
enum { NODE_OP = 0, NODE_COPY = 1 };

typedef struct {
    int   kind, op;
    void* args;                      /* NODE_OP: the deep copy (one allocation, owned) */
    void* dst;                       /* NODE_COPY */
    const void* src;
    uint64_t bytes;
} Node;

struct DI_Graph {
    uint32_t    magic;
    int         n, cap;
    Node*       nodes;
};

static void graph_free(DI_Graph* g) {
    if (!g) return;
    for (int i = 0; i < g->n; i++) free(g->nodes[i].args);
    free(g->nodes);
    g->magic = 0;
    free(g);
}

static Node* graph_push(DI_Graph* g) {
    if (g->n == g->cap) {
        int cap = g->cap ? 2 * g->cap : 64;
        Node* nn = realloc(g->nodes, (size_t)cap * sizeof(Node));
        if (!nn) return NULL;
        g->nodes = nn;
        g->cap = cap;
    }
    Node* nd = &g->nodes[g->n++];
    memset(nd, 0, sizeof *nd);
    return nd;
}

/* a copy of `t`'s quant descriptor at *bump (advanced); t->quant then points at it */
static void own_quant(DI_Tensor* t, char** bump) {
    if (!t->quant) return;
    DI_Quant* q = (DI_Quant*)*bump;
    *bump += sizeof(DI_Quant);
    memcpy(q, t->quant, sizeof(DI_Quant));
    q->struct_size = sizeof(DI_Quant);  /* validated: the caller's bytes past ours are zero */
    t->quant = q;
}

static DI_Status record_op(DI_Context* ctx, DI_Graph* g, int op, const void* args, uint32_t size) {
    const TField* f = k_fields[op].f;
    int nf = k_fields[op].n;
    /* one allocation: the struct, then every array, then every quant descriptor */
    size_t total = ((size_t)size + 15) & ~(size_t)15;
    for (int i = 0; i < nf; i++) {
        if (f[i].array) {
            int32_t cnt = *(const int32_t*)((const char*)args + f[i].count_off);
            const DI_Tensor* arr = *(const DI_Tensor* const*)((const char*)args + f[i].off);
            if (cnt <= 0 || !arr) continue;
            total += (size_t)cnt * sizeof(DI_Tensor);
            for (int32_t e = 0; e < cnt; e++)
                if (arr[e].quant) total += sizeof(DI_Quant);
        } else if (((const DI_Tensor*)((const char*)args + f[i].off))->quant) {
            total += sizeof(DI_Quant);
        }
    }
    char* mem = malloc(total);
    Node* nd = mem ? graph_push(g) : NULL;
    if (!nd) {
        free(mem);
        return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "graph capture: out of host memory recording op %d", op);
    }
    memcpy(mem, args, size);
    ((DI_ArgsHeader*)mem)->struct_size = size;
    char* bump = mem + (((size_t)size + 15) & ~(size_t)15);
    for (int i = 0; i < nf; i++) {
        if (f[i].array) {
            int32_t cnt = *(const int32_t*)(mem + f[i].count_off);
            const DI_Tensor** slot = (const DI_Tensor**)(mem + f[i].off);
            if (cnt <= 0 || !*slot) continue;
            DI_Tensor* copy = (DI_Tensor*)bump;
            bump += (size_t)cnt * sizeof(DI_Tensor);
            memcpy(copy, *slot, (size_t)cnt * sizeof(DI_Tensor));
            *slot = copy;
            for (int32_t e = 0; e < cnt; e++) own_quant(&copy[e], &bump);
        } else {
            own_quant((DI_Tensor*)(mem + f[i].off), &bump);
        }
    }
    nd->kind = NODE_OP;
    nd->op = op;
    nd->args = mem;
    return DI_OK;
}

/* ------------------------------------------------------------------ hooks for plugin.c */
int graph_capturing(DI_Context* ctx, DI_Stream stream) {
    return ctx->capture != NULL && ctx->capture_stream == stream;
}

DI_Status graph_capture_op(DI_Context* ctx, int op, const void* args, uint32_t lib_size) {
    /* the op's own checks now (query mode), so a bad call fails where it was issued */
    DI_Status st = di_run_op(ctx, op, args, 1);
    if (st == DI_QUERY_SLOW) st = DI_OK;
    if (st) return st;
    return record_op(ctx, ctx->capture, op, args, lib_size);
}

DI_Status graph_capture_copy(DI_Context* ctx, void* dst, const void* src, uint64_t bytes) {
    Node* nd = graph_push(ctx->capture);
    if (!nd) return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "graph capture: out of host memory recording a copy");
    nd->kind = NODE_COPY;
    nd->dst = dst;
    nd->src = src;
    nd->bytes = bytes;
    return DI_OK;
}

/* ------------------------------------------------------------------ the four entries */
DI_Status graph_begin(DI_Context* ctx, DI_Stream stream) {
    if (ctx->capture)
        return di_fail(ctx, DI_FAILED_PRECONDITION, "graph_begin: this context is already capturing a stream; "
                       "call graph_end first");
    DI_Graph* g = calloc(1, sizeof *g);
    if (!g) return di_fail(ctx, DI_RESOURCE_EXHAUSTED, "graph_begin: out of host memory");
    g->magic = GRAPH_MAGIC;
    ctx->capture = g;
    ctx->capture_stream = stream;
    return DI_OK;
}

DI_Status graph_end(DI_Context* ctx, DI_Stream stream, DI_Graph** out) {
    if (!out) return di_fail(ctx, DI_INVALID_ARGUMENT, "graph_end: out is NULL");
    *out = NULL;
    if (!ctx->capture)
        return di_fail(ctx, DI_FAILED_PRECONDITION, "graph_end: no capture in progress (graph_begin first)");
    if (ctx->capture_stream != stream)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "graph_end: the capture is on another stream than the one given");
    *out = ctx->capture;
    ctx->capture = NULL;
    ctx->capture_stream = NULL;
    return DI_OK;
}

DI_Status graph_launch(DI_Context* ctx, DI_Graph* g, DI_Stream stream) {
    (void)stream;  /* every node has finished when the launch returns */
    if (!g || g->magic != GRAPH_MAGIC)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "graph_launch: graph is NULL or not a live graph of this library");
    if (ctx->capture)
        return di_fail(ctx, DI_FAILED_PRECONDITION, "graph_launch: this context is capturing; launching a graph "
                       "inside a capture is not supported");
    DI_Status st = DI_OK;
    if (g_profile < 0) {
        const char* e = getenv("DEEPINFER_CPU_PROFILE");
        g_profile = e && *e && strcmp(e, "0") != 0;
        if (g_profile) atexit(graph_profile_report);   /* and at exit, if no context is destroyed */
    }
    pool_hot(ctx->pool, 1);
    double t = g_profile ? 1e-9 * (double)di_now_ns() : 0;
    for (int i = 0; i < g->n && !st; i++) {
        const Node* nd = &g->nodes[i];
        if (nd->kind == NODE_COPY) {
            memmove(nd->dst, nd->src, (size_t)nd->bytes);
        } else {
            st = di_run_op(ctx, nd->op, nd->args, 0);
        }
        if (g_profile) {
            double t1 = 1e-9 * (double)di_now_ns();
            int k = nd->kind == NODE_COPY ? DI_OP_COUNT_V1_6 : nd->op;
            g_prof_s[k] += t1 - t;
            g_prof_n[k]++;
            t = t1;
        }
        if (st) {
            char msg[DI_ERR_LEN];
            snprintf(msg, sizeof msg, "%s", di_last_error());
            di_fail(ctx, st, "graph_launch: node %d of %d failed: %s", i, g->n, msg);
        }
    }
    pool_hot(ctx->pool, 0);
    if (g_profile) g_prof_launches++;
    return st;
}

DI_Status graph_destroy(DI_Context* ctx, DI_Graph* g) {
    if (!g || g->magic != GRAPH_MAGIC)
        return di_fail(ctx, DI_INVALID_ARGUMENT, "graph_destroy: graph is NULL or not a live graph of this library");
    graph_free(g);
    return DI_OK;
}

void graph_abandon(DI_Context* ctx) {
    graph_free(ctx->capture);
    ctx->capture = NULL;
}
