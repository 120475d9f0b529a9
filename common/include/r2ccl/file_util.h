// Reading a small configuration or data file safely: the peer list, token and topology of the
// snapshot daemon, the tuner's rules file, the predictor's weights, topology-check dumps.
// Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <string>

namespace r2ccl {

// Reads the whole file at `path` into *out, at most `max_bytes` bytes. Only a regular file is
// read: it is opened non-blocking and checked with fstat, so a FIFO, a device or a directory
// never blocks and never reads as empty. Returns false with *why (the reason only, for the
// caller to prefix with the file's role) and *out untouched:
//   "cannot open: <strerror>", "not a regular file", "read error: <strerror>",
//   "larger than <max_bytes> bytes".
bool read_regular_file(const std::string& path, size_t max_bytes, std::string* out,
                       std::string* why);

}  // namespace r2ccl
