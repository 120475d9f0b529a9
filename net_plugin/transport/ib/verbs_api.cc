#include "verbs_api.h"

#include <dlfcn.h>

#include <cstring>
#include <map>
#include <mutex>

namespace r2ccl::net::ib {

int VerbsApi::query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) const {
  memset(attr, 0, sizeof(*attr));
  return query_port_compat(ctx, port, attr);
}

namespace {

template <typename F>
bool bind(void* h, const char* sym, F* out, bool required, std::string* missing) {
  void* p = dlsym(h, sym);
  if (!p && required) {
    *missing = sym;
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

const VerbsApi* VerbsApi::load(const std::string& lib, std::string* err) {
  static std::mutex mu;
  static std::map<std::string, VerbsApi*> loaded;  // never freed: the library stays mapped
  std::lock_guard<std::mutex> g(mu);
  auto it = loaded.find(lib);
  if (it != loaded.end()) return it->second;
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    *err = "cannot load the verbs library '" + lib +
           "' (R2CCL_IBVERBS_LIB): " + (e ? e : "unknown error");
    return nullptr;
  }
  auto* v = new VerbsApi{};
  std::string miss;
  bool ok = bind(h, "ibv_get_device_list", &v->get_device_list, true, &miss) &&
            bind(h, "ibv_free_device_list", &v->free_device_list, true, &miss) &&
            bind(h, "ibv_get_device_name", &v->get_device_name, true, &miss) &&
            bind(h, "ibv_get_device_guid", &v->get_device_guid, true, &miss) &&
            bind(h, "ibv_open_device", &v->open_device, true, &miss) &&
            bind(h, "ibv_close_device", &v->close_device, true, &miss) &&
            bind(h, "ibv_query_device", &v->query_device, true, &miss) &&
            bind(h, "ibv_query_port", &v->query_port_compat, true, &miss) &&
            bind(h, "ibv_query_gid", &v->query_gid, true, &miss) &&
            bind(h, "_ibv_query_gid_ex", &v->query_gid_ex, false, &miss) &&
            bind(h, "ibv_query_pkey", &v->query_pkey, false, &miss) &&
            bind(h, "ibv_alloc_pd", &v->alloc_pd, true, &miss) &&
            bind(h, "ibv_dealloc_pd", &v->dealloc_pd, true, &miss) &&
            bind(h, "ibv_reg_mr", &v->reg_mr, true, &miss) &&
            bind(h, "ibv_reg_mr_iova2", &v->reg_mr_iova2, false, &miss) &&
            bind(h, "ibv_reg_dmabuf_mr", &v->reg_dmabuf_mr, false, &miss) &&
            bind(h, "ibv_dereg_mr", &v->dereg_mr, true, &miss) &&
            bind(h, "ibv_fork_init", &v->fork_init, false, &miss) &&
            bind(h, "ibv_is_fork_initialized", &v->is_fork_initialized, false, &miss) &&
            bind(h, "fakeverbs_getifaddrs", &v->netdev_getifaddrs, false, &miss) &&
            bind(h, "fakeverbs_freeifaddrs", &v->netdev_freeifaddrs, false, &miss) &&
            bind(h, "ibv_create_cq", &v->create_cq, true, &miss) &&
            bind(h, "ibv_destroy_cq", &v->destroy_cq, true, &miss) &&
            bind(h, "ibv_create_qp", &v->create_qp, true, &miss) &&
            bind(h, "ibv_modify_qp", &v->modify_qp, true, &miss) &&
            bind(h, "ibv_query_qp", &v->query_qp, true, &miss) &&
            bind(h, "ibv_destroy_qp", &v->destroy_qp, true, &miss) &&
            bind(h, "ibv_get_async_event", &v->get_async_event, true, &miss) &&
            bind(h, "ibv_ack_async_event", &v->ack_async_event, true, &miss) &&
            bind(h, "ibv_event_type_str", &v->event_type_str, true, &miss) &&
            bind(h, "ibv_wc_status_str", &v->wc_status_str, true, &miss);
  if (!ok) {
    *err = "the verbs library '" + lib + "' (R2CCL_IBVERBS_LIB) lacks the symbol " + miss;
    dlclose(h);
    delete v;
    return nullptr;
  }
  loaded[lib] = v;
  return v;
}

}  // namespace r2ccl::net::ib
