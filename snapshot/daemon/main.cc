// r2ccl_snapshotd's command line (the daemon: daemon.h): options parsed and checked, then
// Daemon::run(). Exit status 2 on bad arguments or files.
#include <CLI/CLI.hpp>
#include <cstdlib>

#include "daemon.h"

using snapd::Daemon;
using snapd::Options;

namespace {

// Reads the file named by option `what` (e.g. "--peers"); *err names the option, the path and
// why (not a regular file, too large, or the system's reason).
bool read_text(const char* what, const std::string& path, std::string* out, std::string* err) {
  std::string why;
  if (read_regular_file(path, 16u << 20, out, &why)) return true;
  *err = std::string(what) + " " + path + ": " + why;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  // The daemon's stderr is its log: SNAP_WARN/SNAP_INFO lines stamped with CLOCK_MONOTONIC
  // seconds (the plugins' event-line clock), INFO always shown. Usage errors below stay plain
  // "r2ccl_snapshotd: ..." messages, like CLI11's.
  set_stderr_options(true, NCCL_LOG_INFO);
  Options o;
  uint32_t id = 0;
  std::string peers_file, token_file, topo_file, spill_dir;
  int period_ms = 500;
  uint64_t mem_mb = 4096, max_shard_mb = 1024;
  CLI::App app{"r2ccl snapshot sidecar: membership, shard replication, consistent cuts, restore",
               "r2ccl_snapshotd"};
  app.add_option("--id", id, "this node's id in the peer list")
      ->required()
      ->check(CLI::Range(0, board::kMaxNodes - 1));
  app.add_option("--peers", peers_file, "peer list: lines 'ID HOST:PORT'")
      ->required()
      ->type_name("FILE");
  app.add_option("--token-file", token_file, "the job token shared by all nodes (1-64 bytes)")
      ->required()
      ->type_name("FILE");
  app.add_option("--board", o.board, "this node's health board name (default 'default')")
      ->type_name("NAME");
  app.add_option("--period-ms", period_ms, "heartbeat period (default 500)")
      ->check(CLI::Range(10, 60000));
  app.add_option("--socket", o.socket_path,
                 "client socket (default /tmp/r2ccl-snapshotd-BOARD.sock; mode 0600)")
      ->type_name("PATH");
  app.add_option("--socket-group", o.socket_group,
                 "make the client socket 0660, owned by this group")
      ->type_name("GROUP");
  app.add_option("--spill-dir", spill_dir,
                 "where shards beyond --mem-limit-mb go (default: none, "
                 "the memory limit is hard)")
      ->type_name("DIR");
  app.add_option("--mem-limit-mb", mem_mb, "shard bytes held in memory, MiB (default 4096)")
      ->check(CLI::Range(uint64_t(1), uint64_t(1) << 30));
  app.add_option("--max-shard-mb", max_shard_mb, "largest shard accepted, MiB (default 1024)")
      ->check(CLI::Range(uint64_t(1), uint64_t(1) << 20));
  app.add_option("--replicas", o.replicas, "replica nodes per shard (default 3)")
      ->check(CLI::Range(1, 16));
  app.add_option("--metrics", o.metrics_addr,
                 "serve Prometheus metrics on ADDR:PORT "
                 "(numeric IPv4 address, e.g. 127.0.0.1:9464; port 0: any free port)")
      ->type_name("ADDR:PORT");
  std::string etcd_urls, job = "default", etcd_password_file;
  int lease_ttl = 3;
  app.add_option("--etcd", etcd_urls,
                 "etcd client URLs of the control plane: http(s)://HOST:PORT[,...] (required)")
      ->required()
      ->type_name("URL[,URL...]");
  app.add_option("--job", job,
                 "the job's name: its etcd keys live under /r2ccl/JOB/ (default 'default'; "
                 "letters, digits, '-', '_', '.')")
      ->type_name("NAME");
  app.add_option("--lease-ttl", lease_ttl,
                 "seconds of etcd silence after which this daemon counts as gone (default 3)")
      ->check(CLI::Range(1, 3600));
  app.add_option("--etcd-ca", o.etcd.ca_file,
                 "for https etcd URLs: PEM file of the CA that signed etcd's server certificate "
                 "(default: the system's CA store)")
      ->type_name("FILE");
  app.add_option("--etcd-cert", o.etcd.cert_file,
                 "PEM client certificate for an etcd with --client-cert-auth; with etcd "
                 "authentication on too, its subject must have no Common Name (etcd refuses one)")
      ->type_name("FILE");
  app.add_option("--etcd-key", o.etcd.key_file,
                 "PEM private key of --etcd-cert, unencrypted (default: in the --etcd-cert file)")
      ->type_name("FILE");
  app.add_option("--etcd-user", o.etcd.user,
                 "etcd user, for an etcd with authentication on (password: --etcd-password-file)")
      ->type_name("NAME");
  app.add_option("--etcd-password-file", etcd_password_file,
                 "file whose first line is the --etcd-user's password (keep it mode 0600)")
      ->type_name("FILE");
  app.add_option("--topology", topo_file,
                 "node places in the network: lines 'ID SWITCH/PATH' "
                 "(default: nearest by measured round trip)")
      ->type_name("FILE");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    printf("%s", app.help().c_str());
    return 0;
  } catch (const CLI::ParseError& e) {
    fprintf(stderr, "r2ccl_snapshotd: %s\n%s", e.what(), app.help().c_str());
    return 2;
  }
  std::string text, err, token;
  if (!read_text("--peers", peers_file, &text, &err) || !parse_peers(text, &o.peers, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: %s\n", err.c_str());
    return 2;
  }
  if (!read_text("--token-file", token_file, &token, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: %s\n", err.c_str());
    return 2;
  }
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  if (token.empty() || token.size() > kTokenBytes) {
    fprintf(stderr, "r2ccl_snapshotd: the job token in %s has %zu bytes (accepted: 1..%zu)\n",
            token_file.c_str(), token.size(), kTokenBytes);
    return 2;
  }
  bool listed = false;
  for (const auto& p : o.peers) listed |= p.id == id;
  if (!listed) {
    fprintf(stderr, "r2ccl_snapshotd: --id %u is not in the peer list %s\n", id,
            peers_file.c_str());
    return 2;
  }
  std::string seg;
  if (!board::segment_name(o.board, &seg, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: --board: %s\n", err.c_str());
    return 2;
  }
  if (!topo_file.empty() && (!read_text("--topology", topo_file, &text, &err) ||
                             !parse_topology(text, &o.topology, &err))) {
    fprintf(stderr, "r2ccl_snapshotd: --topology: %s\n", err.c_str());
    return 2;
  }
  if (app.count("--socket") && o.socket_path.empty()) {
    fprintf(stderr,
            "r2ccl_snapshotd: --socket is empty (accepted: a path; leave the option out "
            "for /tmp/r2ccl-snapshotd-BOARD.sock)\n");
    return 2;
  }
  if (o.socket_path.empty()) o.socket_path = "/tmp/r2ccl-snapshotd-" + o.board + ".sock";
  if (!o.socket_group.empty() && !getgrnam(o.socket_group.c_str())) {
    fprintf(stderr, "r2ccl_snapshotd: --socket-group %s: no such group\n", o.socket_group.c_str());
    return 2;
  }
  if (!spill_dir.empty()) {
    // The directory itself is created (mode 0700) if missing, its parent must exist: a typo
    // does not silently create a tree.
    std::string parent = spill_dir;
    while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
    const size_t slash = parent.rfind('/');
    parent = slash == std::string::npos ? "." : slash == 0 ? "/" : parent.substr(0, slash);
    struct stat st;
    if (stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      fprintf(stderr,
              "r2ccl_snapshotd: --spill-dir %s: its parent directory %s does not exist "
              "(the spill directory itself is created if missing)\n",
              spill_dir.c_str(), parent.c_str());
      return 2;
    }
  }
  // The socket is bound as PATH.tmpPID first: room for that suffix too.
  constexpr size_t kMaxSocketPath = sizeof(sockaddr_un::sun_path) - 16;
  if (o.socket_path.size() > kMaxSocketPath) {
    fprintf(stderr, "r2ccl_snapshotd: --socket %s is %zu bytes long (accepted: at most %zu)\n",
            o.socket_path.c_str(), o.socket_path.size(), kMaxSocketPath);
    return 2;
  }
  if (!o.metrics_addr.empty()) {
    asio::ip::tcp::endpoint ep;
    if (!M::parse_listen_address(o.metrics_addr, &ep, &err)) {
      fprintf(stderr, "r2ccl_snapshotd: --metrics: %s\n", err.c_str());
      return 2;
    }
  }
  if (!etcd::parse_endpoints(etcd_urls, &o.etcd, &err)) {
    fprintf(stderr, "r2ccl_snapshotd: --etcd: %s\n", err.c_str());
    return 2;
  }
  if (job.empty() || job.size() > 64 ||
      job.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") !=
          std::string::npos) {
    fprintf(stderr,
            "r2ccl_snapshotd: --job '%s' (accepted: 1-64 letters, digits, '-', '_' or '.')\n",
            job.c_str());
    return 2;
  }
  for (const std::string* f : {&o.etcd.ca_file, &o.etcd.cert_file, &o.etcd.key_file})
    if (!f->empty() && access(f->c_str(), R_OK) != 0) {
      fprintf(stderr, "r2ccl_snapshotd: %s: cannot read it (%s)\n", f->c_str(), strerror(errno));
      return 2;
    }
  if (!etcd_password_file.empty()) {
    if (o.etcd.user.empty()) {
      fprintf(stderr, "r2ccl_snapshotd: --etcd-password-file needs --etcd-user\n");
      return 2;
    }
    if (!read_text("--etcd-password-file", etcd_password_file, &o.etcd.password, &err)) {
      fprintf(stderr, "r2ccl_snapshotd: %s\n", err.c_str());
      return 2;
    }
    o.etcd.password = o.etcd.password.substr(0, o.etcd.password.find('\n'));
    if (!o.etcd.password.empty() && o.etcd.password.back() == '\r') o.etcd.password.pop_back();
  }
  o.prefix = "/r2ccl/" + job + "/";
  o.lease_ttl_s = lease_ttl;
  o.etcd.timeout_ms = std::max(200, std::min(1000, lease_ttl * 1000 / 3));
  o.test_write_after_pause = getenv("R2CCL_SNAPD_TEST_WRITE_AFTER_PAUSE") != nullptr;
  if (const char* e = getenv("R2CCL_SNAPD_TEST_REGISTER_DELAY_MS")) {
    char* end = nullptr;
    const long ms = strtol(e, &end, 10);
    if (end == e || *end != '\0' || ms < 0 || ms > 10000) {
      fprintf(stderr,
              "r2ccl_snapshotd: R2CCL_SNAPD_TEST_REGISTER_DELAY_MS=\"%s\" is not valid "
              "(accepted: milliseconds, 0..10000; a test hook)\n",
              e);
      return 2;
    }
    o.test_register_delay_ms = static_cast<int>(ms);
  }
  o.self = id;
  o.token = token;
  o.period = static_cast<TimeUs>(period_ms) * kUsPerMs;
  o.store.spill_dir = spill_dir;
  o.store.memory_limit_bytes = mem_mb << 20;
  o.store.max_shard_bytes = max_shard_mb << 20;
  Daemon d(std::move(o));
  return d.run();
}
