// TCP_INFO counters of one socket, for the failure predictor's retransmit signal on TCP rails.
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

}  // namespace r2ccl::net
