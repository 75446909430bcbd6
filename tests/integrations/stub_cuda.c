/* A stand-in for libcuda.so.1, for tests on machines without a GPU (see
 * test_vllm_worker_stub_cuda.py): "device memory" is host memory, and an
 * asynchronous copy runs only when something waits for it: a stream
 * synchronized, or an event recorded behind it synchronized (or queried).
 * Code that reads what a copy wrote without waiting for it reads the old
 * bytes, as it might on a GPU; a test then sees it. Only the driver calls
 * p2pxfer.cuda makes. One mutex serializes every call. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { uint64_t dst, src; size_t n; } op;
typedef struct { op *ops; size_t len, cap, done; } stream;
typedef struct { stream *s; size_t pos; } event;
typedef struct { uint64_t addr, n; } range;

enum { NOT_READY = 600, ALREADY_REGISTERED = 712, NOT_REGISTERED = 713, MAX_RANGES = 4096 };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static stream legacy;                  /* stream 0 */
static range pinned[MAX_RANGES];
static int npinned;
static range devs[MAX_RANGES];
static int ndevs;
static long copies_run, copies_queued;

static stream *S(void *h) { return h ? (stream *)h : &legacy; }

static void run_to(stream *s, size_t pos)
{
    while (s->done < pos) {
        op *o = &s->ops[s->done++];
        memcpy((void *)o->dst, (void *)o->src, o->n);
        copies_run++;
    }
}

static int enqueue(stream *s, uint64_t dst, uint64_t src, size_t n)
{
    if (s->len == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 256;
        op *ops = realloc(s->ops, cap * sizeof *ops);
        if (!ops)
            return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
        s->ops = ops;
        s->cap = cap;
    }
    s->ops[s->len++] = (op){dst, src, n};
    copies_queued++;
    return 0;
}

/* -- what the tests ask the stub ------------------------------------------ */
int stub_pinned(void) { pthread_mutex_lock(&mu); int n = npinned; pthread_mutex_unlock(&mu); return n; }
long stub_copies_queued(void) { return copies_queued; }
long stub_copies_run(void) { return copies_run; }

/* -- the driver API ------------------------------------------------------- */
int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuGetErrorString(int rc, const char **s)
{
    static char buf[64];
    snprintf(buf, sizeof buf, "stub CUDA error %d", rc);
    *s = buf;
    return 0;
}
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return ordinal == 0 ? 0 : 101; }
int cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = (void *)0x1; return 0; }
int cuCtxSetCurrent(void *c) { (void)c; return 0; }

static __thread void *ctx_stack[64];
static __thread int ctx_depth;
static __thread void *ctx_cur;
int cuCtxPushCurrent_v2(void *c) { ctx_stack[ctx_depth++] = ctx_cur; ctx_cur = c; return 0; }
int cuCtxPopCurrent_v2(void **c)
{
    if (!ctx_depth)
        return 201;
    if (c)
        *c = ctx_cur;
    ctx_cur = ctx_stack[--ctx_depth];
    return 0;
}
int cuCtxGetCurrent(void **c) { *c = ctx_cur; return 0; }

int cuPointerGetAttribute(void *out, int attr, uint64_t p)
{
    int rc = 1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < ndevs; i++)
        if (devs[i].n && p >= devs[i].addr && p < devs[i].addr + devs[i].n) {
            if (attr == 2)
                *(unsigned *)out = 2; /* CU_MEMORYTYPE_DEVICE */
            else
                *(int *)out = 0;
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&mu);
    return rc;
}

int cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    (void)flags;
    int rc = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < npinned; i++)
        if (pinned[i].addr == (uint64_t)p)
            rc = ALREADY_REGISTERED;
    if (!rc)
        pinned[npinned++] = (range){(uint64_t)p, n};
    pthread_mutex_unlock(&mu);
    return rc;
}

int cuMemHostUnregister(void *p)
{
    int rc = NOT_REGISTERED;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < npinned; i++)
        if (pinned[i].addr == (uint64_t)p) {
            pinned[i] = pinned[--npinned];
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&mu);
    return rc;
}

int cuMemAlloc_v2(uint64_t *p, size_t n)
{
    void *m = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!m)
        return 2;
    pthread_mutex_lock(&mu);
    *p = (uint64_t)m;
    devs[ndevs++] = (range){*p, n};
    pthread_mutex_unlock(&mu);
    return 0;
}

int cuMemFree_v2(uint64_t p)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < ndevs; i++)
        if (devs[i].addr == p)
            devs[i].n = 0;
    pthread_mutex_unlock(&mu);
    free((void *)p);
    return 0;
}

int cuStreamCreate(void **s, unsigned flags) { (void)flags; *s = calloc(1, sizeof(stream)); return *s ? 0 : 2; }
int cuStreamDestroy_v2(void *h)
{
    stream *s = S(h);
    pthread_mutex_lock(&mu);
    run_to(s, s->len); /* work queued before a destroy still completes */
    pthread_mutex_unlock(&mu);
    free(s->ops);
    free(s);
    return 0;
}
int cuStreamSynchronize(void *h)
{
    pthread_mutex_lock(&mu);
    run_to(S(h), S(h)->len);
    pthread_mutex_unlock(&mu);
    return 0;
}

int cuEventCreate(void **e, unsigned flags) { (void)flags; *e = calloc(1, sizeof(event)); return *e ? 0 : 2; }
int cuEventDestroy_v2(void *e) { free(e); return 0; }
int cuEventRecord(void *e, void *h)
{
    pthread_mutex_lock(&mu);
    ((event *)e)->s = S(h);
    ((event *)e)->pos = S(h)->len;
    pthread_mutex_unlock(&mu);
    return 0;
}
int cuEventSynchronize(void *e)
{
    event *ev = e;
    pthread_mutex_lock(&mu);
    if (ev->s)
        run_to(ev->s, ev->pos);
    pthread_mutex_unlock(&mu);
    return 0;
}
int cuEventQuery(void *e)
{
    /* The device makes progress: what the event waits for runs now. */
    return cuEventSynchronize(e);
}

int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, void *h)
{
    pthread_mutex_lock(&mu);
    int rc = enqueue(S(h), dst, src, n);
    pthread_mutex_unlock(&mu);
    return rc;
}
int cuMemsetD8Async(uint64_t p, unsigned char v, size_t n, void *h)
{
    (void)h;
    memset((void *)p, v, n);
    return 0;
}

/* cuMemcpyBatchAsync (CUDA 13), as p2pxfer calls it: one attribute set
 * (stream order) for every copy. */
struct loc { int32_t type, id; };
struct attrs { int32_t order; struct loc s, d; uint32_t flags; };
static int batch(uint64_t *dst, uint64_t *src, size_t *n, size_t count, struct attrs *a,
                 size_t *idx, size_t na, void *h)
{
    if (na != 1 || a[0].order != 1 || idx[0] != 0)
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    int rc = 0;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < count && !rc; i++)
        rc = enqueue(S(h), dst[i], src[i], n[i]);
    pthread_mutex_unlock(&mu);
    return rc;
}
int cuGetProcAddress_v2(const char *sym, void **fn, int version, uint64_t flags, int *status)
{
    (void)flags;
    if (!strcmp(sym, "cuMemcpyBatchAsync") && version >= 13000) {
        *fn = (void *)batch;
        *status = 0;
        return 0;
    }
    *status = 1;
    return 500;
}
