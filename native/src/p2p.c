/* p2pxfer's C helpers; see p2p.h for what belongs here. */
#define _GNU_SOURCE
#include "p2p.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define P2P_CQ_BATCH 64
#define P2P_RUN_LOOKBACK 8

/* How long a held poller naps between looks at p->hold. A holder that gives
 * up with work left pokes the wake fd, so this only bounds how late a poller
 * let go quietly resumes reading (peers' arrivals). Not shorter: in a loop of
 * express writes the poller is held nearly all the time, and frequent
 * wake-ups take a core's share from the writer and the target. */
#define P2P_HOLD_NAP_NS 250000

/* A spinning thread yields its CPU this often (sched_yield): each time costs
 * a system call, so not at every look at the CQs. */
#define P2P_YIELD_EVERY_NS 20000

/* A bell rung this recently is not rung again: its target, woken by it, spins
 * its bell_spin_ns (and on after each completion it reads meanwhile), so a
 * stream of small writes sends a datagram every few writes, not each one. */
#define P2P_RING_GAP_NS 200000
/* Datagrams read off a doorbell per wake-up at most: all that queued (the
 * kernel keeps a few, net.unix.max_dgram_qlen), yet a flood cannot keep the
 * poller draining. */
#define P2P_BELL_DRAIN 1024

int64_t p2p_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int p2p_bell_init(struct p2p_bell *b, int fd, const char *name, int namelen, int every)
{
    if (fd < 0 || namelen <= 0 || (size_t)namelen > sizeof(b->addr.sun_path))
        return -FI_EINVAL;
    memset(b, 0, sizeof(*b));
    b->fd = fd;
    b->every = every;
    b->addr.sun_family = AF_UNIX;
    memcpy(b->addr.sun_path, name, (size_t)namelen);
    b->len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)namelen);
    b->last_ns = INT64_MIN / 2;
    return 0;
}

/* One datagram to the target's doorbell, unless rung within P2P_RING_GAP_NS.
 * Never blocks; a target that is gone or not listening (another network
 * namespace, an older p2pxfer) makes it fail silently: the target's own
 * back-off still bounds the wait. */
static void ring(struct p2p_bell *b)
{
    int64_t now = p2p_now_ns();

    if (now - __atomic_load_n(&b->last_ns, __ATOMIC_RELAXED) < P2P_RING_GAP_NS)
        return;
    __atomic_store_n(&b->last_ns, now, __ATOMIC_RELAXED);
    if (sendto(b->fd, "", 1, MSG_DONTWAIT | MSG_NOSIGNAL, (const struct sockaddr *)&b->addr,
               b->len) == 1)
        __atomic_add_fetch(&b->rings, 1, __ATOMIC_RELAXED);
}

/* Pieces [start, end), none with an immediate, up to `group` per RMA write
 * (see P2P_GROUP_MAX): each group is one fi_writemsg of as many iovs and
 * rma_iovs, its context carrying its piece count. A group goes out whole or
 * not at all, so a cursor's next always sits between groups. Returns the
 * index of the first piece not posted, as p2p_post_writes. */
static int64_t post_groups(struct fid_ep *ep, uint64_t dest, const int64_t *src_off,
                           const int64_t *dst_off, const int64_t *len, int64_t start,
                           int64_t end, uint64_t src_base, void *src_desc, uint64_t dst_base,
                           uint64_t dst_key, uint64_t context, int group, int64_t *err)
{
    struct iovec iov[P2P_GROUP_MAX];
    struct fi_rma_iov rma[P2P_GROUP_MAX];
    void *desc[P2P_GROUP_MAX];
    struct fi_msg_rma msg;
    int64_t i = start;
    ssize_t rc;

    if (group > P2P_GROUP_MAX)
        group = P2P_GROUP_MAX;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.desc = desc;
    msg.addr = (fi_addr_t)dest;
    msg.rma_iov = rma;
    while (i < end) {
        int64_t k = end - i < group ? end - i : group;
        for (int64_t j = 0; j < k; j++) {
            iov[j].iov_base = (void *)(uintptr_t)(src_base + (uint64_t)src_off[i + j]);
            iov[j].iov_len = (size_t)len[i + j];
            desc[j] = src_desc;
            rma[j].addr = dst_base + (uint64_t)dst_off[i + j];
            rma[j].len = (size_t)len[i + j];
            rma[j].key = dst_key;
        }
        msg.iov_count = (size_t)k;
        msg.rma_iov_count = (size_t)k;
        msg.context = (void *)(uintptr_t)(context | ((uint64_t)(k - 1) << P2P_GROUP_SHIFT));
        rc = fi_writemsg(ep, &msg, FI_COMPLETION);
        if (rc == 0) {
            i += k;
            continue;
        }
        if (rc != -FI_EAGAIN)
            *err = rc;
        break;
    }
    return i;
}

/* Whether piece i carries the immediate: every piece (with_imm 1), or only
 * the odd ones (P2P_IMM_TAILS: each piece k of the arrays goes as two, its
 * head at index 2k without the immediate and its tail at 2k + 1 with it). */
static inline int imm_at(int with_imm, int64_t i)
{
    return with_imm == 1 || (with_imm == P2P_IMM_TAILS && (i & 1));
}

/* Piece i as posted: entry i of the arrays, or under P2P_IMM_TAILS half of
 * entry i / 2 (all but its last P2P_IMM_TAIL_BYTES, then those). */
static inline int64_t piece_at(const int64_t *src_off, const int64_t *dst_off,
                               const int64_t *len, int with_imm, int64_t i,
                               int64_t *src, int64_t *dst)
{
    int64_t k, head;

    if (with_imm != P2P_IMM_TAILS) {
        *src = src_off[i];
        *dst = dst_off[i];
        return len[i];
    }
    k = i >> 1;
    head = len[k] - P2P_IMM_TAIL_BYTES;
    *src = src_off[k] + ((i & 1) ? head : 0);
    *dst = dst_off[k] + ((i & 1) ? head : 0);
    return (i & 1) ? P2P_IMM_TAIL_BYTES : head;
}

/* Post pieces [start, end) as RMA writes. Returns the index of the first piece
 * not posted: end when all went out, earlier when the TX queue pushed back
 * (-FI_EAGAIN, *err left 0) or a post failed (*err set to the negative code).
 * The remote address is dst_base + dst_off: dst_base is the peer's virtual
 * base under FI_MR_VIRT_ADDR and 0 under offset addressing. */
int64_t p2p_post_writes(struct fid_ep *ep, uint64_t dest,
                        const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                        int64_t start, int64_t end,
                        uint64_t src_base, void *src_desc,
                        uint64_t dst_base, uint64_t dst_key,
                        uint64_t imm, int with_imm, uint64_t context, int group,
                        int64_t *err)
{
    int64_t i;
    ssize_t rc;
    void *ctx = (void *)(uintptr_t)context;

    *err = 0;
    if (!with_imm && group > 1)
        return post_groups(ep, dest, src_off, dst_off, len, start, end, src_base, src_desc,
                           dst_base, dst_key, context, group, err);
    for (i = start; i < end; i++) {
        int64_t s, d, n = piece_at(src_off, dst_off, len, with_imm, i, &s, &d);
        const void *buf = (const void *)(uintptr_t)(src_base + (uint64_t)s);
        uint64_t raddr = dst_base + (uint64_t)d;
        if (imm_at(with_imm, i))
            rc = fi_writedata(ep, buf, (size_t)n, src_desc, imm, (fi_addr_t)dest,
                              raddr, dst_key, ctx);
        else
            rc = fi_write(ep, buf, (size_t)n, src_desc, (fi_addr_t)dest, raddr,
                          dst_key, ctx);
        if (rc == 0)
            continue;
        if (rc != -FI_EAGAIN)
            *err = rc;
        break;
    }
    return i;
}

/* p2p_post_writes, but pieces from index dc_from on go out with
 * FI_DELIVERY_COMPLETE (fi_writemsg): their completion means the target placed
 * them. The engine marks only a cursor's last piece so: tcp;ofi_rxm and shm
 * advertise FI_ORDER_WAW (and RMA_WAW) and process one connection's writes in
 * order, so the tail's delivery-complete also covers the pieces before it. */
int64_t p2p_post_writes_dc(struct fid_ep *ep, uint64_t dest,
                           const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                           int64_t start, int64_t end,
                           uint64_t src_base, void *src_desc,
                           uint64_t dst_base, uint64_t dst_key,
                           uint64_t imm, int with_imm, uint64_t context, int group,
                           int64_t dc_from, int64_t *err)
{
    int64_t i = start;
    ssize_t rc;

    *err = 0;
    if (dc_from > start) {
        int64_t stop = dc_from < end ? dc_from : end;
        i = p2p_post_writes(ep, dest, src_off, dst_off, len, start, stop, src_base, src_desc,
                            dst_base, dst_key, imm, with_imm, context, group, err);
        if (i < stop || *err)
            return i;
    }
    for (; i < end; i++) {
        struct iovec iov;
        struct fi_rma_iov rma;
        struct fi_msg_rma msg;
        void *desc = src_desc;
        int64_t s, d, n = piece_at(src_off, dst_off, len, with_imm, i, &s, &d);

        iov.iov_base = (void *)(uintptr_t)(src_base + (uint64_t)s);
        iov.iov_len = (size_t)n;
        rma.addr = dst_base + (uint64_t)d;
        rma.len = (size_t)n;
        rma.key = dst_key;
        memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov;
        msg.desc = &desc;
        msg.iov_count = 1;
        msg.addr = (fi_addr_t)dest;
        msg.rma_iov = &rma;
        msg.rma_iov_count = 1;
        msg.context = (void *)(uintptr_t)context;
        msg.data = imm;
        rc = fi_writemsg(ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE |
                         (imm_at(with_imm, i) ? FI_REMOTE_CQ_DATA : 0));
        if (rc == 0)
            continue;
        if (rc != -FI_EAGAIN)
            *err = rc;
        break;
    }
    return i;
}

int p2p_poller_init(struct p2p_poller *p, int wake_fd, int64_t backoff_max_ns)
{
    p->ncq = 0;
    p->wake_fd = wake_fd;
    p->err_cq = -1;
    p->backoff_ns = 0;
    p->backoff_max_ns = backoff_max_ns;
    p->entries = 0;
    p->hold = 0;
    p->nbell = 0;
    p->bell_spin_ns = 0;
    p->bells = 0;
    p->bells_dropped = 0;
    p->bells_refused = 0;
    return 0;
}

int p2p_poller_add_cq(struct p2p_poller *p, struct fid_fabric *fabric, struct fid_cq *cq, int fd)
{
    if (p->ncq >= P2P_MAX_CQ)
        return -FI_ENOMEM;
    p->fabric[p->ncq] = fabric;
    p->cq[p->ncq] = cq;
    p->fd[p->ncq] = fd;
    p->ncq++;
    return 0;
}

int p2p_poller_add_bell(struct p2p_poller *p, int fd)
{
    if (p->nbell >= P2P_MAX_CQ)
        return -FI_ENOMEM;
    p->bell_fd[p->nbell++] = fd;
    return 0;
}

/* Add one completion to the runs from index nruns (the last
 * P2P_RUN_LOOKBACK looked at for its run); counts its pieces into
 * p->entries. Returns the new number of runs. */
static int64_t add_entry(struct p2p_poller *p, int64_t nruns, int cq,
                         const struct fi_cq_data_entry *e)
{
    uint64_t ctx, data;
    int64_t k, lo, pieces = 1;

    if (e->flags & FI_REMOTE_CQ_DATA) {
        /* A target-side arrival: only the immediate means anything. */
        ctx = 0;
        data = e->data;
    } else {
        ctx = (uint64_t)(uintptr_t)e->op_context;
        pieces = (int64_t)((ctx & P2P_GROUP_BITS) >> P2P_GROUP_SHIFT) + 1;
        ctx &= ~P2P_GROUP_BITS;
        data = 0;
    }
    p->entries += pieces;
    lo = nruns > P2P_RUN_LOOKBACK ? nruns - P2P_RUN_LOOKBACK : 0;
    for (k = nruns - 1; k >= lo; k--) {
        if (p->run_cq[k] == cq && p->run_ctx[k] == ctx && p->run_flags[k] == e->flags &&
            p->run_data[k] == data) {
            p->run_count[k] += pieces;
            p->run_bytes[k] += (int64_t)e->len;
            return nruns;
        }
    }
    p->run_cq[nruns] = cq;
    p->run_ctx[nruns] = ctx;
    p->run_flags[nruns] = e->flags;
    p->run_data[nruns] = data;
    p->run_count[nruns] = pieces;
    p->run_bytes[nruns] = (int64_t)e->len;
    return nruns + 1;
}

/* Read every CQ once, up to max_entries in all, appending to the runs from
 * index nruns. Returns the new number of runs; stops early at a CQ that
 * reports an error (p->err_cq set) or when the run table is full. Negative
 * only for an unexpected read error. */
static int64_t drain_into(struct p2p_poller *p, int64_t nruns, int64_t max_entries)
{
    struct fi_cq_data_entry buf[P2P_CQ_BATCH];
    int64_t seen = 0;
    int c;

    for (c = 0; c < p->ncq; c++) {
        for (;;) {
            int64_t room = p->max_runs - nruns;
            size_t want = P2P_CQ_BATCH;
            ssize_t n, j;

            if (room <= 0 || seen >= max_entries)
                goto out;
            if ((int64_t)want > room)
                want = (size_t)room;
            if ((int64_t)want > max_entries - seen)
                want = (size_t)(max_entries - seen);
            n = fi_cq_read(p->cq[c], buf, want);
            if (n == -FI_EAGAIN)
                break;
            if (n == -FI_EAVAIL) {
                p->err_cq = c;
                goto out;
            }
            if (n < 0)
                return n;
            for (j = 0; j < n; j++)
                nruns = add_entry(p, nruns, c, &buf[j]);
            seen += n;
            /* A short read does not mean the CQ is empty: ofi_rxm moves one
             * message-provider completion per fi_cq_read (its
             * FI_OFI_RXM_COMP_PER_PROGRESS, default 1), so tcp hands over
             * one arrival per call. Read on until -FI_EAGAIN: stopping here
             * sent a receiving poller back to Python once per piece. */
        }
    }
out:
    return nruns;
}

static int post_pass(struct p2p_cursor *cur, int ncur)
{
    int pending = 0, k;
    for (k = 0; k < ncur; k++) {
        struct p2p_cursor *c = &cur[k];
        int64_t i, from = c->next;
        if (c->next >= c->end || c->err)
            continue;
        if (c->dc_from < c->end)
            c->next = p2p_post_writes_dc(c->ep, c->dest, c->src_off, c->dst_off, c->len,
                                         c->next, c->end, c->src_base, c->src_desc,
                                         c->dst_base, c->dst_key, c->imm, c->with_imm,
                                         c->context, c->group, c->dc_from, &c->err);
        else
            c->next = p2p_post_writes(c->ep, c->dest, c->src_off, c->dst_off, c->len,
                                      c->next, c->end, c->src_base, c->src_desc,
                                      c->dst_base, c->dst_key, c->imm, c->with_imm,
                                      c->context, c->group, &c->err);
        for (i = from; i < c->next; i++) {
            int64_t s, d;
            c->bytes_posted += piece_at(c->src_off, c->dst_off, c->len, c->with_imm, i, &s, &d);
        }
        /* Posted a piece whose completion waits for the target or whose
         * immediate it should hear of (a tail's completes at its post), or
         * found its queue full (only its progress empties it): wake it. */
        if (c->bell && ((c->next > from && (c->with_imm || c->bell->every ||
                                            c->next > c->dc_from)) ||
                        (c->next < c->end && !c->err)))
            ring(c->bell);
        pending |= c->next < c->end && !c->err;
    }
    return pending;
}

/* One pass over the cursors, no CQ reads: for a thread that does not own the
 * CQs. Returns 1 if pieces are left (TX queue full), else 0. */
int64_t p2p_post_once(struct p2p_cursor *cur, int ncur)
{
    return post_pass(cur, ncur);
}

/* What a cursor posts: pieces [start, end) of the arrays, their immediate
 * and completion context; err and bytes_posted start at 0. */
static void set_pieces(struct p2p_cursor *c, const int64_t *src_off, const int64_t *dst_off,
                       const int64_t *len, int64_t start, int64_t end, uint64_t imm,
                       int with_imm, uint64_t context)
{
    c->src_off = src_off;
    c->dst_off = dst_off;
    c->len = len;
    c->next = start;
    c->end = end;
    c->imm = imm;
    c->with_imm = with_imm;
    c->context = context;
    c->err = 0;
    c->bytes_posted = 0;
}

/* Fill cursor i in one call (a Python attribute store per field cost a
 * small write microseconds); err and bytes_posted start at 0. */
void p2p_cursor_set(struct p2p_cursor *cur, int i, struct fid_ep *ep, uint64_t dest,
                    const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                    int64_t start, int64_t end, uint64_t src_base, void *src_desc,
                    uint64_t dst_base, uint64_t dst_key, uint64_t imm, int with_imm,
                    uint64_t context, int64_t dc_from, struct p2p_bell *bell, int group)
{
    struct p2p_cursor *c = &cur[i];
    c->ep = ep;
    c->dest = dest;
    c->src_base = src_base;
    c->src_desc = src_desc;
    c->dst_base = dst_base;
    c->dst_key = dst_key;
    c->dc_from = dc_from;
    c->bell = bell;
    c->group = group < 1 ? 1 : group > P2P_GROUP_MAX ? P2P_GROUP_MAX : group;
    set_pieces(c, src_off, dst_off, len, start, end, imm, with_imm, context);
}

/* Post every cursor's pieces, draining the CQs into the run table whenever a
 * TX queue pushes back, until all are posted, a CQ reports an error, the run
 * table is nearly full, or budget_ns passes. One call replaces what would
 * otherwise be a Python loop per -FI_EAGAIN. Returns the runs drained. */
int64_t p2p_post_cursors(struct p2p_poller *p, struct p2p_cursor *cur, int ncur,
                         int64_t budget_ns)
{
    int64_t nruns = 0, t0 = p2p_now_ns();

    p->err_cq = -1;
    for (;;) {
        int64_t before = p->entries;

        if (!post_pass(cur, ncur))
            return nruns;
        nruns = drain_into(p, nruns, 1 << 20);
        if (nruns < 0 || p->err_cq >= 0 || nruns > p->max_runs - P2P_RUN_LOOKBACK ||
            p2p_now_ns() - t0 > budget_ns)
            return nruns;
        if (p->entries == before)
            sched_yield();  /* the queue drains as the peer progresses: let it run */
    }
}

static int all_have_fds(const struct p2p_poller *p)
{
    int c;
    for (c = 0; c < p->ncq; c++)
        if (p->fd[c] < 0)
            return 0;
    return 1;
}

static void drain_wake_fd(int fd)
{
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof(v));
    (void)r;
}

/* Whether a datagram came from a process that may ring us: our own user
 * or root (a shm peer maps our segment, which only they can: it is 0600).
 * Credentials ride on every datagram (SO_PASSCRED on the bell); one
 * without them (a bell made without it) counts as before. */
static int ring_allowed(struct msghdr *m, uid_t me)
{
    struct cmsghdr *c;

    for (c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS &&
            c->cmsg_len >= CMSG_LEN(sizeof(struct ucred))) {
            struct ucred cred;
            memcpy(&cred, CMSG_DATA(c), sizeof(cred));
            return cred.uid == me || cred.uid == 0;
        }
    }
    return 1;
}

/* Read what queued on a doorbell: 1 if a ring we take was there, 0 if
 * none, -1 if the fd is no socket of ours any more (never poll it again).
 * Rings from other users are read and counted (bells_refused), never
 * taken: a local process could otherwise keep this poller spinning for
 * the price of a datagram every bell_spin_ns. */
static int drain_bell(struct p2p_poller *p, int fd)
{
    char buf[16];
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(struct ucred))];
    } ctl;
    struct iovec iov = { buf, sizeof(buf) };
    struct msghdr m;
    uid_t me = getuid();
    int k, rung = 0;

    for (k = 0; k < P2P_BELL_DRAIN; k++) {
        memset(&m, 0, sizeof(m));
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = ctl.b;
        m.msg_controllen = sizeof(ctl.b);
        if (recvmsg(fd, &m, MSG_DONTWAIT) >= 0) {
            if (ring_allowed(&m, me))
                rung = 1;
            else
                p->bells_refused++;
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return rung;
        return -1;
    }
    return rung;
}

static void drop_bell(struct p2p_poller *p, int c)
{
    p->bell_fd[c] = p->bell_fd[--p->nbell];
    p->bells_dropped++;
}

/* Read rings that queued while we were not asleep (spinning, or in Python):
 * stale, or a piece just posted. Either way the caller reads the CQs once
 * more before sleeping (ring comes after post) and spins no longer. 1 if
 * any were there. */
static int drain_bells_quietly(struct p2p_poller *p)
{
    int c, any = 0, r;

    for (c = p->nbell - 1; c >= 0; c--) {
        r = drain_bell(p, p->bell_fd[c]);
        if (r < 0)
            drop_bell(p, c);
        else
            any |= r;
    }
    return any;
}

/* Block until a CQ, a doorbell or the wake fd is readable, or timeout_ns
 * passes. Where every CQ has a wait fd, fi_trywait makes sure nothing is left
 * unread before we sleep; otherwise we sleep a growing back-off (capped),
 * which keeps an idle shm poller near 0% CPU, and a peer about to need our
 * progress rings a doorbell. Returns 1 if the wake fd fired, 2 if a doorbell
 * rang, else 0. */
static int wait_for_work(struct p2p_poller *p, int64_t timeout_ns)
{
    struct pollfd pfd[2 * P2P_MAX_CQ + 1];
    struct timespec ts;
    int n = 0, c, rc, first_bell, rung = 0;
    int blockable = all_have_fds(p);
    int64_t sleep_ns = timeout_ns;

    if (p->nbell && drain_bells_quietly(p))
        return 0;           /* go read the CQs once more before sleeping */
    if (blockable) {
        for (c = 0; c < p->ncq; c++) {
            struct fid *f = &p->cq[c]->fid;
            if (fi_trywait(p->fabric[c], &f, 1) != FI_SUCCESS)
                return 0;   /* something arrived meanwhile: go read it */
            pfd[n].fd = p->fd[c];
            pfd[n].events = POLLIN;
            n++;
        }
    } else {
        p->backoff_ns = p->backoff_ns ? p->backoff_ns * 2 : 2000;
        if (p->backoff_ns > p->backoff_max_ns)
            p->backoff_ns = p->backoff_max_ns;
        if (sleep_ns < 0 || sleep_ns > p->backoff_ns)
            sleep_ns = p->backoff_ns;
    }
    first_bell = n;
    for (c = 0; c < p->nbell; c++) {
        pfd[n].fd = p->bell_fd[c];
        pfd[n].events = POLLIN;
        n++;
    }
    if (p->wake_fd >= 0) {
        pfd[n].fd = p->wake_fd;
        pfd[n].events = POLLIN;
        n++;
    }
    if (sleep_ns >= 0) {
        ts.tv_sec = sleep_ns / 1000000000LL;
        ts.tv_nsec = sleep_ns % 1000000000LL;
    }
    rc = ppoll(pfd, (nfds_t)n, sleep_ns >= 0 ? &ts : NULL, NULL);
    if (rc <= 0)
        return 0;
    if (p->wake_fd >= 0 && (pfd[n - 1].revents & POLLIN)) {
        drain_wake_fd(p->wake_fd);
        return 1;
    }
    for (c = p->nbell - 1; c >= 0; c--) {
        short ev = pfd[first_bell + c].revents;
        int r = 0;
        if (ev & POLLIN)
            r = drain_bell(p, p->bell_fd[c]);
        if (r < 0 || (ev & (POLLERR | POLLNVAL))) {
            /* Not a socket we can read any more: never poll it again (it
             * would wake every ppoll at once). */
            drop_bell(p, c);
        } else if (r > 0) {
            rung = 1;
        }
    }
    if (rung) {
        p->bells++;
        p->backoff_ns = 0;
        return 2;
    }
    return 0;
}

/* While another thread holds the CQs (p->hold), sleep on the wake fd alone
 * for at most nap_ns: reading the CQs now would steal the completion it spins
 * for and send it across a thread hop. Returns 1 if the wake fd fired. */
static int wait_while_held(struct p2p_poller *p, int64_t nap_ns)
{
    struct pollfd pfd;
    struct timespec ts = { nap_ns / 1000000000LL, nap_ns % 1000000000LL };

    if (p->wake_fd < 0)
        return nanosleep(&ts, NULL), 0;
    pfd.fd = p->wake_fd;
    pfd.events = POLLIN;
    if (ppoll(&pfd, 1, &ts, NULL) > 0) {
        drain_wake_fd(p->wake_fd);
        return 1;
    }
    return 0;
}

/* The poller's one call: drain every CQ, accumulating runs, until at least
 * min_entries completions were seen (or an error entry, a nearly full run
 * table, max_entries, a wake-up, or timeout_ns since the call: negative means
 * no limit, 0 means do not block). Between batches it spins (reading keeps
 * manual-progress providers moving) for spin_ns after the last activity (with
 * timeout_ns == 0: at most spin_ns in all), then sleeps on the wait fds. Returns the number of runs, or a negative error. */
int64_t p2p_poller_progress(struct p2p_poller *p, int64_t max_entries, int64_t min_entries,
                            int64_t spin_ns, int64_t timeout_ns)
{
    int64_t nruns = 0, start = p->entries, t0 = p2p_now_ns(), active = t0, yielded = t0;
    int woke;

    p->err_cq = -1;
    if (min_entries < 1)
        min_entries = 1;
    for (;;) {
        int64_t before = p->entries, got, now, left;

        if (__atomic_load_n(&p->hold, __ATOMIC_ACQUIRE)) {
            now = p2p_now_ns();
            if (timeout_ns == 0 || (timeout_ns > 0 && now - t0 >= timeout_ns))
                break;
            if (wait_while_held(p, P2P_HOLD_NAP_NS))
                break;
            active = p2p_now_ns();  /* spin anew once let go: the holder's write may be due */
            continue;
        }
        nruns = drain_into(p, nruns, max_entries - (p->entries - start));
        if (nruns < 0)
            return nruns;
        got = p->entries - start;
        if (got >= min_entries || got >= max_entries || p->err_cq >= 0 ||
            nruns > p->max_runs - P2P_RUN_LOOKBACK)
            break;
        now = p2p_now_ns();
        if (p->entries > before)
            active = now;
        /* timeout_ns == 0 (never sleep) also caps the spin at spin_ns from
         * the call: such a caller (the trio thread) must not stay longer,
         * however often completions keep it active. */
        if (now - active < spin_ns && (timeout_ns != 0 || now - t0 < spin_ns)) {
            /* Spin politely: a thread that shares this CPU (the peer whose
             * progress we wait for, woken onto our CPU) gets it within
             * P2P_YIELD_EVERY_NS, not when the scheduler's slice ends. */
            if (now - yielded >= P2P_YIELD_EVERY_NS) {
                sched_yield();
                yielded = now;
            }
            continue;
        }
        if (timeout_ns == 0)
            break;
        left = timeout_ns < 0 ? -1 : timeout_ns - (now - t0);
        if (timeout_ns > 0 && left <= 0)
            break;
        woke = wait_for_work(p, left);
        if (woke == 2) {
            /* Rung: a peer just posted what needs our progress. Spin for it
             * (reading progresses the provider) instead of napping on, at
             * least bell_spin_ns for the rest of this call. */
            active = p2p_now_ns();
            if (spin_ns < p->bell_spin_ns)
                spin_ns = p->bell_spin_ns;
            continue;
        }
        if (woke) {
            /* Woken on purpose: report what is there, unless a holder polls
             * these CQs for its own completion right now. */
            if (!__atomic_load_n(&p->hold, __ATOMIC_ACQUIRE))
                nruns = drain_into(p, nruns, max_entries - (p->entries - start));
            break;
        }
    }
    if (p->entries > start)
        p->backoff_ns = 0;
    return nruns;
}

/* Of the runs [from, nruns): the count of completions with context ctx (an
 * express write's own pieces), and the runs carrying remote CQ data (peers'
 * arrivals) moved down to follow the first `from` (kept before), the number
 * kept in all in *kept. Runs of any other context are dropped: writes given
 * up earlier, as the shard drops them. */
static int64_t take_runs(struct p2p_poller *p, int64_t from, int64_t nruns, uint64_t ctx,
                         uint64_t data_flag, int64_t *kept)
{
    int64_t got = 0, k = from;

    for (int64_t i = from; i < nruns; i++) {
        if (p->run_flags[i] & data_flag) {
            if (k != i) {
                p->run_cq[k] = p->run_cq[i];
                p->run_ctx[k] = p->run_ctx[i];
                p->run_flags[k] = p->run_flags[i];
                p->run_data[k] = p->run_data[i];
                p->run_count[k] = p->run_count[i];
                p->run_bytes[k] = p->run_bytes[i];
            }
            k++;
        } else if (p->run_ctx[i] == ctx) {
            got += p->run_count[i];
        }
    }
    *kept = k;
    return got;
}

/* An express write (engine/_express.py), posting half: hold the CQs (the
 * poller thread keeps off them until the caller lets go), give cursor c
 * (its peer, memory and bell set with p2p_cursor_set for this plan) this
 * write's pieces, immediate and context, and post them. Returns 1 if pieces
 * are left (a full TX queue) or a post failed (c->err), else 0. With the
 * polling half, what was five crossings into C and back is two.
 *
 * alive_fd (or -1): a file that must still have a name for the peer to be
 * posted to, looked at first (shm: the peer's segment, opened O_PATH when
 * the peer was looked up; libfabric 1.17's shm kills a process that posts
 * to a peer in it whose segment is gone, and a write to one in another
 * process that closed "completes"). Unlinked: P2P_PEER_GONE, nothing held
 * or posted. An fstat of a held fd walks no path: a stat by name cost a
 * 4 KiB write about a seventh of its time. */
int64_t p2p_express_post(struct p2p_poller *p, struct p2p_cursor *c, const int64_t *src_off,
                         const int64_t *dst_off, const int64_t *len, int64_t n, uint64_t imm,
                         int with_imm, uint64_t context, int alive_fd)
{
    struct stat st;

    if (alive_fd >= 0 && (fstat(alive_fd, &st) != 0 || st.st_nlink == 0))
        return P2P_PEER_GONE;
    __atomic_store_n(&p->hold, 1, __ATOMIC_RELEASE);
    set_pieces(c, src_off, dst_off, len, 0, n, imm, with_imm, context);
    return post_pass(c, 1) || c->err;
}

/* An express write, polling half (the CQs held): spin on them until `want`
 * completions of `ctx` are read or budget_ns passed, yielding the CPU every
 * P2P_YIELD_EVERY_NS (the target may share it). Peers' arrivals read on the
 * way are kept at the front of the run table (*kept of them:
 * take_runs), other contexts dropped. Returns the completions of ctx
 * read. Where a read stops at an error entry (p->err_cq >= 0) nothing of
 * that read is taken: *kept is then the runs in the table, all of them for
 * the caller to absorb. Negative: a CQ read failed. */
int64_t p2p_express_poll(struct p2p_poller *p, int64_t want, uint64_t ctx, int64_t budget_ns,
                         uint64_t data_flag, int64_t *kept)
{
    int64_t got = 0, nkept = 0, t0 = p2p_now_ns(), yielded = t0;

    p->err_cq = -1;
    *kept = 0;
    for (;;) {
        int64_t nruns = drain_into(p, nkept, (int64_t)1 << 16), now;

        if (nruns < 0)
            return nruns;
        if (p->err_cq >= 0) {
            *kept = nruns;
            return got;
        }
        got += take_runs(p, nkept, nruns, ctx, data_flag, &nkept);
        now = p2p_now_ns();
        if (got >= want || now - t0 >= budget_ns || nkept > p->max_runs - P2P_RUN_LOOKBACK)
            break;
        if (now - yielded >= P2P_YIELD_EVERY_NS) {
            sched_yield();
            yielded = now;
        }
    }
    *kept = nkept;
    return got;
}

/* Abort the TCP connection on socket fd (a provider's, found by the caller):
 * connect() to an AF_UNSPEC address runs the kernel's tcp_disconnect, which
 * drops the send queue (bytes never go out, even once a cut link is back),
 * sends a reset and leaves the socket closed with ECONNRESET pending, so the
 * provider's next look at it fails and it flushes what it had queued.
 * Returns 0 or -errno. */
int p2p_tcp_reset(int fd)
{
    struct sockaddr sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_family = AF_UNSPEC;
    if (connect(fd, &sa, sizeof(sa)) != 0)
        return -errno;
    return 0;
}

/* Register device memory (iface FI_HMEM_CUDA & co.) with fi_mr_regattr,
 * whose attribute struct grew across libfabric versions: filled here, where
 * the compiler knows the installed one. Returns fi_mr_regattr's code (the
 * providers of a libfabric built without CUDA answer -FI_ENOSYS). */
int p2p_mr_reg_hmem(struct fid_domain *domain, uint64_t address, size_t len, uint64_t access,
                    uint64_t requested_key, int iface, int device, struct fid_mr **mr)
{
    struct iovec iov = {(void *)(uintptr_t)address, len};
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = (enum fi_hmem_iface)iface;
    attr.device.cuda = device;
    return fi_mr_regattr(domain, &attr, 0, mr);
}

/* 1 where this libfabric registers dma-buf file descriptors (FI_MR_DMABUF,
 * from 1.20 on), else 0: the library p2pxfer was built against decides. */
int p2p_has_dmabuf(void)
{
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 20))
    return 1;
#else
    return 0;
#endif
}

/* Register `len` bytes at `offset` into the dma-buf `fd` (device memory a
 * GPU driver exported) whose byte 0 is at virtual address `base`: the
 * region is base + offset onwards. */
int p2p_mr_reg_dmabuf(struct fid_domain *domain, int fd, uint64_t offset, size_t len,
                      uint64_t base, uint64_t access, uint64_t requested_key, int device,
                      struct fid_mr **mr)
{
#if FI_VERSION_GE(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), FI_VERSION(1, 20))
    struct fi_mr_dmabuf dmabuf;
    struct fi_mr_attr attr;
    memset(&dmabuf, 0, sizeof dmabuf);
    memset(&attr, 0, sizeof attr);
    dmabuf.fd = fd;
    dmabuf.offset = offset;
    dmabuf.len = len;
    dmabuf.base_addr = (void *)(uintptr_t)base;
    attr.dmabuf = &dmabuf;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = device;
    return fi_mr_regattr(domain, &attr, FI_MR_DMABUF, mr);
#else
    (void)domain; (void)fd; (void)offset; (void)len; (void)base; (void)access;
    (void)requested_key; (void)device; (void)mr;
    return -FI_ENOSYS;
#endif
}
