// A small etcd v3 client for the snapshot daemon's control plane (issue 15).
//
// It speaks etcd's JSON gateway (`POST /v3/...`, the grpc-gateway every etcd >= 3.4 serves on
// its client URLs; Debian 12 ships etcd 3.4.23) through libcurl, with nlohmann-json for the
// bodies. Byte fields (keys, values) are base64 on the wire (the gateway's JSON mapping of
// protobuf `bytes`); 64-bit integers arrive as JSON strings. Why the gateway and not gRPC: the
// protocol files Debian installs (golang-etcd-server-dev) import gogoproto and google.api
// annotations, so generating C++ stubs needs a second protobuf tree at build time, and the
// generated gRPC code alone would take minutes of the 2-core CI machines' build; the gateway
// needs only libcurl, which is in every distribution, and etcd serves it on the same port.
//
// Facts used (etcd API reference, v3.4: api/etcdserverpb/rpc.proto and its gateway mapping):
//   /v3/kv/range, /v3/kv/put, /v3/kv/deleterange, /v3/kv/txn, /v3/lease/grant,
//   /v3/lease/keepalive (a TTL of 0 or absent in the answer: the lease is gone),
//   /v3/lease/revoke, /v3/watch (a stream of JSON objects, one per line, each {"result": ...}),
//   /v3/auth/authenticate (a token sent back in the "Authorization" header).
//   Compare targets VERSION, CREATE, MOD, VALUE, LEASE; results EQUAL, GREATER, LESS, NOT_EQUAL;
//   a key that does not exist has create_revision 0. A txn's "succeeded" is absent when false
//   (proto3 JSON leaves out default values).
//
// Endpoints: a list of base URLs ("http://10.0.0.1:2379"); a request that cannot reach one
// (connection refused, timeout) moves on to the next, and the one that answered is used first
// from then on. TLS: https URLs with a CA file, and a client certificate and key when the cluster
// asks for one. Authentication: a user and password, exchanged for a token on first use and
// again when etcd says the token is invalid. Both are tested against etcd 3.4 over https with
// --client-cert-auth (tests/loopback/test_snapshotd_etcd_tls.cc). One fact of etcd to know:
// when authentication, --client-cert-auth and the gateway are all on, etcd refuses (HTTP 400
// "CommonName of client sending a request against gateway will be ignored ...") every request
// whose client certificate has a Common Name, whatever its token: a client certificate for
// this client must have no CN in its subject (e.g. "/O=r2ccl"); the etcd user is the one of
// `user`/`password`, never the certificate's.
//
// Thread-safety: every EtcdClient method may be called from any thread; calls are serialized on
// one connection by an internal mutex (a call blocks at most `timeout_ms` per endpoint tried).
// An EtcdWatch runs its own thread and connection.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace r2ccl::snap::etcd {

struct Options {
  std::vector<std::string> endpoints;  // base URLs, e.g. "http://127.0.0.1:2379"
  // TLS, for https endpoints (libcurl with OpenSSL; every file PEM):
  //   ca_file    the CA certificate(s) that signed etcd's server certificate, which must name
  //              the endpoint's host (subjectAltName); empty: the system's CA store.
  //   cert_file  this client's certificate, for an etcd with --client-cert-auth (signed by a
  //              CA of its --trusted-ca-file; no Common Name when etcd authentication is on,
  //              see above); empty: none.
  //   key_file   its private key, unencrypted; empty: the key is in cert_file.
  std::string ca_file, cert_file, key_file;
  // etcd authentication: a user etcd knows and its password; empty user = none (an etcd with
  // authentication on then refuses every request: "user name is empty").
  std::string user, password;
  int timeout_ms = 1000;  // per request and endpoint (TLS handshake included)
};

// Parses "URL[,URL...]" (each http:// or https://HOST:PORT, no path) into opts->endpoints.
// Returns false with *err naming the bad entry and the accepted form.
bool parse_endpoints(const std::string& text, Options* opts, std::string* err);

struct Status {
  enum Code { kOk, kUnreachable, kError } code = kOk;
  std::string message;  // for kUnreachable and kError: what failed and why
  bool ok() const { return code == kOk; }
};

struct KeyValue {
  std::string key, value;
  int64_t create_revision = 0, mod_revision = 0, version = 0, lease = 0;
};

struct Compare {
  enum Target { kVersion, kCreate, kMod, kValue, kLease } target = kCreate;
  enum Result { kEqual, kGreater, kLess, kNotEqual } result = kEqual;
  std::string key;
  int64_t number = 0;  // kVersion, kCreate, kMod, kLease
  std::string value;   // kValue
};

struct Op {
  enum Kind { kPut, kDelete, kRange } kind = kPut;
  std::string key, value;
  std::string range_end;  // kDelete, kRange: "" = the key alone
  int64_t lease = 0;      // kPut
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;                       // the store's revision after the transaction
  std::vector<std::vector<KeyValue>> ranges;  // one per kRange op of the branch that ran
};

// The range_end that selects every key starting with `prefix`.
std::string prefix_end(const std::string& prefix);

class Client {
 public:
  explicit Client(Options o);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Keys in [key, range_end) (range_end "" = key alone), sorted by key; *revision = the
  // store's revision the answer reflects.
  Status range(const std::string& key, const std::string& range_end, std::vector<KeyValue>* out,
               int64_t* revision = nullptr);
  // The first key of [key, range_end) by create revision (the oldest); *found false when none.
  Status oldest(const std::string& key, const std::string& range_end, KeyValue* out, bool* found);
  Status put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status del(const std::string& key, const std::string& range_end = "");
  Status txn(const std::vector<Compare>& cmp, const std::vector<Op>& success,
             const std::vector<Op>& failure, TxnResult* out);
  // A lease of `ttl_s` seconds; *id its id.
  Status lease_grant(int64_t ttl_s, int64_t* id);
  // Refreshes the lease; *ttl_s = its remaining TTL, 0 when it no longer exists.
  Status lease_keepalive(int64_t id, int64_t* ttl_s);
  // Revokes the lease (its keys are deleted); a lease already gone is not an error.
  Status lease_revoke(int64_t id);

  const Options& options() const { return o_; }

 private:
  friend class Watch;
  Status call(const std::string& path, const std::string& body, std::string* answer);
  Status post_once(void* curl, const std::string& url, const std::string& body,
                   std::string* answer);
  Status authenticate(void* curl, const std::string& base);
  Options o_;
  std::mutex mu_;
  void* curl_ = nullptr;
  size_t current_ = 0;  // index of the endpoint that answered last
  std::string token_;   // authentication token, when a user is set
};

struct WatchEvent {
  enum Type { kPut, kDelete } type = kPut;
  KeyValue kv;  // for kDelete: key and mod_revision only
};

// Watches every key under a prefix from a revision on, on its own thread. Events are delivered
// in revision order, by batch, to `on_events` (called on the watch thread). A dropped stream is
// reopened from the revision after the last one delivered; when that revision was compacted
// away, `on_reset` is called (on the watch thread): the caller reads the prefix again and returns
// the revision of what it read, and the watch goes on from the revision after it. `on_link(up)`
// says when the stream is open or lost (for the caller's "etcd unreachable" log line).
class Watch {
 public:
  using Events = std::function<void(const std::vector<WatchEvent>&, int64_t revision)>;
  Watch(Options o, std::string prefix, int64_t start_revision, Events on_events,
        std::function<int64_t()> on_reset, std::function<void(bool up)> on_link);
  ~Watch();  // stops the thread (libcurl looks at the stop flag about once a second)
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

 private:
  void run();
  Options o_;
  std::string prefix_;
  std::atomic<int64_t> next_rev_;
  Events on_events_;
  std::function<int64_t()> on_reset_;
  std::function<void(bool)> on_link_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace r2ccl::snap::etcd
