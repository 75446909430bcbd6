/* libfabric types p2pxfer reads or writes. Partial structs ("...;") let the C
 * compiler fill in layout, so only the fields we touch are named here. */
typedef uint64_t fi_addr_t;
typedef struct fid *fid_t;

struct fid { size_t fclass; ...; };
struct fid_fabric { struct fid fid; ...; };
struct fid_domain { struct fid fid; ...; };
struct fid_ep { struct fid fid; ...; };
struct fid_av { struct fid fid; ...; };
struct fid_cq { struct fid fid; ...; };
struct fid_mr { struct fid fid; ...; };
struct fid_wait;
struct fid_nic;

enum fi_ep_type { FI_EP_UNSPEC, FI_EP_MSG, FI_EP_DGRAM, FI_EP_RDM, ... };
enum fi_threading { FI_THREAD_UNSPEC, FI_THREAD_SAFE, FI_THREAD_FID, FI_THREAD_DOMAIN,
                    FI_THREAD_COMPLETION, FI_THREAD_ENDPOINT, ... };
enum fi_progress { FI_PROGRESS_UNSPEC, FI_PROGRESS_AUTO, FI_PROGRESS_MANUAL, ... };
enum fi_av_type { FI_AV_UNSPEC, FI_AV_MAP, FI_AV_TABLE, ... };
enum fi_wait_obj { FI_WAIT_NONE, FI_WAIT_UNSPEC, FI_WAIT_SET, FI_WAIT_FD,
                   FI_WAIT_MUTEX_COND, FI_WAIT_YIELD, FI_WAIT_POLLFD, ... };
enum fi_cq_format { FI_CQ_FORMAT_UNSPEC, FI_CQ_FORMAT_CONTEXT, FI_CQ_FORMAT_MSG,
                    FI_CQ_FORMAT_DATA, FI_CQ_FORMAT_TAGGED, ... };
enum fi_cq_wait_cond { FI_CQ_COND_NONE, FI_CQ_COND_THRESHOLD, ... };
enum fi_hmem_iface { FI_HMEM_SYSTEM, FI_HMEM_CUDA, FI_HMEM_ROCR, FI_HMEM_ZE, ... };

struct fi_tx_attr {
    uint64_t caps; uint64_t mode; uint64_t op_flags; uint64_t msg_order;
    uint64_t comp_order; size_t inject_size; size_t size; size_t iov_limit;
    size_t rma_iov_limit; ...;
};
struct fi_rx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; size_t size; ...; };
struct fi_ep_attr { enum fi_ep_type type; size_t max_msg_size; size_t max_order_waw_size;
                    ...; };
struct fi_domain_attr {
    struct fid_domain *domain; char *name; enum fi_threading threading;
    enum fi_progress control_progress; enum fi_progress data_progress;
    enum fi_av_type av_type; int mr_mode; size_t mr_key_size; size_t cq_data_size;
    size_t mr_iov_limit; size_t mr_cnt; ...;
};
struct fi_fabric_attr {
    struct fid_fabric *fabric; char *name; char *prov_name; uint32_t prov_version;
    uint32_t api_version; ...;
};
struct fi_info {
    struct fi_info *next; uint64_t caps; uint64_t mode; uint32_t addr_format;
    size_t src_addrlen; size_t dest_addrlen; void *src_addr; void *dest_addr;
    struct fi_tx_attr *tx_attr; struct fi_rx_attr *rx_attr; struct fi_ep_attr *ep_attr;
    struct fi_domain_attr *domain_attr; struct fi_fabric_attr *fabric_attr;
    struct fid_nic *nic; ...;
};
struct fi_av_attr { enum fi_av_type type; size_t count; uint64_t flags; ...; };
struct fi_cq_attr {
    size_t size; uint64_t flags; enum fi_cq_format format; enum fi_wait_obj wait_obj;
    int signaling_vector; enum fi_cq_wait_cond wait_cond; struct fid_wait *wait_set; ...;
};
struct fi_cq_data_entry { void *op_context; uint64_t flags; size_t len; void *buf;
                          uint64_t data; ...; };
struct fi_cq_err_entry {
    void *op_context; uint64_t flags; size_t len; void *buf; uint64_t data; uint64_t tag;
    size_t olen; int err; int prov_errno; void *err_data; size_t err_data_size; ...;
};
