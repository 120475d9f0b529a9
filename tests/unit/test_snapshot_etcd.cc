// etcd endpoint lists (etcd.h): what --etcd accepts and how a bad entry is named.
#include <catch2/catch.hpp>

#include "r2ccl/snapshot/etcd.h"

using namespace r2ccl::snap;

TEST_CASE("etcd: endpoint lists", "[snapshot][etcd]") {
  etcd::Options o;
  std::string err;
  REQUIRE(etcd::parse_endpoints("http://127.0.0.1:2379", &o, &err));
  CHECK(o.endpoints == std::vector<std::string>{"http://127.0.0.1:2379"});
  REQUIRE(etcd::parse_endpoints("http://a:1,https://b.example:2379/", &o, &err));
  CHECK(o.endpoints == std::vector<std::string>{"http://a:1", "https://b.example:2379"});
  for (const char* bad : {"", "127.0.0.1:2379", "http://a", "http://a:0", "http://a:99999",
                          "http://a:1/v3", "ftp://a:1", "http://a:1,,http://b:2", "http://:1"}) {
    INFO(bad);
    CHECK_FALSE(etcd::parse_endpoints(bad, &o, &err));
    CHECK_THAT(err, Catch::Contains("http://HOST:PORT"));
  }
  CHECK(etcd::prefix_end("/r2ccl/j/") == "/r2ccl/j0");
  CHECK(etcd::prefix_end("a\xff") == "b");
}
