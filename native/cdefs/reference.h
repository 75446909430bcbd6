/* The C-to-C reference loops (native/src/baseline.c), for p2pxfer.bench._cref.
 * The fabric's objects are opaque here: their pointers come from p2pxfer._fabric. */
struct fid_ep;
struct fid_cq;
int64_t p2p_ref_target(struct fid_cq *cq, int64_t expected, int64_t timeout_ns);
int64_t p2p_ref_write(struct fid_ep *ep, struct fid_cq *cq, uint64_t dest,
                      const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                      int64_t n, uint64_t src_base, void *src_desc, uint64_t dst_base,
                      uint64_t dst_key, uint64_t imm, int with_imm, int group,
                      int64_t timeout_ns);
int64_t p2p_ref_pingpong(struct fid_ep *ep, struct fid_cq *cq, uint64_t dest,
                         uint64_t src_base, void *src_desc, uint64_t dst_base, uint64_t dst_key,
                         int64_t len, int64_t iters, int initiator, int64_t timeout_ns,
                         int64_t *rtt_ns);
