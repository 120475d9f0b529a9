#include "sock_io.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "r2ccl/snapshot/big_buffer.h"
#include "r2ccl/snapshot/client_wire.h"

namespace r2ccl::snap::client {

int connect_unix(const std::string& path, std::string* err) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    *err = "snapshot socket path '" + path + "' is " + std::to_string(path.size()) +
           " bytes (accepted: 1.." + std::to_string(sizeof(addr.sun_path) - 1) + ")";
    return -1;
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("socket(AF_UNIX): ") + std::strerror(errno);
    return -1;
  }
  int rc;
  do {
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int e = errno;
    ::close(fd);
    *err = "cannot connect to r2ccl_snapshotd at " + path + ": " + std::strerror(e);
    if (e == ENOENT || e == ECONNREFUSED)
      *err +=
          " (is r2ccl_snapshotd running on this node? it listens on --socket PATH; set "
          "R2CCL_SNAPSHOT_SOCKET or R2CCL_HEALTH_BOARD to match)";
    else if (e == EACCES)
      *err += " (the socket is mode 0600 for the daemon's user, or 0660 with --socket-group)";
    return -1;
  }
  return fd;
}

bool write_frame(int fd, uint16_t type, const void* a, size_t na, const void* b, size_t nb,
                 std::string* err) {
  PeerHeader h{};
  h.magic = kClientMagic;
  h.version = kClientVersion;
  h.type = type;
  uint64_t len = uint64_t(na) + nb;
  if (len > UINT32_MAX) {
    *err = "frame of " + std::to_string(len) + " bytes exceeds the protocol's 4 GiB - 1 limit";
    return false;
  }
  h.length = static_cast<uint32_t>(len);
  iovec iov[3] = {{&h, sizeof(h)}, {const_cast<void*>(a), na}, {const_cast<void*>(b), nb}};
  int first = 0;
  while (first < 3) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    msghdr m{};
    m.msg_iov = iov + first;
    m.msg_iovlen = static_cast<size_t>(3 - first);
    ssize_t w = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        pollfd p{fd, POLLOUT, 0};
        int pr = ::poll(&p, 1, kWriteStallMs);
        if (pr == 0) {
          *err = "the daemon accepted no byte for " + std::to_string(kWriteStallMs / 1000) +
                 " s (wedged?)";
          return false;
        }
        if (pr < 0 && errno != EINTR) {
          *err = std::string("poll: ") + std::strerror(errno);
          return false;
        }
        continue;
      }
      // EPIPE / ECONNRESET: the daemon closed its end (it restarted, or dropped this client);
      // said as such, like the end of file a read sees for the same event.
      if (errno == EPIPE || errno == ECONNRESET)
        *err =
            std::string("the daemon closed the connection (write: ") + std::strerror(errno) + ")";
      else
        *err = std::string("write to the daemon failed: ") + std::strerror(errno);
      return false;
    }
    size_t left = static_cast<size_t>(w);
    while (first < 3 && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (first < 3) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

namespace {
// 1: all read; 0: EOF before the first byte; -1: error or EOF in the middle.
int read_all(int fd, void* buf, size_t n, std::string* err) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, static_cast<uint8_t*>(buf) + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      *err = std::string("read from the daemon failed: ") + std::strerror(errno);
      return -1;
    }
    if (r == 0) {
      if (got == 0) return 0;
      *err = "the daemon closed the connection in the middle of a frame";
      return -1;
    }
    got += static_cast<size_t>(r);
  }
  return 1;
}
}  // namespace

bool read_frame_into(int fd, uint64_t max_shard_bytes, uint16_t* type,
                     const std::function<uint8_t*(size_t)>& alloc, std::string* err) {
  PeerHeader h{};
  int r = read_all(fd, &h, sizeof(h), err);
  if (r == 0) {
    *err = "the daemon closed the connection";
    return false;
  }
  if (r < 0) return false;
  if (h.magic != kClientMagic || h.version != kClientVersion) {
    *err = "bad frame header from the daemon: magic 0x" + std::to_string(h.magic) + " version " +
           std::to_string(h.version) + " (accepted: magic R2SC, version " +
           std::to_string(kClientVersion) + ")";
    return false;
  }
  if (!client_payload_ok(h.type, h.length, max_shard_bytes)) {
    *err = "frame type " + std::to_string(h.type) + " with " + std::to_string(h.length) +
           " payload bytes refused (unknown type, a size other than the type's, or a shard over "
           "the largest registered buffer's bound " +
           std::to_string(max_shard_bytes) + ")";
    return false;
  }
  if (h.length) {
    uint8_t* p = alloc(h.length);
    if (!p) {
      *err = "cannot allocate " + std::to_string(h.length) + " bytes for a frame from the daemon";
      return false;
    }
    if (read_all(fd, p, h.length, err) != 1) {
      if (err->empty()) *err = "the daemon closed the connection in the middle of a frame";
      return false;
    }
  }
  *type = h.type;
  return true;
}

bool read_frame(int fd, uint64_t max_shard_bytes, uint16_t* type, std::vector<uint8_t>* payload,
                std::string* err) {
  payload->clear();
  return read_frame_into(
      fd, max_shard_bytes, type,
      [payload](size_t n) {
        payload->resize(n);
        return payload->data();
      },
      err);
}

PageBuf& PageBuf::operator=(PageBuf&& o) noexcept {
  if (this != &o) {
    reset();
    p_ = o.p_;
    n_ = o.n_;
    cap_ = o.cap_;
    o.p_ = nullptr;
    o.n_ = 0;
    o.cap_ = 0;
  }
  return *this;
}

void PageBuf::reset() {
  big_free(p_, cap_);
  p_ = nullptr;
  n_ = 0;
  cap_ = 0;
}

bool PageBuf::alloc(size_t n, bool populate, size_t capacity) {
  reset();
  const size_t cap = std::max(n, capacity);
  if (cap == 0) return true;
  p_ = big_alloc(cap, populate);
  if (!p_) return false;
  n_ = n;
  cap_ = cap;
  return true;
}

}  // namespace r2ccl::snap::client
