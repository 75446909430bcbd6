/* p2pxfer's C helpers: the loops that must not run in Python.
 *
 * Everything here works on flat arrays handed in by the caller; nothing here
 * allocates per page, takes the GIL or knows about Python objects. Completion
 * contexts are plain integers (transfer ids), never pointers to objects. */
#ifndef P2P_H
#define P2P_H

#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>

#define P2P_MAX_CQ 16
/* Pieces that carry no immediate go out up to P2P_GROUP_MAX per RMA write
 * (fi_writemsg with that many iovs and rma_iovs, where the provider's
 * iov_limit and rma_iov_limit allow): a message's fixed cost (its header,
 * its send call, its completion) is then paid once per group, not per
 * piece. How many pieces a completion stands for rides in its operation
 * context, in the two bits at P2P_GROUP_SHIFT (that count less one), and is
 * taken out again where completions are read (add_entry): runs count
 * pieces. A piece with an immediate stays alone, as the target counts one
 * arrival per immediate. */
#define P2P_GROUP_MAX 4
#define P2P_GROUP_SHIFT 54
#define P2P_GROUP_BITS (3ULL << P2P_GROUP_SHIFT)

/* A cursor's with_imm: 0, no piece carries the immediate; 1, every piece;
 * P2P_IMM_TAILS: each entry of its arrays goes as two pieces, its head (all
 * but the last P2P_IMM_TAIL_BYTES, no immediate) at index 2k, then its tail
 * with the immediate at 2k + 1, where a lone write carrying one would wait
 * for the target's progress and one without is placed at its post (shm:
 * FabricInfo.imm_tail). The cursor's indices count pieces so posted. */
#define P2P_IMM_TAILS 2
#define P2P_IMM_TAIL_BYTES 64

/* p2p_express_post: the peer's segment is gone (unlinked), nothing posted */
#define P2P_PEER_GONE 2

/* A shm target's doorbell, as an initiator sees it: the target's abstract
 * unix datagram socket (its name) and this process's sending socket. shm CQs
 * have no wait fd, so an idle shm target naps between looks at its CQ; a
 * pass that posted a piece whose completion needs the target's progress
 * (delivery-complete, or one carrying an immediate; any piece with `every`)
 * or that stopped on a full queue (only the target's progress empties it)
 * rings it, at most once per P2P_RING_GAP_NS per bell (a target rung that
 * recently still spins). */
struct p2p_bell {
    int fd;
    int every;                   /* every piece needs the target (delivery-complete
                                  * on every transmit) */
    socklen_t len;
    int64_t last_ns;             /* when it was last rung (read and written by
                                  * whichever thread posts: a lost race rings twice) */
    int64_t rings;               /* datagrams sent, lifetime */
    struct sockaddr_un addr;
};

/* What one drain produced: runs of consecutive completions that share
 * (cq, context, flags, data), so a batch of thousands of pieces reaches Python
 * as a handful of rows. */
struct p2p_poller {
    int ncq;
    struct fid_fabric *fabric[P2P_MAX_CQ];
    struct fid_cq *cq[P2P_MAX_CQ];
    int fd[P2P_MAX_CQ];          /* wait fd of each CQ, -1 where it has none */
    int wake_fd;                 /* eventfd that interrupts a blocked wait, or -1 */
    int64_t max_runs;
    int32_t *run_cq;
    uint64_t *run_ctx;
    uint64_t *run_flags;
    uint64_t *run_data;
    int64_t *run_count;
    int64_t *run_bytes;
    int err_cq;                  /* CQ with an error entry waiting (-FI_EAVAIL), or -1 */
    int64_t backoff_ns;          /* current sleep where a CQ has no wait fd */
    int64_t backoff_max_ns;
    int64_t entries;             /* pieces completed and arrivals seen, lifetime */
    int32_t hold;                /* nonzero: another thread is polling these CQs for a
                                  * small write; progress keeps its hands off them */
    int nbell;
    int bell_fd[P2P_MAX_CQ];     /* our shm rails' doorbells, slept on with the wake fd */
    int64_t bell_spin_ns;        /* once rung, spin at least this long: a piece is due */
    int64_t bells;               /* times a doorbell woke this poller, lifetime */
    int64_t bells_dropped;       /* doorbell fds found unreadable and no longer polled */
    int64_t bells_refused;       /* rings from other users, read and ignored */
};

/* One rail's share of a transfer, for p2p_post_cursors: pieces [next, end)
 * still to post. err is set (negative) when a post failed outright. */
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
    int64_t dc_from;             /* pieces from this index on are posted with
                                  * FI_DELIVERY_COMPLETE (INT64_MAX: none) */
    struct p2p_bell *bell;       /* the peer's doorbell, or NULL (not shm) */
    int group;                   /* pieces per RMA write at most (1..P2P_GROUP_MAX),
                                  * for pieces without an immediate */
};

int64_t p2p_post_cursors(struct p2p_poller *p, struct p2p_cursor *cur, int ncur,
                         int64_t budget_ns);

int64_t p2p_post_writes(struct fid_ep *ep, uint64_t dest,
                        const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                        int64_t start, int64_t end,
                        uint64_t src_base, void *src_desc,
                        uint64_t dst_base, uint64_t dst_key,
                        uint64_t imm, int with_imm, uint64_t context, int group,
                        int64_t *err);
int64_t p2p_post_writes_dc(struct fid_ep *ep, uint64_t dest,
                           const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                           int64_t start, int64_t end,
                           uint64_t src_base, void *src_desc,
                           uint64_t dst_base, uint64_t dst_key,
                           uint64_t imm, int with_imm, uint64_t context, int group,
                           int64_t dc_from, int64_t *err);

int p2p_poller_init(struct p2p_poller *p, int wake_fd, int64_t backoff_max_ns);
int p2p_poller_add_cq(struct p2p_poller *p, struct fid_fabric *fabric, struct fid_cq *cq, int fd);
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

#endif
