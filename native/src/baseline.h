/* The C-to-C reference loops (baseline.c); declared for cffi in
 * native/cdefs/helpers.h, in the block at its end. */
#ifndef P2P_BASELINE_H
#define P2P_BASELINE_H

#include <stdint.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_eq.h>

/* Target: busy-poll cq until `expected` remote-CQ-data completions arrived or
 * timeout_ns passed; returns how many arrived, or a negative fi_errno. */
int64_t p2p_ref_target(struct fid_cq *cq, int64_t expected, int64_t timeout_ns);
/* Initiator: post the n pieces, up to `group` per write (fi_writemsg; one:
 * fi_writedata with imm, else fi_write), until the provider pushes back,
 * drain cq, repeat until every write completed. 0, -FI_ETIMEDOUT or a
 * negative fi_errno. */
int64_t p2p_ref_write(struct fid_ep *ep, struct fid_cq *cq, uint64_t dest,
                      const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                      int64_t n, uint64_t src_base, void *src_desc, uint64_t dst_base,
                      uint64_t dst_key, uint64_t imm, int with_imm, int group,
                      int64_t timeout_ns);
/* iters round trips of one len-byte write with immediate each way; the
 * initiator stores each round trip's nanoseconds in rtt_ns (may be NULL). */
int64_t p2p_ref_pingpong(struct fid_ep *ep, struct fid_cq *cq, uint64_t dest,
                         uint64_t src_base, void *src_desc, uint64_t dst_base, uint64_t dst_key,
                         int64_t len, int64_t iters, int initiator, int64_t timeout_ns,
                         int64_t *rtt_ns);

#endif
