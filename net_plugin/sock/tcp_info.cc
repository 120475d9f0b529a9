#include "sock/tcp_info.h"

#include <linux/tcp.h>
#include <netinet/in.h>  // IPPROTO_TCP (the struct comes from linux/tcp.h)
#include <sys/socket.h>

#include <cstddef>
#include <cstring>

namespace r2ccl::net {

bool read_tcp_counters(int fd, TcpCounters* out) {
  struct tcp_info ti;
  std::memset(&ti, 0, sizeof(ti));
  socklen_t len = sizeof(ti);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return false;
  out->total_retrans = ti.tcpi_total_retrans;
  // A kernel older than the field returns a shorter struct: segs_out stays 0.
  out->segs_out = len >= offsetof(struct tcp_info, tcpi_segs_out) + sizeof(ti.tcpi_segs_out)
                      ? ti.tcpi_segs_out
                      : 0;
  return true;
}

bool read_tcp_peer(int fd, TcpPeerView* out) {
  struct tcp_info ti;
  std::memset(&ti, 0, sizeof(ti));
  socklen_t len = sizeof(ti);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return false;
  out->last_ack_ms = ti.tcpi_last_ack_recv;
  out->unanswered_probes = ti.tcpi_probes;
  out->window_known = len >= offsetof(struct tcp_info, tcpi_snd_wnd) + sizeof(ti.tcpi_snd_wnd);
  out->window = out->window_known ? ti.tcpi_snd_wnd : 0;
  return true;
}

}  // namespace r2ccl::net
