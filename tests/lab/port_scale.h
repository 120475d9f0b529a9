// Many communicators from one process over a narrowed ephemeral port range (lab and long
// suites; header-only). One hub process opens `conns` send comms spread evenly over `peers`
// peer processes, TCP on two rails on lo (lo@127.0.0.1, lo@127.0.0.2), every process in a
// network namespace of the test's own whose net.ipv4.ip_local_port_range holds only
// `range_ports` ports (the sysctl is per namespace: the host's range is untouched). Each
// connection then carries two messages hub -> peer, every byte and size checked, and
// everything closes with no socket descriptor left behind (HubOptions::check_sockets_released).
//
// What it proves: outgoing rail sockets bind their rail address with IP_BIND_ADDRESS_NO_PORT
// (net_plugin/sock/socket_util.cc), so the kernel picks each source port at connect, per
// 4-tuple (source address and port, destination address and port). The hub's sockets go to
// 4 peers x 2 rails = 8 listening addresses, so each (rail, destination) pair has a range of
// its own. With a port taken at bind instead (port 0 without the option), every socket of
// one source address needs a port of its own whatever the destination: 2 rail addresses x
// range_ports ports, fewer than the sockets the connections need (2 per connection, below),
// so connects fail partway (EADDRINUSE at bind).
#pragma once

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "net_harness.h"

namespace r2ccl::test {

// Sockets one connection holds on each side with the defaults (params.h): a path per rail
// pair, at most 1 + R2CCL_BACKUP_PATHS (2) of them, x R2CCL_NSOCKS_PER_PATH (2) streams: with
// two rails, 2 paths, so 4 sockets (measured: the hub prints its count; the control
// connection is one of the paths' streams). Descriptors are sized for 6, the most the
// defaults allow.
constexpr int kSocketsPerConnection = 6;

inline void port_scale_scenario(int conns, int peers, int range_ports) {
  REQUIRE(conns % peers == 0);
  // RLIMIT_NOFILE of every process: the hub's descriptors are conns x kSocketsPerConnection
  // sockets (at most 6,000 for 1,000 connections; 4,000 expected), plus the plugin's
  // listeners, netlink socket, pipes and files: a margin of 1,024. A peer needs a quarter of
  // the sockets. Where the hard limit is lower and cannot be raised (no CAP_SYS_RESOURCE), the
  // test cannot run: skipped with a WARN.
  const long nofile = static_cast<long>(conns) * kSocketsPerConnection + 1024;
  ChildResult probe = run_child({}, [&] {
    std::string err;
    if (raise_nofile(nofile, &err)) return 0;
    fprintf(stderr, "%s\n", err.c_str());
    return 1;
  });
  if (probe.status != 0) {
    WARN("SKIPPED: the processes need " << nofile << " descriptors: " << probe.output);
    return;
  }

  TempNetns ns("ports");
  INFO(ns.error());
  REQUIRE(ns.ok());
  const int lo = 40000, hi = lo + range_ports - 1;
  const std::string range = std::to_string(lo) + "\t" + std::to_string(hi);
  std::string out;
  REQUIRE(ns.exec("echo '" + std::to_string(lo) + " " + std::to_string(hi) +
                      "' > /proc/sys/net/ipv4/ip_local_port_range && "
                      "cat /proc/sys/net/ipv4/ip_local_port_range",
                  &out) == 0);
  REQUIRE(out == range + "\n");

  HubOptions o;
  o.env = {{"R2CCL_TRANSPORT", "tcp"},
           {"R2CCL_SOCKET_IFNAME", "lo@127.0.0.1,lo@127.0.0.2"},
           {"R2CCL_HEALTH_BOARD", "none"},
           // Failure detection is not the subject: five processes polling on a loaded 2-core
           // host must not see a late acknowledgement or probe as a dead rail.
           {"R2CCL_ACK_TIMEOUT", "5s"},
           {"R2CCL_HEARTBEAT_INTERVAL", "1s"},
           {"R2CCL_TCP_USER_TIMEOUT", "10s"}};
  o.peers = peers;
  o.conns_per_peer = conns / peers;
  o.devs = {0, 1};  // primaries on both rails
  o.netns = ns.name();
  o.nofile = nofile;
  // 32 connects at a time: ~100 sockets arriving at a peer's listeners at once, under their
  // backlog of 256 (an overflow costs a SYN retransmission, 1 s or more, not a failure).
  o.connect_window = 32;
  o.connect_timeout_ms = 600000;
  o.timeout_s = 1200;
  o.check_sockets_released = true;

  constexpr int kOpTimeoutMs = 300000;
  const std::vector<size_t> sizes = {4096, 16384 + 3};
  auto seed = [](int conn, size_t round) { return static_cast<uint64_t>(conn) * 8 + round + 1; };
  const int per_peer = o.conns_per_peer;

  HubResult r = run_hub(
      o,
      [&](Endpoint& hub) {
        const int n = static_cast<int>(hub.conns.size());
        fprintf(stderr, "hub: %d connections hold %d TCP sockets\n", n, count_tcp_connections());
        std::vector<std::unique_ptr<char[]>> bufs;
        for (int i = 0; i < n; ++i) bufs.emplace_back(new char[sizes.back()]);
        for (size_t round = 0; round < sizes.size(); ++round) {
          std::vector<void*> reqs(static_cast<size_t>(n), nullptr);
          for (int i = 0; i < n; ++i) {
            // Connection k of peer p is hub.conns[p * per_peer + k]: its seed is p * per_peer
            // + k on both sides.
            fill_pattern(bufs[i].get(), sizes[round], seed(i, round));
            ncclResult_t res =
                hub.conns[i].post_send(bufs[i].get(), sizes[round], &reqs[i], kOpTimeoutMs);
            if (res != ncclSuccess) {
              fprintf(stderr, "hub: isend on connection %d (round %zu): result %d\n", i, round,
                      res);
              return 10;
            }
          }
          // Every request on its own connection: wait for each through its endpoint.
          for (int i = 0; i < n; ++i) {
            ncclResult_t res = hub.conns[i].wait(reqs[i], kOpTimeoutMs);
            if (res != ncclSuccess) {
              fprintf(stderr, "hub: send on connection %d (round %zu): result %d\n", i, round, res);
              return 11;
            }
          }
        }
        return 0;
      },
      [&](Endpoint& ep, int p) {
        const int n = static_cast<int>(ep.conns.size());
        std::vector<std::unique_ptr<char[]>> bufs;
        for (int k = 0; k < n; ++k) bufs.emplace_back(new char[sizes.back()]);
        for (size_t round = 0; round < sizes.size(); ++round) {
          std::vector<void*> reqs(static_cast<size_t>(n), nullptr);
          for (int k = 0; k < n; ++k) {
            memset(bufs[k].get(), 0, sizes.back());
            ncclResult_t res =
                ep.conns[k].post_recv(bufs[k].get(), sizes.back(), &reqs[k], kOpTimeoutMs);
            if (res != ncclSuccess) {
              fprintf(stderr, "peer %d: irecv on connection %d (round %zu): result %d\n", p, k,
                      round, res);
              return 20;
            }
          }
          for (int k = 0; k < n; ++k) {
            int got = -1;
            ncclResult_t res = ep.conns[k].wait(reqs[k], kOpTimeoutMs, &got);
            if (res != ncclSuccess) {
              fprintf(stderr, "peer %d: receive on connection %d (round %zu): result %d\n", p, k,
                      round, res);
              return 21;
            }
            const int conn = p * per_peer + k;
            if (got != static_cast<int>(sizes[round])) {
              fprintf(stderr, "peer %d: connection %d (round %zu): %d bytes, sent %zu\n", p, k,
                      round, got, sizes[round]);
              return 22;
            }
            const long long bad = check_pattern(bufs[k].get(), sizes[round], seed(conn, round));
            if (bad >= 0) {
              fprintf(stderr, "peer %d: connection %d (round %zu): first wrong byte at %lld\n", p,
                      k, round, bad);
              return 23;
            }
          }
        }
        return 0;
      });
  INFO(conns << " connections to " << peers << " peers over " << range_ports
             << " ephemeral ports took " << r.seconds << " s");
  CHECK(r.hub_status == 0);
  for (int p = 0; p < peers; ++p) {
    INFO("peer " << p);
    CHECK(r.peer_status[p] == 0);
  }
}

}  // namespace r2ccl::test
