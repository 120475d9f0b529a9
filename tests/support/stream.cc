#include "stream.h"

#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <regex>
#include <sstream>
#include <vector>

namespace r2ccl::test {
namespace {

double mono_s() { return mono_us() / 1e6; }

int result_code(ncclResult_t r) { return r == ncclInProgress ? kStreamStalled : kStreamTestFailed; }

}  // namespace

// Sender: a stream of kMsg-byte messages, kDepth in flight, until kMinMessages were sent and
// kMinSeconds passed; then an 8-byte end marker holding the message count. The kDepth
// buffers are filled once (message k carries pattern k % kDepth), so the sender does nothing
// but drive the plugin and rail 0 always has chunks in flight. Every wait is bounded by
// stall_ms.
int stream_send(Endpoint& ep, const StreamSpec& s) {
  const size_t kMsg = s.msg;
  const int kDepth = s.depth;
  const int stall_ms = s.stall_ms;
  std::vector<std::unique_ptr<char[]>> bufs;
  for (int i = 0; i < kDepth; ++i) {
    bufs.emplace_back(new char[kMsg]);
    fill_pattern(bufs[i].get(), kMsg, static_cast<uint64_t>(i));
  }
  std::vector<void*> inflight;  // oldest first
  double t0 = mono_s();
  int64_t k = 0;
  bool ended = false;
  int64_t end_marker = 0;
  while (!ended || !inflight.empty()) {
    while (!ended && static_cast<int>(inflight.size()) < kDepth) {
      void* req = nullptr;
      ncclResult_t res;
      if (k >= s.min_messages && mono_s() - t0 >= s.min_seconds) {
        end_marker = k;
        res = ep.post_send(&end_marker, sizeof(end_marker), &req, stall_ms);
        ended = true;
      } else {
        // (message k - kDepth, the slot's previous user, has completed: it was the oldest)
        if (s.pattern_per_message)
          fill_pattern(bufs[k % kDepth].get(), kMsg, static_cast<uint64_t>(k));
        res = ep.post_send(bufs[k % kDepth].get(), kMsg, &req, stall_ms);
        ++k;
      }
      if (res != ncclSuccess) {
        fprintf(stderr, "sender: isend of message %lld: result %d\n", static_cast<long long>(k),
                res);
        return res == ncclInProgress ? kStreamStalled : kStreamPostFailed;
      }
      inflight.push_back(req);
    }
    int size = -1;
    ncclResult_t res = ep.wait(inflight.front(), stall_ms, &size);
    if (res != ncclSuccess) {
      fprintf(stderr, "sender: waiting for message %lld: result %d (%s)\n",
              static_cast<long long>(k - static_cast<int64_t>(inflight.size())), res,
              res == ncclInProgress ? "no completion in time" : "error");
      return result_code(res);
    }
    inflight.erase(inflight.begin());
  }
  fprintf(stderr, "sender: %lld messages of %zu bytes in %.2f s\n", static_cast<long long>(k), kMsg,
          mono_s() - t0);
  return kStreamOk;
}

// Receiver: kDepth receives posted ahead; message k must be kMsg bytes of pattern k % kDepth;
// the 8-byte end marker must carry the number of messages received.
int stream_recv(Endpoint& ep, const StreamSpec& s) {
  const size_t kMsg = s.msg;
  const int kDepth = s.depth;
  const int stall_ms = s.stall_ms;
  std::vector<std::unique_ptr<char[]>> bufs;
  for (int i = 0; i < kDepth; ++i) bufs.emplace_back(new char[kMsg]);
  std::vector<void*> reqs(kDepth, nullptr);
  int64_t posted = 0, k = 0;
  auto post = [&]() -> int {
    int slot = static_cast<int>(posted % kDepth);
    memset(bufs[slot].get(), 0, kMsg);
    ncclResult_t res = ep.post_recv(bufs[slot].get(), kMsg, &reqs[slot], stall_ms);
    if (res != ncclSuccess) {
      fprintf(stderr, "receiver: irecv %lld: result %d\n", static_cast<long long>(posted), res);
      return res == ncclInProgress ? kStreamStalled : kStreamPostFailed;
    }
    ++posted;
    return kStreamOk;
  };
  for (int i = 0; i < kDepth; ++i)
    if (int rc = post()) return rc;
  for (;; ++k) {
    int slot = static_cast<int>(k % kDepth);
    int size = -1;
    ncclResult_t res = ep.wait(reqs[slot], stall_ms, &size);
    if (res != ncclSuccess) {
      fprintf(stderr, "receiver: waiting for message %lld: result %d\n", static_cast<long long>(k),
              res);
      return result_code(res);
    }
    if (s.flush) {
      // Before any byte is read, the end marker's too (what an HCA wrote into a GPU-like
      // buffer is visible only after a flush through it: FAKEVERBS_FENCE).
      void* data = bufs[slot].get();
      void* mh = ep.mhandle_for(data, kMsg);
      void* freq = nullptr;
      res = ep.plugin.net->iflush(ep.comm, 1, &data, &size, &mh, &freq);
      if (res == ncclSuccess && freq) res = ep.wait(freq, stall_ms);
      if (res != ncclSuccess) {
        fprintf(stderr, "receiver: iflush of message %lld: result %d\n", static_cast<long long>(k),
                res);
        return result_code(res);
      }
    }
    if (size == static_cast<int>(sizeof(int64_t))) {  // end of stream
      int64_t count = 0;
      memcpy(&count, bufs[slot].get(), sizeof(count));
      if (count != k) {
        fprintf(stderr, "receiver: the sender sent %lld messages, %lld arrived\n",
                static_cast<long long>(count), static_cast<long long>(k));
        return kStreamBadData;
      }
      break;
    }
    if (size != static_cast<int>(kMsg)) {
      fprintf(stderr, "receiver: message %lld reported %d bytes, expected %zu\n",
              static_cast<long long>(k), size, kMsg);
      return kStreamBadData;
    }
    if (s.check_delay_ms > 0) usleep(static_cast<useconds_t>(s.check_delay_ms) * 1000);
    long long bad = check_pattern(bufs[slot].get(), kMsg,
                                  static_cast<uint64_t>(s.pattern_per_message ? k : k % kDepth));
    if (bad >= 0) {
      fprintf(stderr, "receiver: message %lld: first wrong byte at offset %lld\n",
              static_cast<long long>(k), bad);
      return kStreamBadData;
    }
    if (int rc = post()) return rc;
  }
  fprintf(stderr, "receiver: %lld messages intact\n", static_cast<long long>(k));
  if (k < s.min_messages) {
    fprintf(stderr, "receiver: only %lld messages before the end marker\n",
            static_cast<long long>(k));
    return kStreamBadData;
  }
  return kStreamOk;
}

StreamRun run_stream(PairOptions o, const StreamSpec& s,
                     const std::function<void(Endpoint&, bool sender)>& before,
                     const std::function<int(Endpoint&, bool sender)>& after) {
  std::string slog = temp_path("sender.log"), rlog = temp_path("receiver.log");
  o.sender_env["R2CCL_LOG_FILE"] = slog;
  o.receiver_env["R2CCL_LOG_FILE"] = rlog;
  o.finish_together = true;
  // Each side snapshots its log when its stream is over: what comes after (a peer's exit
  // looks like a rail failure) is not the fault's doing.
  auto snapshot = [](const std::string& log) {
    std::string text = read_file(log);
    if (FILE* f = fopen((log + ".end").c_str(), "w")) {
      fwrite(text.data(), 1, text.size(), f);
      fclose(f);
    }
  };
  StreamRun r;
  r.pair = run_pair(
      o,
      [&](Endpoint& ep) {
        if (before) before(ep, true);
        int rc = stream_send(ep, s);
        snapshot(slog);
        if (after) {
          const int a = after(ep, true);
          if (rc == 0) rc = a;
        }
        return rc;
      },
      [&](Endpoint& ep) {
        if (before) before(ep, false);
        int rc = stream_recv(ep, s);
        snapshot(rlog);
        if (after) {
          const int a = after(ep, false);
          if (rc == 0) rc = a;
        }
        return rc;
      });
  r.sender_log = read_file(slog + ".end");
  r.receiver_log = read_file(rlog + ".end");
  for (const auto& f : {slog, rlog, slog + ".end", rlog + ".end"}) unlink(f.c_str());
  return r;
}

std::vector<double> log_numbers(const std::string& log, const std::string& pattern) {
  std::vector<double> out;
  std::regex re(pattern);
  std::istringstream in(log);
  std::string line;
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_search(line, m, re)) out.push_back(std::stod(m[1]));
  return out;
}

std::vector<int> to_replay_counts(const std::string& log) {
  std::vector<int> out;
  for (double v : log_numbers(log, "switchover: rail [^ ]+ failed .*; ([0-9]+) chunks to replay"))
    out.push_back(static_cast<int>(v));
  return out;
}

std::vector<int> replayed_counts(const std::string& log) {
  std::vector<int> out;
  for (double v : log_numbers(log,
                              "Successfully recovered in [0-9.]+ s \\(rail [^ ]+: .*, detected "
                              "after [0-9]+ ms, ([0-9]+) chunks replayed\\)"))
    out.push_back(static_cast<int>(v));
  return out;
}

}  // namespace r2ccl::test
