/* libfabric calls. Most are static inline in the headers; API mode compiles a
 * real wrapper for each. */
uint32_t fi_version(void);
int fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
               const struct fi_info *hints, struct fi_info **info);
void fi_freeinfo(struct fi_info *info);
struct fi_info *fi_dupinfo(const struct fi_info *info);
const char *fi_strerror(int errnum);
char *strdup(const char *s);

int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain,
              void *context);
int fi_close(struct fid *fid);
int fi_control(struct fid *fid, int command, void *arg);

int fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
                void *context);
int fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int fi_enable(struct fid_ep *ep);
int fi_getname(fid_t fid, void *addr, size_t *addrlen);

int fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
               void *context);
int fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
                 uint64_t flags, void *context);
int fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
const char *fi_av_straddr(struct fid_av *av, const void *addr, char *buf, size_t *len);

int fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
               void *context);
ssize_t fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
                           char *buf, size_t len);

int fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
              uint64_t offset, uint64_t requested_key, uint64_t flags, struct fid_mr **mr,
              void *context);
uint64_t fi_mr_key(struct fid_mr *mr);
void *fi_mr_desc(struct fid_mr *mr);
int fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int fi_mr_enable(struct fid_mr *mr);
