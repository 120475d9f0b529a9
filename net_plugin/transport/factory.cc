#include "transport/factory.h"

#include <atomic>
#include <memory>
#include <mutex>

#include "transport/ib/gdr.h"
#include "transport/ib/runtime.h"
#include "transport/tcp/runtime.h"

namespace r2ccl::net {
namespace {

std::mutex g_mu;
// Never destroyed: the background thread may outlive main(), and NCCL may dlclose and
// dlopen the plugin again (it is linked -z nodelete).
Transport* g_transport = nullptr;
std::atomic<Transport*> g_ready{nullptr};
bool g_tried = false;
Status g_status = Status::kOk;
std::string g_why, g_err;

Status create(Transport** out, std::string* why, std::string* err) {
  const Config* cfg = nullptr;
  if (!process_config(&cfg, err)) return Status::kInvalidUsage;
  const std::string& t = cfg->transport;
  if (t != "auto" && t != "ib" && t != "tcp") {
    *err = "R2CCL_TRANSPORT='" + t + "': accepted values are auto, ib and tcp";
    return Status::kInvalidUsage;
  }
  // Verbs-only settings are checked whatever the transport: a typo must fail init on a host
  // that falls back to TCP too, not when the job first meets an HCA.
  int gdr_level = 0;
  if (!ib::gdr_level_of(*cfg, &gdr_level, nullptr, err)) return Status::kInvalidUsage;
  if (t != "tcp") {
    std::unique_ptr<ib::Runtime> ib;
    R2CCL_CHECK(ib::Runtime::create(cfg, t == "ib", &ib, why, err));
    if (ib) {
      *out = ib.release();
      return Status::kOk;
    }
  } else {
    *why = "R2CCL_TRANSPORT=tcp";
  }
  std::unique_ptr<tcp::Runtime> tcp;
  R2CCL_CHECK(tcp::Runtime::create(cfg, &tcp, err));
  *out = tcp.release();
  return Status::kOk;
}

}  // namespace

Status get_transport(Transport** out, std::string* why, std::string* err) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_tried) {
    g_tried = true;
    g_status = create(&g_transport, &g_why, &g_err);
    if (g_status == Status::kOk) g_ready.store(g_transport);
  }
  if (why) *why = g_why;
  if (g_status != Status::kOk) {
    if (err) *err = g_err;
    return g_status;
  }
  *out = g_transport;
  return Status::kOk;
}

Transport* peek_transport() { return g_ready.load(); }

}  // namespace r2ccl::net
