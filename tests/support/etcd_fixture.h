// The tests' etcd: snap::LocalEtcd (snapshot/tools/local_etcd.h, shared with
// r2ccl_snapshot_bench) with its binary from R2CCL_TEST_ETCD (default /usr/bin/etcd) and its
// files in the tests' temporary directory ($TMPDIR or /tmp).
// Thread-safety: none; one test thread owns a cluster.
#pragma once

#include <string>

#include "local_etcd.h"
#include "net_harness.h"

namespace r2ccl::test {

class EtcdCluster : public snap::LocalEtcd {
 public:
  explicit EtcdCluster(const std::string& tag, int members = 1,
                       Transport transport = Transport::kHttp)
      : LocalEtcd(tag, members, transport, binary()) {}
  static std::string binary() { return env_or("R2CCL_TEST_ETCD", "/usr/bin/etcd"); }
};

}  // namespace r2ccl::test
