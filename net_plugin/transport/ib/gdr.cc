#include "transport/ib/gdr.h"

#include <algorithm>
#include <vector>

namespace r2ccl::net::ib {
namespace {

constexpr const char* kNames[] = {"LOC", "NVL", "NVB", "C2C", "PIX",
                                  "PXB", "P2C", "PXN", "PHB", "SYS"};
constexpr int kNumNames = static_cast<int>(sizeof(kNames) / sizeof(kNames[0]));
// NCCL's old numbering (paths.cc levelsOldToNew): 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and 5 SYS;
// larger values are clamped to the last entry.
constexpr int kOldToNew[] = {kPathLoc, kPathPix, kPathPxb, kPathPhb, kPathSys, kPathSys};

// The sysfs path's components after the PCI root complex ("pciDDDD:BB"); false when there is
// no such root. *root gets its name.
bool split_pci(const std::string& path, std::string* root, std::vector<std::string>* out) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t slash = path.find('/', start);
    const std::string c =
        path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (!c.empty()) parts.push_back(c);
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].compare(0, 3, "pci") == 0 && parts[i].find(':') != std::string::npos) {
      *root = parts[i];
      out->assign(parts.begin() + static_cast<long>(i) + 1, parts.end());
      return !out->empty();
    }
  }
  return false;
}

// The PCI switch nodes above a device as NCCL's topology has them, nearest first: the
// function two levels up, then two above that, ... while one exists below the root.
std::vector<std::string> switch_chain(const std::vector<std::string>& c) {
  std::vector<std::string> out;
  for (long k = static_cast<long>(c.size()) - 3; k >= 0; k -= 2) out.push_back(c[k]);
  return out;
}

}  // namespace

const char* gdr_path_name(int type) { return type >= 0 && type < kNumNames ? kNames[type] : "?"; }

bool parse_gdr_level(const std::string& v, const std::string& var, int* out, std::string* err) {
  for (int i = 0; i < kNumNames; ++i) {
    if (v == kNames[i]) {
      *out = i;
      return true;
    }
  }
  if (!v.empty() && v.size() <= 9 && v.find_first_not_of("0123456789") == std::string::npos) {
    const int old = std::min(std::stoi(v), static_cast<int>(sizeof(kOldToNew) / sizeof(int)) - 1);
    *out = kOldToNew[old];
    return true;
  }
  *err = var + "='" + v +
         "': accepted: one of LOC, NVL, NVB, C2C, PIX, PXB, P2C, PXN, PHB, SYS (NCCL's path "
         "types, upper case) or NCCL's legacy integer 0-5 (0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 SYS)";
  return false;
}

int gpu_nic_path_type(const std::string& gpu_pci, int gpu_numa, const std::string& nic_pci,
                      int nic_numa) {
  std::string ra, rb;
  std::vector<std::string> ca, cb;
  if (!split_pci(gpu_pci, &ra, &ca) || !split_pci(nic_pci, &rb, &cb)) return kPathSys;
  const std::vector<std::string> sa = switch_chain(ca), sb = switch_chain(cb);
  if (!sa.empty() && !sb.empty() && sa[0] == sb[0]) return kPathPix;
  for (const auto& s : sa)
    if (std::find(sb.begin(), sb.end(), s) != sb.end()) return kPathPxb;
  if (ra == rb || gpu_numa == nic_numa) return kPathPhb;
  return kPathSys;
}

bool gdr_level_of(const Config& cfg, int* out, std::string* text, std::string* err) {
  auto from = [&cfg](const char* src) {
    return std::find(cfg.sources.begin(), cfg.sources.end(),
                     std::string("R2CCL_NET_GDR_LEVEL from ") + src) != cfg.sources.end();
  };
  const std::string var = from("NCCL_NET_GDR_LEVEL") ? "NCCL_NET_GDR_LEVEL" : "R2CCL_NET_GDR_LEVEL";
  if (!parse_gdr_level(cfg.net_gdr_level, var, out, err)) return false;
  if (text) *text = var + "=" + cfg.net_gdr_level + (from("default") ? " (default)" : "");
  return true;
}

}  // namespace r2ccl::net::ib
