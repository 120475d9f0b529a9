// Moved from tests/lab/test_lab_rates.cc to the long label (scripts/test.sh --long) to keep the
// default test command within its time budget; the same helpers.
// Rail-lab tests of the goodput-weighted scheduler (docs/ARCHITECTURE.md, "Scheduling"): a
// failed primary's traffic spreads over every surviving rail (R2CCL_FAILOVER_SPREAD=1) or
// moves to one backup (0), and a striped connection follows a rail whose rate drops live.
// What each rail carried is read from the sender namespace's interface counters (tx_bytes),
// so the tests see what the kernel sent, not what the plugin believes. Margins are generous:
// the speed targets are benchmarks (scripts/bench_net.sh --only spread,ratedrop).
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "lab/lab_util.h"

using namespace r2ccl::test;

TEST_CASE("long: stripe over 2 rails follows a live rate drop on one of them", "[long]") {
  Lab lab(2, "1gbit");
  PairOptions o = lab_pair(lab, "ratedrop");
  o.env["R2CCL_STRIPE"] = "1";
  // About 2 s at 2 Gbit/s before the drop; the rest at 1.1 Gbit/s after it.
  Stream s{16u << 20, 80, 120000, temp_path("ratedrop-started")};
  std::vector<double> t1, t2;
  std::string fault_out;
  PairResult r;
  {
    Later fault(0, [&] {
      after_start(s.started, 1500);
      fault_out = lab.fault("rate 0 100mbit --side a");
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // the split follows
      t1 = lab.tx_bytes(2);
      std::this_thread::sleep_for(std::chrono::milliseconds(2000));
      t2 = lab.tx_bytes(2);
    });
    r = run_pair(
        o, [&](Endpoint& ep) { return send_stream(ep, s); },
        [&](Endpoint& ep) { return recv_stream(ep, s); });
  }
  lab.fault("rate 0 restore");
  INFO("sender log:\n" << read_file(o.sender_env["R2CCL_LOG_FILE"]) << "\nfault: " << fault_out);
  REQUIRE(r.sender_status == 0);
  REQUIRE(r.receiver_status == 0);
  REQUIRE(t1.size() == 2);
  REQUIRE(t2.size() == 2);
  const double rate = ((t2[0] - t1[0]) + (t2[1] - t1[1])) * 8 / 2.0 / 1e9;  // Gbit/s
  INFO("both rails from 1 s to 3 s after the drop: " << rate << " Gbit/s (rails now 0.1 + 1)");
  // Following the drop: about 1.1 Gbit/s. Not following: the chunks queued on the slow rail
  // hold every message back (about 0.2 Gbit/s). Generous: >= 0.6.
  CHECK(rate >= 0.6);
}
