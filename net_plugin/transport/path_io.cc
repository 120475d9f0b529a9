#include "transport/path_io.h"

#include <climits>

#include "r2ccl/log.h"

namespace r2ccl::net {
namespace {

struct HostMr {
  void* data;
  size_t size;
};

}  // namespace

bool PathIo::has_room(int path) const {
  (void)path;
  return true;
}

void PathIo::quiesce(int path, PathSink& sink, TimeUs now) {
  (void)path;
  (void)sink;
  (void)now;
}

void PathIo::path_recovered(int path, PathSink& sink, TimeUs now) {
  (void)path;
  (void)sink;
  (void)now;
}

TimeUs PathIo::heard_within(int path, TimeUs now) const {
  (void)path;
  (void)now;
  return INT64_MAX;
}

TimeUs PathIo::stall_floor(int path) const {
  (void)path;
  return 0;
}

TimeUs PathIo::fault_start(int path, TimeUs now) const {
  (void)path;
  (void)now;
  return 0;
}

uint64_t PathIo::link_key(int path) const {
  (void)path;
  return 0;
}

bool PathIo::wait_fds(std::vector<pollfd>* out) const {
  (void)out;
  return false;
}

bool PathIo::address_stale(int path) const {
  (void)path;
  return false;
}

void PathIo::abort(TimeUs now) { (void)now; }

Status PathIo::start_flush(int n, void** data, const int* sizes, void** mhandles, uint64_t* token) {
  (void)n;
  (void)data;
  (void)sizes;
  (void)mhandles;
  *token = 0;
  return Status::kOk;
}

int PathIo::test_flush(uint64_t token, Status* err) {
  (void)token;
  *err = Status::kOk;
  return 1;
}

Status PathIo::reg_mr(void* data, size_t size, int type, void** mhandle) {
  (void)type;  // the API layer refused the types this transport does not advertise
  *mhandle = new HostMr{data, size};
  return Status::kOk;
}

Status PathIo::reg_mr_dmabuf(void* data, size_t size, uint64_t offset, int fd, void** mhandle) {
  (void)data;
  (void)size;
  (void)offset;
  (void)fd;
  *mhandle = nullptr;
  R2CCL_WARN("regMrDmaBuf: this transport does not advertise NCCL_PTR_DMABUF");
  return Status::kInternal;
}

void PathIo::dereg_mr(void* mhandle) { delete static_cast<HostMr*>(mhandle); }

uint32_t PathIo::allowed_paths(const void* mhandle) const {
  (void)mhandle;
  return kAllPaths;
}

}  // namespace r2ccl::net
