// The C API of libr2ccl-snapshot (snapshot_client.h): thin adapters over client::Client and the
// exception firewall. Every exported function catches everything; the message of a failed call
// goes to the calling thread's last-error string.
#include <cmath>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "client_impl.h"
#include "r2ccl/snapshot/comm_rebuild.h"
#include "r2ccl/snapshot/log.h"
#include "r2ccl/snapshot/recovery.h"
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

// ---- recovery: the hint, the recovery line, the communicator rebuild ----

namespace {

using r2ccl::snap::CommOps;
using r2ccl::snap::NcclUniqueId;

// CommOps over a caller's table of NCCL-shaped function pointers.
class TableOps final : public CommOps {
 public:
  explicit TableOps(const r2ccl_snap_nccl_ops_t& t) : t_(t) {}
  ncclResult_t get_version(int* v) override { return ncclResult_t(t_.get_version(v)); }
  ncclResult_t get_unique_id(NcclUniqueId* id) override {
    return ncclResult_t(t_.get_unique_id(id->internal));
  }
  ncclResult_t comm_init_rank(void** comm, int nranks, const NcclUniqueId& id, int rank) override {
    return ncclResult_t(t_.comm_init_rank(comm, nranks, id.internal, rank));
  }
  bool has_shrink() const override { return t_.comm_shrink != nullptr; }
  ncclResult_t comm_shrink(void* comm, const std::vector<int>& exclude, void** newcomm,
                           int flags) override {
    std::vector<int> ex(exclude);
    return ncclResult_t(
        t_.comm_shrink(comm, ex.data(), static_cast<int>(ex.size()), newcomm, nullptr, flags));
  }
  ncclResult_t comm_abort(void* comm) override { return ncclResult_t(t_.comm_abort(comm)); }
  ncclResult_t comm_destroy(void* comm) override { return ncclResult_t(t_.comm_destroy(comm)); }
  std::string error_string(ncclResult_t r) override {
    const char* s = t_.get_error_string ? t_.get_error_string(int(r)) : nullptr;
    return s ? s : "ncclResult " + std::to_string(int(r));
  }

 private:
  r2ccl_snap_nccl_ops_t t_;
};

// The unique id of a re-init through the daemons' KV.
class KvIds final : public r2ccl::snap::UniqueIdExchange {
 public:
  explicit KvIds(Client* c) : c_(c) {}
  bool publish(const std::string& key, const NcclUniqueId& id, std::string* err) override {
    const Status s = c_->kv_put(key.c_str(), id.internal, sizeof(id.internal));
    if (!s.ok()) *err = s.msg;
    return s.ok();
  }
  Wait wait(const std::string& key, r2ccl::TimeUs timeout_us, NcclUniqueId* id,
            std::string* err) override {
    size_t n = 0;
    NcclUniqueId got;
    const Status s = c_->kv_get(key.c_str(), got.internal, sizeof(got.internal), &n, timeout_us);
    if (s.code == R2CCL_SNAP_ERR_TIMEOUT) {
      *err = s.msg;
      return Wait::kTimeout;
    }
    if (!s.ok() || n != sizeof(got.internal)) {
      *err = s.ok() ? "the unique id under " + key + " has " + std::to_string(n) +
                          " bytes, expected " + std::to_string(sizeof(got.internal))
                    : s.msg;
      return Wait::kError;
    }
    *id = got;
    return Wait::kOk;
  }

 private:
  Client* c_;
};

}  // namespace

R2CCL_SNAP_API int r2ccl_snap_recovery_hint(double* lr_factor, int* steps) {
  return guarded("recovery_hint", [&]() -> Status {
    if (!lr_factor || !steps) return null_handle("recovery_hint");
    std::vector<std::string> errors;
    const r2ccl::snap::RecoveryHint h = r2ccl::snap::recovery_hint_from_env(&errors);
    *lr_factor = h.lr_factor;
    *steps = h.lr_steps;
    if (errors.empty()) return Status{};
    std::string all;
    for (const auto& e : errors) all += (all.empty() ? "" : "; ") + e;
    return Status{R2CCL_SNAP_ERR_CONFIG, "recovery hint: " + all};
  });
}

R2CCL_SNAP_API int r2ccl_snap_log_recovered(const char* lost_nodes, int n_phases,
                                            const char* const* names, const double* seconds,
                                            char* buf, size_t cap) {
  return guarded("log_recovered", [&]() -> Status {
    if (n_phases < 0 || n_phases > 64 || (n_phases > 0 && (!names || !seconds)))
      return Status{R2CCL_SNAP_ERR_INVALID,
                    "log_recovered: n_phases " + std::to_string(n_phases) +
                        " (accepted: 0..64, with names and seconds for each)"};
    std::vector<r2ccl::snap::PhaseTime> phases;
    double total = 0;
    for (int i = 0; i < n_phases; ++i) {
      if (!names[i] || !std::isfinite(seconds[i]) || seconds[i] < 0)
        return Status{R2CCL_SNAP_ERR_INVALID, "log_recovered: phase " + std::to_string(i) +
                                                  " needs a name and seconds >= 0"};
      phases.push_back({names[i], seconds[i]});
      total += seconds[i];
    }
    std::vector<std::string> nodes;
    if (lost_nodes && *lost_nodes) nodes.push_back(lost_nodes);
    const std::string line = r2ccl::snap::format_recovered_line(total, nodes, phases);
    // An event of the facade: "[SEC.USEC] [R2CCL] Successfully recovered in ..." on the event
    // sink, the stamp and tag the net plugin's recovery lines have (the facade adds the tag).
    constexpr char kTag[] = "[R2CCL] ";
    const bool tagged = line.compare(0, sizeof(kTag) - 1, kTag) == 0;
    r2ccl::log_event(r2ccl::Component::kSnapshot, "%s",
                     line.c_str() + (tagged ? sizeof(kTag) - 1 : 0));
    if (buf) {
      if (cap < line.size() + 1)
        return Status{R2CCL_SNAP_ERR_TOO_SMALL,
                      "log_recovered: the line has " + std::to_string(line.size() + 1) +
                          " bytes with its NUL, buf has " + std::to_string(cap)};
      std::memcpy(buf, line.c_str(), line.size() + 1);
    }
    return Status{};
  });
}

R2CCL_SNAP_API int r2ccl_snap_rebuild_comm(r2ccl_snap_t* h, const r2ccl_snap_nccl_ops_t* ops,
                                           void* old_comm, int old_rank, int old_nranks,
                                           const int* lost_ranks, int n_lost,
                                           const int* replaced_ranks, int n_replaced,
                                           uint64_t epoch, int64_t id_timeout_us, void** new_comm,
                                           int* new_rank, int* new_nranks) {
  return guarded("rebuild_comm", [&]() -> Status {
    if (!h || !new_comm || !new_rank || !new_nranks) return null_handle("rebuild_comm");
    if (n_lost < 1 || !lost_ranks || n_replaced < 0 || (n_replaced > 0 && !replaced_ranks) ||
        id_timeout_us <= 0)
      return Status{R2CCL_SNAP_ERR_INVALID,
                    "rebuild_comm: lost_ranks (n_lost >= 1), replaced_ranks (n_replaced >= 0) "
                    "and id_timeout_us > 0 are required"};
    if (ops && (!ops->get_version || !ops->get_unique_id || !ops->comm_init_rank ||
                !ops->comm_abort || !ops->comm_destroy))
      return Status{R2CCL_SNAP_ERR_INVALID,
                    "rebuild_comm: the ops table needs get_version, get_unique_id, "
                    "comm_init_rank, comm_abort and comm_destroy (comm_shrink and "
                    "get_error_string may be NULL)"};
    std::unique_ptr<CommOps> owned;
    std::string err;
    if (ops) {
      owned = std::make_unique<TableOps>(*ops);
    } else {
      owned = r2ccl::snap::NcclLibrary::open("", &err);
      if (!owned) return Status{R2CCL_SNAP_ERR_CONFIG, "rebuild_comm: " + err};
    }
    int version = 0;
    if (owned->get_version(&version) != ncclResult_t(0))
      return Status{R2CCL_SNAP_ERR_CONNECTION, "rebuild_comm: ncclGetVersion failed"};
    const std::vector<int> lost(lost_ranks, lost_ranks + n_lost);
    const std::vector<int> replaced(replaced_ranks, replaced_ranks + n_replaced);
    r2ccl::snap::RebuildPlan plan;
    if (!r2ccl::snap::plan_rebuild(version, owned->has_shrink(), old_nranks, lost, replaced, &plan,
                                   &err))
      return Status{R2CCL_SNAP_ERR_INVALID, "rebuild_comm: " + err};
    KvIds ids(h->c.get());
    r2ccl::snap::RebuildOptions opt;
    opt.epoch = epoch;
    opt.id_timeout_us = id_timeout_us;
    r2ccl::snap::RebuildOutcome out;
    const r2ccl::snap::RebuildStatus st =
        r2ccl::snap::rebuild_communicator(*owned, plan, old_rank, old_comm, ids, opt, &out, &err);
    switch (st) {
      case r2ccl::snap::RebuildStatus::kOk: break;
      case r2ccl::snap::RebuildStatus::kInvalidArgument:
        return Status{R2CCL_SNAP_ERR_INVALID, "rebuild_comm: " + err};
      case r2ccl::snap::RebuildStatus::kIdTimeout:
        return Status{R2CCL_SNAP_ERR_TIMEOUT, "rebuild_comm: " + err};
      default: return Status{R2CCL_SNAP_ERR_CONNECTION, "rebuild_comm: " + err};
    }
    *new_comm = out.comm;
    *new_rank = out.rank;
    *new_nranks = out.nranks;
    return Status{};
  });
}
