#include "cost_model.h"

#include <algorithm>
#include <cmath>

namespace r2ccl::tuner {
namespace {

constexpr double kProtoBaseUs[kMaxProtos] = {2.0, 3.0, 6.0};
constexpr double kProtoHop[kMaxProtos] = {1.0, 1.2, 2.0};
constexpr double kProtoEff[kMaxProtos] = {0.5, 0.92, 1.0};

constexpr int kBroadcast = 0, kReduce = 1, kAllGather = 2, kReduceScatter = 3, kAllReduce = 4;
constexpr int kTree = 0, kRing = 1, kPat = 6;

double ceil_log2(double x) { return x <= 1 ? 0 : std::ceil(std::log2(x)); }

}  // namespace

double predict_us(const ModelParams& m, double net_bw_eff, int coll, uint64_t bytes,
                  uint64_t n_ranks, uint64_t n_nodes, int algo, int proto) {
  if (proto < 0 || proto >= kMaxProtos || coll < 0 || coll >= kNumColls) return -1;
  const double n = static_cast<double>(std::max<uint64_t>(1, n_ranks));
  const double nn = std::min(n, static_cast<double>(std::max<uint64_t>(1, n_nodes)));
  const double g = std::ceil(n / nn);
  const double bw = nn > 1 ? std::min(std::max(net_bw_eff, 1e-3), m.intra_bw) : m.intra_bw;
  const double hop = nn > 1 ? (nn * m.net_lat + (n - nn) * m.intra_lat) / n : m.intra_lat;
  double steps = 0, volume = 0;
  switch (algo) {
    case kRing:
      if (coll == kAllReduce) {
        steps = 2 * (n - 1);
        volume = 2 * (n - 1) / n;
      } else if (coll == kAllGather || coll == kReduceScatter) {
        steps = n - 1;
        volume = (n - 1) / n;
      } else if (coll == kBroadcast || coll == kReduce) {
        steps = n - 1;
        volume = 1;
      }
      break;
    case kTree:
      if (coll != kAllReduce) return -1;
      steps = hop > 0 ? 2 * (ceil_log2(nn) * (nn > 1 ? m.net_lat : 0) + (g - 1) * m.intra_lat) / hop
                      : 0;
      volume = n > 1 ? 2 : 0;
      break;
    case kPat:
      if ((coll != kAllGather && coll != kReduceScatter) || g > 1) return -1;
      steps = ceil_log2(n);
      volume = (n - 1) / n;
      break;
    default: return -1;
  }
  const double t = kProtoBaseUs[proto] + steps * hop * kProtoHop[proto] +
                   volume * static_cast<double>(bytes) / (1000.0 * bw * kProtoEff[proto]);
  return std::isfinite(t) ? t : -1;
}

}  // namespace r2ccl::tuner
