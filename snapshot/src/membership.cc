#include "r2ccl/snapshot/membership.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <sstream>

#include "text.h"

namespace r2ccl::snap {

using text::trim;

namespace {

bool parse_uint(const std::string& s, uint64_t max, uint64_t* out) {
  if (s.empty() || s.size() > 10) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v > max) return false;
  *out = v;
  return true;
}

}  // namespace

bool parse_peers(const std::string& text, std::vector<PeerSpec>* out, std::string* err) {
  std::vector<PeerSpec> peers;
  std::set<uint32_t> ids;
  std::set<std::string> addrs;
  std::istringstream in(text);
  std::string line;
  int no = 0;
  const std::string form = "accepted: 'ID HOST:PORT' or 'ID [IPV6]:PORT', ID 0.." +
                           std::to_string(board::kMaxNodes - 1) + ", PORT 1..65535";
  while (std::getline(in, line)) {
    ++no;
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    line = trim(line);
    if (line.empty()) continue;
    const size_t sp = line.find_first_of(" \t");
    const std::string where = "peer list line " + std::to_string(no) + " '" + line + "'";
    if (sp == std::string::npos) {
      *err = where + ": no address (" + form + ")";
      return false;
    }
    uint64_t id = 0, port = 0;
    const std::string addr = trim(line.substr(sp));
    const size_t colon = addr.rfind(':');
    if (!parse_uint(line.substr(0, sp), board::kMaxNodes - 1, &id) || colon == std::string::npos ||
        colon == 0 || !parse_uint(addr.substr(colon + 1), 65535, &port) || port == 0 ||
        addr.find_first_of(" \t") != std::string::npos) {
      *err = where + ": malformed (" + form + ")";
      return false;
    }
    std::string host = addr.substr(0, colon);
    if (host.front() == '[') {
      if (host.size() < 3 || host.back() != ']') {
        *err = where + ": malformed IPv6 address (" + form + ")";
        return false;
      }
      host = host.substr(1, host.size() - 2);
    } else if (host.find(':') != std::string::npos) {
      *err = where + ": an IPv6 address needs brackets (" + form + ")";
      return false;
    }
    if (!ids.insert(static_cast<uint32_t>(id)).second) {
      *err = where + ": node id " + std::to_string(id) + " appears twice";
      return false;
    }
    if (!addrs.insert(addr).second) {
      *err = where + ": address " + addr + " appears twice";
      return false;
    }
    peers.push_back(PeerSpec{static_cast<uint32_t>(id), host, static_cast<uint16_t>(port)});
  }
  if (peers.empty()) {
    *err = "peer list has no node (" + form + ")";
    return false;
  }
  *out = std::move(peers);
  return true;
}

Membership::Membership(uint32_t self, const std::vector<uint32_t>& ids, TimeUs period, TimeUs now,
                       int miss_limit)
    : self_(self), period_(period), started_(now), miss_limit_(miss_limit), ids_(ids) {
  std::sort(ids_.begin(), ids_.end());
  ids_.erase(std::unique(ids_.begin(), ids_.end()), ids_.end());
  // Only this node starts live: a peer is live from its first heartbeat, so a daemon that
  // starts alone never speaks for nodes it has not heard, and acts only once a majority has
  // been heard.
  for (uint32_t id : ids_) nodes_.push_back(Node{id, now, id == self});
}

bool Membership::on_heard(uint32_t from, TimeUs now) {
  for (Node& n : nodes_) {
    if (n.id != from) continue;
    n.last_heard = std::max(n.last_heard, now);
    if (!n.alive) {
      n.alive = true;
      ++epoch_;
    }
    return true;
  }
  return false;
}

std::vector<uint32_t> Membership::tick(TimeUs now) {
  if (now - started_ >= static_cast<TimeUs>(miss_limit_) * period_) settled_ = true;
  std::vector<uint32_t> failed;
  for (Node& n : nodes_) {
    if (n.id == self_ || !n.alive) continue;
    if (now - n.last_heard > static_cast<TimeUs>(miss_limit_) * period_) {
      n.alive = false;
      failed.push_back(n.id);
    }
  }
  if (!failed.empty()) ++epoch_;
  return failed;
}

bool Membership::alive(uint32_t id) const {
  for (const Node& n : nodes_)
    if (n.id == id) return n.id == self_ || n.alive;
  return false;
}

std::vector<uint32_t> Membership::live() const {
  std::vector<uint32_t> v;
  for (const Node& n : nodes_)
    if (n.id == self_ || n.alive) v.push_back(n.id);
  return v;
}

uint32_t Membership::coordinator() const {
  for (const Node& n : nodes_)
    if (n.id == self_ || n.alive) return n.id;
  return self_;
}

board::AgreedRecord Membership::agreed_record(const std::vector<float>& usable_gbps) const {
  board::AgreedRecord r;
  r.epoch = epoch_;
  r.n_nodes = ids_.empty() ? 0 : ids_.back() + 1;
  for (uint32_t id : live()) {
    r.members[id / 64] |= 1ULL << (id % 64);
    if (id < usable_gbps.size()) r.node_usable_gbps[id] = usable_gbps[id];
  }
  return r;
}

}  // namespace r2ccl::snap
