#include "sock/tcp_info.h"

#include <linux/tcp.h>
#include <netinet/in.h>  // IPPROTO_TCP (the struct comes from linux/tcp.h)
#include <sys/socket.h>

#include <cstddef>
#include <cstring>

namespace r2ccl::net {
namespace {

// The socket's TCP_INFO, zeroed first; *len: the bytes the kernel filled (an older kernel
// returns a shorter struct, so a field past *len is absent). False when getsockopt fails.
bool get_tcp_info(int fd, struct tcp_info* ti, socklen_t* len) {
  std::memset(ti, 0, sizeof(*ti));
  *len = sizeof(*ti);
  return getsockopt(fd, IPPROTO_TCP, TCP_INFO, ti, len) == 0;
}

}  // namespace

bool read_tcp_counters(int fd, TcpCounters* out) {
  struct tcp_info ti;
  socklen_t len = 0;
  if (!get_tcp_info(fd, &ti, &len)) return false;
  out->total_retrans = ti.tcpi_total_retrans;
  out->segs_out = len >= offsetof(struct tcp_info, tcpi_segs_out) + sizeof(ti.tcpi_segs_out)
                      ? ti.tcpi_segs_out
                      : 0;
  return true;
}

bool read_tcp_peer(int fd, TcpPeerView* out) {
  struct tcp_info ti;
  socklen_t len = 0;
  if (!get_tcp_info(fd, &ti, &len)) return false;
  out->last_ack_ms = ti.tcpi_last_ack_recv;
  out->unanswered_probes = ti.tcpi_probes;
  out->window_known = len >= offsetof(struct tcp_info, tcpi_snd_wnd) + sizeof(ti.tcpi_snd_wnd);
  out->window = out->window_known ? ti.tcpi_snd_wnd : 0;
  out->mss = ti.tcpi_snd_mss;
  return true;
}

}  // namespace r2ccl::net
