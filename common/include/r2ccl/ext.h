// r2ccl extension interface: an optional data symbol a net plugin may export next to its
// ncclNetPlugin_vN tables, for tools (r2ccl_perf --stats / --expect-replay) and tests.
// NCCL never looks at it. A tool finds it with dlsym(handle, "r2cclExt_v1"); a plugin without
// it is still a valid plugin.
//
// Export it like the net tables (C linkage, default visibility, a data object):
//   extern "C" __attribute__((visibility("default"))) const r2cclExt_v1_t r2cclExt_v1 = {1, fn};
//
// getStats(buf, len)
//   Writes one NUL-terminated JSON object describing this process's counters into buf and
//   returns the length of the full JSON text, not counting the NUL (snprintf semantics): when
//   the return value is >= len the text was truncated (or not written when len == 0) and the
//   caller calls again with a buffer of at least return+1 bytes. buf may be NULL when len is 0.
//   Counters are process-wide (every comm of every context), monotonic since the library was
//   loaded. Must be callable from any thread at any time after the first init, also after the
//   comms are closed.
//
// JSON keys (version 1). Readers ignore keys they do not know; writers may add keys.
//   {
//     "rails": [                     one entry per rail (local NIC/address), in device order
//       {
//         "name":            string  rail name, "IFNAME@ADDR", e.g. "lo@127.0.0.1"
//         "state":           string  "up"; "down" (the link is down); "failed" (link up,
//                                    but paths on this rail failed and have not recovered).
//                                    Later versions may add states ("holddown",
//                                    "draining"); readers print unknown states as they are.
//         "chunks_sent":     integer chunks first sent on this rail (replays not counted)
//         "chunks_replayed": integer chunks re-sent on this rail after the path they were
//                                    first sent on failed
//         "bytes_sent":      integer payload bytes sent on this rail, replays included
//         "switchovers":     integer times traffic moved off this rail because it failed
//         "failbacks":       integer times traffic came back to this rail after recovery
//       }, ...
//     ],
//     "switchovers": integer         total switchovers in this process (sum over rails)
//     "replays":     integer         total chunks replayed in this process (sum of
//                                    chunks_replayed over rails)
//     "links":       integer         links whose liveness is shared now: rail pairs to a peer
//                                    process, each probed once for every connection over it
//                                    (engine/link_live.h); a path whose transport cannot
//                                    name the peer process has a private one, not counted
//   }
//
// Thread-safety: getStats must be safe to call concurrently with the data path.
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define R2CCL_EXT_SYMBOL_V1 "r2cclExt_v1"

typedef struct {
  int version;  // 1
  size_t (*getStats)(char* buf, size_t len);
  // Arms in-process faults now, in R2CCL_FAULT_INJECT's syntax (entries for other ranks are
  // ignored); their `at` counts from this call instead of from the first isend. Returns 0, or
  // -1 when the spec is invalid (a WARN says why) or the plugin is not initialised. Lets a
  // driver aim a fault at a phase of its run (r2ccl_perf --inject-pass). May be NULL.
  int (*armFaults)(const char* spec);
} r2cclExt_v1_t;

#ifdef __cplusplus
}  // extern "C"
#endif
