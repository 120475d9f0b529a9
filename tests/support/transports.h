// The transports a shared test case runs over (tests/loopback/test_shared.cc), as a test sees
// them: the environment that makes a pair of processes use one, how to inject the faults the
// shared cases need, and what the event lines then name.
//   tcp: two rails on lo (lo@127.0.0.1, lo@127.0.0.2), faults from the in-process injector
//        (R2CCL_FAULT_INJECT: a reset, a black hole);
//   ib:  the verbs transport on the fake verbs provider (tests/fakeverbs), each process a host
//        with two RoCE HCAs (mlx5_0 on 10.210.1.0/24, mlx5_1 on 10.210.2.0/24), the side
//        channel on lo, faults from the fake (FAKEVERBS_FAULTS: port down, a silent QP).
// Where the two differ for a physical reason, the descriptor says so (receiver_acks).
#pragma once

#include <map>
#include <string>

#include "net_harness.h"

namespace r2ccl::test {

struct TransportUnderTest {
  std::string name;   // "tcp" or "ib"
  std::string rail0;  // rail of device 0 in event lines: "lo@127.0.0.1", "mlx5_0:1"
  // TCP: the receiver acknowledges chunks (ACK messages); verbs: the sender's RC completion
  // is the acknowledgement, and the receiver's landed state only matters after a failure.
  bool receiver_acks = true;
  // Both processes use this transport; `extra` is added to both.
  PairOptions pair(const std::map<std::string, std::string>& extra = {}) const;
  // The environment of a one-host r2ccl_perf run (every rank).
  std::map<std::string, std::string> perf_env() const;
  // Fault environments, added to a PairOptions from pair():
  //  - the sender's primary rail dies mid-stream (TCP: an abortive reset of rail 0 150 ms
  //    into the stream; verbs: the sender's mlx5_0 port goes down after 64 MiB);
  void primary_down(PairOptions* o) const;
  //  - the receiver's primary rail stops receiving mid-stream, so chunks in flight there are
  //    really lost (what proves replay matters);
  void far_primary_lost(PairOptions* o) const;
  //  - the primary rail silently drops everything while its link stays up (a black hole);
  void primary_blackhole(PairOptions* o) const;
  //  - every rail of both processes goes down for good.
  void all_down(PairOptions* o) const;
  // What the sender's log says about a primary_down (besides switchover lines): the
  // transport's own evidence, or "" when it has none.
  std::string down_evidence;
};

TransportUnderTest tcp_lo();
TransportUnderTest ib_fake();

// The fake verbs provider ($R2CCL_TEST_FAKEVERBS, set by ctest), "" when unknown.
std::string fake_verbs_lib();
// A fresh FAKEVERBS_DIR (the fake's shared state between the processes of one run), removed
// when the test binary exits.
std::string fresh_fake_dir();
// Two RoCE HCAs per fake host: the sender's and the receiver's.
extern const char* const kFakeSenderHcas;
extern const char* const kFakeReceiverHcas;

}  // namespace r2ccl::test
