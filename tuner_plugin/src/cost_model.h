// The alpha-beta cost model (enabled by `model on` in the rules file). Pure functions.
//
//   time(us) = proto_base[p] + steps(algo, coll, n) * hop_lat * proto_hop[p]
//              + volume(algo, coll, n) * nBytes / (1000 * bw * proto_eff[p])
//
// with n = nRanks, N = nNodes, g = ceil(n / N) ranks per node, and
//   bw      = min(net_bw_eff, intra_bw) when N > 1, else intra_bw   (GB/s)
//   hop_lat = the average hop of the ring: (N * net_lat + (n - N) * intra_lat) / n, intra_lat
//             when N == 1
//   ring:  AllReduce 2(n-1) steps, volume 2(n-1)/n; AllGather/ReduceScatter (n-1), (n-1)/n;
//          Broadcast/Reduce (n-1) steps, volume 1 (pipelined)
//   tree:  AllReduce only: 2(ceil(log2 N) * net_lat + (g-1) * intra_lat) / hop_lat steps,
//          volume 2 (reduce up, broadcast down)
//   pat:   AllGather/ReduceScatter with one rank per node: ceil(log2 n) steps, (n-1)/n
//   proto: LL base 2 us, hop x1, efficiency 0.5; LL128 3 us, x1.2, 0.92; SIMPLE 6 us, x2, 1.0
// Other algorithms (CollNet, NVLS) have no prediction: NCCL's entries stay.
// net_bw_eff = net_bw, or the agreed minimum usable bandwidth of a member node when that is
// below the degraded threshold (tuner_core.cc, effective_net_bw).
#pragma once

#include <cstdint>

#include "rules.h"

namespace r2ccl::tuner {

// Predicted time in microseconds, or a negative value when the model has none for this
// (collective, algorithm, protocol). n_ranks, n_nodes >= 1.
double predict_us(const ModelParams& m, double net_bw_eff, int coll, uint64_t bytes,
                  uint64_t n_ranks, uint64_t n_nodes, int algo, int proto);

}  // namespace r2ccl::tuner
