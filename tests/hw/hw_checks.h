// What the rdma suite's cases share (tests/hw, real HCAs of this host, loopback through the
// NIC): one pair of processes moving messages of every size with each side's event lines and
// stderr captured, and the lines that mean a path failed. Header-only, like
// support/data_shapes.h: the endpoint functions run in child processes (no Catch there).
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "support/net_harness.h"

namespace r2ccl::test::hw {

// The sizes every case moves: empty, one byte, one page, more than a 512 KiB chunk by one byte
// (a tail chunk), and 64 MiB (many chunks over every QP of a path).
inline const std::vector<size_t>& every_size() {
  static const std::vector<size_t> sizes = {0, 1, 4096, 512 * 1024 + 1, 64 * 1024 * 1024};
  return sizes;
}

struct SizesRun {
  PairResult pair;
  std::string sender_log;  // event lines (R2CCL_LOG_FILE) until that side's last message
  std::string receiver_log;
  std::string sender_stderr;  // the plugin's WARN/INFO lines, whole run
  std::string receiver_stderr;
};

// Copies the event log as it is now to LOG.end: what a side logs after its last message (the
// other side closing) is not the traffic's doing.
inline void snapshot_log(const std::string& log) {
  const std::string text = read_file(log);
  if (FILE* f = fopen((log + ".end").c_str(), "w")) {
    fwrite(text.data(), 1, text.size(), f);
    fclose(f);
  }
}

// Messages of every_size() (each its own pattern, in its own buffer) from the sender to the
// receiver over the verbs transport, `env` added to both; the receiver checks each size and
// every byte. Sender exit 1: a send failed; receiver 1: a receive failed, 2: wrong size or
// bytes.
inline SizesRun every_size_pair(const std::map<std::string, std::string>& env) {
  PairOptions o;
  o.env = env;
  o.env["R2CCL_TRANSPORT"] = "ib";
  const std::string slog = temp_path("hw-sender.log"), rlog = temp_path("hw-receiver.log");
  o.sender_env["R2CCL_LOG_FILE"] = slog;
  o.receiver_env["R2CCL_LOG_FILE"] = rlog;
  o.sender_stderr = temp_path("hw-sender.err");
  o.receiver_stderr = temp_path("hw-receiver.err");
  o.finish_together = true;
  const std::vector<size_t>& sizes = every_size();
  SizesRun r;
  r.pair = run_pair(
      o,
      [&](Endpoint& ep) {
        std::vector<std::vector<char>> bufs;
        for (size_t n : sizes) bufs.emplace_back(n + 1);
        for (size_t i = 0; i < sizes.size(); ++i) {
          fill_pattern(bufs[i].data(), sizes[i], i + 1);
          if (ep.send(bufs[i].data(), sizes[i], 30000) != ncclSuccess) {
            fprintf(stderr, "sender: message %zu (%zu bytes) failed\n", i, sizes[i]);
            return 1;
          }
        }
        snapshot_log(slog);
        return 0;
      },
      [&](Endpoint& ep) {
        std::vector<std::vector<char>> bufs;
        for (size_t n : sizes) bufs.emplace_back(n + 1);
        for (size_t i = 0; i < sizes.size(); ++i) {
          int got = -1;
          if (ep.recv(bufs[i].data(), bufs[i].size(), 30000, &got) != ncclSuccess) {
            fprintf(stderr, "receiver: message %zu failed\n", i);
            return 1;
          }
          const long long bad = check_pattern(bufs[i].data(), sizes[i], i + 1);
          if (got != static_cast<int>(sizes[i]) || bad >= 0) {
            fprintf(stderr, "receiver: message %zu: %d bytes (expected %zu), first bad byte %lld\n",
                    i, got, sizes[i], bad);
            return 2;
          }
        }
        snapshot_log(rlog);
        return 0;
      });
  r.sender_log = read_file(slog + ".end");
  r.receiver_log = read_file(rlog + ".end");
  r.sender_stderr = read_file(o.sender_stderr);
  r.receiver_stderr = read_file(o.receiver_stderr);
  return r;
}

// Event lines that mean a path failed or traffic left it, in `log`: a path failure
// ("... failed (reason)"), a switchover, a give-up.
inline int path_failure_lines(const std::string& log) {
  return count_lines_containing(log, "failed (") + count_lines_containing(log, "switchover") +
         count_lines_containing(log, "give-up");
}

}  // namespace r2ccl::test::hw
