// Tests of the fake verbs provider (libr2ccl-fakeverbs.so), linked directly: the ibv_* calls
// below resolve to the fake.
//
// The fake reads its environment once per process, so every scenario runs in its own forked
// child (run_scenario) with its own FAKEVERBS_DIR, FAKEVERBS_DEVICES and
// FAKEVERBS_RETRY_US=20000 (20 ms). Inside a scenario, EXPECT* print the failing condition and
// exit the child with status 1; the Catch2 test case requires a zero exit status. Scenarios
// that need a second "host" fork again: the fake starts from a fresh state in a fork child.

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <infiniband/verbs.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

extern "C" int fakeverbs_inject(const char* spec);
extern "C" int fakeverbs_port_state(const char* dev);
extern "C" unsigned long long fakeverbs_rnr_naks(void);
extern "C" int fakeverbs_getifaddrs(struct ifaddrs** out);
extern "C" void fakeverbs_freeifaddrs(struct ifaddrs* list);

namespace {

using Ms = std::chrono::milliseconds;
constexpr int kRetryMs =
    300;  // FAKEVERBS_RETRY_US: generous, a 2-core box under ASan must ACK in time

#define EXPECT(cond)                                                            \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "%s:%d: EXPECT failed: %s\n", __FILE__, __LINE__, #cond); \
      _exit(1);                                                                 \
    }                                                                           \
  } while (0)
#define EXPECT_EQ(a, b)                                                                            \
  do {                                                                                             \
    long long _a = static_cast<long long>(a), _b = static_cast<long long>(b);                      \
    if (_a != _b) {                                                                                \
      fprintf(stderr, "%s:%d: EXPECT_EQ failed: %s (%lld) != %s (%lld)\n", __FILE__, __LINE__, #a, \
              _a, #b, _b);                                                                         \
      _exit(1);                                                                                    \
    }                                                                                              \
  } while (0)

// Runs fn in a child process with the given fake environment; returns its exit status
// (-1 on timeout: the child's process group is killed).
int run_scenario(const std::string& devices, const std::function<void()>& fn,
                 const std::string& faults = "", int timeout_s = 60) {
  char tmpl[] = "/tmp/fvtest-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  std::string dir = tmpl;
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setpgid(0, 0);
    setenv("FAKEVERBS_DIR", dir.c_str(), 1);
    setenv("FAKEVERBS_DEVICES", devices.c_str(), 1);
    setenv("FAKEVERBS_RETRY_US", std::to_string(kRetryMs * 1000).c_str(), 1);
    if (faults.empty())
      unsetenv("FAKEVERBS_FAULTS");
    else
      setenv("FAKEVERBS_FAULTS", faults.c_str(), 1);
    fn();
    _exit(0);
  }
  int status = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int rc = -1;
  for (;;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      kill(-pid, SIGKILL);  // peers a failed scenario left behind (its process group)
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      fprintf(stderr, "scenario timed out\n");
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(Ms(5));
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}

// Reports a scenario's exit status (its stderr says which EXPECT failed).
void expect_ok(int scenario_status) {
  if (scenario_status) fprintf(stderr, "scenario exit status %d\n", scenario_status);
  REQUIRE(scenario_status == 0);
}

// ---------------------------------------------------------------------------------------
// Verbs helpers (scenario side).

struct Node {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  bool eth = false;
  uint16_t lid = 0;
};

Node open_dev(const char* name) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  EXPECT(list != nullptr);
  Node node;
  for (int i = 0; i < n; ++i)
    if (strcmp(ibv_get_device_name(list[i]), name) == 0) node.ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  EXPECT(node.ctx != nullptr);
  node.pd = ibv_alloc_pd(node.ctx);
  EXPECT(node.pd != nullptr);
  ibv_port_attr pa;
  EXPECT_EQ(ibv_query_port(node.ctx, 1, &pa), 0);
  node.eth = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
  node.lid = pa.lid;
  return node;
}

struct Addr {
  uint32_t qpn;
  uint16_t lid;
  ibv_gid gid;
};

struct Ep {
  Node* n = nullptr;
  ibv_cq* cq = nullptr;  // send and receive completions
  ibv_qp* qp = nullptr;
};

Ep make_ep(Node& n, int depth = 64, int cqe = 256) {
  Ep e;
  e.n = &n;
  e.cq = ibv_create_cq(n.ctx, cqe, nullptr, nullptr, 0);
  EXPECT(e.cq != nullptr);
  ibv_qp_init_attr ia{};
  ia.send_cq = ia.recv_cq = e.cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = ia.cap.max_recv_wr = depth;
  ia.cap.max_send_sge = ia.cap.max_recv_sge = 4;
  ia.cap.max_inline_data = 64;
  e.qp = ibv_create_qp(n.pd, &ia);
  EXPECT(e.qp != nullptr);
  return e;
}

Addr addr_of(const Ep& e) {
  Addr a{};
  a.qpn = e.qp->qp_num;
  a.lid = e.n->lid;
  if (e.n->eth) EXPECT_EQ(ibv_query_gid(e.n->ctx, 1, 3, &a.gid), 0);
  return a;
}

constexpr int kAllAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

int to_init(ibv_qp* qp, int access = kAllAccess) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = access;
  return ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

ibv_qp_attr rtr_attr(const Node& n, const Addr& r) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = r.qpn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = 1;
  if (n.eth) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = r.gid;
    a.ah_attr.grh.sgid_index = 3;
    a.ah_attr.grh.hop_limit = 1;
  } else {
    a.ah_attr.dlid = r.lid;
  }
  return a;
}
constexpr int kRtrMask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
constexpr int kRtsMask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;

ibv_qp_attr rts_attr(int rnr_retry = 7) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = static_cast<uint8_t>(rnr_retry);
  a.max_rd_atomic = 1;
  return a;
}

void connect_ep(Ep& e, const Addr& r, int access = kAllAccess, int rnr_retry = 7) {
  EXPECT_EQ(to_init(e.qp, access), 0);
  ibv_qp_attr a = rtr_attr(*e.n, r);
  EXPECT_EQ(ibv_modify_qp(e.qp, &a, kRtrMask), 0);
  a = rts_attr(rnr_retry);
  EXPECT_EQ(ibv_modify_qp(e.qp, &a, kRtsMask), 0);
}

void connect_pair(Ep& a, Ep& b, int b_access = kAllAccess, int a_rnr_retry = 7) {
  Addr aa = addr_of(a), ba = addr_of(b);
  connect_ep(a, ba, kAllAccess, a_rnr_retry);
  connect_ep(b, aa, b_access);
}

// RNR NAKs the fake's targets in this process sent.
long long rnr_naks() { return static_cast<long long>(fakeverbs_rnr_naks()); }

struct Buf {
  std::vector<char> mem;
  ibv_mr* mr = nullptr;
  Buf(Node& n, size_t len, int access = kAllAccess) : mem(len, 0) {
    mr = ibv_reg_mr(n.pd, mem.data(), len, access);
    EXPECT(mr != nullptr);
  }
  uint64_t addr(size_t off = 0) const { return reinterpret_cast<uintptr_t>(mem.data()) + off; }
};

int post(ibv_qp* qp, ibv_wr_opcode op, uint64_t wr_id, const Buf* lb, size_t loff, uint32_t len,
         uint64_t raddr = 0, uint32_t rkey = 0, uint32_t imm = 0,
         unsigned flags = IBV_SEND_SIGNALED) {
  ibv_sge s{};
  if (lb) {
    s.addr = lb->addr(loff);
    s.length = len;
    s.lkey = lb->mr->lkey;
  }
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = lb ? &s : nullptr;
  wr.num_sge = lb ? 1 : 0;
  wr.send_flags = flags;
  wr.imm_data = imm;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return ibv_post_send(qp, &wr, &bad);
}

int post_recv(ibv_qp* qp, uint64_t wr_id, const Buf* b, size_t off, uint32_t len) {
  ibv_sge s{};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  if (b) {
    s.addr = b->addr(off);
    s.length = len;
    s.lkey = b->mr->lkey;
    wr.sg_list = &s;
    wr.num_sge = 1;
  }
  return ibv_post_recv(qp, &wr, &bad);
}

// Waits for n completions (or timeout_ms).
std::vector<ibv_wc> poll_n(ibv_cq* cq, size_t n, int timeout_ms = 5000) {
  std::vector<ibv_wc> out;
  auto end = std::chrono::steady_clock::now() + Ms(timeout_ms);
  while (out.size() < n && std::chrono::steady_clock::now() < end) {
    ibv_wc wc[16];
    int k = ibv_poll_cq(cq, static_cast<int>(std::min<size_t>(16, n - out.size())), wc);
    EXPECT(k >= 0);
    out.insert(out.end(), wc, wc + k);
    if (!k) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return out;
}

ibv_wc poll_one(ibv_cq* cq, int timeout_ms = 5000, int line = __builtin_LINE()) {
  auto v = poll_n(cq, 1, timeout_ms);
  if (v.size() != 1) fprintf(stderr, "poll_one at line %d: no completion\n", line);
  EXPECT_EQ(v.size(), 1);
  return v[0];
}

bool quiet(ibv_cq* cq, int ms) { return poll_n(cq, 1, ms).empty(); }

// The next async event within timeout_ms, or IBV_EVENT_* = -1 on timeout.
int next_event(ibv_context* ctx, int timeout_ms, ibv_async_event* out = nullptr) {
  pollfd p{ctx->async_fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) != 1) return -1;
  ibv_async_event ev;
  EXPECT_EQ(ibv_get_async_event(ctx, &ev), 0);
  ibv_ack_async_event(&ev);
  if (out) *out = ev;
  return ev.event_type;
}

bool all_eq(const char* p, size_t n, char v) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != v) return false;
  return true;
}

void write_all(int fd, const void* p, size_t n) {
  EXPECT_EQ(write(fd, p, n), static_cast<ssize_t>(n));
}
void read_all(int fd, void* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, static_cast<char*>(p) + got, n - got);
    EXPECT(r > 0);
    got += static_cast<size_t>(r);
  }
}

const char* kTwoEth = "mlx5_0,eth,10.0.0.1;mlx5_1,eth,10.0.0.2;mlx5_2,eth,10.0.0.3";

}  // namespace

// ---------------------------------------------------------------------------------------

TEST_CASE("fakeverbs: devices ports GID table sysfs") {
  std::string devs =
      "mlx5_0,eth,10.1.2.3,speed=200000,pci=0000:00:01.0/0000:0b:00.0,numa=1;"
      "ib0,ib,7,speed=25000;mlx5_2,eth,10.1.2.4,state=down,guid=0x1234abcd;"
      "mlx5_3,eth,10.1.2.5,speed=400000,pci=0000:00:02.0/0000:3b:00.0";
  expect_ok(run_scenario(devs, [] {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    EXPECT(list != nullptr);
    EXPECT_EQ(n, 4);
    EXPECT(list[4] == nullptr);
    EXPECT(strcmp(ibv_get_device_name(list[0]), "mlx5_0") == 0);
    EXPECT(strcmp(list[1]->name, "ib0") == 0);
    EXPECT_EQ(list[0]->node_type, IBV_NODE_CA);
    EXPECT_EQ(list[0]->transport_type, IBV_TRANSPORT_IB);
    EXPECT_EQ(be64toh(ibv_get_device_guid(list[2])), 0x1234abcdull);
    // sysfs: PCI path and NUMA node; no link for a virtual NIC.
    std::string link = std::string(list[0]->ibdev_path) + "/device";
    char real[PATH_MAX];
    EXPECT(realpath(link.c_str(), real) != nullptr);
    EXPECT(std::string(real).find("/pci0000:00/0000:00:01.0/0000:0b:00.0") != std::string::npos);
    std::ifstream numa(std::string(real) + "/numa_node");
    int node = -5;
    numa >> node;
    EXPECT_EQ(node, 1);
    std::ifstream numa3(std::string(list[3]->ibdev_path) + "/device/numa_node");
    numa3 >> node;
    EXPECT_EQ(node, -1);
    struct stat st;
    EXPECT(lstat((std::string(list[1]->ibdev_path) + "/device").c_str(), &st) != 0);
    ibv_free_device_list(list);

    Node e = open_dev("mlx5_0"), ib = open_dev("ib0"), down = open_dev("mlx5_2"),
         ndr = open_dev("mlx5_3");
    // verbs.h inlines must find no extended op and fall back to the exported ones.
    EXPECT(verbs_get_ctx_op(e.ctx, query_port) == nullptr);
    EXPECT(fcntl(e.ctx->async_fd, F_GETFD) >= 0);
    ibv_port_attr pa;
    EXPECT_EQ(ibv_query_port(e.ctx, 1, &pa), 0);
    EXPECT_EQ(pa.state, IBV_PORT_ACTIVE);
    EXPECT_EQ(pa.link_layer, IBV_LINK_LAYER_ETHERNET);
    EXPECT_EQ(pa.active_mtu, IBV_MTU_4096);
    EXPECT_EQ(pa.gid_tbl_len, 16);
    EXPECT_EQ(pa.active_speed, 64);  // HDR
    EXPECT_EQ(pa.active_width, 2);   // 4x
    EXPECT_EQ(ibv_query_port(ndr.ctx, 1, &pa), 0);
    EXPECT_EQ(pa.active_speed, 128);  // NDR
    EXPECT_EQ(pa.active_width, 2);
    EXPECT_EQ(ibv_query_port(ib.ctx, 1, &pa), 0);
    EXPECT_EQ(pa.link_layer, IBV_LINK_LAYER_INFINIBAND);
    EXPECT_EQ(pa.lid, 7);
    EXPECT_EQ(pa.active_speed, 32);  // EDR
    EXPECT_EQ(pa.active_width, 1);   // 1x
    EXPECT_EQ(ibv_query_port(down.ctx, 1, &pa), 0);
    EXPECT_EQ(pa.state, IBV_PORT_DOWN);
    EXPECT_EQ(fakeverbs_port_state("mlx5_2"), 0);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 1);
    EXPECT_EQ(fakeverbs_port_state("nope"), -1);
    ibv_device_attr da;
    EXPECT_EQ(ibv_query_device(e.ctx, &da), 0);
    EXPECT_EQ(da.phys_port_cnt, 1);
    // GID tables.
    ibv_gid_entry ge;
    const uint32_t types[] = {IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V2, IBV_GID_TYPE_ROCE_V1,
                              IBV_GID_TYPE_ROCE_V2};
    for (uint32_t i = 0; i < 4; ++i) {
      EXPECT_EQ(ibv_query_gid_ex(e.ctx, 1, i, &ge, 0), 0);
      EXPECT_EQ(ge.gid_type, types[i]);
      EXPECT_EQ(ge.gid_index, i);
      EXPECT_EQ(ge.port_num, 1);
    }
    EXPECT_EQ(ibv_query_gid_ex(e.ctx, 1, 4, &ge, 0), ENODATA);
    ibv_gid gid;
    EXPECT_EQ(ibv_query_gid(e.ctx, 1, 3, &gid), 0);
    const uint8_t v4[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 1, 2, 3};
    EXPECT(memcmp(gid.raw, v4, 16) == 0);
    EXPECT_EQ(ibv_query_gid(e.ctx, 1, 0, &gid), 0);
    EXPECT(gid.raw[0] == 0xfe && gid.raw[1] == 0x80);
    EXPECT_EQ(ibv_query_gid(e.ctx, 1, 7, &gid), 0);
    EXPECT(all_eq(reinterpret_cast<char*>(gid.raw), 16, 0));
    EXPECT_EQ(ibv_query_gid_ex(ib.ctx, 1, 0, &ge, 0), 0);
    EXPECT_EQ(ge.gid_type, IBV_GID_TYPE_IB);
    EXPECT(ge.gid.raw[0] == 0xfe && ge.gid.raw[1] == 0x80);
    uint64_t guid;
    memcpy(&guid, ge.gid.raw + 8, 8);
    int nd = 0;
    ibv_device** l2 = ibv_get_device_list(&nd);
    EXPECT_EQ(guid, ibv_get_device_guid(l2[1]));
    ibv_free_device_list(l2);
    EXPECT_EQ(ibv_query_gid_ex(ib.ctx, 1, 1, &ge, 0), ENODATA);
    // dmabuf is not supported.
    errno = 0;
    EXPECT(ibv_reg_dmabuf_mr(e.pd, 0, 4096, 0, 3, IBV_ACCESS_LOCAL_WRITE) == nullptr);
    EXPECT_EQ(errno, EOPNOTSUPP);
    EXPECT(strcmp(ibv_wc_status_str(IBV_WC_RETRY_EXC_ERR), "transport retry counter exceeded") ==
           0);
    EXPECT(strcmp(ibv_event_type_str(IBV_EVENT_PORT_ERR), "port error") == 0);
    EXPECT_EQ(ibv_fork_init(), 0);
  }));

  // No devices configured: an empty list.
  expect_ok(run_scenario("", [] {
    int n = -1;
    ibv_device** l = ibv_get_device_list(&n);
    EXPECT(l != nullptr);
    EXPECT_EQ(n, 0);
    ibv_free_device_list(l);
  }));
  // Bad environments fail ibv_get_device_list with EINVAL.
  for (const char* bad : {"x,foo,1", "x,ib,notanumber", "x,eth,1.2.3.4,colour=red", "x,eth"}) {
    expect_ok(run_scenario(bad, [] {
      errno = 0;
      EXPECT(ibv_get_device_list(nullptr) == nullptr);
      EXPECT_EQ(errno, EINVAL);
    }));
  }
  expect_ok(run_scenario(
      "mlx5_0,eth,10.0.0.1",
      [] {
        errno = 0;
        EXPECT(ibv_get_device_list(nullptr) == nullptr);
        EXPECT_EQ(errno, EINVAL);
      },
      "explode,dev=mlx5_0"));
  expect_ok(run_scenario("mlx5_0,eth,10.0.0.1", [] {
    for (const char* bad : {"port_down", "port_down,dev=nope", "flap,dev=mlx5_0,down_ms=1",
                            "port_down,dev=mlx5_0,after_bytes=x", "hold_write,dev=mlx5_0,for_ms=1",
                            "set_ipv4,dev=mlx5_0,addr=1.2.3", "port_up,dev=mlx5_0;bogus"})
      EXPECT_EQ(fakeverbs_inject(bad), -1);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 1);  // nothing applied
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_0"), 0);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 0);
  }));
}

TEST_CASE("fakeverbs: RoCE netdevs: gid_attrs/ndevs and their addresses with prefix=") {
  // The kernel names each RoCE GID's netdev in ports/1/gid_attrs/ndevs/<i>; its address and
  // netmask come from getifaddrs, which the fake answers for its own netdevs.
  std::string devs = "mlx5_0,eth,10.211.7.2,prefix=16;ib0,ib,7;mlx5_1,eth,10.1.2.4,state=down";
  expect_ok(run_scenario(devs, [] {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    EXPECT_EQ(n, 3);
    auto ndev = [&](int d, int i) {
      std::ifstream f(std::string(list[d]->ibdev_path) + "/ports/1/gid_attrs/ndevs/" +
                      std::to_string(i));
      std::string s;
      std::getline(f, s);
      return s;
    };
    EXPECT(ndev(0, 3) == "eth0");
    EXPECT(ndev(0, 0) == "eth0");
    EXPECT(ndev(0, 5).empty());  // an unused entry
    EXPECT(ndev(1, 0).empty());  // IB: no netdev
    ifaddrs* ifs = nullptr;
    EXPECT_EQ(fakeverbs_getifaddrs(&ifs), 0);
    int seen = 0;
    for (ifaddrs* i = ifs; i; i = i->ifa_next, ++seen) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      const auto* m = reinterpret_cast<const sockaddr_in*>(i->ifa_netmask);
      EXPECT_EQ(a->sin_family, AF_INET);
      char buf[32];
      inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
      if (seen == 0) {
        EXPECT(strcmp(i->ifa_name, "eth0") == 0);
        EXPECT(strcmp(buf, "10.211.7.2") == 0);
        EXPECT_EQ(ntohl(m->sin_addr.s_addr), 0xffff0000u);
        EXPECT_EQ(i->ifa_flags & (IFF_UP | IFF_RUNNING), IFF_UP | IFF_RUNNING);
      } else {
        EXPECT(strcmp(i->ifa_name, "eth2") == 0);
        EXPECT_EQ(ntohl(m->sin_addr.s_addr), 0xffffff00u);  // default /24
        EXPECT_EQ(i->ifa_flags & IFF_RUNNING, 0);           // port down
      }
    }
    EXPECT_EQ(seen, 2);  // eth devices only
    fakeverbs_freeifaddrs(ifs);
    ibv_free_device_list(list);
  }));
  // prefix= is checked like every option: a bad one fails the device list.
  for (const char* bad : {"mlx5_0,eth,10.0.0.1,prefix=33", "ib0,ib,7,prefix=16"}) {
    expect_ok(run_scenario(bad, [] {
      int n = 0;
      errno = 0;
      EXPECT(ibv_get_device_list(&n) == nullptr);
      EXPECT_EQ(errno, EINVAL);
    }));
  }
}

TEST_CASE("fakeverbs: QP state machine") {
  expect_ok(run_scenario(kTwoEth, [] {
    Node n = open_dev("mlx5_0");
    ibv_cq* cq = ibv_create_cq(n.ctx, 16, nullptr, nullptr, 0);
    ibv_qp_init_attr ia{};
    ia.send_cq = ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_UD;
    ia.cap.max_send_wr = ia.cap.max_recv_wr = 4;
    ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
    EXPECT(ibv_create_qp(n.pd, &ia) == nullptr);
    Ep a = make_ep(n, 4), b = make_ep(n, 4);
    EXPECT(a.qp->qp_num != b.qp->qp_num);
    EXPECT(a.qp->qp_num > 0 && a.qp->qp_num <= 0xffffff);
    Addr ba = addr_of(b);
    ibv_qp_attr rtr = rtr_attr(n, ba);
    EXPECT_EQ(ibv_modify_qp(a.qp, &rtr, kRtrMask), EINVAL);  // RESET -> RTR
    Buf buf(n, 4096);
    EXPECT_EQ(post_recv(a.qp, 1, &buf, 0, 64), EINVAL);  // RESET
    ibv_qp_attr ini{};
    ini.qp_state = IBV_QPS_INIT;
    ini.port_num = 1;
    EXPECT_EQ(ibv_modify_qp(a.qp, &ini, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT),
              EINVAL);  // no access flags
    ini.port_num = 2;
    EXPECT_EQ(ibv_modify_qp(a.qp, &ini,
                            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
              EINVAL);  // no port 2
    EXPECT_EQ(to_init(a.qp, IBV_ACCESS_REMOTE_WRITE), 0);
    ibv_qp_attr q;
    ibv_qp_init_attr qi;
    EXPECT_EQ(ibv_query_qp(a.qp, &q, IBV_QP_STATE, &qi), 0);
    EXPECT_EQ(q.qp_state, IBV_QPS_INIT);
    EXPECT_EQ(q.qp_access_flags, IBV_ACCESS_REMOTE_WRITE);
    EXPECT_EQ(q.port_num, 1);
    EXPECT_EQ(a.qp->state, IBV_QPS_INIT);
    // Posting sends before RTS fails; receives are fine from INIT on.
    ibv_sge s{buf.addr(), 8, buf.mr->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.opcode = IBV_WR_SEND;
    wr.sg_list = &s;
    wr.num_sge = 1;
    EXPECT_EQ(ibv_post_send(a.qp, &wr, &bad), EINVAL);
    EXPECT(bad == &wr);
    EXPECT_EQ(post_recv(a.qp, 11, &buf, 0, 64), 0);
    ibv_qp_attr r2 = rtr;
    EXPECT_EQ(ibv_modify_qp(a.qp, &r2, kRtrMask & ~IBV_QP_MIN_RNR_TIMER), EINVAL);
    r2.ah_attr.is_global = 0;  // RoCE needs a GRH
    EXPECT_EQ(ibv_modify_qp(a.qp, &r2, kRtrMask), EINVAL);
    r2 = rtr;
    r2.ah_attr.grh.sgid_index = 9;  // empty GID index
    EXPECT_EQ(ibv_modify_qp(a.qp, &r2, kRtrMask), EINVAL);
    ibv_qp_attr rts = rts_attr();
    EXPECT_EQ(ibv_modify_qp(a.qp, &rts, kRtsMask), EINVAL);  // INIT -> RTS
    EXPECT_EQ(ibv_modify_qp(a.qp, &rtr, kRtrMask), 0);
    EXPECT_EQ(ibv_post_send(a.qp, &wr, &bad), EINVAL);  // RTR
    EXPECT_EQ(ibv_modify_qp(a.qp, &rts, kRtsMask & ~IBV_QP_SQ_PSN), EINVAL);
    EXPECT_EQ(ibv_modify_qp(a.qp, &rts, kRtsMask), 0);
    EXPECT_EQ(ibv_query_qp(a.qp, &q, IBV_QP_STATE, &qi), 0);
    EXPECT_EQ(q.qp_state, IBV_QPS_RTS);
    EXPECT_EQ(q.timeout, 14);
    EXPECT_EQ(q.dest_qp_num, b.qp->qp_num);
    EXPECT_EQ(qi.cap.max_send_wr, 4);
    EXPECT_EQ(ibv_modify_qp(a.qp, &ini, IBV_QP_STATE), EINVAL);  // RTS -> INIT
    // To ERR: the posted receive flushes; later posts flush too.
    ibv_qp_attr err{};
    err.qp_state = IBV_QPS_ERR;
    EXPECT_EQ(ibv_modify_qp(a.qp, &err, IBV_QP_STATE), 0);
    ibv_wc wc = poll_one(a.cq);
    EXPECT_EQ(wc.wr_id, 11);
    EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
    wr.wr_id = 12;
    EXPECT_EQ(ibv_post_send(a.qp, &wr, &bad), 0);
    wc = poll_one(a.cq);
    EXPECT_EQ(wc.wr_id, 12);
    EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(post_recv(a.qp, 13, &buf, 0, 64), 0);
    wc = poll_one(a.cq);
    EXPECT_EQ(wc.wr_id, 13);
    EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
    // ERR -> RESET -> INIT again.
    ibv_qp_attr rs{};
    rs.qp_state = IBV_QPS_RESET;
    EXPECT_EQ(ibv_modify_qp(a.qp, &rs, IBV_QP_STATE), 0);
    EXPECT_EQ(a.qp->state, IBV_QPS_RESET);
    EXPECT_EQ(to_init(a.qp), 0);
    // The send queue depth is enforced.
    Ep c = make_ep(n, 2), d = make_ep(n, 2);
    connect_pair(c, d);
    EXPECT_EQ(ibv_destroy_cq(c.cq), EBUSY);
    ibv_qp_attr dq{};
    dq.qp_state = IBV_QPS_ERR;
    EXPECT_EQ(ibv_modify_qp(d.qp, &dq, IBV_QP_STATE), 0);  // nothing will be acked
    EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 1, &buf, 0, 8, buf.addr(), buf.mr->rkey), 0);
    EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 2, &buf, 0, 8, buf.addr(), buf.mr->rkey), 0);
    EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 3, &buf, 0, 8, buf.addr(), buf.mr->rkey), ENOMEM);
    const uint32_t c_qpn = c.qp->qp_num;  // c.qp is freed by the destroy below
    EXPECT_EQ(ibv_destroy_qp(c.qp), 0);
    EXPECT_EQ(ibv_destroy_qp(d.qp), 0);
    EXPECT(quiet(c.cq, 3 * kRetryMs));  // a destroyed QP completes nothing
    // QP numbers are unique across processes sharing FAKEVERBS_DIR.
    int p[2];
    EXPECT_EQ(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
      Node m = open_dev("mlx5_1");
      Ep x = make_ep(m, 4);
      uint32_t qpn = x.qp->qp_num;
      write_all(p[1], &qpn, 4);
      _exit(0);
    }
    uint32_t other = 0;
    read_all(p[0], &other, 4);
    int st;
    waitpid(pid, &st, 0);
    EXPECT(other != a.qp->qp_num && other != b.qp->qp_num && other != c_qpn);
  }));
}

TEST_CASE("fakeverbs: data path in one process") {
  auto body = [](const char* da, const char* db) {
    Node na = open_dev(da), nb = open_dev(db);
    Ep a = make_ep(na), b = make_ep(nb);
    ibv_cq* bcq = b.cq;
    connect_pair(a, b);
    Buf la(na, 1 << 20), rb(nb, 1 << 20);
    for (size_t i = 0; i < la.mem.size(); ++i) la.mem[i] = static_cast<char>(i * 7 + 3);
    // RDMA WRITE.
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 100, &la, 0, 65536, rb.addr(4096), rb.mr->rkey), 0);
    ibv_wc wc = poll_one(a.cq);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
    EXPECT_EQ(wc.wr_id, 100);
    EXPECT_EQ(wc.qp_num, a.qp->qp_num);
    EXPECT(memcmp(rb.mem.data() + 4096, la.mem.data(), 65536) == 0);
    EXPECT(all_eq(rb.mem.data(), 4096, 0));
    // WRITE WITH IMM consumes a receive; imm in network order.
    EXPECT_EQ(post_recv(b.qp, 200, nullptr, 0, 0), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 101, &la, 100, 5000, rb.addr(200000),
                   rb.mr->rkey, htonl(0xabcdef01)),
              0);
    wc = poll_one(bcq);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
    EXPECT_EQ(wc.wr_id, 200);
    EXPECT_EQ(wc.byte_len, 5000);
    EXPECT_EQ(ntohl(wc.imm_data), 0xabcdef01u);
    EXPECT(wc.wc_flags & IBV_WC_WITH_IMM);
    EXPECT_EQ(wc.qp_num, b.qp->qp_num);
    EXPECT_EQ(wc.src_qp, a.qp->qp_num);
    EXPECT(memcmp(rb.mem.data() + 200000, la.mem.data() + 100, 5000) == 0);
    wc = poll_one(a.cq);
    EXPECT_EQ(wc.wr_id, 101);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    // SEND with a 2-entry gather into a 2-entry scatter.
    {
      ibv_sge rs[2] = {{rb.addr(300000), 1000, rb.mr->lkey}, {rb.addr(310000), 5000, rb.mr->lkey}};
      ibv_recv_wr rwr{}, *rbad;
      rwr.wr_id = 201;
      rwr.sg_list = rs;
      rwr.num_sge = 2;
      EXPECT_EQ(ibv_post_recv(b.qp, &rwr, &rbad), 0);
      ibv_sge ss[2] = {{la.addr(0), 700, la.mr->lkey}, {la.addr(9000), 800, la.mr->lkey}};
      ibv_send_wr swr{}, *sbad;
      swr.wr_id = 102;
      swr.opcode = IBV_WR_SEND_WITH_IMM;
      swr.imm_data = htonl(7);
      swr.sg_list = ss;
      swr.num_sge = 2;
      swr.send_flags = IBV_SEND_SIGNALED;
      EXPECT_EQ(ibv_post_send(a.qp, &swr, &sbad), 0);
      wc = poll_one(bcq);
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
      EXPECT_EQ(wc.opcode, IBV_WC_RECV);
      EXPECT_EQ(wc.byte_len, 1500);
      EXPECT(wc.wc_flags & IBV_WC_WITH_IMM);
      EXPECT_EQ(ntohl(wc.imm_data), 7);
      EXPECT(memcmp(rb.mem.data() + 300000, la.mem.data(), 700) == 0);
      EXPECT(memcmp(rb.mem.data() + 300700, la.mem.data() + 9000, 300) == 0);
      EXPECT(memcmp(rb.mem.data() + 310000, la.mem.data() + 9300, 500) == 0);
      wc = poll_one(a.cq);
      EXPECT_EQ(wc.opcode, IBV_WC_SEND);
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    }
    // Inline SEND: the data is taken at post time, from unregistered memory.
    {
      char msg[32] = "inline payload";
      EXPECT_EQ(post_recv(b.qp, 202, &rb, 400000, 64), 0);
      ibv_sge s{reinterpret_cast<uintptr_t>(msg), 15, 0};
      ibv_send_wr swr{}, *sbad;
      swr.wr_id = 103;
      swr.opcode = IBV_WR_SEND;
      swr.sg_list = &s;
      swr.num_sge = 1;
      swr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
      EXPECT_EQ(ibv_post_send(a.qp, &swr, &sbad), 0);
      strcpy(msg, "overwritten!!!");
      wc = poll_one(bcq);
      EXPECT_EQ(wc.byte_len, 15);
      EXPECT(strcmp(rb.mem.data() + 400000, "inline payload") == 0);
      EXPECT_EQ(poll_one(a.cq).wr_id, 103);
    }
    // RDMA READ into 3 local SGEs.
    {
      for (int i = 0; i < 3000; ++i) rb.mem[500000 + i] = static_cast<char>(i % 251);
      ibv_sge s[3] = {{la.addr(600000), 1000, la.mr->lkey},
                      {la.addr(700000), 1000, la.mr->lkey},
                      {la.addr(800000), 1000, la.mr->lkey}};
      ibv_send_wr wr{}, *bad;
      wr.wr_id = 104;
      wr.opcode = IBV_WR_RDMA_READ;
      wr.sg_list = s;
      wr.num_sge = 3;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = rb.addr(500000);
      wr.wr.rdma.rkey = rb.mr->rkey;
      EXPECT_EQ(ibv_post_send(a.qp, &wr, &bad), 0);
      wc = poll_one(a.cq);
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
      EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
      EXPECT_EQ(wc.byte_len, 3000);
      for (int i = 0; i < 1000; ++i) {
        EXPECT_EQ(la.mem[600000 + i], rb.mem[500000 + i]);
        EXPECT_EQ(la.mem[700000 + i], rb.mem[501000 + i]);
        EXPECT_EQ(la.mem[800000 + i], rb.mem[502000 + i]);
      }
    }
    // Unsignaled WRs complete silently; a zero-length write with no key is a valid probe.
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 105, &la, 0, 100, rb.addr(900000), rb.mr->rkey, 0, 0),
              0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 106, nullptr, 0, 0, 0, 0), 0);
    wc = poll_one(a.cq);
    EXPECT_EQ(wc.wr_id, 106);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
    EXPECT(memcmp(rb.mem.data() + 900000, la.mem.data(), 100) == 0);
    EXPECT(quiet(a.cq, 5));
    // A SEND longer than the receive: LOC_LEN_ERR at the receiver, REM_INV_REQ_ERR here.
    EXPECT_EQ(post_recv(b.qp, 203, &rb, 0, 100), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_SEND, 107, &la, 0, 200), 0);
    wc = poll_one(bcq);
    EXPECT_EQ(wc.wr_id, 203);
    EXPECT_EQ(wc.status, IBV_WC_LOC_LEN_ERR);
    wc = poll_one(a.cq);
    EXPECT_EQ(wc.wr_id, 107);
    EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR);
  };
  expect_ok(run_scenario(kTwoEth, [&] { body("mlx5_0", "mlx5_1"); }));
  expect_ok(run_scenario(kTwoEth, [&] { body("mlx5_0", "mlx5_0"); }));  // same port
  expect_ok(run_scenario("ib0,ib,5;ib1,ib,6", [&] { body("ib0", "ib1"); }));
}

TEST_CASE("fakeverbs: between processes") {
  expect_ok(run_scenario("mlx5_0,eth,10.0.0.1", [] {
    constexpr int kSlots = 8, kN = 160;
    constexpr uint32_t kChunk = 512 * 1024;
    int sp[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sp), 0);
    Node n = open_dev("mlx5_0");  // the parent's state predates the fork
    pid_t pid = fork();
    if (pid == 0) {
      close(sp[0]);
      // Another network namespace when allowed (root): the transport must not care.
      if (unshare(CLONE_NEWNET) == 0) fprintf(stderr, "fakeverbs: peer in its own netns\n");
      setenv("FAKEVERBS_DEVICES", "mlx5_0,eth,10.0.0.2", 1);
      Node m = open_dev("mlx5_0");
      Ep t = make_ep(m, 64);
      Buf ring(m, kSlots * kChunk), readme(m, 65536), small(m, 4096);
      for (int i = 0; i < 65536; ++i) readme.mem[i] = static_cast<char>(0x5a ^ i);
      Addr me = addr_of(t);
      uint64_t info[2] = {ring.addr(), readme.addr()};
      uint32_t keys[2] = {ring.mr->rkey, readme.mr->rkey};
      write_all(sp[1], &me, sizeof me);
      write_all(sp[1], info, sizeof info);
      write_all(sp[1], keys, sizeof keys);
      Addr peer;
      read_all(sp[1], &peer, sizeof peer);
      connect_ep(t, peer);
      for (int i = 0; i < 32; ++i) EXPECT_EQ(post_recv(t.qp, 1, &small, 0, 64), 0);
      char go = 1;
      write_all(sp[1], &go, 1);
      int got = 0;
      while (got <= kN) {
        ibv_wc wc = poll_one(t.cq, 10000);
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        if (wc.opcode == IBV_WC_SEND) continue;  // our credit went out
        if (wc.opcode == IBV_WC_RECV) {          // "bye"
          EXPECT_EQ(got, kN);
          EXPECT_EQ(wc.byte_len, 3);
          EXPECT(memcmp(small.mem.data(), "bye", 3) == 0);
          _exit(0);
        }
        EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
        uint32_t i = ntohl(wc.imm_data);
        EXPECT_EQ(i, static_cast<uint32_t>(got));
        EXPECT_EQ(wc.byte_len, kChunk);
        const char* slot = ring.mem.data() + (i % kSlots) * kChunk;
        for (uint32_t j = 0; j < kChunk; j += 4093)
          EXPECT_EQ(slot[j], static_cast<char>(i * 131 + j));
        ++got;
        EXPECT_EQ(post_recv(t.qp, 1, &small, 0, 64), 0);
        EXPECT_EQ(post(t.qp, IBV_WR_SEND, 9, &small, 1024, 4, 0, 0, 0, IBV_SEND_SIGNALED), 0);
      }
      _exit(1);
    }
    close(sp[1]);
    Ep e = make_ep(n, 64);
    Addr peer;
    uint64_t info[2];
    uint32_t keys[2];
    read_all(sp[0], &peer, sizeof peer);
    read_all(sp[0], info, sizeof info);
    read_all(sp[0], keys, sizeof keys);
    Addr me = addr_of(e);
    write_all(sp[0], &me, sizeof me);
    connect_ep(e, peer);
    Buf src(n, kSlots * kChunk), small(n, 4096), rd(n, 65536);
    for (int i = 0; i < 40; ++i) EXPECT_EQ(post_recv(e.qp, 2, &small, 0, 64), 0);
    char go;
    read_all(sp[0], &go, 1);
    // A poller thread counts completions and reposts receives while this thread posts.
    std::atomic<int> credits{kSlots}, writes_done{0}, errors{0};
    std::atomic<bool> stop{false};
    std::thread poller([&] {
      while (!stop) {
        ibv_wc wc[8];
        int k = ibv_poll_cq(e.cq, 8, wc);
        for (int i = 0; i < k; ++i) {
          if (wc[i].status != IBV_WC_SUCCESS) errors++;
          if (wc[i].status == IBV_WC_SUCCESS && wc[i].opcode == IBV_WC_RECV) {
            credits++;
            if (post_recv(e.qp, 2, &small, 0, 64) != 0) errors++;
          } else if (wc[i].opcode == IBV_WC_RDMA_WRITE) {
            writes_done++;
          }
        }
        if (!k) std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
    for (uint32_t i = 0; i < kSlots * kChunk; ++i) src.mem[i] = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kN; ++i) {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (credits.load() == 0) {
        EXPECT(std::chrono::steady_clock::now() < deadline);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      credits--;
      uint32_t slot = i % kSlots;
      char* p = src.mem.data() + slot * kChunk;
      for (uint32_t j = 0; j < kChunk; j += 4093) p[j] = static_cast<char>(i * 131 + j);
      int rc;
      while ((rc = post(e.qp, IBV_WR_RDMA_WRITE_WITH_IMM, i, &src, slot * kChunk, kChunk,
                        info[0] + slot * kChunk, keys[0], htonl(i))) == ENOMEM)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      EXPECT_EQ(rc, 0);
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (writes_done.load() < kN && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(Ms(1));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(writes_done.load(), kN);
    EXPECT_EQ(errors.load(), 0);
    fprintf(stderr, "fakeverbs: %d x 512 KiB WRITE_WITH_IMM between processes: %.0f MB/s\n", kN,
            kN * 0.524288 / secs);
    // RDMA READ of the peer's memory.
    EXPECT_EQ(post(e.qp, IBV_WR_RDMA_READ, 500, &rd, 0, 65536, info[1], keys[1]), 0);
    deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (rd.mem[65535] != static_cast<char>(0x5a ^ 65535) &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(Ms(1));
    for (int i = 0; i < 65536; ++i) EXPECT_EQ(rd.mem[i], static_cast<char>(0x5a ^ i));
    memcpy(small.mem.data() + 2048, "bye", 3);
    EXPECT_EQ(post(e.qp, IBV_WR_SEND, 501, &small, 2048, 3), 0);
    int st = 0;
    EXPECT_EQ(waitpid(pid, &st, 0), pid);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    stop = true;
    poller.join();
    EXPECT_EQ(errors.load(), 0);
  }));
}

TEST_CASE("fakeverbs: a send-queue slot is free again only once a completion is polled") {
  // mlx5: a WR keeps its slot after it completes until its CQE, or that of a later WR of the
  // QP (an unsignaled WR has none), is polled; a full send queue is ENOMEM.
  expect_ok(run_scenario(kTwoEth, [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Ep a = make_ep(na, 2), b = make_ep(nb, 2);
    connect_pair(a, b);
    Buf la(na, 4096), rb(nb, 4096);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 1, &la, 0, 8, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 2, &la, 0, 8, rb.addr(), rb.mr->rkey), 0);
    std::this_thread::sleep_for(Ms(200));  // both acknowledged, their CQEs not polled
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 3, &la, 0, 8, rb.addr(), rb.mr->rkey), ENOMEM);
    EXPECT_EQ(poll_one(a.cq).wr_id, 1);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 3, &la, 0, 8, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 4, &la, 0, 8, rb.addr(), rb.mr->rkey), ENOMEM);
    auto w = poll_n(a.cq, 2);
    EXPECT_EQ(w.size(), 2);
    // Unsignaled: done without a CQE, the slot stays taken until a later CQE is polled.
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 5, &la, 0, 8, rb.addr(), rb.mr->rkey, 0, 0), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 6, &la, 0, 8, rb.addr(), rb.mr->rkey), 0);
    std::this_thread::sleep_for(Ms(200));
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 7, &la, 0, 8, rb.addr(), rb.mr->rkey), ENOMEM);
    EXPECT_EQ(poll_one(a.cq).wr_id, 6);  // frees 5's slot too
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 7, &la, 0, 8, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 8, &la, 0, 8, rb.addr(), rb.mr->rkey), 0);
    // A QP in ERR: its flushed WRs hold their slots until the flushes are polled.
    std::this_thread::sleep_for(Ms(200));
    ibv_qp_attr e{};
    e.qp_state = IBV_QPS_ERR;
    EXPECT_EQ(ibv_modify_qp(a.qp, &e, IBV_QP_STATE), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 9, &la, 0, 8, rb.addr(), rb.mr->rkey), ENOMEM);
    EXPECT_EQ(poll_n(a.cq, 2).size(), 2);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 9, &la, 0, 8, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a.cq).status, IBV_WC_WR_FLUSH_ERR);
  }));
}

TEST_CASE("fakeverbs: local and remote protection errors") {
  expect_ok(run_scenario(kTwoEth, [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 65536), rb(nb, 65536);
    Buf ro(nb, 65536, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);   // no remote write
    Buf wo(nb, 65536, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);  // no remote read
    memset(la.mem.data(), 'x', la.mem.size());
    auto expect_one_error = [](Ep& e, uint64_t wr_id, ibv_wc_status st) {
      ibv_wc wc = poll_one(e.cq);
      EXPECT_EQ(wc.wr_id, wr_id);
      EXPECT_EQ(wc.status, st);
      ibv_qp_attr q;
      ibv_qp_init_attr qi;
      EXPECT_EQ(ibv_query_qp(e.qp, &q, IBV_QP_STATE, &qi), 0);
      EXPECT_EQ(q.qp_state, IBV_QPS_ERR);
    };
    {  // bad lkey; the next WR flushes
      Ep a = make_ep(na), b = make_ep(nb);
      connect_pair(a, b);
      ibv_sge s{la.addr(), 64, la.mr->lkey + 1};
      ibv_send_wr wr{}, *bad;
      wr.wr_id = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.sg_list = &s;
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = rb.addr();
      wr.wr.rdma.rkey = rb.mr->rkey;
      EXPECT_EQ(ibv_post_send(a.qp, &wr, &bad), 0);
      expect_one_error(a, 1, IBV_WC_LOC_PROT_ERR);
      EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 2, &la, 0, 64, rb.addr(), rb.mr->rkey), 0);
      EXPECT_EQ(poll_one(a.cq).status, IBV_WC_WR_FLUSH_ERR);
      // An SGE past the end of its MR.
      Ep c = make_ep(na), d = make_ep(nb);
      connect_pair(c, d);
      EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 3, &la, 65000, 1000, rb.addr(), rb.mr->rkey), 0);
      expect_one_error(c, 3, IBV_WC_LOC_PROT_ERR);
      EXPECT(all_eq(rb.mem.data(), rb.mem.size(), 0));
    }
    struct Case {
      const char* what;
      uint64_t raddr;
      uint32_t rkey;
      ibv_wr_opcode op;
      int target_access;
    };
    const Case cases[] = {
        {"wrong rkey", rb.addr(), rb.mr->rkey ^ 0x10, IBV_WR_RDMA_WRITE, kAllAccess},
        {"out of range", rb.addr(65000), rb.mr->rkey, IBV_WR_RDMA_WRITE, kAllAccess},
        {"MR without remote write", ro.addr(), ro.mr->rkey, IBV_WR_RDMA_WRITE, kAllAccess},
        {"MR without remote read", wo.addr(), wo.mr->rkey, IBV_WR_RDMA_READ, kAllAccess},
        {"QP without remote write", rb.addr(), rb.mr->rkey, IBV_WR_RDMA_WRITE_WITH_IMM,
         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ},
        {"QP without remote read", rb.addr(), rb.mr->rkey, IBV_WR_RDMA_READ,
         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE},
    };
    for (const auto& c : cases) {
      fprintf(stderr, "case: %s\n", c.what);
      Ep a = make_ep(na), b = make_ep(nb);
      connect_pair(a, b, c.target_access);
      EXPECT_EQ(post_recv(b.qp, 9, nullptr, 0, 0), 0);
      EXPECT_EQ(post(a.qp, c.op, 10, &la, 0, 1000, c.raddr, c.rkey), 0);
      expect_one_error(a, 10, IBV_WC_REM_ACCESS_ERR);
      EXPECT(all_eq(rb.mem.data(), rb.mem.size(), 0));
      EXPECT(all_eq(ro.mem.data(), ro.mem.size(), 0));
      EXPECT(quiet(b.cq, 2));  // the receive was not consumed
    }
    // Injected: rkey_error corrupts the next WRITE/READ's key, lkey_error the next WR.
    {
      Ep a = make_ep(na), b = make_ep(nb);
      connect_pair(a, b);
      EXPECT_EQ(fakeverbs_inject("rkey_error,dev=mlx5_0"), 0);
      EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 20, &la, 0, 1000, rb.addr(), rb.mr->rkey), 0);
      expect_one_error(a, 20, IBV_WC_REM_ACCESS_ERR);
      EXPECT(all_eq(rb.mem.data(), rb.mem.size(), 0));
      Ep c = make_ep(na), d = make_ep(nb);
      connect_pair(c, d);
      EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 21, &la, 0, 1000, rb.addr(), rb.mr->rkey), 0);
      EXPECT_EQ(poll_one(c.cq).status, IBV_WC_SUCCESS);  // one-shot
      EXPECT_EQ(fakeverbs_inject("lkey_error,dev=mlx5_0"), 0);
      EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 22, &la, 0, 1000, rb.addr(2000), rb.mr->rkey), 0);
      expect_one_error(c, 22, IBV_WC_LOC_PROT_ERR);
      EXPECT(all_eq(rb.mem.data() + 2000, 1000, 0));
    }
  }));
}

TEST_CASE("fakeverbs: port down flap far end down") {
  expect_ok(run_scenario(kTwoEth, [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 65536), rb(nb, 65536);
    memset(la.mem.data(), 'y', la.mem.size());
    Ep a1 = make_ep(na), a2 = make_ep(na), b1 = make_ep(nb), b2 = make_ep(nb);
    connect_pair(a1, b1);
    connect_pair(a2, b2);
    EXPECT_EQ(post(a1.qp, IBV_WR_RDMA_WRITE, 1, &la, 0, 10, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a1.cq).status, IBV_WC_SUCCESS);
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_0"), 0);
    ibv_async_event ev;
    EXPECT_EQ(next_event(na.ctx, 1000, &ev), IBV_EVENT_PORT_ERR);
    EXPECT_EQ(ev.element.port_num, 1);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 0);
    ibv_port_attr pa;
    EXPECT_EQ(ibv_query_port(na.ctx, 1, &pa), 0);
    EXPECT_EQ(pa.state, IBV_PORT_DOWN);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(post(a1.qp, IBV_WR_RDMA_WRITE, 10 + i, &la, 0, 1000, rb.addr(100), rb.mr->rkey), 0);
    for (int i = 0; i < 2; ++i)
      EXPECT_EQ(
          post(a2.qp, IBV_WR_RDMA_WRITE, 20 + i, &la, 0, 1000, rb.addr(100), rb.mr->rkey, 0, 0), 0);
    // Per QP: exactly one RETRY_EXC_ERR (the oldest WR), then flushes, in order.
    auto w1 = poll_n(a1.cq, 3);
    EXPECT_EQ(w1.size(), 3);
    EXPECT(std::chrono::steady_clock::now() - t0 >= Ms(kRetryMs - 2));
    EXPECT_EQ(w1[0].wr_id, 10);
    EXPECT_EQ(w1[0].status, IBV_WC_RETRY_EXC_ERR);
    EXPECT_EQ(w1[1].wr_id, 11);
    EXPECT_EQ(w1[1].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(w1[2].wr_id, 12);
    EXPECT_EQ(w1[2].status, IBV_WC_WR_FLUSH_ERR);
    auto w2 = poll_n(a2.cq, 2);  // unsignaled, but errors always complete
    EXPECT_EQ(w2.size(), 2);
    EXPECT_EQ(w2[0].status, IBV_WC_RETRY_EXC_ERR);
    EXPECT_EQ(w2[1].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT(quiet(a1.cq, 3 * kRetryMs));
    EXPECT(all_eq(rb.mem.data() + 100, 1000, 0));
    // Non-blocking async fd: EAGAIN when empty.
    int fl = fcntl(na.ctx->async_fd, F_GETFL);
    fcntl(na.ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
    errno = 0;
    EXPECT_EQ(ibv_get_async_event(na.ctx, &ev), -1);
    EXPECT_EQ(errno, EAGAIN);
    fcntl(na.ctx->async_fd, F_SETFL, fl);
    // Back up after for_ms; QPs in ERR stay there, new ones work.
    EXPECT_EQ(fakeverbs_inject("port_up,dev=mlx5_0"), 0);
    EXPECT_EQ(next_event(na.ctx, 1000), IBV_EVENT_PORT_ACTIVE);
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_0,for_ms=300"), 0);
    EXPECT_EQ(next_event(na.ctx, 1000), IBV_EVENT_PORT_ERR);
    EXPECT_EQ(next_event(na.ctx, 50), -1);
    EXPECT_EQ(next_event(na.ctx, 1000), IBV_EVENT_PORT_ACTIVE);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 1);
    EXPECT_EQ(a1.qp->state, IBV_QPS_ERR);
    Ep a3 = make_ep(na), b3 = make_ep(nb);
    connect_pair(a3, b3);
    EXPECT_EQ(post(a3.qp, IBV_WR_RDMA_WRITE, 30, &la, 0, 1000, rb.addr(100), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a3.cq).status, IBV_WC_SUCCESS);
    EXPECT(all_eq(rb.mem.data() + 100, 1000, 'y'));
    // Far end down: retry exceeded here, with this port active.
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_1"), 0);
    EXPECT_EQ(next_event(nb.ctx, 1000), IBV_EVENT_PORT_ERR);
    EXPECT_EQ(next_event(na.ctx, 20), -1);  // nothing on this side
    EXPECT_EQ(post(a3.qp, IBV_WR_RDMA_WRITE, 31, &la, 0, 1000, rb.addr(5000), rb.mr->rkey), 0);
    EXPECT_EQ(post(a3.qp, IBV_WR_RDMA_WRITE, 32, &la, 0, 1000, rb.addr(5000), rb.mr->rkey), 0);
    auto w3 = poll_n(a3.cq, 2);
    EXPECT_EQ(w3.size(), 2);
    EXPECT_EQ(w3[0].status, IBV_WC_RETRY_EXC_ERR);
    EXPECT_EQ(w3[1].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 1);
    EXPECT(all_eq(rb.mem.data() + 5000, 1000, 0));
    // Flap: count down/up cycles.
    EXPECT_EQ(fakeverbs_inject("port_up,dev=mlx5_1"), 0);
    EXPECT_EQ(next_event(nb.ctx, 1000), IBV_EVENT_PORT_ACTIVE);
    EXPECT_EQ(fakeverbs_inject("flap,dev=mlx5_1,down_ms=20,up_ms=20,count=2"), 0);
    const int expect[] = {IBV_EVENT_PORT_ERR, IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR,
                          IBV_EVENT_PORT_ACTIVE};
    for (int e : expect) EXPECT_EQ(next_event(nb.ctx, 1000), e);
    EXPECT_EQ(next_event(nb.ctx, 100), -1);
    EXPECT_EQ(fakeverbs_port_state("mlx5_1"), 1);
  }));
}

TEST_CASE("fakeverbs: triggers GID change CQ overflow RNR") {
  expect_ok(run_scenario(kTwoEth, [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 1 << 20), rb(nb, 1 << 20);
    // after_bytes: the port goes down once 100000 bytes were posted on mlx5_0.
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_0,after_bytes=100000"), 0);
    Ep a = make_ep(na), b = make_ep(nb);
    connect_pair(a, b);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 1, &la, 0, 65536, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a.cq).status, IBV_WC_SUCCESS);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 1);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 2, &la, 0, 65536, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(fakeverbs_port_state("mlx5_0"), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 3, &la, 0, 65536, rb.addr(), rb.mr->rkey), 0);
    auto w = poll_n(a.cq, 2);
    EXPECT_EQ(w.size(), 2);
    EXPECT_EQ(w[0].wr_id, 2);  // left before, but its ACK finds the port down
    EXPECT_EQ(w[0].status, IBV_WC_RETRY_EXC_ERR);
    EXPECT_EQ(w[1].wr_id, 3);
    EXPECT_EQ(w[1].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(next_event(na.ctx, 0), IBV_EVENT_PORT_ERR);
    EXPECT_EQ(fakeverbs_inject("port_up,dev=mlx5_0"), 0);
    EXPECT_EQ(next_event(na.ctx, 0), IBV_EVENT_PORT_ACTIVE);
    // after_ms counts from the first post_send of the process (already past).
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_1,after_ms=10"), 0);
    EXPECT_EQ(next_event(nb.ctx, 2000), IBV_EVENT_PORT_ERR);
    EXPECT(std::chrono::steady_clock::now() - t0 < Ms(1000));
    EXPECT_EQ(fakeverbs_inject("port_up,dev=mlx5_1"), 0);
    EXPECT_EQ(next_event(nb.ctx, 1000), IBV_EVENT_PORT_ACTIVE);
    // set_ipv4 rewrites GIDs 2/3; a peer still using the old address loses packets.
    Ep c = make_ep(na), d = make_ep(nb);
    connect_pair(c, d);
    ibv_gid before0, g3;
    EXPECT_EQ(ibv_query_gid(na.ctx, 1, 0, &before0), 0);
    EXPECT_EQ(fakeverbs_inject("set_ipv4,dev=mlx5_0,addr=10.9.8.7"), 0);
    ibv_async_event ev;
    EXPECT_EQ(next_event(na.ctx, 1000, &ev), IBV_EVENT_GID_CHANGE);
    EXPECT_EQ(ibv_query_gid(na.ctx, 1, 3, &g3), 0);
    const uint8_t v4[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 9, 8, 7};
    EXPECT(memcmp(g3.raw, v4, 16) == 0);
    ibv_gid after0;
    EXPECT_EQ(ibv_query_gid(na.ctx, 1, 0, &after0), 0);
    EXPECT(memcmp(before0.raw, after0.raw, 16) == 0);
    EXPECT_EQ(post(d.qp, IBV_WR_RDMA_WRITE, 40, &rb, 0, 100, la.addr(), la.mr->rkey), 0);
    EXPECT_EQ(poll_one(d.cq).status, IBV_WC_RETRY_EXC_ERR);
    // CQ overflow: an async CQ_ERR, the extra completions are lost.
    {
      ibv_cq* tiny = ibv_create_cq(na.ctx, 2, nullptr, nullptr, 0);
      ibv_qp_init_attr ia{};
      ia.send_cq = ia.recv_cq = tiny;
      ia.qp_type = IBV_QPT_RC;
      ia.cap.max_send_wr = ia.cap.max_recv_wr = 8;
      ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
      Ep e;
      e.n = &na;
      e.cq = tiny;
      e.qp = ibv_create_qp(na.pd, &ia);
      EXPECT(e.qp != nullptr);
      Ep f = make_ep(nb);
      connect_pair(e, f);
      for (int i = 0; i < 4; ++i)
        EXPECT_EQ(post(e.qp, IBV_WR_RDMA_WRITE, 50 + i, &la, 0, 10, rb.addr(), rb.mr->rkey), 0);
      EXPECT_EQ(next_event(na.ctx, 2000, &ev), IBV_EVENT_CQ_ERR);
      EXPECT(ev.element.cq == tiny);
      // The overrun puts the CQ in error (it takes nothing more) and its QP is fatal.
      EXPECT_EQ(next_event(na.ctx, 2000, &ev), IBV_EVENT_QP_FATAL);
      EXPECT(ev.element.qp == e.qp);
      EXPECT_EQ(e.qp->state, IBV_QPS_ERR);
      auto got = poll_n(tiny, 4, 100);
      EXPECT_EQ(got.size(), 2);
      EXPECT_EQ(post(e.qp, IBV_WR_RDMA_WRITE, 59, &la, 0, 10, rb.addr(), rb.mr->rkey), 0);
      EXPECT(quiet(tiny, 50));
    }
    // RNR: a SEND waits for its receive, NAKed every min_rnr_timer (12: 0.64 ms) and sent
    // again; rnr_retry 7 retries forever; rnr_retry 1 fails after 2 NAKs.
    {
      EXPECT_EQ(rnr_naks(), 0);
      Ep g = make_ep(na), h = make_ep(nb);
      connect_pair(g, h);
      memcpy(la.mem.data(), "hello", 5);
      EXPECT_EQ(post(g.qp, IBV_WR_SEND, 60, &la, 0, 5), 0);
      EXPECT_EQ(post(g.qp, IBV_WR_RDMA_WRITE, 61, &la, 0, 5, rb.addr(7000), rb.mr->rkey), 0);
      std::this_thread::sleep_for(Ms(2 * kRetryMs));
      EXPECT(quiet(g.cq, 1));
      EXPECT(all_eq(rb.mem.data() + 7000, 5, 0));  // in order: behind the SEND
      EXPECT_EQ(post_recv(h.qp, 70, &rb, 8000, 64), 0);
      ibv_wc wc = poll_one(h.cq);
      EXPECT_EQ(wc.byte_len, 5);
      EXPECT(memcmp(rb.mem.data() + 8000, "hello", 5) == 0);
      auto gw = poll_n(g.cq, 2);
      EXPECT_EQ(gw.size(), 2);
      EXPECT_EQ(gw[0].wr_id, 60);
      EXPECT_EQ(gw[0].status, IBV_WC_SUCCESS);
      EXPECT_EQ(gw[1].wr_id, 61);
      EXPECT(memcmp(rb.mem.data() + 7000, "hello", 5) == 0);
      const long long naks = rnr_naks();
      EXPECT(naks >= 100);  // ~2 x kRetryMs of 0.64 ms NAKs (fewer on a loaded machine)
      EXPECT(naks <= 2 * kRetryMs / 0.64 + 1);
      // Forever with rnr_retry 7: still waiting after 3 retry times, then lands.
      EXPECT_EQ(post(g.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 62, &la, 0, 5, rb.addr(9000), rb.mr->rkey),
                0);
      EXPECT(quiet(g.cq, 3 * kRetryMs));
      EXPECT(all_eq(rb.mem.data() + 9000, 5, 0));
      EXPECT_EQ(post_recv(h.qp, 71, &rb, 8000, 64), 0);
      EXPECT_EQ(poll_one(g.cq).status, IBV_WC_SUCCESS);
      EXPECT(memcmp(rb.mem.data() + 9000, "hello", 5) == 0);
      EXPECT_EQ(poll_one(h.cq).opcode, IBV_WC_RECV_RDMA_WITH_IMM);
      // rnr_retry 1: the NAK of its one retry ends it, one timer (0.64 ms) on.
      Ep g1 = make_ep(na), h1 = make_ep(nb);
      connect_pair(g1, h1, kAllAccess, 1);
      auto t1 = std::chrono::steady_clock::now();
      EXPECT_EQ(post(g1.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 63, &la, 0, 5, rb.addr(9100), rb.mr->rkey),
                0);
      wc = poll_one(g1.cq, 2000);
      EXPECT_EQ(wc.status, IBV_WC_RNR_RETRY_EXC_ERR);
      EXPECT(std::chrono::steady_clock::now() - t1 >= std::chrono::microseconds(640));
      EXPECT(all_eq(rb.mem.data() + 9100, 5, 0));
      EXPECT(quiet(h1.cq, 5));
    }
  }));
}

TEST_CASE("fakeverbs: a device-fatal error, the device's reset and a fatal QP") {
  expect_ok(run_scenario(kTwoEth, [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 1 << 16), rb(nb, 1 << 16);
    Ep a = make_ep(na), b = make_ep(nb), idle = make_ep(na), idle_peer = make_ep(nb);
    connect_pair(a, b);
    connect_pair(idle, idle_peer);
    EXPECT_EQ(post_recv(a.qp, 5, &la, 0, 64), 0);
    // qp_fatal: the newest connected QP of the device (here `idle`) goes to ERR and says so.
    EXPECT_EQ(fakeverbs_inject("qp_fatal,dev=mlx5_0"), 0);
    ibv_async_event ev;
    EXPECT_EQ(next_event(na.ctx, 1000, &ev), IBV_EVENT_QP_FATAL);
    EXPECT(ev.element.qp == idle.qp);
    EXPECT_EQ(idle.qp->state, IBV_QPS_ERR);
    EXPECT_EQ(a.qp->state, IBV_QPS_RTS);
    // device_fatal: every QP flushes, DEVICE_FATAL is the context's last event, the device
    // leaves the list, and only destroy/dealloc/close still work on the old context.
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 1, &la, 0, 100, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a.cq).status, IBV_WC_SUCCESS);
    EXPECT_EQ(fakeverbs_inject("device_fatal,dev=mlx5_0,for_ms=1500"), 0);
    EXPECT_EQ(next_event(na.ctx, 1000, &ev), IBV_EVENT_DEVICE_FATAL);
    auto fl = poll_n(a.cq, 1, 200);
    EXPECT_EQ(fl.size(), 1);
    EXPECT_EQ(fl[0].wr_id, 5);  // the posted receive, flushed
    EXPECT_EQ(fl[0].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(b.qp->state, IBV_QPS_RTS);  // the far end learns only by its retries
    EXPECT_EQ(post(b.qp, IBV_WR_RDMA_WRITE, 2, &rb, 0, 100, la.addr(), la.mr->rkey), 0);
    EXPECT_EQ(poll_one(b.cq, 2000).status, IBV_WC_RETRY_EXC_ERR);
    EXPECT(ibv_create_cq(na.ctx, 4, nullptr, nullptr, 0) == nullptr);
    EXPECT_EQ(errno, EIO);
    EXPECT(ibv_reg_mr(na.pd, la.mem.data(), 64, kAllAccess) == nullptr);
    EXPECT_EQ(errno, EIO);
    ibv_port_attr pa;
    EXPECT_EQ(ibv_query_port(na.ctx, 1, &pa), EIO);
    ibv_qp_attr ra{};
    ra.qp_state = IBV_QPS_RESET;
    EXPECT_EQ(ibv_modify_qp(a.qp, &ra, IBV_QP_STATE), 0);
    EXPECT(to_init(a.qp) == EIO);
    auto listed = [](const char* name) {
      int n = 0;
      ibv_device** l = ibv_get_device_list(&n);
      bool seen = false;
      for (int i = 0; i < n; ++i) seen |= strcmp(ibv_get_device_name(l[i]), name) == 0;
      ibv_free_device_list(l);
      return seen;
    };
    EXPECT(!listed("mlx5_0"));
    EXPECT(listed("mlx5_1"));
    EXPECT_EQ(next_event(na.ctx, 0), -1);  // nothing after DEVICE_FATAL
    EXPECT_EQ(ibv_destroy_qp(a.qp), 0);
    EXPECT_EQ(ibv_destroy_qp(idle.qp), 0);
    EXPECT_EQ(ibv_destroy_cq(a.cq), 0);
    EXPECT_EQ(ibv_destroy_cq(idle.cq), 0);
    EXPECT_EQ(ibv_dereg_mr(la.mr), 0);
    EXPECT_EQ(ibv_dealloc_pd(na.pd), 0);
    EXPECT_EQ(ibv_close_device(na.ctx), 0);
    // After the reset the device is back; a new context works end to end.
    auto t0 = std::chrono::steady_clock::now();
    while (!listed("mlx5_0") && std::chrono::steady_clock::now() - t0 < Ms(3000))
      std::this_thread::sleep_for(Ms(10));
    EXPECT(listed("mlx5_0"));
    Node nn = open_dev("mlx5_0");
    Buf lb(nn, 1 << 16);
    Ep c = make_ep(nn), d = make_ep(nb);
    connect_pair(c, d);
    memcpy(lb.mem.data(), "again", 5);
    EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 3, &lb, 0, 5, rb.addr(100), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(c.cq).status, IBV_WC_SUCCESS);
    EXPECT(memcmp(rb.mem.data() + 100, "again", 5) == 0);
  }));
}

TEST_CASE("fakeverbs: lost ACKs of landed writes, and receive completions that lag") {
  expect_ok(run_scenario(kTwoEth, [] {
    setenv("FAKEVERBS_RECV_LAG_US", "200000", 1);  // read at the first verbs call
    setenv("FAKEVERBS_SEED", "7", 1);
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 1 << 16), rb(nb, 1 << 16);
    Ep a = make_ep(na), b = make_ep(nb);
    connect_pair(a, b);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(post_recv(b.qp, 100 + i, nullptr, 0, 0), 0);
    memcpy(la.mem.data(), "lagging", 7);
    // The requester's completion comes at once; the receiver's up to 200 ms later, in order.
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE_WITH_IMM, i, &la, 0, 7, rb.addr(64 * i), rb.mr->rkey,
                     htonl(i)),
                0);
    EXPECT_EQ(poll_n(a.cq, 4, 1000).size(), 4);
    EXPECT(memcmp(rb.mem.data() + 192, "lagging", 7) == 0);  // landed before its completion
    auto got = poll_n(b.cq, 4, 2000);
    EXPECT_EQ(got.size(), 4);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(ntohl(got[i].imm_data), i);
    EXPECT(std::chrono::steady_clock::now() - t0 < Ms(1000));
    // ERR puts lagging completions ahead of the flushes.
    EXPECT_EQ(post_recv(b.qp, 200, nullptr, 0, 0), 0);
    EXPECT_EQ(post_recv(b.qp, 201, nullptr, 0, 0), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 9, &la, 0, 7, rb.addr(512), rb.mr->rkey, 9),
              0);
    EXPECT_EQ(poll_one(a.cq).status, IBV_WC_SUCCESS);
    ibv_qp_attr ea{};
    ea.qp_state = IBV_QPS_ERR;
    EXPECT_EQ(ibv_modify_qp(b.qp, &ea, IBV_QP_STATE), 0);
    got = poll_n(b.cq, 2, 100);
    EXPECT_EQ(got.size(), 2);
    EXPECT_EQ(got[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(got[0].wr_id, 200);
    EXPECT_EQ(got[1].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(got[1].wr_id, 201);
    // ack_loss on the target's device: the write lands, its ACK does not come back.
    Ep c = make_ep(na), d = make_ep(nb);
    connect_pair(c, d);
    EXPECT_EQ(fakeverbs_inject("ack_loss,dev=mlx5_1"), 0);
    EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 10, &la, 0, 7, rb.addr(1024), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(c.cq, 3000).status, IBV_WC_RETRY_EXC_ERR);
    EXPECT(memcmp(rb.mem.data() + 1024, "lagging", 7) == 0);
  }));
}

TEST_CASE("fakeverbs: a dropped packet is resent after one local ACK timeout, time-scaled") {
  expect_ok(run_scenario(kTwoEth, [] {
    unsetenv("FAKEVERBS_RETRY_US");  // the QP's own timeout: 4.096 us x 2^20 / 64 = 67 ms
    setenv("R2CCL_TEST_TIME_SCALE", "64", 1);
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 1 << 16), rb(nb, 1 << 16);
    Ep a = make_ep(na), b = make_ep(nb);
    Addr aa = addr_of(a), ba = addr_of(b);
    EXPECT_EQ(to_init(a.qp), 0);
    ibv_qp_attr x = rtr_attr(na, ba);
    EXPECT_EQ(ibv_modify_qp(a.qp, &x, kRtrMask), 0);
    x = rts_attr();
    x.timeout = 20;
    x.retry_cnt = 2;
    EXPECT_EQ(ibv_modify_qp(a.qp, &x, kRtsMask), 0);
    connect_ep(b, aa);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(post_recv(b.qp, 100 + i, nullptr, 0, 0), 0);
    // Lost twice, then delivered by the second resend; the write behind it lands after it.
    EXPECT_EQ(fakeverbs_inject("drop,dev=mlx5_0,count=1,tries=2"), 0);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 1, &la, 0, 8, rb.addr(0), rb.mr->rkey, 1), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 2, &la, 0, 8, rb.addr(64), rb.mr->rkey, 2), 0);
    auto got = poll_n(a.cq, 2, 2000);
    const auto dt = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(got.size(), 2);
    EXPECT_EQ(got[0].wr_id, 1);
    EXPECT_EQ(got[0].status, IBV_WC_SUCCESS);
    EXPECT_EQ(got[1].status, IBV_WC_SUCCESS);
    EXPECT(dt >= Ms(130));  // two tries of 67 ms
    EXPECT(dt < Ms(1000));  // not the unscaled 8.6 s
    auto rg = poll_n(b.cq, 2, 1000);
    EXPECT_EQ(rg.size(), 2);
    EXPECT_EQ(rg[0].imm_data, 1);  // in posting order at the target
    EXPECT_EQ(rg[1].imm_data, 2);
    // More drops than retry_cnt (2) resends: retry-exceeded after 3 tries.
    EXPECT_EQ(fakeverbs_inject("drop,dev=mlx5_0,count=1,tries=3"), 0);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 3, &la, 0, 8, rb.addr(128), rb.mr->rkey), 0);
    ibv_wc wc = poll_one(a.cq, 2000);
    EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR);
  }));
}

TEST_CASE("fakeverbs: random per-packet delays keep each QP's order; a partial write") {
  expect_ok(run_scenario(kTwoEth, [] {
    setenv("FAKEVERBS_DELAY_US", "2000", 1);
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 1 << 16), rb(nb, 1 << 16);
    Ep a1 = make_ep(na), b1 = make_ep(nb), a2 = make_ep(na), b2 = make_ep(nb);
    connect_pair(a1, b1);
    connect_pair(a2, b2);
    for (int i = 0; i < 32; ++i) {
      EXPECT_EQ(post_recv(b1.qp, i, nullptr, 0, 0), 0);
      EXPECT_EQ(post_recv(b2.qp, i, nullptr, 0, 0), 0);
    }
    for (int i = 0; i < 32; ++i) {
      EXPECT_EQ(post(a1.qp, IBV_WR_RDMA_WRITE_WITH_IMM, i, &la, 0, 4, rb.addr(), rb.mr->rkey, i),
                0);
      EXPECT_EQ(post(a2.qp, IBV_WR_RDMA_WRITE_WITH_IMM, i, &la, 0, 4, rb.addr(), rb.mr->rkey, i),
                0);
    }
    for (Ep* e : {&b1, &b2}) {
      auto got = poll_n(e->cq, 32, 3000);
      EXPECT_EQ(got.size(), 32);
      for (int i = 0; i < 32; ++i) EXPECT_EQ(got[i].imm_data, i);  // in order per QP
    }
    EXPECT_EQ(poll_n(a1.cq, 32, 3000).size(), 32);
    EXPECT_EQ(poll_n(a2.cq, 32, 3000).size(), 32);
    // partial: half of the write lands, nothing completes, the requester runs out of retries.
    EXPECT_EQ(fakeverbs_inject("partial,dev=mlx5_1"), 0);
    memset(la.mem.data(), 'x', 100);
    EXPECT_EQ(post_recv(b1.qp, 98, nullptr, 0, 0), 0);
    EXPECT_EQ(
        post(a1.qp, IBV_WR_RDMA_WRITE_WITH_IMM, 99, &la, 0, 100, rb.addr(4096), rb.mr->rkey, 99),
        0);
    EXPECT_EQ(poll_one(a1.cq, 3000).status, IBV_WC_RETRY_EXC_ERR);
    EXPECT(all_eq(rb.mem.data() + 4096, 50, 'x'));
    EXPECT(all_eq(rb.mem.data() + 4146, 50, 0));
    EXPECT(quiet(b1.cq, 20));
  }));
}

TEST_CASE("fakeverbs: the dma-buf probe answers as told (FAKEVERBS_DMABUF)") {
  for (const bool probe : {false, true}) {
    expect_ok(run_scenario(kTwoEth, [probe] {
      if (probe) setenv("FAKEVERBS_DMABUF", "probe", 1);
      Node na = open_dev("mlx5_0");
      errno = 0;
      EXPECT(ibv_reg_dmabuf_mr(na.pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE) == nullptr);
      EXPECT_EQ(errno, probe ? EBADF : EOPNOTSUPP);
      EXPECT(ibv_reg_dmabuf_mr(na.pd, 0, 4096, 0, 3, IBV_ACCESS_LOCAL_WRITE) == nullptr);
      EXPECT_EQ(errno, EOPNOTSUPP);  // a real dma-buf is never imported
    }));
  }
}

TEST_CASE("fakeverbs: faults from FAKEVERBS_FAULTS") {
  expect_ok(run_scenario(
      kTwoEth,
      [] {
        Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
        Buf la(na, 65536), rb(nb, 65536);
        Ep a = make_ep(na), b = make_ep(nb);
        connect_pair(a, b);
        EXPECT_EQ(fakeverbs_port_state("mlx5_1"), 1);
        auto t0 = std::chrono::steady_clock::now();
        EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 1, &la, 0, 100, rb.addr(), rb.mr->rkey), 0);
        ibv_wc wc = poll_one(a.cq);
        EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR);  // rkey_error, armed at startup
        // after_ms=100 from the first post_send.
        EXPECT_EQ(next_event(nb.ctx, 2000), IBV_EVENT_PORT_ERR);
        EXPECT(std::chrono::steady_clock::now() - t0 >= Ms(95));
        EXPECT_EQ(fakeverbs_port_state("mlx5_1"), 0);
      },
      "rkey_error,dev=mlx5_0; port_down,dev=mlx5_1,after_ms=100"));
}

TEST_CASE("fakeverbs: blackhole") {
  expect_ok(run_scenario(kTwoEth, [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    Buf la(na, 65536), rb(nb, 65536), ra(na, 65536);
    memset(la.mem.data(), 'z', la.mem.size());
    memset(rb.mem.data(), 'q', rb.mem.size());
    Ep a = make_ep(na), b = make_ep(nb);
    connect_pair(a, b);
    EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 1, &la, 0, 100, rb.addr(), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a.cq).status, IBV_WC_SUCCESS);
    memset(rb.mem.data(), 0, rb.mem.size());
    EXPECT_EQ(fakeverbs_inject("blackhole,dev=mlx5_0"), 0);
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, 10 + i, &la, 0, 100, rb.addr(1000), rb.mr->rkey), 0);
    EXPECT(quiet(a.cq, 5 * kRetryMs));  // neither delivered nor completed
    EXPECT(all_eq(rb.mem.data(), rb.mem.size(), 0));
    // Packets towards the blackholed QP are dropped: the sender retries out.
    EXPECT_EQ(post(b.qp, IBV_WR_RDMA_WRITE, 20, &rb, 0, 100, ra.addr(), ra.mr->rkey), 0);
    EXPECT_EQ(poll_one(b.cq).status, IBV_WC_RETRY_EXC_ERR);
    // To ERR: everything flushes, in order.
    ibv_qp_attr err{};
    err.qp_state = IBV_QPS_ERR;
    EXPECT_EQ(ibv_modify_qp(a.qp, &err, IBV_QP_STATE), 0);
    auto w = poll_n(a.cq, 4);
    EXPECT_EQ(w.size(), 4);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(w[i].wr_id, 10 + i);
      EXPECT_EQ(w[i].status, IBV_WC_WR_FLUSH_ERR);
    }
    // A QP created after the trigger works.
    Ep c = make_ep(na), d = make_ep(nb);
    connect_pair(c, d);
    EXPECT_EQ(post(c.qp, IBV_WR_RDMA_WRITE, 30, &la, 0, 100, rb.addr(2000), rb.mr->rkey), 0);
    EXPECT_EQ(poll_one(c.cq).status, IBV_WC_SUCCESS);
    EXPECT(all_eq(rb.mem.data() + 2000, 100, 'z'));
  }));
}

TEST_CASE("fakeverbs: hold_write delivers a stale write late") {
  // Path 1: a1 (mlx5_0) -> t1 (mlx5_2); path 2: a2 (mlx5_1) -> t2 (mlx5_2); both target the
  // same buffer on mlx5_2.
  auto scenario = [](bool target_in_err) {
    Node n0 = open_dev("mlx5_0"), n1 = open_dev("mlx5_1"), n2 = open_dev("mlx5_2");
    Buf old_data(n0, 65536), replay(n1, 65536), fresh(n1, 65536), tb(n2, 65536);
    memset(old_data.mem.data(), 'O', 65536);
    memset(replay.mem.data(), 'O', 65536);
    memset(fresh.mem.data(), 'N', 65536);
    Ep a1 = make_ep(n0), a2 = make_ep(n1), t1 = make_ep(n2), t2 = make_ep(n2);
    connect_pair(a1, t1);
    connect_pair(a2, t2);
    EXPECT_EQ(fakeverbs_inject("hold_write,dev=mlx5_0"), 0);
    EXPECT_EQ(post(a1.qp, IBV_WR_RDMA_WRITE, 1, &old_data, 0, 4096, tb.addr(), tb.mr->rkey), 0);
    EXPECT_EQ(post(a1.qp, IBV_WR_RDMA_WRITE, 2, &old_data, 0, 16, tb.addr(32768), tb.mr->rkey), 0);
    EXPECT(quiet(a1.cq, 3 * kRetryMs));  // held: not delivered, not completed, no retry error
    EXPECT(all_eq(tb.mem.data(), 65536, 0));
    if (target_in_err) {  // the failed path is torn down at both ends
      ibv_qp_attr err{};
      err.qp_state = IBV_QPS_ERR;
      EXPECT_EQ(ibv_modify_qp(t1.qp, &err, IBV_QP_STATE), 0);
      EXPECT_EQ(ibv_modify_qp(a1.qp, &err, IBV_QP_STATE), 0);
      auto w = poll_n(a1.cq, 2);
      EXPECT_EQ(w.size(), 2);
      EXPECT_EQ(w[0].wr_id, 1);
      EXPECT_EQ(w[0].status, IBV_WC_WR_FLUSH_ERR);
      EXPECT_EQ(w[1].status, IBV_WC_WR_FLUSH_ERR);
    }
    // A non-overlapping write does not count towards the release.
    EXPECT_EQ(post(a2.qp, IBV_WR_RDMA_WRITE, 10, &fresh, 0, 100, tb.addr(60000), tb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a2.cq).status, IBV_WC_SUCCESS);
    // The replay of the chunk on path 2 (1st overlapping ack), then the next message (2nd).
    EXPECT_EQ(post(a2.qp, IBV_WR_RDMA_WRITE, 11, &replay, 0, 4096, tb.addr(), tb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a2.cq).status, IBV_WC_SUCCESS);
    EXPECT(all_eq(tb.mem.data(), 4096, 'O'));
    EXPECT(quiet(a1.cq, 2 * kRetryMs));
    EXPECT_EQ(post(a2.qp, IBV_WR_RDMA_WRITE, 12, &fresh, 0, 4096, tb.addr(), tb.mr->rkey), 0);
    EXPECT_EQ(poll_one(a2.cq).status, IBV_WC_SUCCESS);
    if (!target_in_err) {
      // Released: the stale data lands over the new message; then a1 completes in order.
      auto w = poll_n(a1.cq, 2);
      EXPECT_EQ(w.size(), 2);
      EXPECT_EQ(w[0].wr_id, 1);
      EXPECT_EQ(w[0].status, IBV_WC_SUCCESS);
      EXPECT_EQ(w[1].wr_id, 2);
      EXPECT_EQ(w[1].status, IBV_WC_SUCCESS);
      EXPECT(all_eq(tb.mem.data(), 4096, 'O'));
      EXPECT(all_eq(tb.mem.data() + 32768, 16, 'O'));
    } else {
      // Released into a QP in ERR: dropped.
      std::this_thread::sleep_for(Ms(3 * kRetryMs));
      EXPECT(all_eq(tb.mem.data(), 4096, 'N'));
      EXPECT(all_eq(tb.mem.data() + 32768, 16, 0));
      EXPECT(quiet(a1.cq, 2));
    }
  };
  expect_ok(run_scenario(kTwoEth, [&] { scenario(false); }));
  expect_ok(run_scenario(kTwoEth, [&] { scenario(true); }));
}

TEST_CASE("fakeverbs: peer process late then killed") {
  expect_ok(run_scenario("mlx5_0,eth,10.0.0.1", [] {
    int sp[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sp), 0);
    pid_t pid = fork();
    if (pid == 0) {
      setenv("FAKEVERBS_DEVICES", "mlx5_0,eth,10.0.0.2", 1);
      Node m = open_dev("mlx5_0");
      Ep t = make_ep(m);
      Buf b(m, 65536);
      Addr me = addr_of(t), peer;
      uint64_t addr = b.addr();
      uint32_t rkey = b.mr->rkey;
      write_all(sp[1], &me, sizeof me);
      write_all(sp[1], &addr, 8);
      write_all(sp[1], &rkey, 4);
      read_all(sp[1], &peer, sizeof peer);
      connect_ep(t, peer);
      char c = 1;
      write_all(sp[1], &c, 1);
      for (;;) pause();
    }
    Node n = open_dev("mlx5_0");
    Ep e = make_ep(n), e2 = make_ep(n);
    Buf la(n, 65536);
    Addr peer, me = addr_of(e);
    uint64_t raddr;
    uint32_t rkey;
    read_all(sp[0], &peer, sizeof peer);
    read_all(sp[0], &raddr, 8);
    read_all(sp[0], &rkey, 4);
    write_all(sp[0], &me, sizeof me);
    connect_ep(e, peer);
    char c;
    read_all(sp[0], &c, 1);
    EXPECT_EQ(post(e.qp, IBV_WR_RDMA_WRITE, 1, &la, 0, 4096, raddr, rkey), 0);
    EXPECT_EQ(poll_one(e.cq).status, IBV_WC_SUCCESS);
    // A peer whose NIC thread answers late (its process stopped for 3 retry times, as a
    // loaded host may delay it) loses nothing: loss comes from the fault state, never the clock.
    kill(pid, SIGSTOP);
    int st;
    EXPECT_EQ(waitpid(pid, &st, WUNTRACED), pid);
    EXPECT(WIFSTOPPED(st));
    EXPECT_EQ(post(e.qp, IBV_WR_RDMA_WRITE, 10, &la, 0, 4096, raddr, rkey), 0);
    std::this_thread::sleep_for(Ms(3 * kRetryMs));
    kill(pid, SIGCONT);
    ibv_wc late = poll_one(e.cq);
    EXPECT_EQ(late.wr_id, 10);
    EXPECT_EQ(late.status, IBV_WC_SUCCESS);
    // Outstanding when it dies (stopped first, so nothing can be acknowledged).
    kill(pid, SIGSTOP);
    EXPECT_EQ(waitpid(pid, &st, WUNTRACED), pid);  // really stopped
    EXPECT(WIFSTOPPED(st));
    EXPECT_EQ(post(e.qp, IBV_WR_RDMA_WRITE, 2, &la, 0, 4096, raddr, rkey), 0);
    kill(pid, SIGKILL);
    EXPECT_EQ(waitpid(pid, &st, 0), pid);
    EXPECT_EQ(post(e.qp, IBV_WR_RDMA_WRITE, 3, &la, 0, 4096, raddr, rkey), 0);
    auto w = poll_n(e.cq, 2);
    EXPECT_EQ(w.size(), 2);
    EXPECT_EQ(w[0].wr_id, 2);
    EXPECT_EQ(w[0].status, IBV_WC_RETRY_EXC_ERR);
    EXPECT_EQ(w[1].status, IBV_WC_WR_FLUSH_ERR);
    // A QP connected to the dead process afterwards: retry exceeded too.
    connect_ep(e2, peer);
    EXPECT_EQ(post(e2.qp, IBV_WR_RDMA_WRITE, 4, &la, 0, 4096, raddr, rkey), 0);
    EXPECT_EQ(poll_one(e2.cq).status, IBV_WC_RETRY_EXC_ERR);
  }));
}

// ---------------------------------------------------------------------------------------
// Addressing (README "Addressing"): P_Keys, a port that requires a GRH, active MTUs, full GID
// tables with VLAN netdevs, GIDs removed and re-added around a flap, bad options.

namespace {

// An endpoint of `n` connected to `r` with explicit addressing: P_Key index, path MTU, and
// (when grh) the GID at sgid to dgid. Returns the RTR result (0 or EINVAL).
int connect_with(Ep& e, const Addr& r, uint16_t pkey_index, ibv_mtu mtu, bool grh, int sgid,
                 const ibv_gid& dgid) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.pkey_index = pkey_index;
  a.qp_access_flags = kAllAccess;
  int rc =
      ibv_modify_qp(e.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc) return rc;
  a = rtr_attr(*e.n, r);
  a.path_mtu = mtu;
  a.ah_attr.is_global = grh ? 1 : 0;
  if (grh) {
    a.ah_attr.grh.dgid = dgid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(sgid);
  }
  rc = ibv_modify_qp(e.qp, &a, kRtrMask);
  if (rc) return rc;
  a = rts_attr();
  return ibv_modify_qp(e.qp, &a, kRtsMask);
}

// Status of one RDMA WRITE of `len` bytes from a to b.
ibv_wc_status write_status(Ep& a, Buf& la, Buf& rb, uint32_t len) {
  EXPECT_EQ(post(a.qp, IBV_WR_RDMA_WRITE, len, &la, 0, len, rb.addr(), rb.mr->rkey), 0);
  return poll_one(a.cq).status;
}

ibv_gid gid_at(const Node& n, int i) {
  ibv_gid g{};
  EXPECT_EQ(ibv_query_gid(n.ctx, 1, i, &g), 0);
  return g;
}

std::string sysfs_line(const Node& n, const std::string& rel) {
  std::ifstream f(std::string(n.ctx->device->ibdev_path) + "/ports/1/" + rel);
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace

TEST_CASE("fakeverbs: P_Key tables and matching") {
  expect_ok(
      run_scenario("mlx5_0,ib,1,pkeys=0x7fff:0x8001;mlx5_1,ib,2,pkeys=0x8001:0x7fff:0xffff", [] {
        Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
        ibv_port_attr pa;
        EXPECT_EQ(ibv_query_port(na.ctx, 1, &pa), 0);
        EXPECT_EQ(pa.pkey_tbl_len, 2);
        __be16 k = 0;
        EXPECT_EQ(ibv_query_pkey(na.ctx, 1, 1, &k), 0);
        EXPECT_EQ(be16toh(k), 0x8001);
        EXPECT_EQ(ibv_query_pkey(na.ctx, 1, 2, &k), -1);
        EXPECT_EQ(errno, EINVAL);
        EXPECT(sysfs_line(na, "pkeys/0") == "0x7fff");
        Buf la(na, 65536), rb(nb, 65536);
        ibv_gid none{};
        {  // INIT with an index beyond the table
          Ep a = make_ep(na), b = make_ep(nb);
          EXPECT_EQ(connect_with(a, addr_of(b), 2, IBV_MTU_4096, false, 0, none), EINVAL);
        }
        {  // 0x7fff <-> 0x7fff: both limited members, dropped
          Ep a = make_ep(na), b = make_ep(nb);
          EXPECT_EQ(connect_with(a, addr_of(b), 0, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(connect_with(b, addr_of(a), 1, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(write_status(a, la, rb, 100), IBV_WC_RETRY_EXC_ERR);
        }
        {  // 0x8001 <-> 0x8001 (index 1 here, 0 there): delivered
          Ep a = make_ep(na), b = make_ep(nb);
          EXPECT_EQ(connect_with(a, addr_of(b), 1, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(connect_with(b, addr_of(a), 0, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(write_status(a, la, rb, 100), IBV_WC_SUCCESS);
        }
        {  // 0x7fff (limited) <-> 0xffff (full member of the same partition): delivered
          Ep a = make_ep(na), b = make_ep(nb);
          EXPECT_EQ(connect_with(a, addr_of(b), 0, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(connect_with(b, addr_of(a), 2, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(write_status(a, la, rb, 100), IBV_WC_SUCCESS);
        }
        {  // 0x7fff <-> 0x8001: other partitions
          Ep a = make_ep(na), b = make_ep(nb);
          EXPECT_EQ(connect_with(a, addr_of(b), 0, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(connect_with(b, addr_of(a), 0, IBV_MTU_4096, false, 0, none), 0);
          EXPECT_EQ(write_status(a, la, rb, 100), IBV_WC_RETRY_EXC_ERR);
        }
      }));
}

TEST_CASE("fakeverbs: a port that requires a GRH, and active MTUs") {
  expect_ok(run_scenario("mlx5_0,ib,1,grh_required;mlx5_1,ib,2", [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    ibv_port_attr pa;
    EXPECT_EQ(ibv_query_port(na.ctx, 1, &pa), 0);
    EXPECT_EQ(pa.flags & IBV_QPF_GRH_REQUIRED, IBV_QPF_GRH_REQUIRED);
    Buf la(na, 65536), lb(nb, 65536);
    Ep a = make_ep(na), b = make_ep(nb);
    ibv_gid none{};
    EXPECT_EQ(connect_with(a, addr_of(b), 0, IBV_MTU_4096, false, 0, none), EINVAL);
    // b addresses a without a GRH: a's port drops it.
    EXPECT_EQ(connect_with(b, addr_of(a), 0, IBV_MTU_4096, false, 0, none), 0);
    EXPECT_EQ(write_status(b, lb, la, 100), IBV_WC_RETRY_EXC_ERR);
    Ep c = make_ep(na), d = make_ep(nb);
    EXPECT_EQ(connect_with(c, addr_of(d), 0, IBV_MTU_4096, true, 0, gid_at(nb, 0)), 0);
    EXPECT_EQ(connect_with(d, addr_of(c), 0, IBV_MTU_4096, true, 0, gid_at(na, 0)), 0);
    EXPECT_EQ(write_status(d, lb, la, 100), IBV_WC_SUCCESS);
    EXPECT_EQ(write_status(c, la, lb, 100), IBV_WC_SUCCESS);
  }));
  expect_ok(run_scenario("mlx5_0,eth,10.0.0.1;mlx5_1,eth,10.0.0.2,mtu=1024", [] {
    Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
    ibv_port_attr pa;
    EXPECT_EQ(ibv_query_port(nb.ctx, 1, &pa), 0);
    EXPECT_EQ(pa.active_mtu, IBV_MTU_1024);
    EXPECT_EQ(pa.max_mtu, IBV_MTU_4096);
    Buf la(na, 65536), rb(nb, 65536);
    Ep a = make_ep(na), b = make_ep(nb);
    const Addr ba = addr_of(b), aa = addr_of(a);
    EXPECT_EQ(connect_with(a, ba, 0, IBV_MTU_4096, true, 3, ba.gid), 0);
    EXPECT_EQ(connect_with(b, aa, 0, IBV_MTU_4096, true, 3, aa.gid), 0);
    EXPECT_EQ(write_status(a, la, rb, 1024), IBV_WC_SUCCESS);  // one packet fits
    EXPECT_EQ(write_status(a, la, rb, 1025), IBV_WC_RETRY_EXC_ERR);
    Ep c = make_ep(na), d = make_ep(nb);
    const Addr da = addr_of(d), ca = addr_of(c);
    EXPECT_EQ(connect_with(c, da, 0, IBV_MTU_1024, true, 3, da.gid), 0);
    EXPECT_EQ(connect_with(d, ca, 0, IBV_MTU_1024, true, 3, ca.gid), 0);
    EXPECT_EQ(write_status(c, la, rb, 65536), IBV_WC_SUCCESS);
  }));
}

TEST_CASE("fakeverbs: 255-entry GID tables, VLAN netdevs, GIDs around a flap") {
  expect_ok(
      run_scenario("mlx5_0,eth,10.0.0.1,gids=255;mlx5_1,eth,10.0.0.2,gids=255,gid_rotate=7", [] {
        Node na = open_dev("mlx5_0"), nb = open_dev("mlx5_1");
        ibv_port_attr pa;
        EXPECT_EQ(ibv_query_port(na.ctx, 1, &pa), 0);
        EXPECT_EQ(pa.gid_tbl_len, 255);
        ibv_gid_entry e{};
        EXPECT_EQ(ibv_query_gid_ex(na.ctx, 1, 3, &e, 0), 0);
        EXPECT_EQ(e.gid_type, IBV_GID_TYPE_ROCE_V2);
        EXPECT_EQ(e.gid.raw[10], 0xff);
        EXPECT_EQ(e.gid.raw[15], 1);
        EXPECT(sysfs_line(na, "gid_attrs/ndevs/3") == "eth0");
        EXPECT(sysfs_line(na, "gid_attrs/ndevs/0") == "eth0");
        EXPECT(sysfs_line(na, "gid_attrs/types/5") == "RoCE v2");
        EXPECT_EQ(ibv_query_gid_ex(na.ctx, 1, 254, &e, 0), 0);  // full
        // Find the IPv4 v2 GIDs of VLAN 100 at both ends, and b's untagged one.
        auto find = [](const Node& n, const std::string& ndev, uint8_t first) {
          for (int i = 0; i < 255; ++i) {
            ibv_gid_entry x{};
            if (ibv_query_gid_ex(n.ctx, 1, i, &x, 0) != 0) continue;
            if (x.gid_type == IBV_GID_TYPE_ROCE_V2 && x.gid.raw[10] == 0xff &&
                x.gid.raw[12] == first &&
                sysfs_line(n, "gid_attrs/ndevs/" + std::to_string(i)) == ndev)
              return i;
          }
          return -1;
        };
        const int a100 = find(na, "eth0.100", 10), b100 = find(nb, "eth1.100", 10),
                  b_own = find(nb, "eth1", 10);
        EXPECT(a100 >= 0 && b100 >= 0 && b_own >= 0);
        EXPECT(b_own != 3);  // rotated
        Buf la(na, 65536), rb(nb, 65536);
        Ep a = make_ep(na), b = make_ep(nb), c = make_ep(na), d = make_ep(nb);
        // From VLAN 100 to b's untagged GID: another VLAN, dropped.
        EXPECT_EQ(connect_with(a, addr_of(b), 0, IBV_MTU_4096, true, a100, gid_at(nb, b_own)), 0);
        EXPECT_EQ(connect_with(b, addr_of(a), 0, IBV_MTU_4096, true, b100, gid_at(na, a100)), 0);
        EXPECT_EQ(write_status(a, la, rb, 100), IBV_WC_RETRY_EXC_ERR);
        // VLAN 100 at both ends: delivered.
        EXPECT_EQ(connect_with(c, addr_of(d), 0, IBV_MTU_4096, true, a100, gid_at(nb, b100)), 0);
        EXPECT_EQ(connect_with(d, addr_of(c), 0, IBV_MTU_4096, true, b100, gid_at(na, a100)), 0);
        EXPECT_EQ(write_status(c, la, rb, 100), IBV_WC_SUCCESS);
      }));
  expect_ok(run_scenario(kTwoEth, [] {
    Node na = open_dev("mlx5_0");
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_0,for_ms=50,gids=move"), 0);
    EXPECT_EQ(next_event(na.ctx, 1000), IBV_EVENT_PORT_ERR);
    EXPECT_EQ(next_event(na.ctx, 1000), IBV_EVENT_GID_CHANGE);
    ibv_gid_entry e{};
    EXPECT_EQ(ibv_query_gid_ex(na.ctx, 1, 3, &e, 0), ENODATA);
    EXPECT_EQ(ibv_query_gid_ex(na.ctx, 1, 1, &e, 0), 0);  // link-local stays
    EXPECT_EQ(next_event(na.ctx, 1000), IBV_EVENT_PORT_ACTIVE);
    EXPECT_EQ(next_event(na.ctx, 1000), IBV_EVENT_GID_CHANGE);
    EXPECT_EQ(ibv_query_gid_ex(na.ctx, 1, 3, &e, 0), ENODATA);
    EXPECT_EQ(ibv_query_gid_ex(na.ctx, 1, 5, &e, 0), 0);
    EXPECT_EQ(e.gid_type, IBV_GID_TYPE_ROCE_V2);
    EXPECT_EQ(e.gid.raw[15], 1);
    EXPECT_EQ(ibv_query_gid_ex(na.ctx, 1, 4, &e, 0), 0);
    EXPECT_EQ(e.gid_type, IBV_GID_TYPE_ROCE_V1);
    // A QP on the old index fails at RTR.
    Ep a = make_ep(na);
    EXPECT_EQ(connect_with(a, addr_of(a), 0, IBV_MTU_4096, true, 3, gid_at(na, 5)), EINVAL);
  }));
}

TEST_CASE("fakeverbs: bad addressing options are refused") {
  for (const char* devs :
       {"mlx5_0,ib,1,pkeys=0x8000", "mlx5_0,ib,1,pkeys=0xffff:x", "mlx5_0,eth,10.0.0.1,mtu=512",
        "mlx5_0,ib,1,gids=16", "mlx5_0,eth,10.0.0.1,gids=256", "mlx5_0,eth,10.0.0.1,gid_rotate=3",
        "mlx5_0,eth,10.0.0.1,netdev=a.b", "mlx5_0,ib,1,grh_required=yes"}) {
    INFO(devs);
    expect_ok(run_scenario(devs, [] {
      int n = 0;
      EXPECT(ibv_get_device_list(&n) == nullptr);
      EXPECT_EQ(errno, EINVAL);
    }));
  }
  expect_ok(run_scenario(kTwoEth, [] {
    EXPECT_EQ(fakeverbs_inject("port_down,dev=mlx5_0,gids=later"), -1);
    EXPECT_EQ(fakeverbs_inject("blackhole,dev=mlx5_0,gids=move"), -1);
  }));
}
