#include "test_hooks.h"

#include <sstream>

namespace r2ccl::net {

bool parse_test_hooks(const std::string& s, TestHooks* out, std::string* err) {
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    if (tok.empty()) continue;
    if (tok == "no_replay")
      out->replay = false;
    else if (tok == "no_dedup")
      out->guard.dedup = false;
    else if (tok == "no_stale_guard")
      out->guard.stale_guard = false;
    else if (tok == "no_bilateral_err")
      out->bilateral_err = false;
    else if (tok == "force_flush")
      out->force_flush = true;
    else if (tok == "no_goodput")
      out->goodput = false;
    else if (tok.compare(0, 8, "gpu_pci=") == 0 && tok.size() > 8)
      out->gpu_pci = tok.substr(8);
    else {
      *err = "R2CCL_TEST_HOOKS: unknown hook '" + tok +
             "'; accepted: comma list of no_replay, no_dedup, no_stale_guard, no_bilateral_err, "
             "force_flush, no_goodput, gpu_pci=PATH (a sysfs PCI path)";
      return false;
    }
  }
  return true;
}

}  // namespace r2ccl::net
