/* Loops over page lists that need no fabric: validating a scatter list,
 * copying one between two buffers of this process, and issuing one as CUDA
 * copies. Built as p2pxfer._pages,
 * which links no libfabric, so a client library can check what it sends
 * without loading the fabric; see pages.h. */
#define _GNU_SOURCE
#include "pages.h"

#include <string.h>

/* Validate a scatter list in one pass: offsets >= 0, lengths > 0, every piece
 * inside [0, src_size) and [0, dst_size) (written so nothing overflows).
 * Returns -1 when all fit, else the first bad index with *what set:
 * 1 negative src, 2 negative dst, 3 length <= 0, 4 past src end, 5 past dst end,
 * 6 the total length overflows int64.
 * Also reports out[0] the total, out[1] the largest length, and out[2], out[3]
 * the furthest source and destination end: with those kept, later checks
 * against region sizes are two comparisons, not another pass. */
int64_t p2p_check_scatter(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n,
                          int64_t src_size, int64_t dst_size, int32_t *what, int64_t *out)
{
    int64_t i, sum = 0, mx = 0, src_end = 0, dst_end = 0;
    for (i = 0; i < n; i++) {
        int64_t l = len[i];
        if (src[i] < 0) { *what = 1; return i; }
        if (dst[i] < 0) { *what = 2; return i; }
        if (l <= 0) { *what = 3; return i; }
        if (src[i] > src_size - l) { *what = 4; return i; }
        if (dst[i] > dst_size - l) { *what = 5; return i; }
        if (l > INT64_MAX - sum) { *what = 6; return i; }
        sum += l;
        if (l > mx)
            mx = l;
        if (src[i] + l > src_end)
            src_end = src[i] + l;
        if (dst[i] + l > dst_end)
            dst_end = dst[i] + l;
    }
    *what = 0;
    out[0] = sum;
    out[1] = mx;
    out[2] = src_end;
    out[3] = dst_end;
    return -1;
}

/* The same-daemon fast path: copy pieces [start, end) of a scatter list from
 * src to dst, both mappings of this process. memmove, not memcpy: a client may
 * write from one part of its memory into another. Every piece is checked
 * against both sizes again before it is touched (the caller validated the list
 * already; this keeps a bug there from becoming a stray write), and *stop is
 * read between pieces, never inside one: a stopped copy leaves whole pieces.
 * Returns the pieces copied; *bad is the index of a piece out of bounds (the
 * copy stops there), else -1. Touches no Python object: called without the GIL. */
int64_t p2p_copy_scatter(char *dst, int64_t dst_size, const char *src, int64_t src_size,
                         const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                         int64_t start, int64_t end, const int32_t *stop, int64_t *bad)
{
    int64_t i;
    *bad = -1;
    for (i = start; i < end; i++) {
        int64_t l = len[i], s = src_off[i], d = dst_off[i];
        if (__atomic_load_n(stop, __ATOMIC_ACQUIRE))
            break;
        if (l <= 0 || s < 0 || d < 0 || s > src_size - l || d > dst_size - l) {
            *bad = i;
            break;
        }
        memmove(dst + d, src + s, (size_t)l);
    }
    return i - start;
}

/* Issue pieces [0, n) as asynchronous CUDA copies on `stream`, piece i from
 * src_base + src_off[i] to dst_base + dst_off[i]: runs adjacent on both
 * sides become one copy. `memcpy_async` is the driver's cuMemcpyAsync (with
 * unified addressing it infers the direction from the addresses), found by
 * the caller, so this library links no CUDA and loads where there is none.
 * Returns the copies issued; on a failed call, -(its CUresult) with
 * *failed_at the piece it started at. */
typedef int (*p2p_memcpy_async_fn)(uint64_t dst, uint64_t src, size_t bytes, void *stream);

int64_t p2p_device_copy(void *memcpy_async, void *stream, uint64_t dst_base, uint64_t src_base,
                        const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                        int64_t n, int64_t *failed_at)
{
    p2p_memcpy_async_fn copy = (p2p_memcpy_async_fn)memcpy_async;
    int64_t i = 0, issued = 0;
    *failed_at = -1;
    while (i < n) {
        int64_t first = i, s = src_off[i], d = dst_off[i], l = len[i];
        while (i + 1 < n && src_off[i + 1] == s + l && dst_off[i + 1] == d + l)
            l += len[++i];
        int rc = copy(dst_base + (uint64_t)d, src_base + (uint64_t)s, (size_t)l, stream);
        if (rc != 0) {
            *failed_at = first;
            return -(int64_t)rc;
        }
        issued++;
        i++;
    }
    return issued;
}

/* The same pieces as one cuMemcpyBatchAsync (CUDA 13's ABI, found by the
 * caller with cuGetProcAddress): runs merged into `scratch` (3 x n uint64:
 * destinations, sources, sizes), then handed over in one call, so the
 * driver's fixed cost is paid once, not per run. The batch runs in stream
 * order as a whole. Returns the copies in the batch, or -(CUresult). */
struct p2p_mem_location { int32_t type; int32_t id; };
struct p2p_memcpy_attributes {
    int32_t src_access_order;
    struct p2p_mem_location src_hint, dst_hint;
    uint32_t flags;
};
typedef int (*p2p_memcpy_batch_fn)(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count,
                                   struct p2p_memcpy_attributes *attrs, size_t *attr_idx,
                                   size_t num_attrs, void *stream);

int64_t p2p_device_copy_batch(void *memcpy_batch, void *stream, uint64_t dst_base,
                              uint64_t src_base, const int64_t *src_off, const int64_t *dst_off,
                              const int64_t *len, int64_t n, uint64_t *scratch)
{
    uint64_t *dsts = scratch, *srcs = scratch + n;
    size_t *sizes = (size_t *)(scratch + 2 * n);
    int64_t i = 0, runs = 0;
    while (i < n) {
        int64_t s = src_off[i], d = dst_off[i], l = len[i];
        while (i + 1 < n && src_off[i + 1] == s + l && dst_off[i + 1] == d + l)
            l += len[++i];
        dsts[runs] = dst_base + (uint64_t)d;
        srcs[runs] = src_base + (uint64_t)s;
        sizes[runs] = (size_t)l;
        runs++;
        i++;
    }
    if (runs == 0)
        return 0;
    /* Sources are read in stream order (after the work before the batch). */
    struct p2p_memcpy_attributes attr = {1, {0, 0}, {0, 0}, 0};
    size_t attr_idx = 0;
    int rc = ((p2p_memcpy_batch_fn)memcpy_batch)(dsts, srcs, sizes, (size_t)runs, &attr,
                                                  &attr_idx, 1, stream);
    return rc ? -(int64_t)rc : runs;
}
