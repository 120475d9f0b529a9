// A stream of equal messages between the two processes of run_pair, used by the failover
// tests of every transport: the sender keeps `depth` messages in flight until at least
// `min_messages` were sent and `min_seconds` passed, then sends an 8-byte end marker holding
// the message count; the receiver checks every message's size and bytes (message k carries
// pattern k % depth, or k with pattern_per_message) and the count. Every wait is bounded by
// `stall_ms`.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "net_harness.h"

namespace r2ccl::test {

// Exit codes of the stream endpoints.
constexpr int kStreamOk = 0;
constexpr int kStreamPostFailed = 10;  // isend/irecv returned an error
constexpr int kStreamStalled = 11;     // no completion within the stall limit
constexpr int kStreamTestFailed = 12;  // test returned an error
constexpr int kStreamBadData = 13;     // wrong size or wrong bytes

struct StreamSpec {
  size_t msg = 4 * 1024 * 1024;
  int depth = 8;  // NCCL keeps up to 8 per connection
  int min_messages = 64;
  double min_seconds = 1.5;
  int stall_ms = 30000;
  // Receiver: wait this long after a message completes before checking its bytes (a late
  // write that is going to corrupt the buffer has time to land).
  int check_delay_ms = 0;
  // Message k carries pattern k (the sender refills its buffer per message) instead of
  // k % depth, so a stale write from an earlier message into a reused buffer shows.
  bool pattern_per_message = false;
  // Receiver: iflush each message and wait for the flush before checking its bytes, as NCCL
  // does for GPU buffers (with R2CCL_TEST_HOOKS=force_flush the verbs transport flushes host
  // buffers too; the fake's FAKEVERBS_FENCE=1 keeps writes invisible until then).
  bool flush = false;
};

int stream_send(Endpoint& ep, const StreamSpec& s);
int stream_recv(Endpoint& ep, const StreamSpec& s);

struct StreamRun {
  PairResult pair;
  std::string sender_log;  // the plugin's event lines (R2CCL_LOG_FILE) until the stream ended
  std::string receiver_log;
};

// run_pair with stream_send/stream_recv, each side's R2CCL_LOG_FILE captured, and
// finish_together (a peer's exit after the stream is not the fault's doing). `before`, when
// set, runs in each process after connect, just before its side of the stream (sender: true).
// `after`, when set, runs in each process once its side of the stream is over (before the
// connection closes) and may change the process's exit status: a non-zero return replaces
// a successful stream's.
StreamRun run_stream(PairOptions o, const StreamSpec& s,
                     const std::function<void(Endpoint&, bool sender)>& before = {},
                     const std::function<int(Endpoint&, bool sender)>& after = {});

// The plugin's event lines (either transport), parsed:
// capture group 1 of `pattern` (a std::regex) as a number, for every line that matches.
std::vector<double> log_numbers(const std::string& log, const std::string& pattern);
// "N chunks to replay" of every "switchover:" line.
std::vector<int> to_replay_counts(const std::string& log);
// "N chunks replayed" of every "Successfully recovered in" line.
std::vector<int> replayed_counts(const std::string& log);

}  // namespace r2ccl::test
