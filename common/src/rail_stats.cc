#include "r2ccl/rail_stats.h"

namespace r2ccl {

void append_rail_json(std::ostringstream& o, const std::string& name, const char* state,
                      const RailCounters& c) {
  o << "{\"name\":\"" << name << "\",\"state\":\"" << state
    << "\",\"chunks_sent\":" << c.chunks_sent.load()
    << ",\"chunks_replayed\":" << c.chunks_replayed.load()
    << ",\"bytes_sent\":" << c.bytes_sent.load() << ",\"switchovers\":" << c.switchovers.load()
    << ",\"failbacks\":" << c.failbacks.load() << ",\"paths_failed\":" << c.paths_failed.load()
    << ",\"discarded_chunks\":" << c.discarded_chunks.load()
    << ",\"predict_drain\":" << (c.predict_drain.load() ? "true" : "false")
    << ",\"predict_drains\":" << c.predict_drains.load()
    << ",\"tcp_retrans\":" << c.tcp_retrans.load() << "}";
}

}  // namespace r2ccl
