// ptrSupport probes of the verbs transport (transport/ib/caps.h) over an in-test verbs table
// and made-up sysfs trees: GPU pointers only with a peer-memory module, dma-buf only where a
// probe registration of fd -1 fails with EBADF on every HCA; the rest falls back.
#include <sys/stat.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <string>

#include "r2ccl/nccl_abi.h"
#include "transport/ib/caps.h"

using namespace r2ccl::net::ib;

namespace {

int g_probe_errno = EBADF;  // what the stub's ibv_reg_dmabuf_mr fails with
int g_probes = 0;
ibv_pd g_pd_a{}, g_pd_b{};
ibv_pd* g_refusing_pd = nullptr;  // this PD fails with EOPNOTSUPP whatever g_probe_errno says

VerbsApi stub(bool with_dmabuf) {
  VerbsApi v{};
  if (with_dmabuf)
    v.reg_dmabuf_mr = [](ibv_pd* pd, uint64_t, size_t, uint64_t, int fd, int) -> ibv_mr* {
      ++g_probes;
      errno = fd < 0 ? (pd == g_refusing_pd ? EOPNOTSUPP : g_probe_errno) : EINVAL;
      return nullptr;
    };
  v.dereg_mr = [](ibv_mr*) { return 0; };
  return v;
}

// A sysfs tree with the given file (relative to the root) present, or none.
struct Sysfs {
  std::string root;
  explicit Sysfs(const std::string& file) {
    char t[] = "/tmp/r2ccl-caps-XXXXXX";
    REQUIRE(mkdtemp(t) != nullptr);
    root = t;
    if (file.empty()) return;
    const std::string path = root + file;
    for (size_t i = root.size() + 1; i < path.size(); ++i)
      if (path[i] == '/') ::mkdir(path.substr(0, i).c_str(), 0755);
    std::ofstream(path) << "2.0\n";
  }
  ~Sysfs() { std::system(("rm -rf '" + root + "'").c_str()); }
};

}  // namespace

TEST_CASE("ib caps: a build without CUDA advertises host memory only, probing nothing") {
  g_probes = 0;
  Sysfs sys("/module/nvidia_peermem/version");
  const VerbsApi v = stub(true);
  const PtrSupport s = probe_ptr_support(v, {&g_pd_a}, false, sys.root);
  CHECK(s.types == NCCL_PTR_HOST);
  CHECK(s.cuda.find("without CUDA") != std::string::npos);
  CHECK(g_probes == 0);
}

TEST_CASE("ib caps: GPU pointers need a peer-memory module (nvidia_peermem or nv_peer_mem)") {
  g_probe_errno = EBADF;
  g_refusing_pd = nullptr;
  const VerbsApi v = stub(true);
  for (const char* f : {"/module/nvidia_peermem/version", "/kernel/mm/memory_peers/nv_mem/version",
                        "/kernel/mm/memory_peers/nv_mem_nc/version"}) {
    Sysfs sys(f);
    const PtrSupport s = probe_ptr_support(v, {&g_pd_a}, true, sys.root);
    CHECK((s.types & NCCL_PTR_CUDA) != 0);
    CHECK(s.cuda.find(f) != std::string::npos);
  }
  Sysfs none("");
  const PtrSupport s = probe_ptr_support(v, {&g_pd_a}, true, none.root);
  CHECK((s.types & NCCL_PTR_CUDA) == 0);
  CHECK((s.types & NCCL_PTR_HOST) != 0);                      // host memory always
  CHECK((s.types & NCCL_PTR_DMABUF) != 0);                    // dma-buf does not need the module
  CHECK(s.cuda.find("nvidia_peermem") != std::string::npos);  // the log says what is missing
}

TEST_CASE("ib caps: dma-buf only where the probe registration fails with EBADF on every HCA") {
  Sysfs sys("/module/nvidia_peermem/version");
  g_refusing_pd = nullptr;
  SECTION("supported: EBADF (and an errno other than the two refusals)") {
    for (int e : {EBADF, EINVAL}) {
      g_probe_errno = e;
      CHECK((probe_ptr_support(stub(true), {&g_pd_a, &g_pd_b}, true, sys.root).types &
             NCCL_PTR_DMABUF) != 0);
    }
  }
  SECTION("refused: EOPNOTSUPP or EPROTONOSUPPORT, named") {
    for (int e : {EOPNOTSUPP, EPROTONOSUPPORT}) {
      g_probe_errno = e;
      const PtrSupport s = probe_ptr_support(stub(true), {&g_pd_a}, true, sys.root);
      CHECK((s.types & NCCL_PTR_DMABUF) == 0);
      CHECK((s.types & NCCL_PTR_CUDA) != 0);  // falls back to GPUDirect with ibv_reg_mr
      CHECK(s.dmabuf.find(strerror(e)) != std::string::npos);
    }
  }
  SECTION("one HCA of two refuses: not advertised") {
    g_probe_errno = EBADF;
    g_refusing_pd = &g_pd_b;
    CHECK((probe_ptr_support(stub(true), {&g_pd_a, &g_pd_b}, true, sys.root).types &
           NCCL_PTR_DMABUF) == 0);
    g_refusing_pd = nullptr;
  }
  SECTION("no ibv_reg_dmabuf_mr in the verbs library (rdma-core < 34)") {
    const PtrSupport s = probe_ptr_support(stub(false), {&g_pd_a}, true, sys.root);
    CHECK((s.types & NCCL_PTR_DMABUF) == 0);
    CHECK(s.dmabuf.find("rdma-core < 34") != std::string::npos);
  }
}
