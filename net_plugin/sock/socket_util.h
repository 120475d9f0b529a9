// Socket helpers for rail-bound TCP sockets. Every path socket is bound to its rail's
// interface (SO_BINDTODEVICE) and source address, so a dead rail fails instead of being
// silently rerouted through another NIC; TCP_USER_TIMEOUT makes the kernel report a dead
// rail in ~0.2-0.4 s (RAIL-LAB.md measurements) instead of ~15 minutes.
// Thread-safety: stateless apart from the one-time bind-to-device warning.
#pragma once

#include <sys/socket.h>

#include <string>

#include "r2ccl/clock.h"
#include "rails.h"
#include "sock_errors.h"

namespace r2ccl::net {

// Why a socket could not be opened: the errno kept as the kernel gave it, the call that
// failed, and a message naming the call, the rail and the limit involved (describe_errno).
struct SockFailure {
  int err = 0;
  SockOp op = SockOp::kSocket;
  std::string text;  // "socket() on rail eth0: Too many open files (RLIMIT_NOFILE soft 64, ...)"
};
// Non-blocking TCP socket bound to the rail (device + address, port 0). -1 and *why on failure.
int open_rail_socket(const Rail& rail, TimeUs user_timeout, SockFailure* why);
// Starts a non-blocking connect. Returns 0 (connected or in progress) or -errno.
int start_connect(int fd, const sockaddr_storage& peer);
// 0 when the connect finished, -EINPROGRESS while pending, -errno on failure.
int finish_connect(int fd);
// Listening socket on the rail's address, on `port` (network order; 0: an ephemeral port).
// -1 and *err on failure (a taken port: EADDRINUSE, named). Its accept queue holds as many
// connects as net.core.somaxconn allows (a burst of 1,024 at setup is normal). Any thread.
int open_rail_listener(const Rail& rail, std::string* err, uint16_t port = 0);
uint16_t local_port(int fd);
void set_socket_options(int fd, TimeUs user_timeout);
// TCP_USER_TIMEOUT of `fd`, microseconds rounded up to whole ms (0: the kernel default). The
// kernel reads it at every retransmission and zero-window probe timer, so a change applies to
// a socket in use. Errors are ignored (not a TCP socket: nothing to apply). Any thread.
void set_user_timeout(int fd, TimeUs user_timeout);

}  // namespace r2ccl::net
