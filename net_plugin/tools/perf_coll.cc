#include "perf_coll.h"

#include <sched.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace r2perf {

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduce: return "allreduce";
    case Op::kAllGather: return "allgather";
    case Op::kBroadcast: return "broadcast";
    case Op::kSendRecv: return "sendrecv";
    case Op::kSend: return "send";
  }
  return "?";
}

const char* redop_name(Op op) { return op == Op::kAllReduce ? "sum" : "none"; }
int op_root(Op op) { return op == Op::kBroadcast ? 0 : -1; }

double busbw_factor(Op op, int n) {
  switch (op) {
    case Op::kAllReduce: return 2.0 * (n - 1) / n;
    case Op::kAllGather: return static_cast<double>(n - 1) / n;
    default: return 1.0;
  }
}

Geometry geometry(Op op, size_t requested, int nranks) {
  Geometry g;
  size_t elems = requested / sizeof(float);
  if (op == Op::kAllGather) {
    g.send_count = elems / static_cast<size_t>(nranks);
    g.recv_count = g.send_count * static_cast<size_t>(nranks);
    g.count = g.recv_count;
  } else {
    g.send_count = g.recv_count = g.count = elems;
  }
  g.bytes = g.count * sizeof(float);
  return g;
}

namespace {

// Input data for --check: a(i) in [0, 64), b(r) a multiple of 64 in [64, 65344]. Sums of up
// to 256 ranks stay below 2^24, so float arithmetic is exact in any order.
inline float val_a(uint64_t i, uint32_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<float>(x & 63);
}
inline float val_b(int r, uint32_t seed) {
  return static_cast<float>(((static_cast<uint64_t>(r) * 3 + seed) % 1021 + 1) * 64);
}

inline bool same_bits(float x, float y) {
  uint32_t a, b;
  memcpy(&a, &x, 4);
  memcpy(&b, &y, 4);
  return a == b;
}

}  // namespace

Engine::Engine(Net* net, const EngineConfig& cfg, std::vector<Channel>* channels, float* sendbuf,
               float* recvbuf)
    : net_(net), cfg_(cfg), chans_(channels), sendbuf_(sendbuf), recvbuf_(recvbuf) {}

size_t Engine::slices(size_t elems) const {
  size_t per = cfg_.slice_bytes / sizeof(float);
  if (per == 0) per = 1;
  return elems == 0 ? 1 : (elems + per - 1) / per;
}

int Engine::add_sends(ChanPlan* p, float* base, size_t elems, void* mh, int dep_first) {
  int first = static_cast<int>(p->sends.size());
  size_t n = slices(elems);
  for (size_t j = 0; j < n; j++) {
    size_t lo = elems * j / n, hi = elems * (j + 1) / n;
    p->sends.push_back({reinterpret_cast<char*>(base + lo), (hi - lo) * sizeof(float), mh,
                        dep_first < 0 ? -1 : dep_first + static_cast<int>(j)});
  }
  return first;
}

int Engine::add_recvs(ChanPlan* p, float* base, size_t elems, void* mh, int dep_first) {
  int first = static_cast<int>(p->recvs.size());
  size_t n = slices(elems);
  for (size_t j = 0; j < n; j++) {
    size_t lo = elems * j / n, hi = elems * (j + 1) / n;
    p->recvs.push_back({reinterpret_cast<char*>(base + lo), (hi - lo) * sizeof(float), mh,
                        dep_first < 0 ? -1 : dep_first + static_cast<int>(j), nullptr, nullptr});
  }
  return first;
}

int Engine::add_reduce_recvs(ChanPlan* p, float* dst, const float* src, size_t elems, void* mh) {
  int first = static_cast<int>(p->recvs.size());
  size_t n = slices(elems);
  for (size_t j = 0; j < n; j++) {
    size_t lo = elems * j / n, hi = elems * (j + 1) / n;
    p->recvs.push_back({nullptr, (hi - lo) * sizeof(float), mh, -1, dst + lo, src + lo});
  }
  return first;
}

size_t Engine::messages() const {
  size_t m = 0;
  for (const ChanPlan& p : plans_) m += p.sends.size() + p.recvs.size();
  return m;
}

void Engine::plan(Op op, const Geometry& g) {
  op_ = op;
  g_ = g;
  const int N = cfg_.nranks, r = cfg_.rank;
  const size_t C = chans_->size();
  auto mod = [N](long x) { return static_cast<int>(((x % N) + N) % N); };
  plans_.assign(C, ChanPlan());
  for (size_t c = 0; c < C; c++) {
    ChanPlan* p = &plans_[c];
    Channel& ch = (*chans_)[c];
    switch (op) {
      case Op::kAllReduce: {
        if (N == 1) break;
        size_t lo = g.count * c / C, len = g.count * (c + 1) / C - lo;
        auto chunk = [&](int k, size_t* off, size_t* n) {
          *off = lo + len * static_cast<size_t>(k) / N;
          *n = lo + len * static_cast<size_t>(k + 1) / N - *off;
        };
        std::vector<int> rs_send(N - 1), rs_recv(N - 1), ag_recv(N - 1);
        size_t off, n;
        for (int s = 0; s < N - 1; s++) {  // reduce-scatter
          chunk(mod(r - s), &off, &n);
          rs_send[s] = s == 0 ? add_sends(p, sendbuf_ + off, n, ch.mh_send_sendbuf, -1)
                              : add_sends(p, recvbuf_ + off, n, ch.mh_send_recvbuf, rs_recv[s - 1]);
          chunk(mod(r - s - 1), &off, &n);
          rs_recv[s] = add_reduce_recvs(p, recvbuf_ + off, sendbuf_ + off, n, ch.mh_recv_scratch);
        }
        for (int s = 0; s < N - 1; s++) {  // all-gather
          chunk(mod(r + 1 - s), &off, &n);
          add_sends(p, recvbuf_ + off, n, ch.mh_send_recvbuf,
                    s == 0 ? rs_recv[N - 2] : ag_recv[s - 1]);
          // Chunk r-s was read by the reduce-scatter send of step s (from recvbuf when s > 0).
          chunk(mod(r - s), &off, &n);
          ag_recv[s] =
              add_recvs(p, recvbuf_ + off, n, ch.mh_recv_recvbuf, s == 0 ? -1 : rs_send[s]);
        }
        break;
      }
      case Op::kAllGather: {
        size_t cnt = g.send_count;
        size_t a = cnt * c / C, n = cnt * (c + 1) / C - a;
        int prev_recv = -1;
        for (int s = 0; s < N - 1; s++) {
          if (s == 0)
            add_sends(p, sendbuf_ + a, n, ch.mh_send_sendbuf, -1);
          else
            add_sends(p, recvbuf_ + static_cast<size_t>(mod(r - s)) * cnt + a, n,
                      ch.mh_send_recvbuf, prev_recv);
          prev_recv = add_recvs(p, recvbuf_ + static_cast<size_t>(mod(r - s - 1)) * cnt + a, n,
                                ch.mh_recv_recvbuf, -1);
        }
        break;
      }
      case Op::kBroadcast: {
        if (N == 1) break;
        size_t lo = g.count * c / C, n = g.count * (c + 1) / C - lo;
        int pos = mod(r - op_root(op));
        if (pos == 0) {
          add_sends(p, sendbuf_ + lo, n, ch.mh_send_sendbuf, -1);
        } else {
          int first = add_recvs(p, recvbuf_ + lo, n, ch.mh_recv_recvbuf, -1);
          if (pos != N - 1) add_sends(p, recvbuf_ + lo, n, ch.mh_send_recvbuf, first);
        }
        break;
      }
      case Op::kSendRecv: {
        size_t lo = g.count * c / C, n = g.count * (c + 1) / C - lo;
        add_sends(p, sendbuf_ + lo, n, ch.mh_send_sendbuf, -1);
        add_recvs(p, recvbuf_ + lo, n, ch.mh_recv_recvbuf, -1);
        break;
      }
      case Op::kSend: {
        size_t lo = g.count * c / C, n = g.count * (c + 1) / C - lo;
        if (r == 0 && N > 1) add_sends(p, sendbuf_ + lo, n, ch.mh_send_sendbuf, -1);
        if (r == 1) add_recvs(p, recvbuf_ + lo, n, ch.mh_recv_recvbuf, -1);
        break;
      }
    }
  }
}

void Engine::fail(const char* call, int ch, ncclResult_t r) const {
  char buf[256];
  snprintf(buf, sizeof(buf), "%s(channel %d) failed: %s (%d)", call, ch, nccl_result_name(r),
           static_cast<int>(r));
  throw PerfError(buf);
}

void Engine::run() {
  const int N = cfg_.nranks, r = cfg_.rank;
  const int prev = (r - 1 + N) % N;
  const int K = cfg_.inflight;
  // The parts that need no network (NCCL's kernels do these copies).
  if (op_ == Op::kAllReduce && N == 1) memcpy(recvbuf_, sendbuf_, g_.count * sizeof(float));
  if (op_ == Op::kAllGather)
    memcpy(recvbuf_ + static_cast<size_t>(r) * g_.send_count, sendbuf_,
           g_.send_count * sizeof(float));
  if (op_ == Op::kBroadcast && r == op_root(op_))
    memcpy(recvbuf_, sendbuf_, g_.count * sizeof(float));

  struct SPend {
    int idx;
    void* req;
  };
  struct RPend {
    int idx;
    void* req;
    void* flush_req;
    int slot;
    char* buf;
    bool data_done;
  };
  struct State {
    size_t sn = 0, rn = 0, s_finished = 0, r_finished = 0;
    std::vector<uint8_t> s_done, r_done;
    std::vector<SPend> sp;
    std::vector<RPend> rp;
    std::vector<int> slots;
  };
  const size_t C = chans_->size();
  std::vector<State> st(C);
  for (size_t c = 0; c < C; c++) {
    st[c].s_done.assign(plans_[c].sends.size(), 0);
    st[c].r_done.assign(plans_[c].recvs.size(), 0);
    for (int k = K - 1; k >= 0; k--) st[c].slots.push_back(k);
  }

  for (;;) {
    bool all_done = true, progress = false;
    for (size_t c = 0; c < C; c++) {
      const ChanPlan& p = plans_[c];
      State& s = st[c];
      Channel& ch = (*chans_)[c];
      const int ci = static_cast<int>(c);
      if (s.s_finished == p.sends.size() && s.r_finished == p.recvs.size()) continue;
      all_done = false;
      ncclResult_t res;

      while (s.sn < p.sends.size() && static_cast<int>(s.sp.size()) < K) {
        const SendMsg& m = p.sends[s.sn];
        if (m.dep >= 0 && !s.r_done[m.dep]) break;
        void* req = nullptr;
        res = net_->isend(ch.send_comm, m.ptr, m.bytes, r, m.mh, &req);
        if (res != ncclSuccess) fail("isend", ci, res);
        if (!req) break;  // plugin busy: call again later
        s.sp.push_back({static_cast<int>(s.sn++), req});
        progress = true;
      }

      while (s.rn < p.recvs.size() && static_cast<int>(s.rp.size()) < K) {
        const RecvMsg& m = p.recvs[s.rn];
        if (m.dep >= 0 && !s.s_done[m.dep]) break;
        int slot = -1;
        char* buf = m.ptr;
        if (!buf) {
          slot = s.slots.back();
          buf = ch.scratch + static_cast<size_t>(slot) * cfg_.slot_bytes;
        }
        void* req = nullptr;
        res = net_->irecv(ch.recv_comm, buf, m.bytes, prev, m.mh, &req);
        if (res != ncclSuccess) fail("irecv", ci, res);
        if (!req) break;
        if (slot >= 0) s.slots.pop_back();
        s.rp.push_back({static_cast<int>(s.rn++), req, nullptr, slot, buf, false});
        progress = true;
      }

      for (size_t i = 0; i < s.sp.size();) {
        int done = 0, size = 0;
        res = net_->test(s.sp[i].req, &done, &size);
        if (res != ncclSuccess) fail("test(isend)", ci, res);
        if (!done) {
          i++;
          continue;
        }
        s.s_done[s.sp[i].idx] = 1;
        s.s_finished++;
        s.sp.erase(s.sp.begin() + static_cast<long>(i));
        progress = true;
      }

      for (size_t i = 0; i < s.rp.size();) {
        RPend& q = s.rp[i];
        const RecvMsg& m = p.recvs[q.idx];
        if (!q.data_done) {
          int done = 0, size = -1;
          res = net_->test(q.req, &done, &size);
          if (res != ncclSuccess) fail("test(irecv)", ci, res);
          if (!done) {
            i++;
            continue;
          }
          if (size < 0 || static_cast<size_t>(size) != m.bytes) {
            char buf[200];
            snprintf(buf, sizeof(buf),
                     "test(irecv)(channel %d) completed with %d bytes, the peer sent %zu", ci, size,
                     m.bytes);
            throw PerfError(buf);
          }
          q.data_done = true;
          progress = true;
          if (cfg_.flush && m.bytes > 0) {
            res = net_->iflush(ch.recv_comm, q.buf, static_cast<int>(m.bytes), m.mh, &q.flush_req);
            if (res != ncclSuccess) fail("iflush", ci, res);
          }
        }
        if (q.flush_req) {
          int done = 0;
          res = net_->test(q.flush_req, &done, nullptr);
          if (res != ncclSuccess) fail("test(iflush)", ci, res);
          if (!done) {
            i++;
            continue;
          }
          q.flush_req = nullptr;
        }
        if (m.red_dst) {
          const float* in = reinterpret_cast<const float*>(q.buf);
          size_t n = m.bytes / sizeof(float);
          for (size_t k = 0; k < n; k++) m.red_dst[k] = m.red_src[k] + in[k];
          s.slots.push_back(q.slot);
        }
        s.r_done[q.idx] = 1;
        s.r_finished++;
        s.rp.erase(s.rp.begin() + static_cast<long>(i));
        progress = true;
      }
    }
    if (all_done) return;
    if (!progress) sched_yield();
  }
}

void Engine::fill(uint32_t seed) {
  const int r = cfg_.rank;
  const uint64_t base = op_ == Op::kAllGather ? static_cast<uint64_t>(r) * g_.send_count : 0;
  const float b = val_b(r, seed);
  for (size_t i = 0; i < g_.send_count; i++) sendbuf_[i] = val_a(base + i, seed) + b;
  memset(recvbuf_, 0xff, g_.recv_count * sizeof(float));  // NaN: a missed write shows
}

uint64_t Engine::verify(uint32_t seed) const {
  const int N = cfg_.nranks;
  uint64_t wrong = 0;
  switch (op_) {
    case Op::kAllReduce: {
      float bsum = 0;
      for (int k = 0; k < N; k++) bsum += val_b(k, seed);
      const float fn = static_cast<float>(N);
      for (size_t i = 0; i < g_.count; i++)
        wrong += !same_bits(recvbuf_[i], fn * val_a(i, seed) + bsum);
      break;
    }
    case Op::kAllGather:
      for (size_t i = 0; i < g_.recv_count; i++) {
        int owner = static_cast<int>(i / g_.send_count);
        wrong += !same_bits(recvbuf_[i], val_a(i, seed) + val_b(owner, seed));
      }
      break;
    case Op::kBroadcast: {
      const float b = val_b(op_root(op_), seed);
      for (size_t i = 0; i < g_.count; i++) wrong += !same_bits(recvbuf_[i], val_a(i, seed) + b);
      break;
    }
    case Op::kSendRecv: {
      const float b = val_b((cfg_.rank - 1 + N) % N, seed);
      for (size_t i = 0; i < g_.count; i++) wrong += !same_bits(recvbuf_[i], val_a(i, seed) + b);
      break;
    }
    case Op::kSend: {
      if (cfg_.rank != 1) break;  // only rank 1 receives
      const float b = val_b(0, seed);
      for (size_t i = 0; i < g_.count; i++) wrong += !same_bits(recvbuf_[i], val_a(i, seed) + b);
      break;
    }
  }
  return wrong;
}

}  // namespace r2perf
