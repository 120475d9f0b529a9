// Unix-socket framing for the snapshot client (client_wire.h): connect, one frame out
// (header + up to two parts, non-blocking writes with a stall bound), one frame in (blocking,
// length checked with client_payload_ok before the payload is allocated).
// Thread-safety: none inside; the caller serialises writers (Client::send_mu_) and has one
// reader thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace r2ccl::snap::client {

// A write making no progress for this long fails (the daemon is wedged).
constexpr int kWriteStallMs = 120000;

// Connects a stream socket to `path`. Returns the fd, or -1 with *err naming the path, the
// errno text and what to do; *enoent tells "no daemon there" cases apart (ENOENT,
// ECONNREFUSED).
int connect_unix(const std::string& path, std::string* err);

// Writes one frame: header(type, na + nb) + a[na] + b[nb]. False with *err on an error
// (EPIPE: the daemon closed) or a stall longer than kWriteStallMs.
bool write_frame(int fd, uint16_t type, const void* a, size_t na, const void* b, size_t nb,
                 std::string* err);

// Reads one frame. False with *err at EOF (err "closed") or on a bad header (magic, version,
// type/length refused by client_payload_ok(type, len, max_shard_bytes)).
bool read_frame(int fd, uint64_t max_shard_bytes, uint16_t* type, std::vector<uint8_t>* payload,
                std::string* err);

}  // namespace r2ccl::snap::client
