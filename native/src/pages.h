/* p2pxfer's fabric-free C helpers (pages.c): one pass over a page list, no
 * allocation, no Python objects, no libfabric. */
#ifndef P2P_PAGES_H
#define P2P_PAGES_H

#include <stdint.h>

int64_t p2p_check_scatter(const int64_t *src, const int64_t *dst, const int64_t *len, int64_t n,
                          int64_t src_size, int64_t dst_size, int32_t *what, int64_t *out);
int64_t p2p_copy_scatter(char *dst, int64_t dst_size, const char *src, int64_t src_size,
                         const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                         int64_t start, int64_t end, const int32_t *stop, int64_t *bad);
int64_t p2p_device_copy(void *memcpy_async, void *stream, uint64_t dst_base, uint64_t src_base,
                        const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                        int64_t n, int64_t *failed_at);
int64_t p2p_device_copy_batch(void *memcpy_batch, void *stream, uint64_t dst_base,
                              uint64_t src_base, const int64_t *src_off, const int64_t *dst_off,
                              const int64_t *len, int64_t n, uint64_t *scratch);

#endif
