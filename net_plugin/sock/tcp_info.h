// TCP_INFO reads of one socket: counters for the failure predictor's retransmit signal on TCP
// rails, and the peer's advertised window and the answers to window probes, for the TCP
// transport's zero-window rule and its "the peer's machine still answers" liveness hint.
// Separate from socket_util because it needs the kernel's struct tcp_info (<linux/tcp.h>, which
// has tcpi_segs_out; glibc's <netinet/tcp.h> does not) and the two headers do not mix.
// Thread-safety: any thread (one getsockopt).
#pragma once

#include <cstdint>

namespace r2ccl::net {

struct TcpCounters {
  uint32_t total_retrans = 0;  // segments retransmitted over the socket's life (wraps at 2^32)
  uint32_t segs_out = 0;       // segments sent, retransmissions included (Linux >= 4.2; wraps)
};

// False when `fd` is not a TCP socket or the kernel refuses (errno set).
bool read_tcp_counters(int fd, TcpCounters* out);

// What the kernel knows of the peer's end of one socket (TCP_INFO).
struct TcpPeerView {
  uint32_t last_ack_ms = 0;   // since the last ACK from the peer, window-probe answers included
  bool window_known = false;  // the kernel reports the window (tcpi_snd_wnd, Linux >= 5.4)
  // Bytes the peer last advertised it can take; below one segment: its receiver stopped
  // reading (its kernel is up: it sent that ACK).
  uint32_t window = 0;
  uint32_t mss = 0;                // this end's segment size (tcpi_snd_mss), bytes
  uint32_t unanswered_probes = 0;  // window or keepalive probes unanswered since the last ACK
};

// False when `fd` is not a TCP socket or the kernel refuses (errno set).
bool read_tcp_peer(int fd, TcpPeerView* out);
}  // namespace r2ccl::net
