#include "perf_stats.h"

#include <cinttypes>
#include <cstring>

#include "r2ccl/ext.h"

#ifdef R2PERF_HAVE_NLOHMANN_JSON
#include <nlohmann/json.hpp>
#endif

namespace r2perf {

std::string read_plugin_stats(const Net& net) {
  auto* ext = static_cast<const r2cclExt_v1_t*>(net.symbol(R2CCL_EXT_SYMBOL_V1));
  if (!ext) return "0";
  if (ext->version < 1 || !ext->getStats)
    return "Er2cclExt_v1 has version " + std::to_string(ext->version) + " or no getStats";
  std::vector<char> buf(4096);
  for (int attempt = 0; attempt < 4; attempt++) {
    buf[0] = 0;
    size_t need = ext->getStats(buf.data(), buf.size());
    if (need < buf.size()) return "1" + std::string(buf.data(), strnlen(buf.data(), buf.size()));
    buf.assign(need + 1, 0);  // the text grew: call again with room for it
  }
  return "EgetStats keeps asking for a bigger buffer";
}

namespace {

// One rank's totals line (tests and bench_net.sh read it).
void print_total(FILE* out, int rank, uint64_t switchovers, uint64_t replays, uint64_t links) {
  fprintf(out, "# rank %d total: switchovers %" PRIu64 " replays %" PRIu64 " links %" PRIu64 "\n",
          rank, switchovers, replays, links);
}

#ifdef R2PERF_HAVE_NLOHMANN_JSON
uint64_t num(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return 0;
  return it->is_number_unsigned() || it->is_number_integer()
             ? it->get<uint64_t>()
             : static_cast<uint64_t>(it->get<double>());
}

std::string str(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string("?");
}

// Returns false when the text is not the documented object.
bool print_json(int rank, const std::string& text, FILE* out, StatsSummary* sum) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return false;
  uint64_t rail_replays = 0, rail_switchovers = 0;
  auto rails = j.find("rails");
  if (rails != j.end() && rails->is_array()) {
    for (const nlohmann::json& r : *rails) {
      if (!r.is_object()) return false;
      rail_replays += num(r, "chunks_replayed");
      rail_switchovers += num(r, "switchovers");
      if (out)
        fprintf(out,
                "# rank %d rail %-22s state %-8s chunks %10" PRIu64 " replayed %8" PRIu64
                " switchovers %4" PRIu64 " failbacks %4" PRIu64 " bytes %" PRIu64 "\n",
                rank, str(r, "name").c_str(), str(r, "state").c_str(), num(r, "chunks_sent"),
                num(r, "chunks_replayed"), num(r, "switchovers"), num(r, "failbacks"),
                num(r, "bytes_sent"));
    }
  }
  uint64_t replays = std::max(num(j, "replays"), rail_replays);
  uint64_t switchovers = std::max(num(j, "switchovers"), rail_switchovers);
  if (out) print_total(out, rank, switchovers, replays, num(j, "links"));
  sum->replays += replays;
  sum->switchovers += switchovers;
  return true;
}
#else
// Without nlohmann-json: print the text as it is and sum the top-level counters by a scan.
uint64_t scan(const std::string& text, const char* key) {
  std::string k = std::string("\"") + key + "\":";
  size_t p = text.rfind(k);  // the top-level key comes after the rails array
  if (p == std::string::npos) return 0;
  return strtoull(text.c_str() + p + k.size(), nullptr, 10);
}

bool print_json(int rank, const std::string& text, FILE* out, StatsSummary* sum) {
  if (text.empty() || text[0] != '{') return false;
  if (out) fprintf(out, "# rank %d stats: %s\n", rank, text.c_str());
  const uint64_t replays = scan(text, "replays"), switchovers = scan(text, "switchovers");
  if (out) print_total(out, rank, switchovers, replays, scan(text, "links"));
  sum->replays += replays;
  sum->switchovers += switchovers;
  return true;
}
#endif

}  // namespace

StatsSummary summarize_stats(const std::vector<std::string>& blobs, FILE* out) {
  StatsSummary sum;
  size_t without = 0;
  for (const std::string& b : blobs) without += b == "0";
  if (without == blobs.size()) {
    if (out) fprintf(out, "# stats: plugin has no r2cclExt_v1\n");
    return sum;
  }
  if (out) fprintf(out, "#\n# stats (r2cclExt_v1):\n");
  for (size_t r = 0; r < blobs.size(); r++) {
    const std::string& b = blobs[r];
    int rank = static_cast<int>(r);
    if (b == "0") {
      if (out) fprintf(out, "# rank %d stats: plugin has no r2cclExt_v1\n", rank);
    } else if (!b.empty() && b[0] == 'E') {
      if (out) fprintf(out, "# rank %d stats: error: %s\n", rank, b.c_str() + 1);
      sum.bad = true;
    } else if (b.empty() || !print_json(rank, b.substr(1), out, &sum)) {
      if (out)
        fprintf(out, "# rank %d stats: not a JSON object as r2ccl/ext.h documents: %.200s\n", rank,
                b.empty() ? "" : b.c_str() + 1);
      sum.bad = true;
    }
  }
  if (out)
    fprintf(out, "# stats total: switchovers %" PRIu64 " replays %" PRIu64 "\n", sum.switchovers,
            sum.replays);
  return sum;
}

}  // namespace r2perf
