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

#include "lab_util.h"

using namespace r2ccl::test;

TEST_CASE("lab: stripe off, a downed primary's traffic spreads over every surviving rail",
          "[lab]") {
  Lab lab(4, "500mbit");
  for (bool spread : {true, false}) {
    DYNAMIC_SECTION((spread ? "R2CCL_FAILOVER_SPREAD=1" : "R2CCL_FAILOVER_SPREAD=0")) {
      PairOptions o = lab_pair(lab, spread ? "spread" : "onebackup");
      o.env["R2CCL_BACKUP_PATHS"] = "3";
      o.env["R2CCL_FAILOVER_SPREAD"] = spread ? "1" : "0";
      // About 5 s at 500 Mbit/s before the fault, the rest after it on the survivors.
      Stream s{16u << 20, 48, 120000, temp_path(spread ? "spread-started" : "onebackup-started")};
      std::vector<double> at_fault, later;
      std::string fault_out;
      PairResult r;
      {
        Later fault(0, [&] {
          after_start(s.started, 1000);
          fault_out = lab.fault("link-down 0");
          std::this_thread::sleep_for(std::chrono::milliseconds(500));  // detection, replay
          at_fault = lab.tx_bytes(4);
          std::this_thread::sleep_for(std::chrono::milliseconds(2000));
          later = lab.tx_bytes(4);
        });
        r = run_pair(
            o, [&](Endpoint& ep) { return send_stream(ep, s); },
            [&](Endpoint& ep) { return recv_stream(ep, s); });
      }
      lab.fault("link-up 0");
      INFO("sender log:\n"
           << read_file(o.sender_env["R2CCL_LOG_FILE"]) << "\nsender stderr:\n"
           << read_file(o.sender_stderr) << "\nfault: " << fault_out);
      REQUIRE(r.sender_status == 0);
      REQUIRE(r.receiver_status == 0);
      REQUIRE(at_fault.size() == 4);
      REQUIRE(later.size() == 4);
      double d[4], sum = 0;
      for (int i = 0; i < 4; ++i) sum += d[i] = later[i] - at_fault[i];
      INFO("bytes sent per rail over 2 s after the fault: " << d[0] << " " << d[1] << " " << d[2]
                                                            << " " << d[3]);
      REQUIRE(sum > 0);
      CHECK(d[0] / sum < 0.01);  // the downed rail carries nothing
      if (spread) {
        // Three equal idle survivors: about a third each (generous: >= 15 %), and together
        // well beyond one rail (500 Mbit/s = 125 MB in 2 s; generous: >= 1.5 rails' worth).
        for (int i = 1; i < 4; ++i) CHECK(d[i] / sum >= 0.15);
        CHECK(sum >= 1.5 * 125e6);
      } else {
        CHECK(d[1] / sum >= 0.95);  // the first backup alone
        CHECK(sum <= 1.2 * 125e6);
      }
    }
  }
}
