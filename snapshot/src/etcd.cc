// etcd v3 over its JSON gateway (etcd.h says which facts are used, and why the gateway).
#include "r2ccl/snapshot/etcd.h"

#include <curl/curl.h>
#include <openssl/evp.h>

#include <chrono>
#include <nlohmann/json.hpp>

namespace r2ccl::snap::etcd {
namespace {

using nlohmann::json;

std::string b64(const std::string& s) {
  std::string out(4 * ((s.size() + 2) / 3) + 1, '\0');
  const int n =
      EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                      reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  out.resize(n < 0 ? 0 : size_t(n));
  return out;
}
bool unb64(const std::string& s, std::string* out) {
  if (s.size() % 4 != 0) return false;
  out->assign(3 * (s.size() / 4) + 1, '\0');
  const int n =
      EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out->data()),
                      reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  if (n < 0) return false;
  size_t pad = 0;
  if (!s.empty() && s.back() == '=') pad = s.size() >= 2 && s[s.size() - 2] == '=' ? 2 : 1;
  out->resize(size_t(n) - pad);
  return true;
}
// 64-bit integers come as strings (proto3 JSON); absent = 0.
int64_t num(const json& j, const char* k) {
  auto it = j.find(k);
  if (it == j.end()) return 0;
  if (it->is_string()) return std::stoll(it->get<std::string>());
  if (it->is_number()) return it->get<int64_t>();
  return 0;
}
KeyValue kv_of(const json& j) {
  KeyValue kv;
  if (j.contains("key")) unb64(j["key"].get<std::string>(), &kv.key);
  if (j.contains("value")) unb64(j["value"].get<std::string>(), &kv.value);
  kv.create_revision = num(j, "create_revision");
  kv.mod_revision = num(j, "mod_revision");
  kv.version = num(j, "version");
  kv.lease = num(j, "lease");
  return kv;
}
json op_json(const Op& op) {
  json j;
  switch (op.kind) {
    case Op::kPut: {
      json p = {{"key", b64(op.key)}, {"value", b64(op.value)}};
      if (op.lease) p["lease"] = std::to_string(op.lease);
      j["request_put"] = p;
      break;
    }
    case Op::kDelete: {
      json d = {{"key", b64(op.key)}};
      if (!op.range_end.empty()) d["range_end"] = b64(op.range_end);
      j["request_delete_range"] = d;
      break;
    }
    case Op::kRange: {
      json r = {{"key", b64(op.key)}};
      if (!op.range_end.empty()) r["range_end"] = b64(op.range_end);
      j["request_range"] = r;
      break;
    }
  }
  return j;
}
json compare_json(const Compare& c) {
  static const char* kTargets[] = {"VERSION", "CREATE", "MOD", "VALUE", "LEASE"};
  static const char* kResults[] = {"EQUAL", "GREATER", "LESS", "NOT_EQUAL"};
  json j = {{"key", b64(c.key)}, {"target", kTargets[c.target]}, {"result", kResults[c.result]}};
  switch (c.target) {
    case Compare::kVersion: j["version"] = std::to_string(c.number); break;
    case Compare::kCreate: j["create_revision"] = std::to_string(c.number); break;
    case Compare::kMod: j["mod_revision"] = std::to_string(c.number); break;
    case Compare::kValue: j["value"] = b64(c.value); break;
    case Compare::kLease: j["lease"] = std::to_string(c.number); break;
  }
  return j;
}

size_t append_body(char* p, size_t size, size_t n, void* user) {
  static_cast<std::string*>(user)->append(p, size * n);
  return size * n;
}

void global_init() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// The options every request of ours sets on a handle.
void setup(CURL* c, const Options& o, long timeout_ms) {
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, long(o.timeout_ms));
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
  if (!o.ca_file.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, o.ca_file.c_str());
  if (!o.cert_file.empty()) curl_easy_setopt(c, CURLOPT_SSLCERT, o.cert_file.c_str());
  if (!o.key_file.empty()) curl_easy_setopt(c, CURLOPT_SSLKEY, o.key_file.c_str());
}

// What went wrong in one request that got no HTTP answer: curl's code and, when it has one,
// the detail of its error buffer (for TLS, OpenSSL's reason, e.g. "unable to get local issuer
// certificate", which the code's text alone does not say), and what to check for the TLS
// failures. `tls_without_cert`: an https URL and no client certificate set.
std::string curl_failure(CURLcode rc, const char* detail, bool tls_without_cert) {
  std::string m = curl_easy_strerror(rc);
  if (detail[0]) m = std::string(detail).find(m) == std::string::npos ? m + ": " + detail : detail;
  switch (rc) {
    case CURLE_PEER_FAILED_VERIFICATION:
      return m +
             " (etcd's certificate is not signed by the CA file given, or does not name "
             "this host)";
    case CURLE_SSL_CERTPROBLEM: return m + " (the client certificate or its key file)";
    case CURLE_SSL_CACERT_BADFILE: return m + " (the CA file)";
    default: break;
  }
  // An etcd with --client-cert-auth refuses a client without a certificate, or with one its
  // --trusted-ca-file did not sign. Under TLS 1.3 it does so after the client's side of the
  // handshake is done: the client then sees the refusal on its first write or read, as a
  // send or receive error, with OpenSSL's alert ("bad certificate", "certificate required")
  // or, when the write came first, only a closed connection.
  const bool alert = m.find("certificate required") != std::string::npos ||
                     m.find("alert bad certificate") != std::string::npos ||
                     m.find("alert unknown ca") != std::string::npos;
  const bool closed = rc == CURLE_SEND_ERROR || rc == CURLE_RECV_ERROR || rc == CURLE_GOT_NOTHING ||
                      rc == CURLE_SSL_CONNECT_ERROR;
  if (tls_without_cert && (alert || closed))
    m += " (etcd ended the TLS connection and this client has no certificate: an etcd with "
         "--client-cert-auth needs one, signed by a CA of its --trusted-ca-file)";
  else if (alert)
    m += " (etcd refused this client's TLS certificate: an etcd with --client-cert-auth needs "
         "one signed by a CA of its --trusted-ca-file)";
  return m;
}

// A hint for the etcd answers whose own text does not say what to change.
std::string answer_hint(const std::string& msg) {
  if (msg.find("user name is empty") != std::string::npos)
    return " (etcd has authentication on and this client gave no user: set a user and "
           "password; r2ccl_snapshotd: --etcd-user, --etcd-password-file)";
  if (msg.find("CommonName of client sending a request against gateway") != std::string::npos)
    return " (etcd's JSON gateway, with authentication and --client-cert-auth on, refuses every "
           "client certificate that has a Common Name: use one whose subject has no CN)";
  return "";
}

bool transport_error(CURLcode rc) {
  return rc == CURLE_COULDNT_CONNECT || rc == CURLE_OPERATION_TIMEDOUT ||
         rc == CURLE_COULDNT_RESOLVE_HOST || rc == CURLE_RECV_ERROR || rc == CURLE_SEND_ERROR ||
         rc == CURLE_GOT_NOTHING || rc == CURLE_SSL_CONNECT_ERROR || rc == CURLE_PARTIAL_FILE;
}

}  // namespace

bool parse_endpoints(const std::string& text, Options* opts, std::string* err) {
  opts->endpoints.clear();
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string e = text.substr(pos, comma - pos);
    pos = comma + 1;
    while (!e.empty() && e.back() == '/') e.pop_back();
    const bool http = e.rfind("http://", 0) == 0, https = e.rfind("https://", 0) == 0;
    const std::string rest = http ? e.substr(7) : https ? e.substr(8) : "";
    const size_t colon = rest.rfind(':');
    bool ok = (http || https) && colon != std::string::npos && colon > 0 &&
              rest.find('/') == std::string::npos && colon + 1 < rest.size();
    for (size_t i = colon + 1; ok && i < rest.size(); ++i) ok = isdigit((unsigned char)rest[i]);
    if (ok) {
      const long port = std::stol(rest.substr(colon + 1));
      ok = port > 0 && port < 65536;
    }
    if (!ok) {
      *err = "etcd endpoint '" + e +
             "' (accepted: http://HOST:PORT or https://HOST:PORT, several separated by commas)";
      opts->endpoints.clear();
      return false;
    }
    opts->endpoints.push_back(e);
    if (comma == text.size()) break;
  }
  if (opts->endpoints.empty()) {
    *err = "no etcd endpoint (accepted: http://HOST:PORT[,...])";
    return false;
  }
  return true;
}

std::string prefix_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    unsigned char c = static_cast<unsigned char>(end.back());
    if (c < 0xff) {
      end.back() = static_cast<char>(c + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Client::Client(Options o) : o_(std::move(o)) {
  global_init();
  curl_ = curl_easy_init();
}
Client::~Client() {
  if (curl_) curl_easy_cleanup(static_cast<CURL*>(curl_));
}

Status Client::post_once(void* h, const std::string& url, const std::string& body,
                         std::string* answer) {
  CURL* c = static_cast<CURL*>(h);
  curl_easy_reset(c);
  setup(c, o_, o_.timeout_ms);
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, long(body.size()));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, answer);
  struct curl_slist* hdr = curl_slist_append(nullptr, "Content-Type: application/json");
  std::string auth;
  if (!token_.empty()) {
    auth = "Authorization: " + token_;
    hdr = curl_slist_append(hdr, auth.c_str());
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
  char detail[CURL_ERROR_SIZE] = "";
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, detail);
  answer->clear();
  const CURLcode rc = curl_easy_perform(c);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, nullptr);  // the handle outlives `detail`
  curl_slist_free_all(hdr);
  if (rc != CURLE_OK)
    return {transport_error(rc) ? Status::kUnreachable : Status::kError,
            url + ": " +
                curl_failure(rc, detail, url.rfind("https://", 0) == 0 && o_.cert_file.empty())};
  long code = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
  if (code != 200) {
    std::string msg = *answer;
    try {
      json j = json::parse(*answer);
      if (j.contains("message")) msg = j["message"].get<std::string>();
    } catch (const std::exception&) {
    }
    // 503 and 500 "etcdserver: request timed out" / "no leader": the member cannot serve now.
    const bool busy = code == 503 || msg.find("no leader") != std::string::npos ||
                      msg.find("timed out") != std::string::npos;
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == '\r')) msg.pop_back();
    return {busy ? Status::kUnreachable : Status::kError,
            url + ": HTTP " + std::to_string(code) + ": " + msg + answer_hint(msg)};
  }
  return {};
}

Status Client::authenticate(void* h, const std::string& base) {
  token_.clear();
  std::string answer;
  json req = {{"name", o_.user}, {"password", o_.password}};
  Status s = post_once(h, base + "/v3/auth/authenticate", req.dump(), &answer);
  // etcd's refusal ("authentication failed, invalid user ID or password") names neither the
  // user nor what was being done: say both. An unreachable endpoint keeps its own message.
  if (s.code == Status::kError)
    s.message = "etcd authentication as user '" + o_.user + "' failed: " + s.message;
  if (!s.ok()) return s;
  try {
    token_ = json::parse(answer).value("token", "");
  } catch (const std::exception& e) {
    return {Status::kError, base + "/v3/auth/authenticate: unreadable answer: " + e.what()};
  }
  if (token_.empty()) return {Status::kError, base + "/v3/auth/authenticate: no token"};
  return {};
}

Status Client::call(const std::string& path, const std::string& body, std::string* answer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!curl_) return {Status::kError, "libcurl could not be initialised"};
  Status last;
  const size_t n = o_.endpoints.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (current_ + k) % n;
    const std::string& base = o_.endpoints[i];
    if (!o_.user.empty() && token_.empty()) {
      last = authenticate(curl_, base);
      if (last.code == Status::kUnreachable) continue;
      if (!last.ok()) return last;
    }
    last = post_once(curl_, base + path, body, answer);
    if (last.code == Status::kError && !o_.user.empty() &&
        last.message.find("invalid auth token") != std::string::npos) {
      last = authenticate(curl_, base);
      if (last.ok()) last = post_once(curl_, base + path, body, answer);
    }
    if (last.code != Status::kUnreachable) {
      current_ = i;
      return last;
    }
  }
  return last;
}

Status Client::range(const std::string& key, const std::string& range_end,
                     std::vector<KeyValue>* out, int64_t* revision) {
  json req = {{"key", b64(key)}};
  if (!range_end.empty()) req["range_end"] = b64(range_end);
  std::string a;
  Status s = call("/v3/kv/range", req.dump(), &a);
  if (!s.ok()) return s;
  try {
    json j = json::parse(a);
    out->clear();
    if (j.contains("kvs"))
      for (const auto& kv : j["kvs"]) out->push_back(kv_of(kv));
    if (revision) *revision = j.contains("header") ? num(j["header"], "revision") : 0;
  } catch (const std::exception& e) {
    return {Status::kError, "/v3/kv/range: unreadable answer: " + std::string(e.what())};
  }
  return {};
}

Status Client::oldest(const std::string& key, const std::string& range_end, KeyValue* out,
                      bool* found) {
  json req = {{"key", b64(key)},        {"range_end", b64(range_end)}, {"limit", "1"},
              {"sort_order", "ASCEND"}, {"sort_target", "CREATE"},     {"keys_only", true}};
  std::string a;
  Status s = call("/v3/kv/range", req.dump(), &a);
  if (!s.ok()) return s;
  try {
    json j = json::parse(a);
    *found = j.contains("kvs") && !j["kvs"].empty();
    if (*found) *out = kv_of(j["kvs"][0]);
  } catch (const std::exception& e) {
    return {Status::kError, "/v3/kv/range: unreadable answer: " + std::string(e.what())};
  }
  return {};
}

Status Client::put(const std::string& key, const std::string& value, int64_t lease) {
  json req = {{"key", b64(key)}, {"value", b64(value)}};
  if (lease) req["lease"] = std::to_string(lease);
  std::string a;
  return call("/v3/kv/put", req.dump(), &a);
}

Status Client::del(const std::string& key, const std::string& range_end) {
  json req = {{"key", b64(key)}};
  if (!range_end.empty()) req["range_end"] = b64(range_end);
  std::string a;
  return call("/v3/kv/deleterange", req.dump(), &a);
}

Status Client::txn(const std::vector<Compare>& cmp, const std::vector<Op>& success,
                   const std::vector<Op>& failure, TxnResult* out) {
  json req = {{"compare", json::array()}, {"success", json::array()}, {"failure", json::array()}};
  for (const auto& c : cmp) req["compare"].push_back(compare_json(c));
  for (const auto& o : success) req["success"].push_back(op_json(o));
  for (const auto& o : failure) req["failure"].push_back(op_json(o));
  std::string a;
  Status s = call("/v3/kv/txn", req.dump(), &a);
  if (!s.ok()) return s;
  try {
    json j = json::parse(a);
    *out = TxnResult{};
    out->succeeded = j.value("succeeded", false);
    out->revision = j.contains("header") ? num(j["header"], "revision") : 0;
    if (j.contains("responses"))
      for (const auto& r : j["responses"])
        if (r.contains("response_range")) {
          std::vector<KeyValue> kvs;
          if (r["response_range"].contains("kvs"))
            for (const auto& kv : r["response_range"]["kvs"]) kvs.push_back(kv_of(kv));
          out->ranges.push_back(std::move(kvs));
        }
  } catch (const std::exception& e) {
    return {Status::kError, "/v3/kv/txn: unreadable answer: " + std::string(e.what())};
  }
  return {};
}

Status Client::lease_grant(int64_t ttl_s, int64_t* id) {
  json req = {{"TTL", std::to_string(ttl_s)}};
  std::string a;
  Status s = call("/v3/lease/grant", req.dump(), &a);
  if (!s.ok()) return s;
  try {
    json j = json::parse(a);
    *id = num(j, "ID");
    if (j.contains("error") || *id == 0)
      return {Status::kError, "/v3/lease/grant: " + j.value("error", std::string("no lease id"))};
  } catch (const std::exception& e) {
    return {Status::kError, "/v3/lease/grant: unreadable answer: " + std::string(e.what())};
  }
  return {};
}

Status Client::lease_keepalive(int64_t id, int64_t* ttl_s) {
  json req = {{"ID", std::to_string(id)}};
  std::string a;
  Status s = call("/v3/lease/keepalive", req.dump(), &a);
  if (!s.ok()) return s;
  try {
    // The gateway streams: the answer is one {"result": {...}} object (or an error object).
    json j = json::parse(a.substr(0, a.find('\n')));
    if (j.contains("error")) return {Status::kError, "/v3/lease/keepalive: " + j.dump()};
    *ttl_s = j.contains("result") ? num(j["result"], "TTL") : 0;
  } catch (const std::exception& e) {
    return {Status::kError, "/v3/lease/keepalive: unreadable answer: " + std::string(e.what())};
  }
  return {};
}

Status Client::lease_revoke(int64_t id) {
  json req = {{"ID", std::to_string(id)}};
  std::string a;
  Status s = call("/v3/lease/revoke", req.dump(), &a);
  if (s.code == Status::kError && s.message.find("lease not found") != std::string::npos) return {};
  return s;
}

// ---- watch ----

namespace {
struct WatchCtx {
  std::string buf;
  std::atomic<bool>* stop;
  std::function<bool(const std::string&)> line;  // false: abort the stream
  bool aborted = false;
};
size_t watch_body(char* p, size_t size, size_t n, void* user) {
  auto* w = static_cast<WatchCtx*>(user);
  w->buf.append(p, size * n);
  size_t nl;
  while ((nl = w->buf.find('\n')) != std::string::npos) {
    std::string l = w->buf.substr(0, nl);
    w->buf.erase(0, nl + 1);
    if (!l.empty() && !w->line(l)) {
      w->aborted = true;
      return 0;
    }
  }
  // One object may also arrive without a newline at the end of a chunk: try it whole.
  if (!w->buf.empty() && w->buf.back() == '}' && json::accept(w->buf)) {
    std::string l;
    l.swap(w->buf);
    if (!w->line(l)) {
      w->aborted = true;
      return 0;
    }
  }
  return size * n;
}
int watch_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  return static_cast<WatchCtx*>(user)->stop->load() ? 1 : 0;
}
}  // namespace

Watch::Watch(Options o, std::string prefix, int64_t start_revision, Events on_events,
             std::function<int64_t()> on_reset, std::function<void(bool)> on_link)
    : o_(std::move(o)),
      prefix_(std::move(prefix)),
      next_rev_(start_revision),
      on_events_(std::move(on_events)),
      on_reset_(std::move(on_reset)),
      on_link_(std::move(on_link)) {
  global_init();
  thread_ = std::thread([this] { run(); });
}

Watch::~Watch() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Watch::run() {
  CURL* c = curl_easy_init();
  size_t ep = 0;
  std::string token;
  bool up = false;
  while (!stop_) {
    const std::string base = o_.endpoints[ep % o_.endpoints.size()];
    if (!o_.user.empty() && token.empty()) {
      std::string answer;
      const std::string url = base + "/v3/auth/authenticate";
      const std::string body = json{{"name", o_.user}, {"password", o_.password}}.dump();
      curl_easy_reset(c);
      setup(c, o_, o_.timeout_ms);
      curl_easy_setopt(c, CURLOPT_URL, url.c_str());
      curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
      curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append_body);
      curl_easy_setopt(c, CURLOPT_WRITEDATA, &answer);
      if (curl_easy_perform(c) == CURLE_OK) try {
          token = json::parse(answer).value("token", "");
        } catch (const std::exception&) {
        }
    }
    json create = {{"key", b64(prefix_)}, {"range_end", b64(prefix_end(prefix_))}};
    if (next_rev_ > 0) create["start_revision"] = std::to_string(next_rev_.load());
    const std::string body = json{{"create_request", create}}.dump();
    const std::string url = base + "/v3/watch";
    WatchCtx ctx;
    ctx.stop = &stop_;
    bool reset = false;
    ctx.line = [&](const std::string& l) {
      json j;
      try {
        j = json::parse(l);
      } catch (const std::exception&) {
        return false;
      }
      if (!j.contains("result")) return false;  // an error object: reconnect
      const json& r = j["result"];
      if (!up) {
        up = true;
        if (on_link_) on_link_(true);
      }
      if (num(r, "compact_revision") > 0 || r.value("canceled", false)) {
        reset = true;
        return false;
      }
      if (!r.contains("events")) return true;
      std::vector<WatchEvent> evs;
      int64_t last = 0;
      for (const auto& e : r["events"]) {
        WatchEvent ev;
        ev.type = e.value("type", std::string("PUT")) == "DELETE" ? WatchEvent::kDelete
                                                                  : WatchEvent::kPut;
        if (e.contains("kv")) ev.kv = kv_of(e["kv"]);
        last = std::max(last, ev.kv.mod_revision);
        evs.push_back(std::move(ev));
      }
      if (!evs.empty()) {
        next_rev_ = last + 1;
        on_events_(evs, last);
      }
      return true;
    };
    curl_easy_reset(c);
    setup(c, o_, 0);  // no overall timeout: the stream stays open
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, long(body.size()));
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, watch_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &ctx);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, watch_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, &ctx);
    struct curl_slist* hdr = curl_slist_append(nullptr, "Content-Type: application/json");
    std::string auth;
    if (!token.empty()) {
      auth = "Authorization: " + token;
      hdr = curl_slist_append(hdr, auth.c_str());
    }
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
    curl_easy_perform(c);
    curl_slist_free_all(hdr);
    if (stop_) break;
    if (reset) {
      next_rev_ = on_reset_ ? on_reset_() + 1 : 0;
      continue;
    }
    if (up) {
      up = false;
      if (on_link_) on_link_(false);
    }
    token.clear();
    ++ep;
    for (int i = 0; i < 5 && !stop_; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  curl_easy_cleanup(c);
}

}  // namespace r2ccl::snap::etcd
