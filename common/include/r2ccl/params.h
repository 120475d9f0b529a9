// The one declarative table of R2CCL_* parameters (name, type, default, range, help, NCCL
// fallback). Parsed once per process at net init; invalid values fail init with a message
// naming the variable and the accepted form; unknown R2CCL_* variables are warned about.
// docs/PARAMETERS.md is generated from this table (r2ccl_perf --params --markdown).
//
// Units: kDuration values are stored in microseconds and accept "N" (milliseconds), "Nus",
// "Nms" or "Ns". kSize values are bytes and accept a K, M or G suffix (powers of 1024).
// Thread-safety: load_config() is pure; the process-wide config is set once under a lock.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace r2ccl {

enum class ParamType { kInt, kBool, kSize, kDuration, kDouble, kString };

struct ParamDef {
  const char* name;  // full variable name, R2CCL_...
  ParamType type;
  const char* def;  // default, in the variable's own syntax
  double min;       // inclusive range for numeric types (after unit conversion)
  double max;
  const char* nccl_fallback;  // NCCL variable read when ours is unset, or nullptr
  const char* help;
  bool test_only;  // hidden hooks for the test suite; listed separately
};

// X(field, NAME, type, default, min, max, fallback, help)
#define R2CCL_PARAM_TABLE(X)                                                                    \
  X(socket_ifname, "R2CCL_SOCKET_IFNAME", kString, "", 0, 0, "NCCL_SOCKET_IFNAME",              \
    "Rails to use, NCCL syntax: comma list of interface-name prefixes, '^' excludes, '=' "      \
    "matches exactly; IFNAME@ADDR binds a rail to a source address (lo@127.0.0.1,lo@127.0.0.2 " \
    "gives two rails on lo). Empty: every interface that is up with an address, except lo, "    \
    "docker* and virbr*.")                                                                      \
  X(backup_paths, "R2CCL_BACKUP_PATHS", kInt, "2", 0, 3, nullptr,                               \
    "Preheated backup paths per connection, on other rails than the primary.")                  \
  X(nsocks_per_path, "R2CCL_NSOCKS_PER_PATH", kInt, "2", 1, 8, nullptr,                         \
    "TCP streams per path (each its own TCP connection; chunks go round-robin over them). 2: "  \
    "striping over 2 rails in both directions at once kept 0.96x of iperf3 --bidir, 1 only "    \
    "0.88x (docs/BENCHMARKS.md); each stream is a descriptor.")                                 \
  X(stripe, "R2CCL_STRIPE", kBool, "0", 0, 1, nullptr,                                          \
    "1: stripe chunks over every healthy path, weighted by each path's measured goodput; 0: "   \
    "primary path only, backups stay idle and probed.")                                         \
  X(failover_spread, "R2CCL_FAILOVER_SPREAD", kBool, "1", 0, 1, nullptr,                        \
    "With R2CCL_STRIPE=0, while the primary path cannot carry data (failed, draining): 1 "      \
    "spreads its chunks over every surviving path by goodput and the rail's spare capacity "    \
    "in the process; 0 moves them to the first surviving backup only (the default until a "     \
    "verbs bug was fixed: a regMr during an HCA reset failed, seen as a lost connection with "  \
    "spreading on).")                                                                           \
  X(chunk_size, "R2CCL_CHUNK_SIZE", kSize, "512K", 4096, 64.0 * 1024 * 1024, nullptr,           \
    "Bytes per chunk, the unit of scheduling, acknowledgement and replay. 512 KiB keeps a "     \
    "replay cheap while headers cost under 0.01 %.")                                            \
  X(path_window, "R2CCL_PATH_WINDOW", kSize, "4M", 64 * 1024, 1024.0 * 1024 * 1024, nullptr,    \
    "Unacknowledged bytes allowed on one path; bounds what a failure must replay.")             \
  X(eager_threshold, "R2CCL_EAGER_THRESHOLD", kSize, "64K", 0, 1024.0 * 1024, nullptr,          \
    "Messages of at most this many bytes go at once, without waiting for the receiver's "       \
    "clear-to-send, into a bounded, credited area at the receiver (TCP; verbs always "          \
    "waits). Both ends are negotiated (the smaller, at most R2CCL_CHUNK_SIZE: a larger "        \
    "value is lowered to it, with a WARN at init; the init banner shows the value in use). "    \
    "0 disables.")                                                                              \
  X(eager_copy, "R2CCL_EAGER_COPY", kBool, "1", 0, 1, nullptr,                                  \
    "1: an eager isend completes once its bytes are copied into a sender-side buffer kept "     \
    "until the receiver acknowledges them (for replay); 0: it completes on that "               \
    "acknowledgement.")                                                                         \
  X(heartbeat_interval, "R2CCL_HEARTBEAT_INTERVAL", kDuration, "30ms", 10000, 10e6, nullptr,    \
    "Probe period of each link (a rail pair to one peer process: one prober for all the "       \
    "connections over it). A link silent for 3 periods has failed. At least 10 ms: 3 "          \
    "periods must exceed the kernel's ACK-time granularity (a jiffy, up to 10 ms) and a busy "  \
    "host's scheduling delays.")                                                                \
  X(ack_timeout, "R2CCL_ACK_TIMEOUT", kDuration, "100ms", 1000, 60e6, nullptr,                  \
    "Acknowledgement watchdog: a busy path whose chunks see no acknowledgement progress for "   \
    "this long has failed (silent black hole with the link up).")                               \
  X(tcp_user_timeout, "R2CCL_TCP_USER_TIMEOUT", kDuration, "200ms", 0, 600e6, nullptr,          \
    "TCP_USER_TIMEOUT on every path socket, so the kernel reports a dead rail in ~0.2-0.4 s "   \
    "instead of ~15 min; raised to R2CCL_FAILOVER_TIMEOUT while the peer's window is shut "     \
    "(its process paused). 0 keeps the kernel default.")                                        \
  X(failover_timeout, "R2CCL_FAILOVER_TIMEOUT", kDuration, "10s", 100e3, 3600e6, nullptr,       \
    "With no usable path left, pending requests fail after this long (ncclSystemError, or "     \
    "ncclRemoteError when the peer is gone).")                                                  \
  X(connect_timeout, "R2CCL_CONNECT_TIMEOUT", kDuration, "120s", 100e3, 86400e6, nullptr,       \
    "connect/accept return NULL (call again) at most this long, then fail with "                \
    "ncclRemoteError. NCCL itself retries forever.")                                            \
  X(probe_count, "R2CCL_PROBE_COUNT", kInt, "3", 1, 100, nullptr,                               \
    "Consecutive probe round trips a reconnected path must pass before it carries data.")       \
  X(reconnect_min, "R2CCL_RECONNECT_MIN", kDuration, "50ms", 1000, 60e6, nullptr,               \
    "First reconnect delay after a path failure; doubles per failed attempt.")                  \
  X(reconnect_max, "R2CCL_RECONNECT_MAX", kDuration, "2s", 1000, 600e6, nullptr,                \
    "Longest delay between reconnect attempts; a long outage is probed forever at this rate.")  \
  X(holddown_flaps, "R2CCL_HOLDDOWN_FLAPS", kInt, "3", 1, 1000, nullptr,                        \
    "Down-up cycles within R2CCL_HOLDDOWN_WINDOW that start a hold-down.")                      \
  X(holddown_window, "R2CCL_HOLDDOWN_WINDOW", kDuration, "10s", 1000, 3600e6, nullptr,          \
    "Window in which flaps are counted.")                                                       \
  X(holddown_min, "R2CCL_HOLDDOWN_MIN", kDuration, "1s", 1000, 3600e6, nullptr,                 \
    "First hold-down; doubles on each further flap.")                                           \
  X(holddown_max, "R2CCL_HOLDDOWN_MAX", kDuration, "60s", 1000, 3600e6, nullptr,                \
    "Longest hold-down.")                                                                       \
  X(holddown_reset, "R2CCL_HOLDDOWN_RESET", kDuration, "60s", 1000, 3600e6, nullptr,            \
    "Stable time after which the hold-down returns to R2CCL_HOLDDOWN_MIN.")                     \
  X(latency_sigma, "R2CCL_LATENCY_SIGMA", kDouble, "3", 0, 100, nullptr,                        \
    "Shadow routing: a path whose probe RTT exceeds its baseline mean + this many standard "    \
    "deviations drains (stays connected, carries no new chunks). 0 disables.")                  \
  X(latency_min_excess, "R2CCL_LATENCY_MIN_EXCESS", kDuration, "20ms", 0, 10e6, nullptr,        \
    "Shadow routing ignores RTT excursions smaller than this above the baseline, however many " \
    "sigma they are: queueing behind a burst on a shared, shaped link is not a sick rail.")     \
  X(speed_mbps, "R2CCL_SPEED_MBPS", kInt, "0", 0, 1e8, nullptr,                                 \
    "Reported rail speed in Mbps; 0 reads it from the link (sysfs), 10000 when unknown.")       \
  X(link_events, "R2CCL_LINK_EVENTS", kBool, "1", 0, 1, nullptr,                                \
    "Watch netlink link notifications (libnl-3, loaded at run time) to detect a downed rail "   \
    "in milliseconds.")                                                                         \
  X(log_file, "R2CCL_LOG_FILE", kString, "stderr", 0, 0, nullptr,                               \
    "Where switchover, failback and give-up lines go besides NCCL's logger: stderr, a file "    \
    "path (appended), or none.")                                                                \
  X(fault_inject, "R2CCL_FAULT_INJECT", kString, "", 0, 0, nullptr,                             \
    "In-process fault schedule, ';'-separated: rank=R,rail=N,at=MS,kind=reset|blackhole|"       \
    "delay:MS[,for=MS]. Acts on this process's sockets of that rail, 'at' counts from the "     \
    "first chunk, CTS or acknowledgement it sends. rank matches R2CCL_RANK (or RANK).")         \
  X(rank, "R2CCL_RANK", kInt, "-1", -1, 1e9, "RANK",                                            \
    "This process's rank, only used to match R2CCL_FAULT_INJECT entries.")                      \
  X(transport, "R2CCL_TRANSPORT", kString, "auto", 0, 0, nullptr,                               \
    "auto, ib or tcp. auto: the verbs transport when any HCA port (after R2CCL_IB_HCA) is "     \
    "active, else TCP. One transport per process, so a RoCE NIC is never exposed twice.")       \
  X(ibverbs_lib, "R2CCL_IBVERBS_LIB", kString, "libibverbs.so.1", 0, 0, nullptr,                \
    "The verbs library the plugin dlopens (tests point it at the fake verbs provider).")        \
  X(ib_hca, "R2CCL_IB_HCA", kString, "", 0, 0, "NCCL_IB_HCA",                                   \
    "HCAs and ports to use, NCCL syntax: comma list of name prefixes with optional :port, "     \
    "'^' excludes, '=' matches names exactly (mlx5_0:1,mlx5_1). Empty: every active port.")     \
  X(ib_gid_index, "R2CCL_IB_GID_INDEX", kInt, "-1", -1, 1024, "NCCL_IB_GID_INDEX",              \
    "RoCE GID index; -1 selects one by R2CCL_IB_ROCE_VERSION_NUM, R2CCL_IB_ADDR_FAMILY and "    \
    "R2CCL_IB_ADDR_RANGE, again after a GID-change event. An index whose GID is empty on a "    \
    "port falls back to that selection, with a WARN.")                                          \
  X(ib_roce_version, "R2CCL_IB_ROCE_VERSION_NUM", kInt, "2", 1, 2, "NCCL_IB_ROCE_VERSION_NUM",  \
    "RoCE version of the automatically selected GID.")                                          \
  X(ib_addr_family, "R2CCL_IB_ADDR_FAMILY", kString, "AF_INET", 0, 0, "NCCL_IB_ADDR_FAMILY",    \
    "AF_INET or AF_INET6: address family of the automatically selected RoCE GID.")              \
  X(ib_addr_range, "R2CCL_IB_ADDR_RANGE", kString, "", 0, 0, "NCCL_IB_ADDR_RANGE",              \
    "ADDR/PREFIX: the automatically selected RoCE GID must lie in this subnet.")                \
  X(ib_timeout, "R2CCL_IB_TIMEOUT", kInt, "14", 1, 31, "NCCL_IB_TIMEOUT",                       \
    "QP local ACK timeout, 4.096 us * 2^N per try (14 = 67 ms). A silent verbs path is "        \
    "failed over no sooner than two tries (134 ms at 14; 34 s at 22, warned when it comes "     \
    "from NCCL_IB_TIMEOUT), so the QP's own retransmission gets its chance.")                   \
  X(ib_retry_cnt, "R2CCL_IB_RETRY_CNT", kInt, "7", 0, 7, "NCCL_IB_RETRY_CNT",                   \
    "QP transport retries before a work request completes with retry-exceeded.")                \
  X(ib_qps_per_path, "R2CCL_IB_QPS_PER_PATH", kInt, "1", 1, 16, "NCCL_IB_QPS_PER_CONNECTION",   \
    "RC QPs per path; chunks are spread over them.")                                            \
  X(ib_pkey, "R2CCL_IB_PKEY", kString, "", 0, 0, "NCCL_IB_PKEY",                                \
    "InfiniBand partition: a P_Key value (0x8001), looked up in each port's P_Key table; not "  \
    "in a selected port's table fails init. From NCCL_IB_PKEY it is NCCL's P_Key index "        \
    "instead. Unset: index 0.")                                                                 \
  X(ib_sl, "R2CCL_IB_SL", kInt, "0", 0, 15, "NCCL_IB_SL", "InfiniBand service level.")          \
  X(ib_tc, "R2CCL_IB_TC", kInt, "0", 0, 255, "NCCL_IB_TC",                                      \
    "Traffic class (RoCE GRH); the communicator config's traffic class wins when set.")         \
  X(ib_ar, "R2CCL_IB_ADAPTIVE_ROUTING", kInt, "-1", -1, 1, "NCCL_IB_ADAPTIVE_ROUTING",          \
    "1: adaptive-routing-safe writes (payload as RDMA WRITE, then a 0-byte write with "         \
    "immediate); 0: one write with immediate per chunk; -1: 1 on InfiniBand, 0 on RoCE.")       \
  X(net_gdr_level, "R2CCL_NET_GDR_LEVEL", kString, "PXB", 0, 0, "NCCL_NET_GDR_LEVEL",           \
    "How far (PCI path type, NCCL's names) a backup HCA may be from the GPU of an "             \
    "NCCL_PTR_CUDA / DMABUF buffer and still carry it: LOC, NVL, NVB, C2C, PIX, PXB, P2C, "     \
    "PXN, PHB or SYS, or NCCL's legacy integers 0-5 (0 LOC, 1 PIX, 2 PXB, 3 PHB, 4+ SYS). "     \
    "Backups farther away get no registration of the buffer and carry none of its bytes; "      \
    "the primary is NCCL's choice. Host buffers use every path.")                               \
  X(health_board, "R2CCL_HEALTH_BOARD", kString, "default", 0, 0, nullptr,                      \
    "Name of this node's health board, the shared-memory segment /r2ccl-<uid>-<name> where "    \
    "net plugins publish rail state and the tuner reads the agreed cluster record; none "       \
    "turns publishing off.")                                                                    \
  X(tuner_config, "R2CCL_TUNER_CONFIG", kString, "", 0, 0, nullptr,                             \
    "Tuner rules file (r2ccl's format or the columns of NCCL's example tuner CSV). Empty: no "  \
    "rules, NCCL's choices stand (unless the cost model is enabled).")                          \
  X(tuner_strict, "R2CCL_TUNER_STRICT", kBool, "0", 0, 1, nullptr,                              \
    "1: a malformed rules row fails tuner init (ncclInvalidUsage) instead of a WARN and the "   \
    "row skipped (the other rows kept).")                                                       \
  X(predict, "R2CCL_PREDICT", kBool, "1", 0, 1, nullptr,                                        \
    "Run the failure predictor: one process per node samples NIC counters, publishes each "     \
    "rail's risk on the health board and every process drains a rail at risk.")                 \
  X(predict_interval, "R2CCL_PREDICT_INTERVAL", kDuration, "5s", 100e3, 3600e6, nullptr,        \
    "Counter sampling period of the failure predictor (the model was trained at 5 s; other "    \
    "periods get a WARN).")                                                                     \
  X(predict_window, "R2CCL_PREDICT_WINDOW", kDuration, "120s", 20e3, 86400e6, nullptr,          \
    "History the predictor looks at; the model sees WINDOW / INTERVAL samples (24 by default,"  \
    " 2 to 256); the baseline averages its last kBaselineSteps (24 today), at most a window's:" \
    " a shorter window is logged once.")                                                        \
  X(predict_threshold, "R2CCL_PREDICT_THRESHOLD", kDouble, "0.9", 0.01, 1, nullptr,             \
    "Risk (probability of a link failure within the weights file's horizon, 120 s for the "     \
    "shipped one) at or above which a rail is drained: "                                        \
    "no new chunks, in-flight ones finish.")                                                    \
  X(predict_return_threshold, "R2CCL_PREDICT_RETURN_THRESHOLD", kDouble, "0.4", 0, 1, nullptr,  \
    "A drained rail returns once its risk stays below this for R2CCL_PREDICT_RETURN_SAMPLES "   \
    "samples (hysteresis; must not exceed R2CCL_PREDICT_THRESHOLD).")                           \
  X(predict_return_samples, "R2CCL_PREDICT_RETURN_SAMPLES", kInt, "6", 1, 100000, nullptr,      \
    "Consecutive low-risk samples before a drained rail carries data again.")                   \
  X(predict_enter_samples, "R2CCL_PREDICT_ENTER_SAMPLES", kInt, "3", 1, 100000, nullptr,        \
    "Consecutive samples at or above R2CCL_PREDICT_THRESHOLD before a rail is drained: one "    \
    "high sample never drains by itself. Below 3, the baseline's rise rule also drains on the " \
    "1-2 samples an error burst's start gives it (our held-out seed 3: 7.6 false drains per "   \
    "rail-week at 2, 1.6 at 3).")                                                               \
  X(predict_max_drains_per_hour, "R2CCL_PREDICT_MAX_DRAINS_PER_HOUR", kInt, "2", 0, 100000,     \
    nullptr,                                                                                    \
    "Predicted drains allowed per rail within any hour; a drain beyond it is refused with a "   \
    "WARN (0: predictions never drain). Nor is the last usable rail of the node drained.")      \
  X(predict_min_drain, "R2CCL_PREDICT_MIN_DRAIN", kDuration, "1200s", 0, 3600e6, nullptr,       \
    "A rail the predictor drains stays drained at least this long, whatever its risk does "     \
    "meanwhile (then the R2CCL_PREDICT_RETURN_* rule applies): a precursor that pauses does "   \
    "not bring traffic back just before the link dies (our held-out seeds 3-8: 0.767 -> 0.787 " \
    "of failures warned, the same false drains; docs/PREDICTOR.md \"In the plugin\"). 0: off.") \
  X(predict_down_hold, "R2CCL_PREDICT_DOWN_HOLD", kDuration, "600s", 0, 3600e6, nullptr,        \
    "A link that went down: when a rail's link comes back up after its "                        \
    "R2CCL_PREDICT_DOWN_HOLD_AFTER-th link-down within an hour, it stays drained this long "    \
    "(doubled for each further down within the hour, at most 1 hour), whatever the risk. 0: "   \
    "off. Never the last usable rail of the node.")                                             \
  X(predict_down_hold_after, "R2CCL_PREDICT_DOWN_HOLD_AFTER", kInt, "1", 1, 1000, nullptr,      \
    "Link-downs within an hour that make a rail flapping (R2CCL_PREDICT_DOWN_HOLD). 1: every "  \
    "down is held (a link that went down is the likeliest to go down again; docs/PREDICTOR.md " \
    "\"In the plugin\"); 2: a single down returns as soon as the link is back and "             \
    "its risk is low.")                                                                         \
  X(predict_decider, "R2CCL_PREDICT_DECIDER", kString, "baseline", 0, 0, nullptr,               \
    "Whose risk drains rails: baseline (the threshold and rise rules, built in or those "       \
    "R2CCL_PREDICT_MODEL's file carries, and the built-in fall rule), both (the "               \
    "baseline, raised by the LSTM up "                                                          \
    "to R2CCL_PREDICT_LSTM_CAP times its own risk) or lstm (the weights file alone). The "      \
    "LSTM alone does not beat the baseline. both ties it on the frozen evaluation set and "     \
    "warns about 2 % more failures on our own traces at a few more false drains, for "          \
    "12 us of "                                                                                 \
    "inference per rail-sample (docs/PREDICTOR.md \"Deciders\"). With both or lstm and no "     \
    "readable weights file, the baseline decides.")                                             \
  X(predict_lstm_cap, "R2CCL_PREDICT_LSTM_CAP", kDouble, "1.4", 1, 100, nullptr,                \
    "R2CCL_PREDICT_DECIDER=both: the LSTM's risk counts up to this many times the baseline's, " \
    "so it drains a rail only where the baseline's risk is at least "                           \
    "R2CCL_PREDICT_THRESHOLD / this. 1: the baseline alone; larger caps tend to the higher "    \
    "of the two risks (it warns more than either alone, and drains more healthy rails).")       \
  X(predict_model, "R2CCL_PREDICT_MODEL", kString, "", 0, 0, nullptr,                           \
    "LSTM weights file. Empty: r2ccl_lstm.bin shipped next to the plugin "                      \
    "(<prefix>/share/r2ccl/). Missing or corrupt: one WARN, the threshold baseline runs.")      \
  X(sysfs_root, "R2CCL_SYSFS_ROOT", kString, "/sys", 0, 0, nullptr,                             \
    "Where the predictor reads NIC counters (class/infiniband, class/net); tests point it at "  \
    "a fake tree.")                                                                             \
  X(test_hooks, "R2CCL_TEST_HOOKS", kString, "", 0, 0, nullptr,                                 \
    "Test only. Comma list of protections to switch off: no_replay, no_dedup, "                 \
    "no_stale_guard, no_bilateral_err (verbs: replay without moving the peer's QPs to ERR), "   \
    "force_flush (verbs: iflush reads back host buffers too), no_goodput (the scheduler "       \
    "before goodput weights: configured rail speed, least-loaded), gpu_pci=PATH (verbs: GPU "   \
    "buffers are accepted in any build, host memory standing in, and their GPU sits at the "    \
    "sysfs PCI path PATH). "                                                                    \
    "Used by tests to prove each protection matters.")                                          \
  X(test_time_scale, "R2CCL_TEST_TIME_SCALE", kInt, "1", 1, 1000000, nullptr,                   \
    "Test only. r2ccl's verbs failure bounds take one QP try as 4.096 us * 2^R2CCL_IB_TIMEOUT " \
    "/ N; the fake verbs provider runs its QP timers N times faster when it reads the same "    \
    "variable, so NCCL_IB_TIMEOUT=22 can be tested in milliseconds. Real HCAs ignore it: "      \
    "never set it outside tests.")

template <ParamType>
struct ParamCType;
template <>
struct ParamCType<ParamType::kInt> {
  using T = int64_t;
};
template <>
struct ParamCType<ParamType::kBool> {
  using T = bool;
};
template <>
struct ParamCType<ParamType::kSize> {
  using T = int64_t;
};  // bytes
template <>
struct ParamCType<ParamType::kDuration> {
  using T = int64_t;
};  // microseconds
template <>
struct ParamCType<ParamType::kDouble> {
  using T = double;
};
template <>
struct ParamCType<ParamType::kString> {
  using T = std::string;
};

struct Config {
#define R2CCL_PARAM_FIELD(field, name, type, def, min, max, fb, help) \
  typename ::r2ccl::ParamCType<::r2ccl::ParamType::type>::T field{};
  R2CCL_PARAM_TABLE(R2CCL_PARAM_FIELD)
#undef R2CCL_PARAM_FIELD
  // Which source won for each parameter with an NCCL fallback, for the INFO log.
  std::vector<std::string> sources;
};

// R2CCL_PREDICT_WINDOW / R2CCL_PREDICT_INTERVAL at most: the LSTM runs over the whole window
// every sample on the background thread, so its cost is bounded here.
constexpr int64_t kMaxPredictWindowSteps = 256;

// Variable lookup, injectable for tests. Returns nullptr when unset.
using EnvLookup = std::function<const char*(const char*)>;
EnvLookup process_env();

// Parses every parameter. On error returns false and sets *err to a message naming the
// variable, the value and the accepted form. Unknown R2CCL_* variables (from `env_names`)
// are appended to *warnings.
bool load_config(const EnvLookup& env, const std::vector<std::string>& env_names, Config* out,
                 std::string* err, std::vector<std::string>* warnings);

// The parameter table's defaults: what a process with no R2CCL_* variable set runs with (the
// tools show them as their own defaults). Pure; any thread. The table's defaults always parse
// (tests/unit/test_params.cc checks it), so this cannot fail.
Config default_config();

// The process-wide configuration, parsed at first use from the real environment.
// Returns false with *err on an invalid variable (then every init fails the same way).
bool process_config(const Config** out, std::string* err);

const std::vector<ParamDef>& param_table();
// Writes the table as plain text, or as the Markdown of docs/PARAMETERS.md.
std::string format_param_table(bool markdown);

// Helpers shared by tools and tests.
bool parse_duration_us(const std::string& s, int64_t* out);
bool parse_size_bytes(const std::string& s, int64_t* out);

}  // namespace r2ccl
