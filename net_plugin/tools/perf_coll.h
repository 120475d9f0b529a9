// r2ccl_perf collectives: ring AllReduce (reduce-scatter + all-gather, float32 sum), ring
// AllGather, ring-pipelined Broadcast from rank 0 and SendRecv, on host memory, using nothing
// but the net plugin API.
//
// Like NCCL's proxy, each ring step's data is cut into slices and up to `inflight` isend and
// irecv requests are outstanding per connection; one thread polls every request of every
// channel with test() until done, never blocking. A slice that depends on the previous step
// (forwarding or reducing what was just received) is posted once that receive is processed.
// Every step has at least one slice, so zero-byte messages are exchanged for empty chunks.
//
// Out of place: the input is `sendbuf`, the result lands in `recvbuf`, and every iteration
// computes the same result from the same input (repeatable timing loops). A receive never
// overwrites a region that an unfinished isend still reads.
//
// Data for --check: element i of rank r's input is a(i) + b(r), small integers (< 2^17), so
// every float sum is exact and the result is verified bit for bit.
// Thread-safety: one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "perf_net.h"

namespace r2perf {

// kSend: one direction only (rank 0 sends to rank 1, which receives; other ranks idle), for
// measuring a transport's one-way throughput against a single iperf3 stream.
enum class Op { kAllReduce, kAllGather, kBroadcast, kSendRecv, kSend };

const char* op_name(Op op);     // "allreduce", ...
const char* redop_name(Op op);  // "sum" or "none"
int op_root(Op op);             // 0 for broadcast, -1 otherwise
double busbw_factor(Op op, int nranks);

// What one benchmark point moves, as nccl-tests reports it. `bytes` is the requested size
// rounded down to whole elements (and, for AllGather, to a multiple of nranks elements).
struct Geometry {
  size_t bytes = 0;  // size column: AllGather: the whole output
  size_t count = 0;  // count column, elements of `bytes`
  size_t send_count = 0;
  size_t recv_count = 0;
};
Geometry geometry(Op op, size_t requested_bytes, int nranks);

// One ring channel: the connection to the next rank and the one from the previous rank, plus
// the registrations of the buffers on each comm.
struct Channel {
  int dev = 0;
  void* listen_comm = nullptr;
  void* send_comm = nullptr;
  void* recv_comm = nullptr;
  void* mh_send_sendbuf = nullptr;  // on send_comm
  void* mh_send_recvbuf = nullptr;  // on send_comm
  void* mh_recv_recvbuf = nullptr;  // on recv_comm
  void* mh_recv_scratch = nullptr;  // on recv_comm (AllReduce only)
  char* scratch = nullptr;          // inflight slots of slot_bytes
};

struct EngineConfig {
  int rank = 0;
  int nranks = 1;
  int inflight = 4;
  size_t slice_bytes = 1 << 20;
  size_t slot_bytes = 0;  // scratch slot size (AllReduce): min(slice, buffer)
  bool flush = true;
};

class Engine {
 public:
  Engine(Net* net, const EngineConfig& cfg, std::vector<Channel>* channels, float* sendbuf,
         float* recvbuf);
  // Builds the message lists for one collective of geometry `g`.
  void plan(Op op, const Geometry& g);
  // Runs one collective; throws PerfError naming the failed call, the rank and the channel.
  void run();
  // Writes the --check input for `seed` and poisons the output.
  void fill(uint32_t seed);
  // Returns how many output elements differ (bit for bit) from the expected result.
  uint64_t verify(uint32_t seed) const;
  // How many messages one run() posts per channel (for the header).
  size_t messages() const;

 private:
  struct SendMsg {
    char* ptr;
    size_t bytes;
    void* mh;
    int dep;  // index of the receive that must be processed first, or -1
  };
  struct RecvMsg {
    char* ptr;  // nullptr: into a scratch slot, then reduced
    size_t bytes;
    void* mh;
    int dep;         // index of the send that must be complete before posting, or -1
    float* red_dst;  // reduce: red_dst[i] = red_src[i] + scratch[i]
    const float* red_src;
  };
  struct ChanPlan {
    std::vector<SendMsg> sends;
    std::vector<RecvMsg> recvs;
  };
  int add_sends(ChanPlan* p, float* base, size_t elems, void* mh, int dep_first);
  int add_recvs(ChanPlan* p, float* base, size_t elems, void* mh, int dep_first);
  int add_reduce_recvs(ChanPlan* p, float* dst, const float* src, size_t elems, void* mh);
  size_t slices(size_t elems) const;
  [[noreturn]] void fail(const char* call, int ch, ncclResult_t r) const;

  Net* net_;
  EngineConfig cfg_;
  std::vector<Channel>* chans_;
  float* sendbuf_;
  float* recvbuf_;
  Op op_ = Op::kAllReduce;
  Geometry g_;
  std::vector<ChanPlan> plans_;
};

}  // namespace r2perf
