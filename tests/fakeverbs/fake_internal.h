// Internal state of the fake verbs provider (libr2ccl-fakeverbs.so). Not a public header.
//
// Emulation model (details in README.md):
//  - One process-wide State, guarded by one mutex (State::mu). Every ibv_* call and the NIC
//    thread take it, so post_send / post_recv / poll_cq are thread-safe against each other and
//    against the NIC thread. Nothing blocks while holding it (sockets are non-blocking).
//  - Each process is one "host": it owns the devices named in FAKEVERBS_DEVICES, listens on a
//    pathname Unix socket $FAKEVERBS_DIR/nic-<pid>.sock, and runs one NIC thread (started at
//    the first ibv_open_device) that accepts connections, reads packets, executes them against
//    local memory, sends ACKs and runs the timers (retry, RNR, scheduled faults).
//  - A QP number is allocated from $FAKEVERBS_DIR/qpn (a counter under flock) and published as
//    the symlink $FAKEVERBS_DIR/qp-<qpn> -> "<pid>", so a requester finds the process that owns
//    dest_qp_num. One packet per work request (a REQ carrying the whole payload), one ACK per
//    REQ, sent back on the connection the REQ came in on. Packets of one local device to one
//    process travel on one stream, so those of a QP execute at the target in posting order,
//    and the devices are independent.
//  - Loss comes only from the fault state, never from the clock: a packet is lost when the
//    fake drops it (a down port at either end, a blackholed QP, a wrong address, a target QP
//    that is missing or not in RTR/RTS: the target's NIC then sends a kAckLost notice, which
//    stands for the silence a real requester would hear) or when the peer process dies (its
//    connection closes). A delivered packet waits for its ACK however late the peer's NIC
//    thread runs (a loaded host, a stopped process: a real HCA would still answer). Lost
//    packets are never retransmitted: once the oldest outstanding WR is lost, the requester's
//    retry timer (from its sending, or the QP's last progress) completes it with
//    IBV_WC_RETRY_EXC_ERR and moves the QP to ERR.
#pragma once

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#define FV_API extern "C" __attribute__((visibility("default")))

namespace fv {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
constexpr TimePoint kNever = TimePoint::max();

constexpr int kGidTableLen = 16;        // default gid_tbl_len
constexpr int kMaxGidTableLen = 255;    // gids=N at most (mlx5 RoCE ports have 255 entries)
constexpr int kMaxPkeys = 64;           // pkeys=... entries at most
constexpr uint32_t kMaxMsg = 1u << 30;  // port max_msg_sz
constexpr int kMaxSge = 30;
constexpr int kMaxWr = 16384;
constexpr int kMaxCqe = 1 << 20;
constexpr uint32_t kMaxInline = 256;

struct Device;
struct Context;
struct Pd;
struct Mr;
struct Cq;
struct Qp;
struct Conn;

// Standard-layout boxes: the public verbs struct first, then a back pointer. A pointer to the
// public struct handed to the user converts back to the box (and so to the object).
struct DevBox {
  ibv_device pub;
  Device* impl;
};
struct CtxBox {
  verbs_context vctx;  // ibv_context is its last member, as verbs.h requires
  Context* impl;
};
struct PdBox {
  ibv_pd pub;
  Pd* impl;
};
struct MrBox {
  ibv_mr pub;
  Mr* impl;
};
struct CqBox {
  ibv_cq pub;
  Cq* impl;
};
struct QpBox {
  ibv_qp pub;
  Qp* impl;
};

struct GidEntry {
  ibv_gid gid{};
  uint32_t type = 0;  // enum ibv_gid_type
  bool valid = false;
  bool ip_based = false;  // from an IP address (not the MAC's link-local): removed on netdev down
  std::string ndev;       // the netdev it belongs to (sysfs gid_attrs/ndevs/<i>)
};

// A write held back by the visibility fence (FAKEVERBS_FENCE): its bytes reach memory only
// when the device that wrote them executes a later RDMA READ (a flush), or the MR goes away.
struct FencedWrite {
  char* dst;
  std::vector<char> data;
  const struct Mr* mr;
};

struct Device {
  DevBox box;
  std::string name;
  bool eth = false;   // RoCE (else InfiniBand)
  uint16_t lid = 0;   // ib
  uint32_t ipv4 = 0;  // eth, network byte order
  int prefix = 24;    // eth: the prefix length of ipv4 on the device's netdev
  uint64_t guid = 0;  // host order
  int speed_mbps = 100000;
  uint8_t active_speed = 32, active_width = 2;
  std::string pci;  // "" = virtual NIC
  int numa = -1;
  bool active = true;
  // Addressing (README "Addressing"). gids.size() is the port's gid_tbl_len.
  std::vector<GidEntry> gids = std::vector<GidEntry>(kGidTableLen);
  int big_gids = 0;                     // gids=N: a filled table of N entries (0: classic)
  int gid_rotate = 0;                   // gid_rotate=K: table position p holds entry p-K
  std::string netdev;                   // the port's netdev (default "eth<device index>")
  std::vector<uint16_t> pkeys{0xffff};  // P_Key table, host order, bit 15 = full member
  bool grh_required = false;            // IBV_QPF_GRH_REQUIRED in ibv_port_attr.flags
  int active_mtu = IBV_MTU_4096;        // enum ibv_mtu; max_mtu is always 4096
  // GIDs removed by the last netdev down (gids=readd|move), re-added at the next port up.
  std::vector<std::pair<int, GidEntry>> removed_gids;  // (index, entry)
  uint64_t bytes_posted = 0;       // RDMA WRITE / SEND payload posted on this device
  std::deque<FencedWrite> fenced;  // writes by this device not yet visible (FAKEVERBS_FENCE)
  // RNR NAKs this device sent as a target; the process's total is kept in
  // $FAKEVERBS_DIR/rnr-naks-<pid> for tests (a real HCA counts them too: rnr_nak_retry_err
  // and out_of_buffer in hw_counters).
  uint64_t rnr_naks = 0;
  // Armed one-shot faults.
  int arm_hold = 0;
  int hold_k = 2;
  int arm_rkey = 0;
  int arm_lkey = 0;
  int arm_sq_full = 0;  // the next N ibv_post_send calls on the device find the queue full
  // Fault device_fatal: the HCA hit a fatal error (a firmware reset). Its open contexts are
  // dead for good (Context::dead); while `removed`, the device is not listed and cannot be
  // opened; a context opened after it is back works (a new incarnation).
  bool removed = false;
  int incarnation = 0;
  // Fault ack_loss: packets arriving at this device land (completions and all) but their
  // ACKs are lost on the way back (a one-way fault), so requesters end in RETRY_EXC_ERR.
  bool ack_loss = false;
  // Fault drop: the next arm_drop packets with a payload sent from this device are lost
  // drop_tries times each, then delivered by the requester's retransmission.
  int arm_drop = 0;
  int drop_tries = 1;
  // Fault partial: the next arm_partial RDMA writes with >= 2 bytes arriving at this device
  // land only their first half, complete nothing and are lost (the link died mid-message).
  int arm_partial = 0;
  std::vector<Context*> contexts;
};

struct Context {
  CtxBox box;
  Device* dev = nullptr;
  int async_wr = -1;  // write end of the async pipe; the read end is box.vctx.context.async_fd
  std::deque<ibv_async_event> events;
  // The device had a fatal error after this context was opened (IBV_EVENT_DEVICE_FATAL was
  // its last event): every command that would reach the device fails with EIO; destroying,
  // deregistering, deallocating and closing work, as mlx5 answers them in internal-error state.
  bool dead = false;
};

struct Pd {
  PdBox box;
  Context* ctx = nullptr;
  int users = 0;  // MRs + QPs
};

struct Mr {
  MrBox box;
  Pd* pd = nullptr;
  char* addr = nullptr;
  uint64_t len = 0;
  uint64_t iova = 0;
  int access = 0;
  uint32_t key = 0;  // lkey == rkey; bit 31 always clear (a corrupted rkey sets it)
  // FAKEVERBS_KERNEL_FORK=copy: registered after ibv_fork_init (its pages are MADV_DONTFORK,
  // the parent keeps them after a fork), and whether a fork has since given the HCA's pages
  // to the child (copy-on-write), so that what the HCA writes no longer reaches this process.
  bool dontfork = false;
  bool cow_lost = false;
};

struct Cq {
  CqBox box;
  Context* ctx = nullptr;
  int capacity = 0;
  int users = 0;
  std::deque<ibv_wc> wcs;
  // Parallel to wcs: a send completion's QP slot end (SendWr::slot_end, 0 for receives). As
  // on mlx5, a send-queue slot is free again only once the completion of its WR, or of a
  // later WR of the same QP (unsignaled WRs have none), has been polled.
  std::deque<uint64_t> slot_ends;
  // Overrun (a completion with the CQ full): the CQ is in error, raises IBV_EVENT_CQ_ERR once
  // and takes no more completions; its QPs become fatal (IBV_EVENT_QP_FATAL, state ERR).
  bool overrun = false;
};

// Wire format (host byte order: both ends are on this machine).
enum : uint8_t { kReq = 1, kAck = 2 };
// kAckLost: not a packet of real hardware; it tells the requester that its packet was dropped
// at the target (a real requester learns it only from the silence, by its retry timer).
enum : uint8_t {
  kAckOk = 0,
  kAckRemAccess,
  kAckRemInv,
  kAckRemOp,
  kAckRnrWait,
  kAckRnrFail,
  kAckLost
};
constexpr uint32_t kMagic = 0x46564231;  // "FVB1"

struct Hdr {
  uint32_t magic;
  uint8_t type;
  uint8_t op;      // ibv_wr_opcode for REQ, echoed in ACK
  uint8_t status;  // ACK status
  uint8_t is_eth;
  uint32_t src_pid;
  uint32_t src_qpn;
  uint32_t dst_qpn;
  uint32_t imm;  // network order, passed through
  uint32_t rkey;
  uint32_t len;     // payload bytes following the header
  uint32_t rd_len;  // RDMA READ: bytes requested
  uint64_t seq;
  uint64_t raddr;
  uint8_t dgid[16];
  uint16_t dlid;
  uint16_t slid;
  uint32_t rnr_retry;  // the requester's rnr_retry (7: retry RNR NAKs forever)
  uint16_t pkey;       // the requester QP's P_Key (BTH), host order
  uint8_t has_grh;     // the requester's AV had is_global (RoCE: always)
  uint8_t path_mtu;    // the requester QP's path_mtu (enum ibv_mtu)
  uint8_t pad_;
  uint16_t vlan;  // VLAN of the requester's source GID's netdev (0: untagged); RoCE
};

struct SendWr {
  enum St { kQueued, kHeld, kSent, kRnr, kDone };
  uint64_t wr_id = 0;
  uint64_t seq = 0;
  uint64_t ordinal = 0;  // process-wide posting order
  ibv_wr_opcode op = IBV_WR_SEND;
  bool signaled = false;
  uint32_t len = 0;
  uint64_t raddr = 0;
  St st = kQueued;
  bool lost = false;  // kSent: the packet or its ACK was lost (the retry timer runs)
  // Fault drop: this packet is lost on its next drops_left transmissions; while `retx`, the
  // requester resends it one local ACK timeout after sent_at (tries counts the resends; more
  // than retry_cnt: RETRY_EXC_ERR). The packet is kept until it is really sent.
  int drops_left = 0;
  bool retx = false;
  int tries = 0;
  uint64_t slot_end = 0;  // Qp::sq_posted after this WR took its send-queue slot
  ibv_wc_status status = IBV_WC_SUCCESS;
  TimePoint sent_at{};
  std::vector<ibv_sge> read_sges;  // RDMA READ destination
  std::vector<char> pkt;           // kQueued: the packet to transmit
};

struct RecvWr {
  uint64_t wr_id = 0;
  std::vector<ibv_sge> sges;
};

struct Inbound {
  Hdr h;
  std::vector<char> payload;
  std::shared_ptr<Conn> conn;  // where the ACK goes
  // RNR: the target had no receive posted. It NAKs (counted in Device::rnr_naks) and the
  // requester sends the packet again after the target's min_rnr_timer, so the packet runs no
  // earlier than retry_at even if a receive is posted meanwhile; with none by then, another
  // NAK. After rnr_retry NAKs (7: never) the requester gets RNR_RETRY_EXC_ERR.
  bool rnr_notified = false;
  int rnr_naks = 0;
  TimePoint retry_at{};
  // FAKEVERBS_DELAY_US: the packet executes no earlier than this (a random delay, in order
  // per QP: the QPs and HCAs of one host are independent, so their packets interleave).
  TimePoint ready_at{};
};

struct Qp {
  QpBox box;
  Context* ctx = nullptr;
  Device* dev = nullptr;
  Pd* pd = nullptr;
  Cq* scq = nullptr;
  Cq* rcq = nullptr;
  uint32_t qpn = 0;
  ibv_qp_state state = IBV_QPS_RESET;
  ibv_qp_attr attr{};  // the attributes set so far
  ibv_qp_cap cap{};
  bool sig_all = false;
  std::deque<SendWr> sq;
  // Send-queue slots: taken at post, freed when a completion is polled (Cq::slot_ends);
  // ibv_post_send returns ENOMEM while sq_posted - sq_freed == cap.max_send_wr.
  uint64_t sq_posted = 0;
  uint64_t sq_freed = 0;
  std::deque<RecvWr> rq;
  std::deque<Inbound> inq;
  uint64_t next_seq = 1;
  TimePoint last_progress{};
  int peer_pid = 0;         // owner of attr.dest_qp_num (0 = not resolved)
  bool blackholed = false;  // fault: silently stopped
  bool held_block = false;  // a held write blocks transmission of later WRs
  // FAKEVERBS_RECV_LAG_US: receive completions of packets that landed, each due at its time
  // (in order: none overtakes an earlier one), entering rcq then. ERR puts them all in the CQ
  // ahead of the flushes; RESET and destroy drop them.
  std::deque<std::pair<TimePoint, ibv_wc>> lagged;
  bool err_pending = false;  // a WR that failed locally waits to complete: transmit nothing
  // A dropped packet waits for its retransmission: later WRs are not transmitted before it
  // (RC go-back-N: the target would discard them as out of sequence, and they are resent).
  bool retx_block = false;
  // Fault partial: a write landed only in part and was lost; the target now discards what
  // follows on this QP (as out of sequence) until the QP leaves RTR/RTS.
  bool gap = false;
};

struct Conn {
  int fd = -1;
  int peer_pid = 0;             // outbound: the pid we connected to ...
  const Device* dev = nullptr;  // ... for the QPs of this local device
  bool dead = false;
  // Input, touched by the NIC thread only.
  Hdr in_hdr{};
  size_t in_hgot = 0;
  std::vector<char> in_pay;
  size_t in_pgot = 0;
  // Output, under State::mu.
  std::deque<std::vector<char>> out;
  size_t out_off = 0;
};

struct HeldWrite {
  std::vector<char> pkt;
  uint64_t raddr = 0;
  uint32_t len = 0;
  uint64_t ordinal = 0;
  int k = 2;
  int acked = 0;
  uint32_t src_qpn = 0;
  uint64_t seq = 0;
  uint32_t dst_qpn = 0;
  int dst_pid = 0;
};

// A parsed fault entry (see faults.cc).
struct Fault {
  std::string text;  // the entry as written, for messages
  std::string kind;
  Device* dev = nullptr;
  long long for_ms = -1, down_ms = 0, up_ms = 0, count = 1, release_after = 2, tries = 1;
  uint32_t addr = 0;
  long long after_bytes = -1, after_ms = -1;
  int gids = 0;  // port_down / flap: kGidsKeep, kGidsReadd or kGidsMove
};

// What a netdev down/up does to the IP-based GIDs (fault key gids=).
enum : int { kGidsKeep = 0, kGidsReadd = 1, kGidsMove = 2 };

struct Scheduled {
  TimePoint at;
  Device* dev;
  bool up;
  int gids = kGidsKeep;
  bool reset_done = false;     // device_fatal,for_ms: the device comes back (not a port change)
  bool ack_loss_done = false;  // ack_loss,for_ms: the device's ACKs get through again
};

struct State {
  std::mutex mu;
  bool inited = false;
  int init_errno = 0;  // non-zero: the environment was bad, every get_device_list fails
  std::string dir;
  long long retry_us_env = -1;
  // FAKEVERBS_FENCE=1: the per-HCA visibility fence of GPU memory. RDMA WRITE payload into an
  // MR registered with IBV_ACCESS_RELAXED_ORDERING (the fake's stand-in for device memory) is
  // not visible to the process until an RDMA READ executed by the same device (the plugin's
  // flush through a loopback QP); the completions come at once, as on hardware. So data
  // landed through HCA B and flushed through HCA A is stale, as it can be on a GPU.
  bool fence = false;
  // FAKEVERBS_KERNEL_FORK: "safe" (default; Linux >= 5.13 keeps registered pages with the
  // parent across fork, ibv_is_fork_initialized says IBV_FORK_UNNEEDED) or "copy" (older
  // kernels: after a fork the parent's next write to a registered page gives it a private
  // copy while the HCA goes on writing the old page, now the child's; the fake takes the
  // worst case, every page written, unless the MR was registered after ibv_fork_init).
  bool fork_copies = false;
  bool fork_inited = false;
  // FAKEVERBS_RECV_LAG_US: the receiver's completion lags the requester's: a packet's data
  // lands and is ACKed at once, its receive completion enters the CQ a random 0..N us later
  // (seeded: FAKEVERBS_SEED, printed at init when random delays are on).
  long long recv_lag_us = 0;
  long long delay_us = 0;  // FAKEVERBS_DELAY_US: random 0..N us before a packet executes
  // FAKEVERBS_DMABUF=probe: ibv_reg_dmabuf_mr answers as a kernel with dma-buf support does
  // (fd -1: EBADF); default: as one without (EOPNOTSUPP). Importing a real dma-buf is never
  // emulated.
  bool dmabuf_probe = false;
  // R2CCL_TEST_TIME_SCALE (the variable the plugin reads too): the QP timers derived from
  // the QP attributes (local ACK timeout, RNR timer) run this many times faster.
  long long time_scale = 1;
  uint64_t seed = 0;
  uint64_t lag_rng = 0;
  std::vector<Device*> devices;
  std::unordered_map<uint32_t, Qp*> qps;  // local QPs by number
  std::unordered_map<uint32_t, Mr*> mrs;  // by key
  uint64_t key_rng = 0;
  uint64_t ordinal = 0;
  // Transport.
  bool nic_started = false;
  int listen_fd = -1;
  int wake_fd = -1;
  std::string sock_path;
  std::map<int, std::shared_ptr<Conn>> conns;  // by fd
  // By peer pid and local device: one stream per HCA and peer process, so a long write on one
  // HCA never delays the packets of another (real HCAs are independent), while the packets of
  // one QP stay in order.
  std::map<std::pair<int, const Device*>, std::shared_ptr<Conn>> outbound;
  TimePoint nic_wake_at = kNever;
  std::vector<int> owned_fds;  // closed in a fork child
  // $FAKEVERBS_DIR/qpn, the QP number counter shared by the processes of a run: opened once
  // and kept (a real provider needs no descriptor per QP; one per QP here would make a
  // process that runs out of descriptors fail where real verbs would not).
  int qpn_fd = -1;
  // Faults.
  std::vector<Fault> pending;  // faults waiting for their trigger
  std::vector<Scheduled> scheduled;
  std::deque<HeldWrite> held;
  bool posted_any = false;
  TimePoint first_post{};
  // QPs to make fatal (CQ overrun, qp_fatal) and devices to fail (device_fatal): applied by the
  // NIC thread's next pass, never inside the post/poll/completion code that found them.
  std::vector<uint32_t> fatal_qpns;
  std::vector<Device*> fatal_devices;
};

extern State* g;

// --- fake_verbs.cc ---
// Reads the environment once (devices, faults, dir). Returns 0 or an errno value. Locked.
int ensure_init_locked();
Device* find_device(const std::string& name);
void push_event(Context* c, ibv_event_type t, Cq* cq, int port);
void push_qp_event(Qp* qp, ibv_event_type t);
// Applies the deferred QP-fatal and device-fatal faults (State::fatal_qpns, fatal_devices).
void apply_fatal_locked();
// The device of `d` is back after a fatal error (a new incarnation).
void device_back_locked(Device* d);
// sq_slot_end: a send completion's SendWr::slot_end (0: a receive completion).
void push_cqe(Cq* cq, const ibv_wc& wc, uint64_t sq_slot_end = 0);
// gids: kGidsKeep, or on down remove the IP-based GIDs (GID_CHANGE after PORT_ERR) and on up
// re-add them (PORT_ACTIVE, then GID_CHANGE) at the same indices (kGidsReadd) or at the first
// free ones after the highest used index (kGidsMove).
void set_port_locked(Device* d, bool up, int gids = kGidsKeep);
// 1 when the P_Keys a and b (host order) match (IBA vol. 1 10.9.3: same low 15 bits, at least
// one of them a full member).
inline bool pkeys_match(uint16_t a, uint16_t b) {
  return (a & 0x7fff) == (b & 0x7fff) && ((a | b) & 0x8000) != 0;
}
// Bytes of an enum ibv_mtu (256 << (mtu - 1)).
inline uint32_t mtu_bytes(int mtu) { return mtu >= 1 && mtu <= 5 ? 128u << mtu : 0; }
void write_gid_sysfs(Device* d);
// The VLAN id of the entry's netdev ("eth0.100" -> 100), 0 when untagged.
int vlan_of_gid(const GidEntry& e);
void set_ipv4_locked(Device* d, uint32_t addr_be);
void qp_to_error_locked(Qp* qp);
// Moves a QP's lagged receive completions into its CQ: those due by `until` (all: kNever).
void release_lagged_locked(Qp* qp, TimePoint until);
// Random 0..max_us microseconds from the seeded generator.
long long random_us_locked(long long max_us);
void advance_sq_locked(Qp* qp);
Mr* find_mr(uint32_t key);
// Makes the fenced writes of `d` visible (all, or only those into `only`, an MR going away).
void apply_fenced_locked(Device* d, const Mr* only = nullptr);
// Microseconds before a QP's oldest unacknowledged WR gives up (-1 = never).
long long retry_us(const Qp* qp);
// Microseconds of one local ACK timeout of the QP (one try), time-scaled.
long long one_try_us(const Qp* qp);
Context* ctx_of(ibv_context* c);

// --- nic.cc ---
void start_nic_locked();
void wake_nic();
// Sends a queued WR's packet (or loses it). Locked.
void transmit_locked(Qp* qp, SendWr* w);
// Runs what a packet newly at the head of a QP's inbound queue allows. Locked.
void process_inbound_locked(Qp* qp);
void on_write_acked_locked(const SendWr& w);
int lookup_qp_owner(uint32_t qpn);
bool send_packet_locked(int pid, const Device* dev, std::vector<char> pkt);
// At RTR: opens the stream of the QP's device to the owner of its dest_qp_num now, while the
// process can still open descriptors (a real HCA needs none later; a process that runs out
// afterwards must not lose packets here). A failure is retried at the first send.
void preconnect_locked(Qp* q);

// --- faults.cc ---
// Parses `spec` (';'-separated entries). On error returns false with *err set.
bool parse_faults_locked(const std::string& spec, std::vector<Fault>* out, std::string* err);
void arm_or_fire_locked(const Fault& f);
void fire_fault_locked(const Fault& f);
// Runs due time-triggered faults and scheduled port changes; returns the next deadline.
TimePoint run_fault_timers_locked(TimePoint now);
void check_byte_triggers_locked(Device* d);

// Text helpers of the FAKEVERBS_* parsers: split keeps empty fields; trim drops blanks.
inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t b = 0;
  for (;;) {
    size_t e = s.find(sep, b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

inline std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\n") - b + 1);
}

}  // namespace fv
