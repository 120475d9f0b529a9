// The C API of libr2ccl-snapshot (snapshot_client.h): thin adapters over client::Client and the
// exception firewall. Every exported function catches everything; the message of a failed call
// goes to the calling thread's last-error string.
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "client_impl.h"
#include "r2ccl/snapshot_client.h"

using r2ccl::snap::client::Client;
using r2ccl::snap::client::Config;
using r2ccl::snap::client::Status;

struct r2ccl_snap {
  std::unique_ptr<Client> c;
};

namespace {

thread_local std::string t_last_error;

int finish(const Status& s) {
  if (s.ok()) return R2CCL_SNAP_OK;
  t_last_error = "r2ccl snapshot: " + s.msg;
  return s.code;
}

template <class F>
int guarded(const char* fn, F&& f) {
  try {
    return finish(f());
  } catch (const std::bad_alloc&) {
    t_last_error = std::string("r2ccl snapshot: ") + fn + ": out of memory";
    return R2CCL_SNAP_ERR_NOMEM;
  } catch (const std::exception& e) {
    t_last_error = std::string("r2ccl snapshot: ") + fn + ": " + e.what();
    return R2CCL_SNAP_ERR_CONNECTION;
  } catch (...) {
    t_last_error = std::string("r2ccl snapshot: ") + fn + ": unexpected exception";
    return R2CCL_SNAP_ERR_CONNECTION;
  }
}

Status null_handle(const char* fn) {
  return Status{R2CCL_SNAP_ERR_INVALID, std::string(fn) + ": null handle or output pointer"};
}

}  // namespace

#define R2CCL_SNAP_API extern "C" __attribute__((visibility("default")))

R2CCL_SNAP_API int r2ccl_snap_open(const char* socket_path, uint32_t rank, uint32_t world,
                                   r2ccl_snap_t** out) {
  return guarded("open", [&]() -> Status {
    if (!out) return null_handle("open");
    Config cfg;
    Status s = r2ccl::snap::client::load_config(socket_path, &cfg);
    if (!s.ok()) return s;
    std::unique_ptr<Client> c;
    s = Client::open(cfg, rank, world, &c);
    if (!s.ok()) return s;
    auto* h = new r2ccl_snap;
    h->c = std::move(c);
    *out = h;
    return s;
  });
}

R2CCL_SNAP_API int r2ccl_snap_register(r2ccl_snap_t* h, uint32_t id, void* ptr, size_t bytes,
                                       int dtype, int codec, uint32_t flags) {
  return guarded("register", [&] {
    return h ? h->c->register_buffer(id, ptr, bytes, dtype, codec, flags) : null_handle("register");
  });
}

R2CCL_SNAP_API int r2ccl_snap_set_loss_scale(r2ccl_snap_t* h, double v) {
  return guarded("set_loss_scale",
                 [&] { return h ? h->c->set_loss_scale(v) : null_handle("set_loss_scale"); });
}

R2CCL_SNAP_API int r2ccl_snap_get_loss_scale(r2ccl_snap_t* h, double* out) {
  return guarded("get_loss_scale", [&] {
    return h && out ? h->c->get_loss_scale(out) : null_handle("get_loss_scale");
  });
}

R2CCL_SNAP_API int r2ccl_snap_set_rng_state(r2ccl_snap_t* h, const void* blob, size_t n) {
  return guarded("set_rng_state",
                 [&] { return h ? h->c->set_rng_state(blob, n) : null_handle("set_rng_state"); });
}

R2CCL_SNAP_API int r2ccl_snap_get_rng_state(r2ccl_snap_t* h, void* buf, size_t cap, size_t* n) {
  return guarded("get_rng_state", [&] {
    return h && n && (buf || cap == 0) ? h->c->get_rng_state(buf, cap, n)
                                       : null_handle("get_rng_state");
  });
}

R2CCL_SNAP_API int r2ccl_snap_take(r2ccl_snap_t* h, uint64_t step, r2ccl_snap_take_stats_t* st) {
  r2ccl_snap_take_stats_t local;
  if (!st) st = &local;
  std::memset(st, 0, sizeof(*st));
  return guarded("take", [&] { return h ? h->c->take(step, st) : null_handle("take"); });
}

R2CCL_SNAP_API int r2ccl_snap_flush(r2ccl_snap_t* h, int64_t timeout_us) {
  return guarded("flush", [&] { return h ? h->c->flush(timeout_us) : null_handle("flush"); });
}

R2CCL_SNAP_API int r2ccl_snap_state(r2ccl_snap_t* h, r2ccl_snap_state_t* out) {
  return guarded("state", [&] { return h && out ? h->c->state(out) : null_handle("state"); });
}

R2CCL_SNAP_API int r2ccl_snap_wait_event(r2ccl_snap_t* h, int64_t timeout_us,
                                         r2ccl_snap_state_t* out) {
  return guarded("wait_event", [&] {
    return h && out ? h->c->wait_event(timeout_us, out) : null_handle("wait_event");
  });
}

R2CCL_SNAP_API int r2ccl_snap_restore(r2ccl_snap_t* h, int64_t timeout_us, uint64_t* step_out) {
  return guarded("restore", [&] {
    return h && step_out ? h->c->restore(timeout_us, step_out) : null_handle("restore");
  });
}

R2CCL_SNAP_API int r2ccl_snap_kv_put(r2ccl_snap_t* h, const char* key, const void* value,
                                     size_t n) {
  return guarded("kv_put", [&] { return h ? h->c->kv_put(key, value, n) : null_handle("kv_put"); });
}

R2CCL_SNAP_API int r2ccl_snap_kv_get(r2ccl_snap_t* h, const char* key, void* buf, size_t cap,
                                     size_t* n, int64_t timeout_us) {
  return guarded("kv_get", [&] {
    return h && n && (buf || cap == 0) ? h->c->kv_get(key, buf, cap, n, timeout_us)
                                       : null_handle("kv_get");
  });
}

R2CCL_SNAP_API void r2ccl_snap_close(r2ccl_snap_t* h) {
  try {
    delete h;
  } catch (...) {
  }
}

R2CCL_SNAP_API const char* r2ccl_snap_last_error(const r2ccl_snap_t*) {
  return t_last_error.c_str();
}

R2CCL_SNAP_API const char* r2ccl_snap_strerror(int code) {
  switch (code) {
    case R2CCL_SNAP_OK: return "R2CCL_SNAP_OK";
    case R2CCL_SNAP_ERR_INVALID: return "R2CCL_SNAP_ERR_INVALID";
    case R2CCL_SNAP_ERR_CONFIG: return "R2CCL_SNAP_ERR_CONFIG";
    case R2CCL_SNAP_ERR_CONNECT: return "R2CCL_SNAP_ERR_CONNECT";
    case R2CCL_SNAP_ERR_CONNECTION: return "R2CCL_SNAP_ERR_CONNECTION";
    case R2CCL_SNAP_ERR_TIMEOUT: return "R2CCL_SNAP_ERR_TIMEOUT";
    case R2CCL_SNAP_ERR_NO_SNAPSHOT: return "R2CCL_SNAP_ERR_NO_SNAPSHOT";
    case R2CCL_SNAP_ERR_REFUSED: return "R2CCL_SNAP_ERR_REFUSED";
    case R2CCL_SNAP_ERR_CORRUPT: return "R2CCL_SNAP_ERR_CORRUPT";
    case R2CCL_SNAP_ERR_NOMEM: return "R2CCL_SNAP_ERR_NOMEM";
    case R2CCL_SNAP_ERR_UNSUPPORTED: return "R2CCL_SNAP_ERR_UNSUPPORTED";
    case R2CCL_SNAP_ERR_TOO_SMALL: return "R2CCL_SNAP_ERR_TOO_SMALL";
    case R2CCL_SNAP_ERR_ENCODE: return "R2CCL_SNAP_ERR_ENCODE";
    case R2CCL_SNAP_ERR_CUDA: return "R2CCL_SNAP_ERR_CUDA";
  }
  return "unknown";
}
