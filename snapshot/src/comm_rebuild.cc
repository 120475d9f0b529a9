#include "r2ccl/snapshot/comm_rebuild.h"

#include <dlfcn.h>

#include <algorithm>
#include <cinttypes>
#include <cstdlib>
#include <set>

#include "r2ccl/snapshot/log.h"

namespace r2ccl::snap {

namespace {

std::string join_ranks(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(v[i]);
  }
  return s.empty() ? "none" : s;
}

// "ncclCommShrink failed: <NCCL's text> (ncclResult_t 2)".
std::string nccl_failure(CommOps& ops, const char* call, ncclResult_t r) {
  return std::string(call) + " failed: " + ops.error_string(r) + " (ncclResult_t " +
         std::to_string(static_cast<int>(r)) + ")";
}

bool contains(const std::vector<int>& sorted, int v) {
  return std::binary_search(sorted.begin(), sorted.end(), v);
}

}  // namespace

std::string nccl_version_string(int code) {
  if (code <= 0) return "unknown";
  int major, minor, patch;
  if (code >= 10000) {  // 2.9 and later
    major = code / 10000;
    minor = code / 100 % 100;
    patch = code % 100;
  } else {
    major = code / 1000;
    minor = code / 100 % 10;
    patch = code % 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// ---------------------------------------------------------------------------------------------
// NcclLibrary

std::unique_ptr<NcclLibrary> NcclLibrary::open(const std::string& path, std::string* err) {
  std::string name = path;
  if (name.empty()) {
    const char* env = std::getenv(kNcclLibraryEnv);
    name = (env && *env) ? env : kNcclLibraryDefault;
  }
  dlerror();
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = dlerror();
    *err = "cannot load the NCCL library " + name + ": " + (why ? why : "unknown dlopen error") +
           " (set " + kNcclLibraryEnv + " to the libnccl.so.2 the application uses)";
    return nullptr;
  }
  // Never dlclose'd (header comment), also when a symbol is missing: another part of the
  // process may hold the same library.
  return from_resolver([handle](const char* sym) { return dlsym(handle, sym); }, name, err);
}

std::unique_ptr<NcclLibrary> NcclLibrary::from_resolver(const Resolver& resolve,
                                                        const std::string& label,
                                                        std::string* err) {
  std::unique_ptr<NcclLibrary> lib(new NcclLibrary());
  lib->label_ = label;
  struct Required {
    const char* name;
    void** slot;
  };
  // Function pointers are stored through void* (POSIX guarantees dlsym's round trip).
  void* p_version = nullptr;
  void* p_uid = nullptr;
  void* p_init = nullptr;
  void* p_abort = nullptr;
  void* p_destroy = nullptr;
  void* p_errstr = nullptr;
  const Required req[] = {
      {"ncclGetVersion", &p_version},  {"ncclGetUniqueId", &p_uid},
      {"ncclCommInitRank", &p_init},   {"ncclCommAbort", &p_abort},
      {"ncclCommDestroy", &p_destroy}, {"ncclGetErrorString", &p_errstr},
  };
  for (const Required& r : req) {
    *r.slot = resolve(r.name);
    if (!*r.slot) {
      *err = "the NCCL library " + label + " has no symbol " + r.name +
             " (not an NCCL 2.x library? set " + kNcclLibraryEnv + ")";
      return nullptr;
    }
  }
  lib->get_version_ = reinterpret_cast<GetVersionFn>(p_version);
  lib->get_unique_id_ = reinterpret_cast<GetUniqueIdFn>(p_uid);
  lib->init_rank_ = reinterpret_cast<InitRankFn>(p_init);
  lib->abort_ = reinterpret_cast<CommFn>(p_abort);
  lib->destroy_ = reinterpret_cast<CommFn>(p_destroy);
  lib->error_string_ = reinterpret_cast<ErrorStringFn>(p_errstr);
  lib->shrink_ = reinterpret_cast<ShrinkFn>(resolve("ncclCommShrink"));

  int v = 0;
  ncclResult_t r = lib->get_version_(&v);
  if (r != ncclSuccess) {
    *err = "ncclGetVersion of " + label + " failed: " + lib->error_string(r) + " (ncclResult_t " +
           std::to_string(static_cast<int>(r)) + ")";
    return nullptr;
  }
  lib->version_ = v;
  SNAP_INFO("snapshot rebuild: NCCL %s from %s, ncclCommShrink %s", nccl_version_string(v).c_str(),
            label.c_str(),
            lib->has_shrink() ? "available"
                              : (lib->shrink_ ? "present but the version is below 2.27"
                                              : "absent (re-init only)"));
  return lib;
}

ncclResult_t NcclLibrary::get_version(int* version) { return get_version_(version); }

ncclResult_t NcclLibrary::get_unique_id(NcclUniqueId* id) { return get_unique_id_(id); }

ncclResult_t NcclLibrary::comm_init_rank(void** comm, int nranks, const NcclUniqueId& id,
                                         int rank) {
  return init_rank_(comm, nranks, id, rank);
}

bool NcclLibrary::has_shrink() const {
  return shrink_ != nullptr && version_ >= kNcclShrinkMinVersion;
}

ncclResult_t NcclLibrary::comm_shrink(void* comm, const std::vector<int>& exclude, void** newcomm,
                                      int flags) {
  if (!has_shrink()) return ncclInvalidUsage;
  std::vector<int> list(exclude);  // NCCL takes a non-const int*
  return shrink_(comm, list.empty() ? nullptr : list.data(), static_cast<int>(list.size()), newcomm,
                 nullptr, flags);
}

ncclResult_t NcclLibrary::comm_abort(void* comm) { return abort_(comm); }

ncclResult_t NcclLibrary::comm_destroy(void* comm) { return destroy_(comm); }

std::string NcclLibrary::error_string(ncclResult_t result) {
  const char* s = error_string_ ? error_string_(result) : nullptr;
  return s ? s : "ncclResult_t " + std::to_string(static_cast<int>(result));
}

// ---------------------------------------------------------------------------------------------
// Plan

const char* to_string(RebuildMode m) {
  switch (m) {
    case RebuildMode::kShrink: return "shrink";
    case RebuildMode::kReinit: return "abort + re-init";
  }
  return "?";
}

const char* to_string(RebuildStatus s) {
  switch (s) {
    case RebuildStatus::kOk: return "ok";
    case RebuildStatus::kInvalidArgument: return "invalid argument";
    case RebuildStatus::kNcclError: return "NCCL error";
    case RebuildStatus::kIdTimeout: return "unique id timeout";
    case RebuildStatus::kIdExchangeError: return "unique id exchange error";
  }
  return "?";
}

std::string rebuild_id_key(uint64_t epoch, bool fallback) {
  std::string k = "r2ccl.rebuild.e" + std::to_string(epoch);
  if (fallback) k += ".fallback";
  return k;
}

bool plan_rebuild(int nccl_version, bool have_shrink, int old_nranks, const std::vector<int>& lost,
                  const std::vector<int>& replaced, RebuildPlan* out, std::string* err) {
  if (old_nranks <= 0) {
    *err = "rebuild plan: the old communicator has " + std::to_string(old_nranks) +
           " ranks (accepted: 1 or more)";
    return false;
  }
  auto check = [&](const std::vector<int>& in, const char* what, std::vector<int>* sorted) {
    std::set<int> seen;
    for (int r : in) {
      if (r < 0 || r >= old_nranks) {
        *err = "rebuild plan: " + std::string(what) + " rank " + std::to_string(r) +
               " is outside the old communicator (ranks 0.." + std::to_string(old_nranks - 1) + ")";
        return false;
      }
      if (!seen.insert(r).second) {
        *err = "rebuild plan: " + std::string(what) + " rank " + std::to_string(r) +
               " is listed twice";
        return false;
      }
    }
    sorted->assign(seen.begin(), seen.end());
    return true;
  };
  RebuildPlan p;
  p.old_nranks = old_nranks;
  if (!check(lost, "lost", &p.lost) || !check(replaced, "replaced", &p.replaced)) return false;
  if (p.lost.empty()) {
    *err = "rebuild plan: no rank was lost (nothing to rebuild)";
    return false;
  }
  for (int r : p.replaced) {
    if (!contains(p.lost, r)) {
      *err = "rebuild plan: replaced rank " + std::to_string(r) +
             " was not lost (a replacement takes over a lost rank; lost: " + join_ranks(p.lost) +
             ")";
      return false;
    }
  }
  if (static_cast<int>(p.lost.size()) == old_nranks) {
    *err = "rebuild plan: every rank of the old communicator was lost (" +
           std::to_string(old_nranks) +
           "): nothing to rebuild from; start the job again from the last complete snapshot";
    return false;
  }
  p.new_rank.assign(static_cast<size_t>(old_nranks), -1);
  int next = 0;
  for (int r = 0; r < old_nranks; ++r) {
    const bool survivor = !contains(p.lost, r);
    if (survivor && p.id_root < 0) p.id_root = r;
    if (survivor || contains(p.replaced, r)) p.new_rank[static_cast<size_t>(r)] = next++;
  }
  p.new_nranks = next;

  const std::string ver = nccl_version_string(nccl_version);
  if (!p.replaced.empty()) {
    p.mode = RebuildMode::kReinit;
    p.reason = std::to_string(p.replaced.size()) +
               " replacement rank(s) join, which need a new communicator";
  } else if (nccl_version < kNcclShrinkMinVersion) {
    p.mode = RebuildMode::kReinit;
    p.reason = "NCCL " + ver + " has no ncclCommShrink (2.27 or later)";
  } else if (!have_shrink) {
    p.mode = RebuildMode::kReinit;
    p.reason = "NCCL " + ver + " does not export ncclCommShrink";
  } else {
    p.mode = RebuildMode::kShrink;
    p.reason = "NCCL " + ver + " has ncclCommShrink and no replacement joins";
  }
  *out = std::move(p);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Driver

namespace {

// Re-init on this rank: the old communicator (if any) is already released.
RebuildStatus reinit(CommOps& ops, const RebuildPlan& plan, int old_rank, UniqueIdExchange& ids,
                     const std::string& key, TimeUs timeout_us, void** comm, std::string* err) {
  const int rank = plan.new_rank[static_cast<size_t>(old_rank)];
  NcclUniqueId id{};
  if (old_rank == plan.id_root) {
    ncclResult_t r = ops.get_unique_id(&id);
    if (r != ncclSuccess) {
      *err = "rebuild: " + nccl_failure(ops, "ncclGetUniqueId", r) + " on old rank " +
             std::to_string(old_rank) + " (the id root)";
      return RebuildStatus::kNcclError;
    }
    std::string why;
    if (!ids.publish(key, id, &why)) {
      *err = "rebuild: publishing the unique id under " + key + " failed: " + why;
      return RebuildStatus::kIdExchangeError;
    }
  } else {
    std::string why;
    switch (ids.wait(key, timeout_us, &id, &why)) {
      case UniqueIdExchange::Wait::kOk: break;
      case UniqueIdExchange::Wait::kTimeout:
        *err = "rebuild: no unique id under " + key + " from old rank " +
               std::to_string(plan.id_root) + " within " + std::to_string(timeout_us / kUsPerMs) +
               " ms" + (why.empty() ? "" : ": " + why);
        return RebuildStatus::kIdTimeout;
      case UniqueIdExchange::Wait::kError:
        *err = "rebuild: waiting for the unique id under " + key + " failed: " + why;
        return RebuildStatus::kIdExchangeError;
    }
  }
  void* c = nullptr;
  ncclResult_t r = ops.comm_init_rank(&c, plan.new_nranks, id, rank);
  if (r != ncclSuccess) {
    *err = "rebuild: " + nccl_failure(ops, "ncclCommInitRank", r) + " (rank " +
           std::to_string(rank) + " of " + std::to_string(plan.new_nranks) + ")";
    return RebuildStatus::kNcclError;
  }
  *comm = c;
  return RebuildStatus::kOk;
}

// Aborts the old communicator; a failure is noted (the handle is gone either way).
void release_parent(CommOps& ops, void* comm, bool destroy, std::string* note) {
  ncclResult_t r = destroy ? ops.comm_destroy(comm) : ops.comm_abort(comm);
  if (r != ncclSuccess) {
    std::string m = nccl_failure(ops, destroy ? "ncclCommDestroy" : "ncclCommAbort", r) +
                    " on the old communicator";
    SNAP_WARN("snapshot rebuild: %s", m.c_str());
    if (!note->empty()) *note += "; ";
    *note += m;
  }
}

}  // namespace

RebuildStatus rebuild_communicator(CommOps& ops, const RebuildPlan& plan, int old_rank,
                                   void* old_comm, UniqueIdExchange& ids, const RebuildOptions& opt,
                                   RebuildOutcome* out, std::string* err) {
  if (plan.old_nranks <= 0 || plan.new_rank.size() != static_cast<size_t>(plan.old_nranks) ||
      plan.id_root < 0 || plan.id_root >= plan.old_nranks) {
    *err = "rebuild: the plan is not one plan_rebuild made";
    return RebuildStatus::kInvalidArgument;
  }
  if (old_rank < 0 || old_rank >= plan.old_nranks) {
    *err = "rebuild: old rank " + std::to_string(old_rank) +
           " is outside the old communicator (0.." + std::to_string(plan.old_nranks - 1) + ")";
    return RebuildStatus::kInvalidArgument;
  }
  if (opt.id_timeout_us <= 0) {
    *err = "rebuild: the unique id timeout must be > 0 us (got " +
           std::to_string(opt.id_timeout_us) + ")";
    return RebuildStatus::kInvalidArgument;
  }
  const bool lost = contains(plan.lost, old_rank);
  const bool replacement = lost && contains(plan.replaced, old_rank);
  if (lost && !replacement) {
    *err = "rebuild: old rank " + std::to_string(old_rank) +
           " was lost and is not replaced; it has no place in the new communicator";
    return RebuildStatus::kInvalidArgument;
  }
  if (replacement && old_comm) {
    *err = "rebuild: old rank " + std::to_string(old_rank) +
           " is taken over by a replacement, which has no old communicator (pass nullptr)";
    return RebuildStatus::kInvalidArgument;
  }
  if (!replacement && !old_comm) {
    *err = "rebuild: surviving old rank " + std::to_string(old_rank) +
           " must pass its old communicator";
    return RebuildStatus::kInvalidArgument;
  }
  if (plan.mode == RebuildMode::kShrink && !plan.replaced.empty()) {
    *err = "rebuild: a shrink plan cannot take replacements";
    return RebuildStatus::kInvalidArgument;
  }

  RebuildOutcome o;
  o.rank = plan.new_rank[static_cast<size_t>(old_rank)];
  o.nranks = plan.new_nranks;
  const std::string lost_s = join_ranks(plan.lost);

  if (plan.mode == RebuildMode::kShrink) {
    void* child = nullptr;
    ncclResult_t r = ops.has_shrink()
                         ? ops.comm_shrink(old_comm, plan.lost, &child, plan.shrink_flags)
                         : ncclInvalidUsage;
    if (r == ncclSuccess) {
      // With NCCL_SHRINK_ABORT nothing is shared with the parent: abort it. With
      // NCCL_SHRINK_DEFAULT no operation was outstanding: destroy it (shared resources, if
      // any, are reference-counted by NCCL).
      release_parent(ops, old_comm, !(plan.shrink_flags & kNcclShrinkAbort), &o.note);
      o.comm = child;
      o.mode = RebuildMode::kShrink;
      SNAP_INFO("snapshot rebuild: shrink done, lost ranks %s, old rank %d -> %d of %d",
                lost_s.c_str(), old_rank, o.rank, o.nranks);
      *out = std::move(o);
      return RebuildStatus::kOk;
    }
    const std::string why = ops.has_shrink()
                                ? nccl_failure(ops, "ncclCommShrink", r)
                                : std::string("ncclCommShrink is not available in this NCCL");
    SNAP_WARN(
        "snapshot rebuild: %s on old rank %d (lost ranks %s); falling back to abort + "
        "re-init under %s",
        why.c_str(), old_rank, lost_s.c_str(), rebuild_id_key(opt.epoch, true).c_str());
    o.fell_back = true;
    o.note = why;
    release_parent(ops, old_comm, false, &o.note);
    void* c = nullptr;
    RebuildStatus s = reinit(ops, plan, old_rank, ids, rebuild_id_key(opt.epoch, true),
                             opt.id_timeout_us, &c, err);
    if (s != RebuildStatus::kOk) {
      *err += " (after " + why + ")";
      return s;
    }
    o.comm = c;
    o.mode = RebuildMode::kReinit;
    *out = std::move(o);
    return RebuildStatus::kOk;
  }

  if (old_comm) release_parent(ops, old_comm, false, &o.note);
  void* c = nullptr;
  RebuildStatus s = reinit(ops, plan, old_rank, ids, rebuild_id_key(opt.epoch, false),
                           opt.id_timeout_us, &c, err);
  if (s != RebuildStatus::kOk) return s;
  o.comm = c;
  o.mode = RebuildMode::kReinit;
  SNAP_INFO("snapshot rebuild: re-init done (%s), lost ranks %s, old rank %d%s -> %d of %d",
            plan.reason.c_str(), lost_s.c_str(), old_rank, replacement ? " (replacement)" : "",
            o.rank, o.nranks);
  *out = std::move(o);
  return RebuildStatus::kOk;
}

}  // namespace r2ccl::snap
