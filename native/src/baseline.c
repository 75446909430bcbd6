/* The C-to-C reference every benchmark ratio is measured against, like
 * fabtests' fi_rma_bw: an initiator that posts a scatter list of RMA writes and
 * counts its own completions, a target that busy-polls its CQ and counts
 * remote-CQ-data arrivals, and a ping-pong of one write each way. Each end runs
 * inside one of these calls, in its own process: no Python, no poller thread,
 * no sleeping between polls.
 *
 * What must not live here: anything the engine uses. This file only measures
 * what the provider can do, so it stays independent of p2p.c. */
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

#include "baseline.h"

#define REF_BATCH 64
/* Pieces per RMA write at most (as the engine's P2P_GROUP_MAX): the
 * provider's best, so the reference stays the limit. */
#define REF_GROUP_MAX 4
/* Empty polls between two looks at the clock: reading it costs more than an
 * empty fi_cq_read on shm. */
#define REF_CLOCK_EVERY 64

static int64_t ref_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static ssize_t ref_post(struct fid_ep *ep, void *buf, size_t len, void *desc, uint64_t imm,
                        int with_imm, fi_addr_t dest, uint64_t addr, uint64_t key)
{
    if (with_imm)
        return fi_writedata(ep, buf, len, desc, imm, dest, addr, key, (void *)(uintptr_t)1);
    return fi_write(ep, buf, len, desc, dest, addr, key, (void *)(uintptr_t)1);
}

int64_t p2p_ref_target(struct fid_cq *cq, int64_t expected, int64_t timeout_ns)
{
    struct fi_cq_data_entry buf[REF_BATCH];
    int64_t got = 0, empty = 0, deadline = ref_now_ns() + timeout_ns;

    while (got < expected) {
        ssize_t r = fi_cq_read(cq, buf, REF_BATCH);
        if (r == -FI_EAGAIN) {
            if (++empty % REF_CLOCK_EVERY == 0 && ref_now_ns() > deadline)
                break;
            continue;
        }
        if (r < 0)
            return r;
        for (ssize_t i = 0; i < r; i++)
            if (buf[i].flags & FI_REMOTE_CQ_DATA)
                got++;
    }
    return got;
}

/* Pieces [i, i + k) in one RMA write of k iovs and k rma_iovs. */
static ssize_t ref_post_group(struct fid_ep *ep, const int64_t *src_off,
                              const int64_t *dst_off, const int64_t *len, int64_t i, int64_t k,
                              uint64_t src_base, void *src_desc, uint64_t dst_base,
                              uint64_t dst_key, uint64_t imm, int with_imm, fi_addr_t dest)
{
    struct iovec iov[REF_GROUP_MAX];
    struct fi_rma_iov rma[REF_GROUP_MAX];
    void *desc[REF_GROUP_MAX];
    struct fi_msg_rma msg;

    for (int64_t j = 0; j < k; j++) {
        iov[j].iov_base = (void *)(uintptr_t)(src_base + (uint64_t)src_off[i + j]);
        iov[j].iov_len = (size_t)len[i + j];
        desc[j] = src_desc;
        rma[j].addr = dst_base + (uint64_t)dst_off[i + j];
        rma[j].len = (size_t)len[i + j];
        rma[j].key = dst_key;
    }
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = iov;
    msg.desc = desc;
    msg.iov_count = (size_t)k;
    msg.addr = dest;
    msg.rma_iov = rma;
    msg.rma_iov_count = (size_t)k;
    msg.context = (void *)(uintptr_t)1;
    msg.data = imm;
    return fi_writemsg(ep, &msg, FI_COMPLETION | (with_imm ? FI_REMOTE_CQ_DATA : 0));
}

int64_t p2p_ref_write(struct fid_ep *ep, struct fid_cq *cq, uint64_t dest,
                      const int64_t *src_off, const int64_t *dst_off, const int64_t *len,
                      int64_t n, uint64_t src_base, void *src_desc, uint64_t dst_base,
                      uint64_t dst_key, uint64_t imm, int with_imm, int group,
                      int64_t timeout_ns)
{
    struct fi_cq_data_entry buf[REF_BATCH];
    int64_t posted = 0, done = 0, empty = 0, deadline = ref_now_ns() + timeout_ns, writes;

    if (group < 1)
        group = 1;
    if (group > REF_GROUP_MAX)
        group = REF_GROUP_MAX;
    writes = (n + group - 1) / group;
    while (done < writes) {
        /* Post until the provider pushes back, then let the CQ drive progress. */
        while (posted < n) {
            int64_t k = n - posted < group ? n - posted : group;
            ssize_t rc = k == 1
                ? ref_post(ep, (void *)(uintptr_t)(src_base + (uint64_t)src_off[posted]),
                           (size_t)len[posted], src_desc, imm, with_imm, (fi_addr_t)dest,
                           dst_base + (uint64_t)dst_off[posted], dst_key)
                : ref_post_group(ep, src_off, dst_off, len, posted, k, src_base, src_desc,
                                 dst_base, dst_key, imm, with_imm, (fi_addr_t)dest);
            if (rc == -FI_EAGAIN)
                break;
            if (rc < 0)
                return rc;
            posted += k;
        }
        ssize_t r = fi_cq_read(cq, buf, REF_BATCH);
        if (r == -FI_EAGAIN) {
            if (++empty % REF_CLOCK_EVERY == 0 && ref_now_ns() > deadline)
                return -FI_ETIMEDOUT;
            continue;
        }
        if (r < 0)
            return r;
        for (ssize_t i = 0; i < r; i++)
            if (!(buf[i].flags & FI_REMOTE_CQ_DATA))
                done++;
    }
    return 0;
}

/* Busy-wait for one remote-CQ-data arrival, skipping our own TX completions. */
static int64_t ref_await_arrival(struct fid_cq *cq, int64_t deadline)
{
    struct fi_cq_data_entry buf[REF_BATCH];
    int64_t empty = 0;
    for (;;) {
        ssize_t r = fi_cq_read(cq, buf, 1);
        if (r == -FI_EAGAIN) {
            if (++empty % REF_CLOCK_EVERY == 0 && ref_now_ns() > deadline)
                return -FI_ETIMEDOUT;
            continue;
        }
        if (r < 0)
            return r;
        if (buf[0].flags & FI_REMOTE_CQ_DATA)
            return 0;
    }
}

int64_t p2p_ref_pingpong(struct fid_ep *ep, struct fid_cq *cq, uint64_t dest,
                         uint64_t src_base, void *src_desc, uint64_t dst_base, uint64_t dst_key,
                         int64_t len, int64_t iters, int initiator, int64_t timeout_ns,
                         int64_t *rtt_ns)
{
    int64_t deadline = ref_now_ns() + timeout_ns, rc;
    for (int64_t i = 0; i < iters; i++) {
        int64_t t0 = ref_now_ns();
        if (!initiator && (rc = ref_await_arrival(cq, deadline)) < 0)
            return rc;
        do {
            rc = ref_post(ep, (void *)(uintptr_t)src_base, (size_t)len, src_desc, 1, 1,
                          (fi_addr_t)dest, dst_base, dst_key);
            if (rc == -FI_EAGAIN) {
                fi_cq_read(cq, NULL, 0);
                if (ref_now_ns() > deadline)
                    return -FI_ETIMEDOUT;
            }
        } while (rc == -FI_EAGAIN);
        if (rc < 0)
            return rc;
        if (initiator) {
            if ((rc = ref_await_arrival(cq, deadline)) < 0)
                return rc;
            if (rtt_ns)
                rtt_ns[i] = ref_now_ns() - t0;
        }
    }
    return 0;
}
