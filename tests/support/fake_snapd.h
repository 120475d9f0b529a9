// A fake r2ccl_snapshotd for the snapshot client's tests: serves the client protocol
// (snapshot/include/r2ccl/snapshot/client_wire.h) on a Unix socket, one thread per connection.
//   HELLO    -> STATE (node 0, the configured epoch, member bit 0)
//   SHARD    kept in memory by (rank, buffer, step); when every rank 0..world-1 has every
//            buffer of a step, that step becomes the complete step (unless it is above
//            complete_limit) and every connection gets a STATE
//   QUERY    -> STATE (every STATE counts the QUERYs read on its connection); stale_state_on_query
//               sends an older step's STATE first and delays the answer
//   FETCH    -> FETCHED: the chain base..step of (rank, buffer) oldest first, or one frame with
//               kNotHeld; refuse_buffer and close_on_fetch inject failures
//   KV_PUT / KV_GET -> KV_VALUE (origin 0, or kKvAbsent)
// Threads: the public methods may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace r2ccl::test {

struct FakeSnapdOptions {
  uint64_t epoch = 1;
  uint64_t complete_limit = UINT64_MAX;  // steps above it never become complete
  int64_t shard_read_delay_us = 0;       // sleep before reading each SHARD payload (slow reader)
  int close_on_fetch = -1;     // at the N-th FETCH (0-based): send one chain frame, then close
  int refuse_buffer = -1;      // FETCH of this buffer id -> a refusal
  uint32_t refuse_status = 2;  // FetchStatus of the refusal (kCorrupt)
  // FETCH of this buffer id without avoid_node: its first shard goes out with one payload byte
  // flipped, "served by" node kCorruptNode; a FETCH that avoids that node gets it intact.
  int corrupt_buffer = -1;
  // >= 0: a QUERY is first followed by a STATE of this complete step that does not count it (a
  // push of an older step still on its way when the client sent the QUERY), and answered only
  // once the client sent its next frame or 500 ms passed (a slow daemon): a client that takes
  // any STATE after its QUERY for the answer has acted on the older step by then.
  int64_t stale_state_on_query = -1;
};
constexpr uint32_t kCorruptNode = 7;

class FakeSnapd {
 public:
  explicit FakeSnapd(std::string socket_path, FakeSnapdOptions opt = {});
  ~FakeSnapd();
  FakeSnapd(const FakeSnapd&) = delete;
  FakeSnapd& operator=(const FakeSnapd&) = delete;

  bool start(std::string* err);
  void stop();  // closes the listener and every connection, joins the threads

  void set_epoch(uint64_t epoch);  // pushes a STATE to every connection
  void set_options(const FakeSnapdOptions& opt);
  const std::string& path() const { return path_; }
  uint64_t shards_received() const { return shards_.load(); }
  // FETCHes that named an avoid_node (a client's retry after a failed checksum).
  uint64_t fetches_avoiding() const { return avoiding_.load(); }
  bool has_complete() const;
  uint64_t complete_step() const;
  // Steps held for (rank, buffer), and a stored shard's base step (-1: none).
  std::vector<uint64_t> steps_held(uint32_t rank, uint32_t buffer) const;
  int64_t base_step_of(uint32_t rank, uint32_t buffer, uint64_t step) const;

 private:
  struct Conn;
  struct Shard {
    std::vector<uint8_t> frame;  // ShardMeta + payload, as received
    uint64_t base_step = 0;
  };
  void accept_main();
  void conn_main(std::shared_ptr<Conn> c);
  // complete_override >= 0 replaces the complete step.
  bool send_state(Conn& c, int64_t complete_override = -1);
  void push_state_all();
  void check_complete(uint64_t step);  // under mu_

  const std::string path_;
  FakeSnapdOptions opt_;
  std::atomic<uint64_t> avoiding_{0};
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> shards_{0};
  std::thread acceptor_;

  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Conn>> conns_;
  std::vector<std::thread> threads_;
  uint32_t world_ = 0;
  bool has_complete_ = false;
  uint64_t complete_ = 0;
  int fetches_ = 0;
  std::map<std::tuple<uint32_t, uint32_t, uint64_t>, Shard> store_;  // (rank, buffer, step)
  struct RankStep {
    uint32_t n_buffers = 0;
    std::set<uint32_t> got;
  };
  std::map<uint64_t, std::map<uint32_t, RankStep>> steps_;  // step -> rank -> buffers received
  std::map<std::string, std::vector<uint8_t>> kv_;
};

}  // namespace r2ccl::test
