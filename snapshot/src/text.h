// Small text helpers shared by the snapshot core's parsers (peer list, topology, environment).
// Internal to r2ccl_snapshot_core.
#pragma once

#include <cctype>
#include <string>

namespace r2ccl::snap::text {

// `s` without leading and trailing whitespace (isspace).
inline std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

}  // namespace r2ccl::snap::text
