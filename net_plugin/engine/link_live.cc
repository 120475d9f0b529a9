#include "engine/link_live.h"

#include <functional>
#include <string_view>

namespace r2ccl::net {

std::shared_ptr<LinkLive> LinkTable::get(uint64_t key) {
  if (key == 0) return std::make_shared<LinkLive>(hp_);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = map_.find(key);
  if (it != map_.end())
    if (auto l = it->second.lock()) return l;
  // Drop entries whose links closed, so the map stays the size of the live links.
  for (auto e = map_.begin(); e != map_.end();)
    e = e->second.expired() ? map_.erase(e) : std::next(e);
  auto l = std::make_shared<LinkLive>(hp_);
  map_[key] = l;
  return l;
}

size_t LinkTable::size() {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& e : map_) n += e.second.expired() ? 0 : 1;
  return n;
}

bool LinkTable::every_other_high(const LinkLive* self, TimeUs now, TimeUs window) {
  std::lock_guard<std::mutex> lk(mu_);
  int recent = 0;
  for (const auto& e : map_) {
    const auto l = e.second.lock();
    if (!l || l.get() == self) continue;
    if (now - l->sampled_at.load(std::memory_order_relaxed) > window) continue;
    if (!l->sample_high.load(std::memory_order_relaxed)) return false;
    ++recent;
  }
  return recent > 0;
}

uint64_t new_link_path_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

uint64_t link_key_of(const void* bytes, size_t len) {
  const uint64_t h =
      std::hash<std::string_view>{}(std::string_view(static_cast<const char*>(bytes), len));
  return h != 0 ? h : 1;
}

}  // namespace r2ccl::net
