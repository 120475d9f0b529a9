// The plugin's only door to libibverbs: a table of function pointers filled by dlopen
// (libibverbs.so.1, or the library named by R2CCL_IBVERBS_LIB). The plugin links no verbs
// library, so it loads on hosts without rdma-core, and the tests substitute the fake verbs
// provider (tests/fakeverbs) for the real one.
//
// Types come from rdma-core's <infiniband/verbs.h> (Debian libibverbs-dev 44). The data-path
// calls ibv_post_send / ibv_post_recv / ibv_poll_cq are verbs.h inlines that go through the
// context's ops table, so they need no entry here.
//
// ibv_query_port and ibv_reg_mr are macros in verbs.h; the table holds the exported symbols
// of the same names (the compat ibv_query_port fills the classic struct ibv_port_attr
// prefix; query_port() below zeroes the whole struct first, as verbs.h's inline does).
// query_gid_ex (_ibv_query_gid_ex, rdma-core >= 31) is optional: without it GID types come
// from sysfs.
//
// Thread-safety: load() once under a lock; the table is immutable afterwards.
#pragma once

#include <infiniband/verbs.h>

struct ifaddrs;  // <ifaddrs.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace r2ccl::net::ib {

struct VerbsApi {
  ibv_device** (*get_device_list)(int* num);
  void (*free_device_list)(ibv_device** list);
  const char* (*get_device_name)(ibv_device* dev);
  __be64 (*get_device_guid)(ibv_device* dev);
  ibv_context* (*open_device)(ibv_device* dev);
  int (*close_device)(ibv_context* ctx);
  int (*query_device)(ibv_context* ctx, ibv_device_attr* attr);
  int (*query_port_compat)(ibv_context* ctx, uint8_t port, ibv_port_attr* attr);
  int (*query_gid)(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid);
  int (*query_gid_ex)(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                      uint32_t flags, size_t entry_size);  // may be nullptr
  // ibv_query_pkey(3): the P_Key at `index`, network byte order; 0, or -1 with errno. May be
  // nullptr (then only NCCL_IB_PKEY's index form works).
  int (*query_pkey)(ibv_context* ctx, uint8_t port, int index, __be16* pkey);
  ibv_pd* (*alloc_pd)(ibv_context* ctx);
  int (*dealloc_pd)(ibv_pd* pd);
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t len, int access);
  // Takes the optional access flags (IBV_ACCESS_RELAXED_ORDERING), dropping those the kernel
  // lacks (rdma-core >= 28); may be nullptr.
  ibv_mr* (*reg_mr_iova2)(ibv_pd* pd, void* addr, size_t len, uint64_t iova, unsigned access);
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t len, uint64_t iova, int fd,
                           int access);  // may be nullptr (rdma-core < 34)
  int (*dereg_mr)(ibv_mr* mr);
  int (*fork_init)();                        // may be nullptr
  ibv_fork_status (*is_fork_initialized)();  // may be nullptr (rdma-core < 35)
  ibv_cq* (*create_cq)(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* ch,
                       int comp_vector);
  int (*destroy_cq)(ibv_cq* cq);
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr);
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int mask);
  int (*query_qp)(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init);
  int (*destroy_qp)(ibv_qp* qp);
  int (*get_async_event)(ibv_context* ctx, ibv_async_event* ev);
  void (*ack_async_event)(ibv_async_event* ev);
  const char* (*event_type_str)(ibv_event_type t);
  const char* (*wc_status_str)(ibv_wc_status s);
  // Where the netdevs of RoCE GIDs are listed when not in the kernel: only the fake verbs
  // provider (tests/fakeverbs) has these (its netdevs exist for its devices only); with the
  // real libibverbs both are nullptr and getifaddrs(3) / freeifaddrs(3) are used.
  int (*netdev_getifaddrs)(struct ifaddrs** out);
  void (*netdev_freeifaddrs)(struct ifaddrs* list);

  // Zeroes *attr, then asks the library (like verbs.h's ___ibv_query_port without the
  // extended op). Returns 0 or an errno value.
  int query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) const;

  // The loaded table. `lib` is the file name or path to dlopen. Returns nullptr with *err
  // naming the library and the missing symbol or dlerror(). The first successful load
  // wins for the life of the process (the library stays mapped).
  // Thread: any; serialised internally.
  static const VerbsApi* load(const std::string& lib, std::string* err);
};

}  // namespace r2ccl::net::ib
