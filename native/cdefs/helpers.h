/* p2pxfer's own C helpers (native/src/p2p.c). */
struct p2p_bell {
    int64_t rings;
    ...;
};
struct p2p_poller {
    int ncq;
    int wake_fd;
    int64_t max_runs;
    int32_t *run_cq;
    uint64_t *run_ctx;
    uint64_t *run_flags;
    uint64_t *run_data;
    int64_t *run_count;
    int64_t *run_bytes;
    int err_cq;
    int64_t backoff_ns;
    int64_t backoff_max_ns;
    int64_t entries;
    int32_t hold;
    int64_t bell_spin_ns;
    int64_t bells;
    int64_t bells_dropped;
    int64_t bells_refused;
    ...;
};
#define P2P_GROUP_MAX ...
#define P2P_IMM_TAILS ...
#define P2P_PEER_GONE ...
#define P2P_IMM_TAIL_BYTES ...
struct p2p_cursor {
    struct fid_ep *ep;
    uint64_t dest;
    const int64_t *src_off;
    const int64_t *dst_off;
    const int64_t *len;
    int64_t next;
    int64_t end;
    uint64_t src_base;
    void *src_desc;
    uint64_t dst_base;
    uint64_t dst_key;
    uint64_t imm;
    int with_imm;
    uint64_t context;
    int64_t err;
    int64_t bytes_posted;
    int64_t dc_from;
    struct p2p_bell *bell;
    int group;
};
int64_t p2p_post_cursors(struct p2p_poller *p, struct p2p_cursor *cur, int ncur,
                         int64_t budget_ns);
int64_t p2p_post_writes(struct fid_ep *ep, uint64_t dest,
                        const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                        int64_t start, int64_t end, uint64_t src_base, void *src_desc,
                        uint64_t dst_base, uint64_t dst_key,
                        uint64_t imm, int with_imm, uint64_t context, int group,
                        int64_t *err);
int p2p_poller_init(struct p2p_poller *p, int wake_fd, int64_t backoff_max_ns);
int p2p_poller_add_cq(struct p2p_poller *p, struct fid_fabric *fabric, struct fid_cq *cq,
                      int fd);
int p2p_poller_add_bell(struct p2p_poller *p, int fd);
int p2p_bell_init(struct p2p_bell *b, int fd, const char *name, int namelen, int every);
int64_t p2p_poller_progress(struct p2p_poller *p, int64_t max_entries, int64_t min_entries,
                            int64_t spin_ns, int64_t timeout_ns);
int64_t p2p_now_ns(void);
int64_t p2p_post_once(struct p2p_cursor *cur, int ncur);
int64_t p2p_express_post(struct p2p_poller *p, struct p2p_cursor *c, const int64_t *src_off,
                         const int64_t *dst_off, const int64_t *len, int64_t n, uint64_t imm,
                         int with_imm, uint64_t context, int alive_fd);
int64_t p2p_express_poll(struct p2p_poller *p, int64_t want, uint64_t ctx, int64_t budget_ns,
                         uint64_t data_flag, int64_t *kept);
void p2p_cursor_set(struct p2p_cursor *cur, int i, struct fid_ep *ep, uint64_t dest,
                    const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                    int64_t start, int64_t end, uint64_t src_base, void *src_desc,
                    uint64_t dst_base, uint64_t dst_key, uint64_t imm, int with_imm,
                    uint64_t context, int64_t dc_from, struct p2p_bell *bell, int group);
int p2p_tcp_reset(int fd);
int p2p_mr_reg_hmem(struct fid_domain *domain, uint64_t address, size_t len, uint64_t access,
                    uint64_t requested_key, int iface, int device, struct fid_mr **mr);
int p2p_has_dmabuf(void);
int p2p_mr_reg_dmabuf(struct fid_domain *domain, int fd, uint64_t offset, size_t len,
                      uint64_t base, uint64_t access, uint64_t requested_key, int device,
                      struct fid_mr **mr);
