#include "transport/ib/mr_cache.h"

#include <cerrno>
#include <limits>
#include <utility>

#include "r2ccl/log.h"

namespace r2ccl::net::ib {

MrCache::MrCache(RegFn reg, DeregFn dereg, size_t page_size)
    : reg_(std::move(reg)), dereg_(std::move(dereg)), page_(page_size ? page_size : 4096) {}

MrCache::~MrCache() {
  std::lock_guard<std::mutex> g(mu_);
  if (!by_start_.empty()) {
    R2CCL_WARN("NET/R2CCL: %zu memory registrations still referenced at teardown; deregistering",
               by_start_.size());
  }
  for (auto& kv : by_start_) dereg_(kv.second.mr);
  by_start_.clear();
  by_mr_.clear();
}

void* MrCache::acquire(const void* addr, size_t len, std::string* err) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  const uintptr_t max = std::numeric_limits<uintptr_t>::max();
  if (len == 0) len = 1;
  if (len - 1 > max - a) {
    *err = "memory registration: range overflows the address space";
    errno = EINVAL;
    return nullptr;
  }
  const uintptr_t last = a + (len - 1);  // inclusive
  const uintptr_t start = a - a % page_;
  const uintptr_t last_page = last - last % page_;
  if (last_page > max - page_) {
    *err = "memory registration: range overflows the address space";
    errno = EINVAL;
    return nullptr;
  }
  const uintptr_t end = last_page + page_;  // exclusive

  std::lock_guard<std::mutex> g(mu_);
  // A covering entry starts at or before `start`; take the oldest (lowest start first, then
  // insertion order) that reaches `end`.
  for (auto it = by_start_.begin(); it != by_start_.end() && it->first <= start; ++it) {
    if (it->second.end >= end) {
      it->second.refs++;
      return it->second.mr;
    }
  }
  std::string e;
  void* mr = reg_(start, static_cast<size_t>(end - start), &e);
  if (!mr) {
    const int reg_errno = errno;  // the string copy may allocate
    *err = e.empty() ? "memory registration failed" : e;
    errno = reg_errno;
    return nullptr;
  }
  auto it = by_start_.emplace(start, Entry{start, end, mr, 1});
  by_mr_[mr] = it;
  return mr;
}

bool MrCache::release(void* mr) {
  if (!mr) return false;
  std::lock_guard<std::mutex> g(mu_);
  auto f = by_mr_.find(mr);
  if (f == by_mr_.end()) return false;
  if (--f->second->second.refs > 0) return true;
  by_start_.erase(f->second);
  by_mr_.erase(f);
  dereg_(mr);
  return true;
}

size_t MrCache::entries() const {
  std::lock_guard<std::mutex> g(mu_);
  return by_start_.size();
}

size_t MrCache::refs(void* mr) const {
  std::lock_guard<std::mutex> g(mu_);
  auto f = by_mr_.find(mr);
  return f == by_mr_.end() ? 0 : f->second->second.refs;
}

}  // namespace r2ccl::net::ib
