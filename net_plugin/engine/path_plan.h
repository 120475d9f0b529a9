// The path plan: which local rails a connection uses and which peer rail each one talks to.
// One rule for every transport: the primary (the NCCL device's rail), then backups nearest
// first, where "nearest" is the transport's distance (verbs: PCIe switch, root complex and
// NUMA node of the HCAs; TCP: another interface before an alias of the primary's), ties in
// device order after the primary. Each chosen local rail is then paired with a peer rail the
// transport scores as reachable (TCP: the same subnet; verbs: the same link layer, the same
// subnet under both ends' real prefixes preferred, transport/ib/pairing.h), an unused one
// first.
// Pure functions. Thread-safety: stateless.
#pragma once

#include <functional>
#include <utility>
#include <vector>

namespace r2ccl::net {

// Local rails for a connection on `primary` among rails 0..n-1: primary first, then every
// rail whose distance(r) >= 0, smaller distance first, ties by (r - primary) mod n. At most
// `want` entries (primary included). distance(primary) is not consulted.
std::vector<int> order_rails(int primary, int n, int want, const std::function<int(int)>& distance);

struct RailPair {
  int local;  // index into the caller's local list (order_rails' output)
  int peer;   // peer rail
};

// Pairs local[i] (in order) with a peer rail among 0..n_peer-1. score(i, p) > 0 allows the
// pair (higher is better), <= 0 forbids it. An unused peer rail with the highest score wins
// (ties: lowest p); with allow_reuse a peer rail already taken may serve again when no unused
// one scores. A local rail without a partner is left out (the caller may warn). Returns the
// pairs in local order.
std::vector<RailPair> pair_rails(int n_local, int n_peer, bool allow_reuse,
                                 const std::function<int(int, int)>& score);

}  // namespace r2ccl::net
