// The snapshot delta codec: FP16/BF16 conversions against known bit patterns, exact lossless
// chains with bases every K, restore from the latest base, compression of realistic FP16
// optimizer steps, the closed-loop lossy codec (error reported, bounded over 50 snapshots),
// every refusal (CRC, truncation, magic, version, oversized sizes without allocating,
// sequence, buffer size) leaving the decoder unchanged, and 2000 random frame mutations.
#include <zlib.h>
#include <zstd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "r2ccl/snapshot/codec.h"

using namespace r2ccl::snap;

// ---- allocation watch: the largest single operator-new request while armed ----
// The replacements below are a malloc/free pair. GCC 12 inlines them into vector code and
// then pairs the new-expression with free() (-Wmismatched-new-delete): a false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
namespace {
std::atomic<bool> g_watch{false};
std::atomic<size_t> g_largest{0};
void* watched_alloc(size_t n) {
  if (g_watch.load(std::memory_order_relaxed)) {
    size_t cur = g_largest.load(std::memory_order_relaxed);
    while (n > cur && !g_largest.compare_exchange_weak(cur, n)) {
    }
  }
  return std::malloc(n ? n : 1);
}
}  // namespace

void* operator new(size_t n) {
  void* p = watched_alloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}
void* operator new[](size_t n) {
  void* p = watched_alloc(n);
  if (!p) throw std::bad_alloc();
  return p;
}
void* operator new(size_t n, const std::nothrow_t&) noexcept { return watched_alloc(n); }
void* operator new[](size_t n, const std::nothrow_t&) noexcept { return watched_alloc(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::unique_ptr<DeltaEncoder> make_enc(DType t, size_t bytes, Codec c = Codec::kLossless,
                                       uint32_t k = 8) {
  EncoderConfig cfg;
  cfg.dtype = t;
  cfg.size_bytes = bytes;
  cfg.codec = c;
  cfg.base_every = k;
  std::string err;
  auto e = DeltaEncoder::create(cfg, &err);
  INFO(err);
  REQUIRE(e);
  return e;
}

std::unique_ptr<DeltaDecoder> make_dec(DType t, size_t bytes) {
  std::string err;
  auto d = DeltaDecoder::create(t, bytes, &err);
  INFO(err);
  REQUIRE(d);
  return d;
}

std::vector<uint8_t> encode(DeltaEncoder& e, const void* cur, EncodeStats* st = nullptr) {
  std::vector<uint8_t> f;
  std::string err;
  EncodeStats local;
  const bool ok = e.encode(cur, &f, st ? st : &local, &err);
  INFO(err);
  REQUIRE(ok);
  return f;
}

void apply_ok(DeltaDecoder& d, const std::vector<uint8_t>& f) {
  std::string err;
  const bool ok = d.apply(f.data(), f.size(), &err);
  INFO(err);
  REQUIRE(ok);
}

// A decoder's observable state, to prove a refused frame changed nothing.
struct View {
  std::vector<uint8_t> state;
  bool has;
  uint64_t last, base;
  bool operator==(const View& o) const {
    return state == o.state && has == o.has && (!has || (last == o.last && base == o.base));
  }
};
View view(const DeltaDecoder& d) {
  return {std::vector<uint8_t>(d.state(), d.state() + d.size_bytes()), d.has_state(), d.last_seq(),
          d.base_seq()};
}

void expect_refused(DeltaDecoder& d, const std::vector<uint8_t>& f, const std::string& needle) {
  const View before = view(d);
  std::string err;
  CHECK_FALSE(d.apply(f.data(), f.size(), &err));
  INFO("error: " << err);
  CHECK(err.find(needle) != std::string::npos);
  CHECK(view(d) == before);
}

// Recomputes the payload CRC (bytes 56..59) and the header CRC (60..63) of a hand-made frame.
void reseal(std::vector<uint8_t>* f) {
  if (f->size() < kFrameHeaderBytes) return;
  uint32_t pc = uint32_t(crc32_z(0, f->data() + kFrameHeaderBytes, f->size() - kFrameHeaderBytes));
  for (int i = 0; i < 4; ++i) (*f)[56 + i] = uint8_t(pc >> (8 * i));
  uint32_t hc = uint32_t(crc32_z(0, f->data(), 60));
  for (int i = 0; i < 4; ++i) (*f)[60 + i] = uint8_t(hc >> (8 * i));
}

FrameHeader header_of(const std::vector<uint8_t>& f) {
  FrameHeader h;
  std::string err;
  const bool ok = parse_frame_header(f.data(), f.size(), &h, &err);
  INFO(err);
  REQUIRE(ok);
  return h;
}

// Replaces the payload and rewrites the header around it (sizes and CRCs consistent).
std::vector<uint8_t> with_payload(const std::vector<uint8_t>& f,
                                  const std::vector<uint8_t>& payload) {
  FrameHeader h = header_of(f);
  // Sized once and copied into: GCC 12 at -O3 (Release) reports a false -Warray-bounds for
  // out.insert(out.end(), ...) on a vector of kFrameHeaderBytes.
  std::vector<uint8_t> out(kFrameHeaderBytes + payload.size());
  std::copy(payload.begin(), payload.end(), out.begin() + kFrameHeaderBytes);
  h.payload_size = payload.size();
  h.payload_crc = uint32_t(crc32_z(0, payload.data(), payload.size()));
  write_frame_header(h, out.data());
  return out;
}

std::vector<uint8_t> zstd_of(const std::vector<uint8_t>& content) {
  std::vector<uint8_t> out(ZSTD_compressBound(content.size()));
  const size_t n = ZSTD_compress(out.data(), out.size(), content.data(), content.size(), 1);
  REQUIRE_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// Trained-looking FP16/BF16 weights: N(0, 0.02).
std::vector<uint16_t> weights(size_t n, bool bf16, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<uint16_t> w(n);
  for (auto& x : w) x = bf16 ? float_to_bf16(nd(rng)) : float_to_fp16(nd(rng));
  return w;
}

// An optimizer step: `frac` of the elements (all if frac >= 1) move by lr * N(0,1) (clipped
// at 4 sigma).
// With `decay` (weight decay), x -> (1 - decay) x + d keeps the weights' spread stationary.
void step(std::vector<uint16_t>* w, double frac, float lr, bool bf16, std::mt19937_64& rng,
          float decay = 0) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<double> u(0, 1);
  for (auto& x : *w) {
    if (frac < 1 && u(rng) >= frac) continue;
    const float d = lr * std::max(-4.0f, std::min(4.0f, nd(rng)));
    const float v = (1 - decay) * (bf16 ? bf16_to_float(x) : fp16_to_float(x)) + d;
    x = bf16 ? float_to_bf16(v) : float_to_fp16(v);
  }
}

double max_abs_diff(const uint16_t* a, const uint16_t* b, size_t n, bool bf16) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = bf16 ? bf16_to_float(a[i]) : fp16_to_float(a[i]);
    const double y = bf16 ? bf16_to_float(b[i]) : fp16_to_float(b[i]);
    m = std::max(m, std::fabs(x - y));
  }
  return m;
}

}  // namespace

TEST_CASE("fp16: known bit patterns, round to nearest even, NaN and Inf", "[snapshot][codec]") {
  struct C {
    float f;
    uint16_t h;
  } cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {0.5f, 0x3800},
      {65504.0f, 0x7bff},   // largest finite
      {65519.99f, 0x7bff},  // below the midpoint to Inf
      {65520.0f, 0x7c00},   // the midpoint: ties to even = Inf
      {1e6f, 0x7c00},
      {-1e6f, 0xfc00},
      {0.1f, 0x2e66},
      {0.333333343f, 0x3555},
      {6.103515625e-05f, 0x0400},          // smallest normal
      {6.097555160522461e-05f, 0x03ff},    // largest subnormal
      {5.960464477539063e-08f, 0x0001},    // smallest subnormal 2^-24
      {2.98023223876953125e-08f, 0x0000},  // 2^-25: tie to even = 0
      {from_bits(0x33000001), 0x0001},     // just above 2^-25
      {8.940696716308594e-08f, 0x0002},    // 1.5 * 2^-24: tie to even = 2
      {1.00048828125f, 0x3c00},            // 1 + 2^-11: tie, even stays
      {1.00146484375f, 0x3c02},            // 1 + 3*2^-11: tie, rounds up to even
      {1.0004883f + 1e-7f, 0x3c01},        // above the tie
      {from_bits(0x00000001), 0x0000},     // float subnormal
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
  };
  for (const auto& c : cases) {
    INFO("float " << c.f << " bits " << std::hex << bits(c.f));
    CHECK(float_to_fp16(c.f) == c.h);
  }
  CHECK(fp16_to_float(0x3c00) == 1.0f);
  CHECK(fp16_to_float(0x3555) == 0.333251953125f);
  CHECK(fp16_to_float(0x0001) == 5.960464477539063e-08f);
  CHECK(fp16_to_float(0x03ff) == 6.097555160522461e-05f);
  CHECK(fp16_to_float(0x7bff) == 65504.0f);
  CHECK(bits(fp16_to_float(0x8000)) == 0x80000000u);
  CHECK(fp16_to_float(0x7c00) == std::numeric_limits<float>::infinity());
  CHECK(fp16_to_float(0xfc00) == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(fp16_to_float(0x7e00)));
  CHECK(std::isnan(fp16_to_float(0x7c01)));  // signalling NaN stays NaN
  // NaN in: NaN out, sign kept, never Inf (a payload only in the low bits included).
  CHECK(float_to_fp16(from_bits(0x7fc00000)) == 0x7e00);
  CHECK(float_to_fp16(from_bits(0xffc00000)) == 0xfe00);
  const uint16_t low_payload = float_to_fp16(from_bits(0x7f800001));
  CHECK((low_payload & 0x7c00) == 0x7c00);
  CHECK((low_payload & 0x03ff) != 0);
}

TEST_CASE("bf16: known bit patterns, round to nearest even, NaN and Inf", "[snapshot][codec]") {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  CHECK(float_to_bf16(-2.0f) == 0xc000);
  CHECK(float_to_bf16(3.14159265f) == 0x4049);            // 0x40490fdb rounds down
  CHECK(float_to_bf16(from_bits(0x3f808000)) == 0x3f80);  // tie, even stays
  CHECK(float_to_bf16(from_bits(0x3f818000)) == 0x3f82);  // tie, rounds up to even
  CHECK(float_to_bf16(from_bits(0x3f808001)) == 0x3f81);  // above the tie
  CHECK(float_to_bf16(from_bits(0x7f7fffff)) == 0x7f80);  // FLT_MAX rounds to Inf
  CHECK(float_to_bf16(from_bits(0x7f7f7fff)) == 0x7f7f);  // stays finite
  CHECK(float_to_bf16(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(float_to_bf16(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(float_to_bf16(from_bits(0x00000001)) == 0x0000);  // tiny subnormal
  CHECK(float_to_bf16(from_bits(0x80000000)) == 0x8000);
  CHECK(float_to_bf16(from_bits(0x7fc00000)) == 0x7fc0);
  CHECK(float_to_bf16(from_bits(0x7f800001)) == 0x7fc0);  // low-payload NaN stays NaN
  CHECK(float_to_bf16(from_bits(0xff800001)) == 0xffc0);
  CHECK(bf16_to_float(0x3f80) == 1.0f);
  CHECK(bf16_to_float(0x4049) == 3.140625f);
  CHECK(std::isnan(bf16_to_float(0x7fc1)));
}

TEST_CASE("fp16/bf16: every 16-bit pattern survives widening then narrowing", "[snapshot][codec]") {
  int fp16_bad = 0, bf16_bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_float(uint16_t(h));
    const uint16_t back = float_to_fp16(f);
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
    if (nan ? !((back & 0x7c00) == 0x7c00 && (back & 0x3ff) && (back & 0x8000) == (h & 0x8000))
            : back != h)
      ++fp16_bad;
    const float g = bf16_to_float(uint16_t(h));
    const uint16_t bback = float_to_bf16(g);
    const bool bnan = (h & 0x7f80) == 0x7f80 && (h & 0x7f);
    if (bnan ? !std::isnan(bf16_to_float(bback)) : bback != h) ++bf16_bad;
  }
  CHECK(fp16_bad == 0);
  CHECK(bf16_bad == 0);
  // Narrowing agrees with the exact midpoint rule on random floats in binary16's range.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-65519.0f, 65519.0f);  // below Inf's midpoint
  int wrong = 0;
  for (int i = 0; i < 200000; ++i) {
    const float f = (i & 1) ? u(rng) : u(rng) * 1e-6f;
    const uint16_t h = float_to_fp16(f);
    // The nearest of h and its neighbours must be h (ties: even mantissa).
    const double d0 = std::fabs(double(fp16_to_float(h)) - f);
    for (int s : {-1, 1}) {
      const uint16_t n = uint16_t(h + s);
      if ((n & 0x7fff) >= 0x7c00 || ((h ^ n) & 0x8000)) continue;
      const double d1 = std::fabs(double(fp16_to_float(n)) - f);
      if (d1 < d0 || (d1 == d0 && (n & 1) == 0)) ++wrong;
    }
  }
  CHECK(wrong == 0);
}

TEST_CASE("codec configs are validated with clear errors", "[snapshot][codec]") {
  std::string err;
  EncoderConfig c;
  c.dtype = DType::kF32;
  c.size_bytes = 4096;
  c.codec = Codec::kLossyDynRange;
  CHECK_FALSE(DeltaEncoder::create(c, &err));
  CHECK(err.find("kLossyDynRange needs dtype kF16 or kBF16 (got kF32)") != std::string::npos);
  c.codec = Codec::kLossless;
  c.size_bytes = 4098;
  CHECK_FALSE(DeltaEncoder::create(c, &err));
  CHECK(err.find("size_bytes 4098") != std::string::npos);
  c.size_bytes = 0;
  CHECK_FALSE(DeltaEncoder::create(c, &err));
  c.size_bytes = 4096;
  c.base_every = 0;
  CHECK_FALSE(DeltaEncoder::create(c, &err));
  CHECK(err.find("base_every 0") != std::string::npos);
  c.base_every = 8;
  c.zstd_level = 1000;
  CHECK_FALSE(DeltaEncoder::create(c, &err));
  CHECK(err.find("zstd_level 1000") != std::string::npos);
  c.zstd_level = 1;
  CHECK(DeltaEncoder::create(c, &err));
  CHECK_FALSE(DeltaDecoder::create(DType::kF16, 3, &err));
  CHECK(err.find("size_bytes 3") != std::string::npos);
  CHECK_FALSE(DeltaDecoder::create(DType::kF16, 0, &err));
}

TEST_CASE("lossless: exact round trip over a chain with a base every K", "[snapshot][codec]") {
  struct Case {
    DType t;
    size_t bytes;
  } cases[] = {
      {DType::kBytes, 100001},
      {DType::kF32, 4 * 70001},
      {DType::kF16, 2 * (2 * kChunkElems + 1001)},  // three chunks, the last partial
      {DType::kBF16, 2 * 5000},
  };
  std::mt19937_64 rng(42);
  for (const auto& c : cases) {
    INFO("dtype " << dtype_name(c.t) << " bytes " << c.bytes);
    const uint32_t k = 4;
    auto enc = make_enc(c.t, c.bytes, Codec::kLossless, k);
    auto dec = make_dec(c.t, c.bytes);
    std::vector<uint8_t> cur(c.bytes);
    for (auto& b : cur) b = uint8_t(rng());
    for (int s = 0; s < 13; ++s) {
      if (s == 5) {
        for (auto& b : cur) b = uint8_t(rng());  // everything changes
      } else if (s != 3) {                       // s == 3: nothing changes
        for (size_t i = 0; i < c.bytes / 20; ++i) cur[rng() % c.bytes] = uint8_t(rng());
      }
      EncodeStats st;
      auto f = encode(*enc, cur.data(), &st);
      CHECK(st.seq == uint64_t(s));
      CHECK(st.is_base == (s % k == 0));
      CHECK(st.base_seq == uint64_t(s - s % k));
      CHECK(st.codec == Codec::kLossless);
      CHECK(st.raw_bytes == c.bytes);
      CHECK(st.frame_bytes == f.size());
      CHECK(st.max_abs_error == 0);
      apply_ok(*dec, f);
      REQUIRE(std::memcmp(dec->state(), cur.data(), c.bytes) == 0);
      REQUIRE(std::memcmp(enc->reconstruction(), cur.data(), c.bytes) == 0);
      CHECK(dec->last_seq() == uint64_t(s));
    }
  }
}

TEST_CASE("lossless: a restore starts from the latest base", "[snapshot][codec]") {
  const size_t n = 30000;
  std::mt19937_64 rng(3);
  auto w = weights(n, false, rng);
  auto enc = make_enc(DType::kF16, 2 * n, Codec::kLossless, 4);
  std::vector<std::vector<uint8_t>> frames;
  for (int s = 0; s < 11; ++s) {
    step(&w, 0.05, 1e-4f, false, rng);
    frames.push_back(encode(*enc, w.data()));
  }
  size_t latest = 0;
  for (size_t i = 0; i < frames.size(); ++i)
    if (header_of(frames[i]).base) latest = i;
  CHECK(latest == 8);
  auto dec = make_dec(DType::kF16, 2 * n);
  for (size_t i = latest; i < frames.size(); ++i) apply_ok(*dec, frames[i]);
  CHECK(std::memcmp(dec->state(), w.data(), 2 * n) == 0);
  CHECK(dec->base_seq() == 8);
  CHECK(dec->last_seq() == 10);

  auto fresh = make_dec(DType::kF16, 2 * n);
  expect_refused(*fresh, frames[9], "a chain starts with a base frame");
  // An older chain cannot skip to the newer one's deltas.
  auto old = make_dec(DType::kF16, 2 * n);
  apply_ok(*old, frames[4]);
  expect_refused(*old, frames[9], "does not match the decoder's chain base 4");
  // A newer base moves a decoder to the new chain; reset() accepts an older one.
  apply_ok(*old, frames[8]);
  expect_refused(*old, frames[4], "is not after the decoder's last seq 8");
  old->reset();
  apply_ok(*old, frames[4]);
  CHECK(old->last_seq() == 4);
}

// apply_chain(): what restore() uses. A chain decoded in one pass must give the state, seq and
// base of the same frames applied one by one, for every dtype, chunk layout and chain shape,
// including the shapes it hands to apply_streaming() (lossy deltas, a base mid-chain).
namespace {
std::vector<const uint8_t*> ptrs(const std::vector<std::vector<uint8_t>>& fs, size_t from = 0,
                                 size_t to = SIZE_MAX) {
  std::vector<const uint8_t*> v;
  for (size_t i = from; i < std::min(to, fs.size()); ++i) v.push_back(fs[i].data());
  return v;
}
std::vector<size_t> sizes_of(const std::vector<std::vector<uint8_t>>& fs, size_t from = 0,
                             size_t to = SIZE_MAX) {
  std::vector<size_t> v;
  for (size_t i = from; i < std::min(to, fs.size()); ++i) v.push_back(fs[i].size());
  return v;
}
bool chain_ok(DeltaDecoder& d, const std::vector<std::vector<uint8_t>>& fs, size_t from = 0,
              size_t to = SIZE_MAX, std::string* err_out = nullptr) {
  const auto p = ptrs(fs, from, to);
  const auto n = sizes_of(fs, from, to);
  std::string err;
  const bool ok = d.apply_chain(p.data(), n.data(), p.size(), &err);
  if (err_out) *err_out = err;
  return ok;
}
}  // namespace

TEST_CASE("apply_chain: one pass gives what frame-by-frame decoding gives", "[snapshot][codec]") {
  struct Case {
    DType t;
    size_t bytes;
  } cases[] = {
      {DType::kBytes, 100001},
      {DType::kF32, 4 * (kChunkElems + 7001)},      // two chunks, the last partial
      {DType::kF16, 2 * (2 * kChunkElems + 1001)},  // three chunks, the last partial
      {DType::kBF16, 2 * 5000},
  };
  std::mt19937_64 rng(11);
  for (const auto& c : cases) {
    INFO("dtype " << dtype_name(c.t) << " bytes " << c.bytes);
    auto enc = make_enc(c.t, c.bytes, Codec::kLossless, 5);
    std::vector<uint8_t> cur(c.bytes);
    for (auto& b : cur) b = uint8_t(rng());
    std::vector<std::vector<uint8_t>> fs;
    std::vector<std::vector<uint8_t>> states;
    for (int s = 0; s < 5; ++s) {  // a base and 4 deltas: sparse, none, dense, sparse
      if (s == 3)
        for (auto& b : cur) b = uint8_t(rng());
      else if (s != 2)
        for (size_t i = 0; i < c.bytes / 50 + 1; ++i) cur[rng() % c.bytes] = uint8_t(rng());
      fs.push_back(encode(*enc, cur.data()));
      states.push_back(cur);
    }
    // The whole chain, from an empty decoder whose memory holds garbage.
    auto d = make_dec(c.t, c.bytes);
    REQUIRE(chain_ok(*d, fs));
    CHECK(std::memcmp(d->state(), cur.data(), c.bytes) == 0);
    CHECK(d->has_state());
    CHECK(d->last_seq() == 4);
    CHECK(d->base_seq() == 0);
    // Every prefix, and a chain that starts with deltas on a decoder that holds the base.
    for (size_t len = 1; len <= fs.size(); ++len) {
      INFO("prefix of " << len);
      auto p = make_dec(c.t, c.bytes);
      REQUIRE(chain_ok(*p, fs, 0, len));
      CHECK(std::memcmp(p->state(), states[len - 1].data(), c.bytes) == 0);
      CHECK(p->last_seq() == len - 1);
    }
    auto q = make_dec(c.t, c.bytes);
    apply_ok(*q, fs[0]);
    apply_ok(*q, fs[1]);
    REQUIRE(chain_ok(*q, fs, 2));
    CHECK(std::memcmp(q->state(), cur.data(), c.bytes) == 0);
    CHECK(q->last_seq() == 4);
  }
}

TEST_CASE("tagged chunks: every density decodes as the untagged layout does", "[snapshot][codec]") {
  // Elements changed per step, as a fraction of a chunk: none, a few, just under, at and just
  // over the encoder's sparse limit (1/8), half, all. A chunk over the limit goes dense.
  const double fracs[] = {0.0, 0.001, 0.124, 0.125, 0.126, 0.5, 1.0};
  for (DType t : {DType::kBytes, DType::kF16, DType::kF32}) {
    const size_t es = dtype_size(t), elems = kChunkElems + 5001;  // two chunks, one partial
    std::mt19937_64 rng(23);
    std::vector<uint8_t> cur(elems * es);
    for (auto& b : cur) b = uint8_t(rng());
    EncoderConfig cfg;
    cfg.dtype = t;
    cfg.size_bytes = cur.size();
    cfg.base_every = 64;
    std::string err;
    auto tagged = DeltaEncoder::create(cfg, &err);
    cfg.sparse_chunks = false;
    auto plain = DeltaEncoder::create(cfg, &err);
    REQUIRE(tagged);
    REQUIRE(plain);
    std::vector<std::vector<uint8_t>> ft{encode(*tagged, cur.data())},
        fp{encode(*plain, cur.data())};
    for (double f : fracs) {
      // Exactly round(f * m) elements of each chunk change (distinct, at random).
      for (size_t off = 0; off < elems; off += kChunkElems) {
        const size_t m = std::min<size_t>(kChunkElems, elems - off);
        std::vector<size_t> pick(m);
        for (size_t i = 0; i < m; ++i) pick[i] = i;
        std::shuffle(pick.begin(), pick.end(), rng);
        const size_t k = size_t(std::llround(f * double(m)));
        for (size_t j = 0; j < k; ++j)
          cur[(off + pick[j]) * es + rng() % es] ^= uint8_t(1 + rng() % 255);
      }
      ft.push_back(encode(*tagged, cur.data()));
      fp.push_back(encode(*plain, cur.data()));
      INFO(dtype_name(t) << " fraction " << f);
      CHECK(header_of(ft.back()).tagged);
      CHECK_FALSE(header_of(fp.back()).tagged);
      if (f > 0 && f <= 0.01) CHECK(ft.back().size() < fp.back().size());
    }
    // apply(), apply_streaming() and apply_chain() of either layout give the state.
    auto d1 = make_dec(t, cur.size()), d2 = make_dec(t, cur.size()), d3 = make_dec(t, cur.size()),
         d4 = make_dec(t, cur.size());
    for (size_t i = 0; i < ft.size(); ++i) {
      apply_ok(*d1, ft[i]);
      REQUIRE(d2->apply_streaming(ft[i].data(), ft[i].size(), &err));
    }
    REQUIRE(chain_ok(*d3, ft));
    REQUIRE(chain_ok(*d4, fp));
    INFO(dtype_name(t));
    CHECK(std::memcmp(d1->state(), cur.data(), cur.size()) == 0);
    CHECK(std::memcmp(d2->state(), cur.data(), cur.size()) == 0);
    CHECK(std::memcmp(d3->state(), cur.data(), cur.size()) == 0);
    CHECK(std::memcmp(d4->state(), cur.data(), cur.size()) == 0);
  }
}

TEST_CASE("apply_chain: lossy deltas and a base mid-chain go frame by frame", "[snapshot][codec]") {
  const size_t n = kChunkElems + 333;
  std::mt19937_64 rng(5);
  auto w = weights(n, false, rng);
  // Lossy: closed-loop deltas add in float32, so the result must equal apply() one by one.
  auto lenc = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange, 8);
  std::vector<std::vector<uint8_t>> lossy;
  for (int s = 0; s < 4; ++s) {
    if (s) step(&w, 0.3, 1e-3f, false, rng);
    lossy.push_back(encode(*lenc, w.data()));
  }
  CHECK(header_of(lossy[1]).codec == Codec::kLossyDynRange);
  auto seq = make_dec(DType::kF16, 2 * n);
  for (const auto& f : lossy) apply_ok(*seq, f);
  auto one = make_dec(DType::kF16, 2 * n);
  REQUIRE(chain_ok(*one, lossy));
  CHECK(std::memcmp(one->state(), seq->state(), 2 * n) == 0);
  CHECK(std::memcmp(one->state(), lenc->reconstruction(), 2 * n) == 0);
  CHECK(one->last_seq() == 3);
  // A base every 2: base, delta, base, delta in one call.
  auto enc = make_enc(DType::kF16, 2 * n, Codec::kLossless, 2);
  std::vector<std::vector<uint8_t>> fs;
  for (int s = 0; s < 4; ++s) {
    step(&w, 0.05, 1e-3f, false, rng);
    fs.push_back(encode(*enc, w.data()));
  }
  CHECK(header_of(fs[2]).base);
  auto d = make_dec(DType::kF16, 2 * n);
  REQUIRE(chain_ok(*d, fs));
  CHECK(std::memcmp(d->state(), w.data(), 2 * n) == 0);
  CHECK(d->base_seq() == 2);
  CHECK(d->last_seq() == 3);
}

TEST_CASE("apply_chain: refusals name the frame; found while decoding discards the state",
          "[snapshot][codec]") {
  // Small frames: the damaged-payload search below decodes once per byte it tries.
  const size_t n = 3077;
  std::mt19937_64 rng(8);
  auto w = weights(n, false, rng);
  // No payload CRC (what the snapshot client writes: its shard checksum covers the frame), so
  // a damaged payload reaches zstd.
  EncoderConfig cfg;
  cfg.dtype = DType::kF16;
  cfg.size_bytes = 2 * n;
  cfg.payload_crc = false;
  std::string err;
  auto enc = DeltaEncoder::create(cfg, &err);
  REQUIRE(enc);
  std::vector<std::vector<uint8_t>> fs;
  for (int s = 0; s < 3; ++s) {
    if (s) step(&w, 0.2, 1e-3f, false, rng);
    fs.push_back(encode(*enc, w.data()));
  }
  auto d = make_dec(DType::kF16, 2 * n);
  apply_ok(*d, fs[0]);
  const View before = view(*d);
  SECTION("no frame") {
    CHECK_FALSE(d->apply_chain(nullptr, nullptr, 0, &err));
    CHECK(err.find("no frame") != std::string::npos);
    CHECK(view(*d) == before);
  }
  SECTION("a gap in the chain: refused before anything is written") {
    std::vector<std::vector<uint8_t>> gap{fs[0], fs[2]};
    auto e = make_dec(DType::kF16, 2 * n);
    const View empty = view(*e);
    CHECK_FALSE(chain_ok(*e, gap, 0, SIZE_MAX, &err));
    INFO(err);
    CHECK(err.find("chain frame 1 of 2") != std::string::npos);
    CHECK(err.find("does not follow the decoder's last seq 0") != std::string::npos);
    CHECK(view(*e) == empty);
    // The decoder holding seq 0: a chain that repeats seq 0's base is refused as a whole.
    CHECK_FALSE(chain_ok(*d, fs, 0, SIZE_MAX, &err));
    CHECK(err.find("chain frame 0 of 3") != std::string::npos);
    CHECK(view(*d) == before);
  }
  SECTION("a truncated last frame: refused before anything is written") {
    auto cut = fs;
    cut[2].resize(cut[2].size() - 3);
    CHECK_FALSE(chain_ok(*d, cut, 1, SIZE_MAX, &err));
    CHECK(err.find("chain frame 1 of 2") != std::string::npos);
    CHECK(view(*d) == before);
  }
  SECTION("a damaged delta payload that zstd rejects while decoding") {
    // The first byte flip in the payload that the frame-by-frame decoder finds only while
    // decoding (zstd's own errors, past the checks): the chain must fail the same way and
    // leave no state.
    bool found = false;
    for (size_t off = kFrameHeaderBytes; off < fs[1].size() && !found; ++off) {
      auto bad = fs;
      bad[1][off] ^= 0x5a;
      auto ref = make_dec(DType::kF16, 2 * n);
      apply_ok(*ref, bad[0]);
      std::string e1;
      if (ref->apply_streaming(bad[1].data(), bad[1].size(), &e1)) continue;
      if (e1.find("found while decoding") == std::string::npos) continue;
      found = true;
      auto e = make_dec(DType::kF16, 2 * n);
      CHECK_FALSE(chain_ok(*e, bad, 0, SIZE_MAX, &err));
      INFO(err);
      CHECK(err.find("chain frame 1 (seq 1)") != std::string::npos);
      CHECK(err.find("found while decoding") != std::string::npos);
      CHECK_FALSE(e->has_state());
    }
    CHECK(found);
  }
}

TEST_CASE("lossless: a sparse FP16 optimizer step compresses > 2x", "[snapshot][codec]") {
  const size_t n = size_t(1) << 22;  // 8 MiB of FP16 weights
  std::mt19937_64 rng(11);
  auto w = weights(n, false, rng);
  auto enc = make_enc(DType::kF16, 2 * n);
  EncodeStats st;
  encode(*enc, w.data(), &st);
  CHECK(st.is_base);
  const double base_ratio = st.ratio();
  step(&w, 0.01, 1e-4f, false, rng);  // 1 % of the weights move by ~lr
  encode(*enc, w.data(), &st);
  CHECK_FALSE(st.is_base);
  const double sparse_ratio = st.ratio();
  step(&w, 1.0, 1e-4f, false, rng);  // every weight moves (a dense step), for the record
  encode(*enc, w.data(), &st);
  WARN("lossless FP16 (8 MiB): base " << base_ratio << "x, 1% sparse step " << sparse_ratio
                                      << "x, dense step " << st.ratio() << "x");
  CHECK(sparse_ratio > 2.0);
  // The shuffle is what makes it work: the dense step's XOR has zero high bytes.
  CHECK(st.ratio() > 1.3);
}

namespace {

// Runs `snapshots` lossy snapshots of dense steps (no base after the first) and checks the
// decoder against the encoder and the reported error; returns the errors per snapshot.
std::vector<double> lossy_chain(bool bf16, int snapshots, float lr, double* worst_bound_ratio) {
  const DType t = bf16 ? DType::kBF16 : DType::kF16;
  const size_t n = 100000;
  std::mt19937_64 rng(bf16 ? 5 : 6);
  auto w = weights(n, bf16, rng);
  auto enc = make_enc(t, 2 * n, Codec::kLossyDynRange, 1000);
  auto dec = make_dec(t, 2 * n);
  std::vector<double> errs;
  *worst_bound_ratio = 0;
  for (int s = 0; s < snapshots; ++s) {
    const std::vector<uint16_t> before = w;
    // Dense steps with weight decay 1 - sqrt(1 - (lr/0.02)^2): the spread stays N(0, 0.02),
    // so early and late snapshots are comparable.
    if (s > 0) step(&w, 1.0, lr, bf16, rng, 1 - std::sqrt(1 - (lr / 0.02f) * (lr / 0.02f)));
    EncodeStats st;
    auto f = encode(*enc, w.data(), &st);
    CHECK(st.is_base == (s == 0));
    CHECK(st.codec == (s == 0 ? Codec::kLossless : Codec::kLossyDynRange));
    apply_ok(*dec, f);
    REQUIRE(std::memcmp(dec->state(), enc->reconstruction(), 2 * n) == 0);
    const auto* rec = reinterpret_cast<const uint16_t*>(dec->state());
    const double measured = max_abs_diff(w.data(), rec, n, bf16);
    CHECK(measured <= st.max_abs_error);
    CHECK(st.max_abs_error <= measured);  // the report is the actual maximum, not a loose bound
    errs.push_back(st.max_abs_error);
    if (s > 0) {
      // Closed loop: this snapshot's delta is (this step) + (last snapshot's error), so the
      // error is at most half a code step of that plus the format's rounding.
      const double step_max = max_abs_diff(w.data(), before.data(), n, bf16);
      double top = 0;  // the largest magnitude around: the format's rounding step there
      for (size_t i = 0; i < n; ++i)
        top = std::max(top, std::fabs(double(bf16 ? bf16_to_float(w[i]) : fp16_to_float(w[i]))));
      const double ulp = std::ldexp(1.0, std::ilogb(top * 1.01) - (bf16 ? 7 : 10));
      const double bound = (step_max + errs[size_t(s) - 1]) / 254.0 * 1.001 + ulp / 2;
      *worst_bound_ratio = std::max(*worst_bound_ratio, st.max_abs_error / bound);
    }
  }
  return errs;
}

}  // namespace

TEST_CASE("lossy: error reported exactly and bounded over 50 snapshots (closed loop)",
          "[snapshot][codec]") {
  for (bool bf16 : {false, true}) {
    INFO((bf16 ? "BF16" : "FP16"));
    double worst = 0;
    // Steps of ~2e-3: many units in the last place (at 0.02: FP16 1.5e-5, BF16 1.2e-4).
    const auto errs = lossy_chain(bf16, 51, 2e-3f, &worst);
    double early = 0, late = 0;
    for (int s = 1; s <= 5; ++s) early = std::max(early, errs[size_t(s)]);
    for (int s = 40; s <= 50; ++s) late = std::max(late, errs[size_t(s)]);
    WARN((bf16 ? "BF16" : "FP16") << " lossy max error: snapshots 1-5 " << early
                                  << ", snapshots 40-50 " << late
                                  << ", worst error / closed-loop bound " << worst);
    CHECK(early > 0);
    CHECK(worst <= 1.0);
    // An open loop (deltas against the previous input) would let errors random-walk:
    // ~sqrt(45) times the first ones by snapshot 50.
    CHECK(late <= 2 * early);
  }
}

TEST_CASE("lossy: smaller than lossless on dense optimizer-state deltas, not on sparse steps",
          "[snapshot][codec]") {
  // Adam's first moment in FP16: m = 0.9 m + 0.1 g changes every element by a large fraction
  // of itself, which leaves lossless XOR little to compress. int8 codes of a dense delta cost
  // ~7.5 bits after zstd, so the lossy gain is bounded (~1.5x here), not an order of magnitude.
  const size_t n = size_t(1) << 20;
  std::mt19937_64 rng(21);
  std::normal_distribution<float> nd(0.0f, 1e-3f);
  std::vector<float> m(n);
  for (auto& x : m) x = nd(rng);
  std::vector<uint16_t> h(n);
  auto to_h = [&] {
    for (size_t i = 0; i < n; ++i) h[i] = float_to_fp16(m[i]);
  };
  to_h();
  auto ll = make_enc(DType::kF16, 2 * n, Codec::kLossless);
  auto ly = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange);
  auto dec = make_dec(DType::kF16, 2 * n);
  EncodeStats sl, sy;
  encode(*ll, h.data(), &sl);
  apply_ok(*dec, encode(*ly, h.data(), &sy));
  double rl = 0, ry = 0, err = 0;
  const int steps = 4;
  for (int s = 0; s < steps; ++s) {
    for (auto& x : m) x = 0.9f * x + 0.1f * nd(rng);
    to_h();
    encode(*ll, h.data(), &sl);
    auto f = encode(*ly, h.data(), &sy);
    apply_ok(*dec, f);
    rl += sl.ratio() / steps;
    ry += sy.ratio() / steps;
    err = std::max(err, sy.max_abs_error);
  }
  WARN("FP16 Adam moment (2 MiB), dense delta: lossless "
       << rl << "x, lossy " << ry << "x, lossy max error " << err << " (values ~1e-3)");
  CHECK(ry > 1.3 * rl);
  CHECK(err < 1e-4);

  // On a sparse weight step lossless is as good or better (the lossy codec pays a 4-byte
  // scale for every block with a change); the lossy error stays tiny.
  auto w = weights(n, false, rng);
  auto ll2 = make_enc(DType::kF16, 2 * n, Codec::kLossless);
  auto ly2 = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange);
  encode(*ll2, w.data(), &sl);
  encode(*ly2, w.data(), &sy);
  step(&w, 0.01, 1e-4f, false, rng);
  encode(*ll2, w.data(), &sl);
  encode(*ly2, w.data(), &sy);
  WARN("FP16 weights (2 MiB), 1% sparse step: lossless "
       << sl.ratio() << "x, lossy " << sy.ratio() << "x, lossy max error " << sy.max_abs_error);
  CHECK(sy.max_abs_error < 1e-4);
}

TEST_CASE("lossy: buffers of several chunks, sparse and dense steps", "[snapshot][codec]") {
  for (bool bf16 : {false, true}) {
    INFO((bf16 ? "BF16" : "FP16"));
    const DType t = bf16 ? DType::kBF16 : DType::kF16;
    const size_t n = 2 * kChunkElems + 300;  // 3 chunks; the last block partial
    std::mt19937_64 rng(bf16 ? 12 : 13);
    auto w = weights(n, bf16, rng);
    auto enc = make_enc(t, 2 * n, Codec::kLossyDynRange, 100);
    auto dec = make_dec(t, 2 * n);
    apply_ok(*dec, encode(*enc, w.data()));
    for (int s = 1; s <= 4; ++s) {
      step(&w, s % 2 ? 0.01 : 1.0, 2e-3f, bf16, rng);
      EncodeStats st;
      apply_ok(*dec, encode(*enc, w.data(), &st));
      CHECK(st.codec == Codec::kLossyDynRange);
      REQUIRE(std::memcmp(dec->state(), enc->reconstruction(), 2 * n) == 0);
      const double measured =
          max_abs_diff(w.data(), reinterpret_cast<const uint16_t*>(dec->state()), n, bf16);
      CHECK(measured == st.max_abs_error);
      CHECK(measured < 1e-3);
    }
  }
}

TEST_CASE("lossy: a change to or from NaN/Inf makes an exact base; NaN/Inf left alone stay",
          "[snapshot][codec]") {
  const size_t n = 5000;
  std::mt19937_64 rng(9);
  auto w = weights(n, false, rng);
  auto enc = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange, 100);
  auto dec = make_dec(DType::kF16, 2 * n);
  EncodeStats st;
  apply_ok(*dec, encode(*enc, w.data(), &st));
  step(&w, 1.0, 1e-3f, false, rng);
  apply_ok(*dec, encode(*enc, w.data(), &st));
  CHECK(st.codec == Codec::kLossyDynRange);
  w[4321] = 0x7e00;  // NaN
  w[17] = 0xfc00;    // -Inf
  apply_ok(*dec, encode(*enc, w.data(), &st));
  CHECK(st.is_base);
  CHECK(st.seq == 2);
  CHECK(st.codec == Codec::kLossless);
  CHECK(std::memcmp(dec->state(), w.data(), 2 * n) == 0);
  // The chain continues lossy from that base: a NaN or Inf that stays put is kept exactly.
  step(&w, 0.5, 1e-3f, false, rng);
  CHECK(w[4321] == 0x7e00);
  CHECK(w[17] == 0xfc00);
  apply_ok(*dec, encode(*enc, w.data(), &st));
  CHECK_FALSE(st.is_base);
  CHECK(st.codec == Codec::kLossyDynRange);
  const auto* rec = reinterpret_cast<const uint16_t*>(dec->state());
  CHECK(rec[4321] == 0x7e00);
  CHECK(rec[17] == 0xfc00);
  CHECK(std::isfinite(st.max_abs_error));
  // A change away from NaN/Inf has no finite delta: a base again.
  w[4321] = float_to_fp16(0.01f);
  w[17] = float_to_fp16(-0.01f);
  apply_ok(*dec, encode(*enc, w.data(), &st));
  CHECK(st.is_base);
  CHECK(st.seq == 4);
  CHECK(std::memcmp(dec->state(), w.data(), 2 * n) == 0);
  step(&w, 0.5, 1e-3f, false, rng);
  apply_ok(*dec, encode(*enc, w.data(), &st));
  CHECK_FALSE(st.is_base);
  CHECK(st.codec == Codec::kLossyDynRange);
  CHECK(st.base_seq == 4);
}

TEST_CASE("payloads follow the documented layout", "[snapshot][codec]") {
  // Lossless: per chunk of m elements, byte k of element i at k*m + i, of cur XOR prev.
  for (DType t : {DType::kBytes, DType::kF16, DType::kF32}) {
    INFO(dtype_name(t));
    const size_t es = dtype_size(t), m = kChunkElems + 37;  // two chunks, SIMD tails
    std::mt19937_64 rng(1);
    std::vector<uint8_t> a(m * es), b(m * es);
    for (auto& x : a) x = uint8_t(rng());
    for (auto& x : b) x = uint8_t(rng());
    auto enc = make_enc(t, m * es);
    const auto fa = encode(*enc, a.data());
    const auto fb = encode(*enc, b.data());
    // The delta changed every element: tagged chunks (flag bit 2), each a u32 tag 0xFFFFFFFF
    // (dense) before the chunk's bytes.
    CHECK_FALSE(header_of(fa).tagged);
    CHECK(header_of(fb).tagged);
    for (int which = 0; which < 2; ++which) {
      const auto& f = which ? fb : fa;
      const size_t tags = which ? 4 * 2 : 0;  // two chunks
      std::vector<uint8_t> content(m * es + tags);
      REQUIRE(ZSTD_decompress(content.data(), content.size(), f.data() + kFrameHeaderBytes,
                              f.size() - kFrameHeaderBytes) == content.size());
      size_t bad = 0;
      size_t pos = 0;
      for (size_t off = 0; off < m; off += kChunkElems) {
        const size_t cm = std::min<size_t>(kChunkElems, m - off);
        if (which) {
          uint32_t tag;
          std::memcpy(&tag, content.data() + pos, 4);
          CHECK(tag == kChunkDense);
          pos += 4;
        }
        for (size_t i = 0; i < cm; ++i)
          for (size_t k = 0; k < es; ++k) {
            const size_t e = (off + i) * es + k;
            const uint8_t want = which ? uint8_t(a[e] ^ b[e]) : a[e];
            bad += content[pos + k * cm + i] != want;
          }
        pos += cm * es;
      }
      CHECK(bad == 0);
    }
    // A step that changed a few elements: each chunk lists them (gaps, then values).
    auto c = b;
    const std::vector<size_t> moved = {3, 4, 1000, kChunkElems - 1, kChunkElems + 36};
    for (size_t i : moved) c[i * es + es - 1] ^= 0x81;
    const auto fc = encode(*enc, c.data());
    CHECK(header_of(fc).tagged);
    std::vector<uint8_t> sc(4096);
    const size_t got = ZSTD_decompress(sc.data(), sc.size(), fc.data() + kFrameHeaderBytes,
                                       fc.size() - kFrameHeaderBytes);
    REQUIRE_FALSE(ZSTD_isError(got));
    // Chunk 0: 4 entries (3, 4, 1000, kChunkElems - 1); chunk 1: 1 entry (36).
    const std::initializer_list<uint32_t> idx[] = {{3, 4, 1000, kChunkElems - 1}, {36}};
    size_t pos = 0;
    for (const auto& want : idx) {
      uint32_t n;
      std::memcpy(&n, sc.data() + pos, 4);
      REQUIRE(n == want.size());
      pos += 4;
      uint32_t prev = UINT32_MAX;
      for (size_t j = 0; j < n; ++j) {
        uint32_t gap = 0;
        for (size_t p = 0; p < 4; ++p) gap |= uint32_t(sc[pos + p * n + j]) << (8 * p);
        const uint32_t w = *(want.begin() + j);
        CHECK(gap == w - prev - 1);
        prev = w;
        for (size_t k = 0; k < es; ++k)
          CHECK(sc[pos + 4 * n + k * n + j] == (k == es - 1 ? 0x81 : 0));
      }
      pos += n * (4 + es);
    }
    CHECK(pos == got);
  }
  // Lossy: per chunk, the block scales (max|delta| / 127) then the int8 codes.
  const size_t n = 600;  // 3 blocks, the last partial
  std::vector<uint16_t> z(n, 0), w(n, 0);
  for (size_t i = 0; i < n; ++i) w[i] = float_to_fp16(float(i % 7) * 0.125f - 0.25f);
  auto enc = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange);
  encode(*enc, z.data());
  const auto f = encode(*enc, w.data());
  const size_t nb = 3;
  std::vector<uint8_t> content(4 * nb + n);
  REQUIRE(ZSTD_decompress(content.data(), content.size(), f.data() + kFrameHeaderBytes,
                          f.size() - kFrameHeaderBytes) == content.size());
  for (size_t blk = 0; blk < nb; ++blk) {
    float scale;
    std::memcpy(&scale, content.data() + 4 * blk, 4);
    CHECK(scale == 0.5f / 127.0f);  // max |delta| is 0.5 in every block
  }
  const auto* codes = reinterpret_cast<const int8_t*>(content.data() + 4 * nb);
  for (size_t i = 0; i < n; ++i) {
    INFO("element " << i);
    CHECK(codes[i] == int8_t(std::lround((float(i % 7) * 0.125f - 0.25f) / (0.5f / 127.0f))));
  }
}

TEST_CASE("lossy: a delta that would overflow saturates instead of becoming Inf",
          "[snapshot][codec]") {
  const size_t n = 256;
  std::vector<uint16_t> w(n, 0);
  auto enc = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange, 100);
  auto dec = make_dec(DType::kF16, 2 * n);
  w[0] = 0xfbff;  // -65504
  w[1] = 0xd640;  // -100
  apply_ok(*dec, encode(*enc, w.data()));
  w[0] = 0x7bff;  // +65504: delta 131008, scale ~1031.6
  w[1] = 0x7bff;  // +65504: delta 65604, code 64 -> -100 + 66020 = 65920, beyond Inf's midpoint
  w[2] = 0x7bfe;
  EncodeStats st;
  apply_ok(*dec, encode(*enc, w.data(), &st));
  CHECK(st.codec == Codec::kLossyDynRange);
  const auto* rec = reinterpret_cast<const uint16_t*>(dec->state());
  for (size_t i = 0; i < n; ++i) CHECK((rec[i] & 0x7c00) != 0x7c00);  // all finite
  CHECK(rec[1] == 0x7bff);                                            // saturated
  CHECK(std::isfinite(st.max_abs_error));
}

TEST_CASE("request_base, first_seq and the frame header", "[snapshot][codec]") {
  EncoderConfig c;
  c.dtype = DType::kF32;
  c.size_bytes = 4000;
  c.first_seq = 1000;
  c.base_every = 3;
  std::string err;
  auto enc = DeltaEncoder::create(c, &err);
  REQUIRE(enc);
  std::vector<float> v(1000, 1.5f);
  EncodeStats st;
  encode(*enc, v.data(), &st);
  CHECK((st.seq == 1000 && st.is_base && st.base_seq == 1000));
  auto f = encode(*enc, v.data(), &st);
  CHECK((st.seq == 1001 && !st.is_base && st.base_seq == 1000));
  const FrameHeader h = header_of(f);
  CHECK(h.dtype == DType::kF32);
  CHECK(h.codec == Codec::kLossless);
  CHECK(h.chunk_elems == kChunkElems);
  CHECK(h.elem_count == 1000);
  CHECK(h.raw_size == 4000);
  CHECK(h.payload_size == f.size() - kFrameHeaderBytes);
  CHECK(std::memcmp(f.data(), "R2SF", 4) == 0);
  enc->request_base();
  encode(*enc, v.data(), &st);
  CHECK((st.seq == 1002 && st.is_base));
  CHECK(enc->next_seq() == 1003);
  // zstd threads give the same decodable stream.
  c.zstd_workers = 2;
  auto mt = DeltaEncoder::create(c, &err);
  INFO(err);
  REQUIRE(mt);
  auto dec = make_dec(DType::kF32, 4000);
  apply_ok(*dec, encode(*mt, v.data()));
  v[7] = 2.5f;
  apply_ok(*dec, encode(*mt, v.data()));
  CHECK(std::memcmp(dec->state(), v.data(), 4000) == 0);
}

TEST_CASE("refused frames: clear errors, decoder unchanged", "[snapshot][codec]") {
  const size_t n = 3000;
  std::mt19937_64 rng(77);
  auto w = weights(n, false, rng);
  auto enc = make_enc(DType::kF16, 2 * n, Codec::kLossless, 8);
  auto f0 = encode(*enc, w.data());
  step(&w, 0.1, 1e-3f, false, rng);
  auto f1 = encode(*enc, w.data());
  step(&w, 0.1, 1e-3f, false, rng);
  auto f2 = encode(*enc, w.data());
  auto dec = make_dec(DType::kF16, 2 * n);
  apply_ok(*dec, f0);
  apply_ok(*dec, f1);  // the decoder holds seq 1 of chain 0

  SECTION("corrupted payload: CRC") {
    auto f = f2;
    f[kFrameHeaderBytes + f.size() / 3] ^= 0x10;
    expect_refused(*dec, f, "payload CRC-32");
  }
  SECTION("corrupted header: header CRC") {
    auto f = f2;
    f[20] ^= 0x01;  // inside seq
    expect_refused(*dec, f, "header CRC-32");
  }
  SECTION("truncated frames") {
    for (size_t len : {size_t(0), size_t(10), size_t(63), size_t(64), f2.size() - 1}) {
      INFO("length " << len);
      std::vector<uint8_t> f(f2.begin(), f2.begin() + long(len));
      expect_refused(*dec, f, "truncated");
    }
    std::string err;
    CHECK_FALSE(dec->apply(nullptr, 100, &err));
  }
  SECTION("trailing bytes") {
    auto f = f2;
    f.push_back(0);
    expect_refused(*dec, f, "1 trailing bytes");
  }
  SECTION("wrong magic and version") {
    auto f = f2;
    f[0] = 'X';
    expect_refused(*dec, f, "magic 0x4653325");
    f = f2;
    f[4] = 2;
    reseal(&f);
    expect_refused(*dec, f, "version 2, this decoder reads version 1");
    f = f2;
    f[6] = 80;
    reseal(&f);
    expect_refused(*dec, f, "header bytes 80");
  }
  SECTION("bad enum and flag values") {
    auto f = f2;
    f[8] = 9;
    reseal(&f);
    expect_refused(*dec, f, "dtype 9");
    f = f2;
    f[9] = 7;
    reseal(&f);
    expect_refused(*dec, f, "codec 7");
    f = f2;
    f[10] = 8;
    reseal(&f);
    expect_refused(*dec, f, "flags 8");
    // Tagged chunks (bit 2) belong to lossless deltas only.
    f = f0;
    f[10] |= kFrameTagged;
    reseal(&f);
    expect_refused(*dec, f, "tagged chunks are for kLossless deltas only");
    FrameHeader lh = header_of(f2);
    lh.codec = Codec::kLossyDynRange;
    f = f2;
    write_frame_header(lh, f.data());
    expect_refused(*dec, f, "tagged chunks are for kLossless deltas only");
    f = f2;
    FrameHeader h = header_of(f2);
    h.chunk_elems = 300;
    write_frame_header(h, f.data());
    expect_refused(*dec, f, "chunk_elems 300");
    h = header_of(f0);
    h.codec = Codec::kLossyDynRange;
    f = f0;
    write_frame_header(h, f.data());
    expect_refused(*dec, f, "a base is always kLossless");
  }
  SECTION("out-of-order and foreign frames") {
    expect_refused(*dec, f1,
                   "delta seq 1 does not follow the decoder's last seq 1 (the next "
                   "delta must have seq 2)");
    step(&w, 0.1, 1e-3f, false, rng);
    auto f3 = encode(*enc, w.data());
    expect_refused(*dec, f3, "delta seq 3 does not follow");
    expect_refused(*dec, f0, "base seq 0 is not after the decoder's last seq 1");
    // A delta naming another base.
    FrameHeader h = header_of(f2);
    h.base_seq = 1;
    auto f = f2;
    write_frame_header(h, f.data());
    expect_refused(*dec, f, "base_seq 1 does not match the decoder's chain base 0");
    // And the real next frame is still accepted afterwards.
    apply_ok(*dec, f2);
    apply_ok(*dec, f3);
    CHECK(std::memcmp(dec->state(), w.data(), 2 * n) == 0);
  }
  SECTION("wrong buffer size or dtype") {
    auto big = make_dec(DType::kF16, 2 * n + 2);
    expect_refused(*big, f0,
                   "raw_size 6000 bytes (elem_count 3000), this buffer is registered "
                   "with 6002 bytes");
    auto bf = make_dec(DType::kBF16, 2 * n);
    expect_refused(*bf, f0, "dtype kF16, this buffer is registered as kBF16");
    auto bytes = make_dec(DType::kBytes, 2 * n);
    expect_refused(*bytes, f0, "dtype kF16");
  }
  SECTION("inconsistent header sizes") {
    FrameHeader h = header_of(f2);
    h.raw_size += 2;
    auto f = f2;
    write_frame_header(h, f.data());
    expect_refused(*dec, f, "raw_size 6002 bytes, expected elem_count 3000 * 2 = 6000");
    h = header_of(f2);
    h.base_seq = h.seq;
    write_frame_header(h, f.data());
    expect_refused(*dec, f, "a delta has base_seq < seq");
  }
  SECTION("payloads that are not the expected zstd frame") {
    // A valid zstd frame of the wrong size (untagged: exactly raw_size; tagged chunks: at
    // most raw_size + 4 per chunk).
    REQUIRE(header_of(f2).tagged);
    auto untagged = f2;
    untagged[10] &= uint8_t(~kFrameTagged);
    reseal(&untagged);
    std::vector<uint8_t> small(100, 0);
    expect_refused(*dec, with_payload(untagged, zstd_of(small)),
                   "zstd frame content size 100, expected 6000 bytes");
    expect_refused(*dec, with_payload(f2, zstd_of(std::vector<uint8_t>(6005, 0))),
                   "zstd frame content size 6005, expected unknown or 4..6004 bytes");
    // Two frames back to back.
    auto p = std::vector<uint8_t>(f2.begin() + kFrameHeaderBytes, f2.end());
    auto two = p;
    two.insert(two.end(), p.begin(), p.end());
    expect_refused(*dec, with_payload(f2, two), "not exactly one zstd frame");
    // Not zstd at all.
    expect_refused(*dec, with_payload(f2, std::vector<uint8_t>(50, 0xab)),
                   "not exactly one zstd frame");
    // A frame whose content size is unknown (streamed without a pledged size).
    ZSTD_CCtx* cc = ZSTD_createCCtx();
    std::vector<uint8_t> content(6000, 0), out(8000);
    ZSTD_outBuffer ob{out.data(), out.size(), 0};
    ZSTD_inBuffer ib{content.data(), content.size(), 0};
    ZSTD_CCtx_setParameter(cc, ZSTD_c_contentSizeFlag, 0);
    REQUIRE(ZSTD_compressStream2(cc, &ob, &ib, ZSTD_e_end) == 0);
    ZSTD_freeCCtx(cc);
    out.resize(ob.pos);
    expect_refused(*dec, with_payload(untagged, out), "zstd frame content size unknown");
  }
  SECTION("tagged chunks with a bad tag, count or index") {
    // One chunk of 3000 FP16 elements: a u32 tag, then the dense chunk or the sparse entries.
    auto tagged = [&](uint32_t tag, const std::vector<uint8_t>& body) {
      std::vector<uint8_t> c(4 + body.size());
      for (int i = 0; i < 4; ++i) c[size_t(i)] = uint8_t(tag >> (8 * i));
      std::copy(body.begin(), body.end(), c.begin() + 4);
      return with_payload(f2, zstd_of(c));
    };
    // Sparse entries: gaps as 4 byte planes, then 2 value planes.
    auto entries = [](std::initializer_list<uint32_t> gaps) {
      const size_t k = gaps.size();
      std::vector<uint8_t> b(6 * k, 0);
      size_t j = 0;
      for (uint32_t g : gaps) {
        for (size_t p = 0; p < 4; ++p) b[p * k + j] = uint8_t(g >> (8 * p));
        b[4 * k + j] = 0x5a;  // a value
        ++j;
      }
      return b;
    };
    expect_refused(*dec, tagged(1001, std::vector<uint8_t>(6000, 0)),
                   "tag 1001, expected 0xFFFFFFFF (dense) or a count n");
    expect_refused(*dec, tagged(1, entries({3000})), "entry 0 of 1 has index 3000");
    expect_refused(*dec, tagged(2, entries({2999, 0})), "entry 1 of 2 has index 3000");
    expect_refused(*dec, tagged(2, entries({5, 0xffffffffu})), "entry 1 of 2 has index 4294967301");
    expect_refused(*dec, tagged(kChunkDense, std::vector<uint8_t>(100, 0)),
                   "the payload ended after");
    expect_refused(*dec, tagged(3, entries({0, 1, 2, 3})), "the frame does not end after its");
    // Content of unknown size that asks for a 128 MiB zstd window (for this 6000-byte buffer):
    // refused before zstd allocates it.
    {
      ZSTD_CCtx* cc = ZSTD_createCCtx();
      REQUIRE_FALSE(ZSTD_isError(ZSTD_CCtx_setParameter(cc, ZSTD_c_windowLog, 27)));
      std::vector<uint8_t> c4(4, 0), out(1024);
      ZSTD_outBuffer ob{out.data(), out.size(), 0};
      ZSTD_inBuffer none{c4.data(), 0, 0}, ib{c4.data(), c4.size(), 0};
      ZSTD_compressStream2(cc, &ob, &none, ZSTD_e_continue);  // the size is not known up front
      REQUIRE(ZSTD_compressStream2(cc, &ob, &ib, ZSTD_e_end) == 0);
      ZSTD_freeCCtx(cc);
      out.resize(ob.pos);
      expect_refused(*dec, with_payload(f2, out), "Frame requires too much memory");
    }
    // The same entries, well formed, are applied: three elements XOR'd with 0x5a in their low
    // byte, the rest unchanged.
    const View before = view(*dec);
    std::string err;
    REQUIRE(dec->apply(tagged(3, entries({0, 1, 2})).data(), tagged(3, entries({0, 1, 2})).size(),
                       &err));
    const View after = view(*dec);
    size_t changed = 0;
    for (size_t i = 0; i < after.state.size(); ++i) {
      const uint8_t want =
          (i == 0 || i == 4 || i == 10) ? uint8_t(before.state[i] ^ 0x5a) : before.state[i];
      changed += after.state[i] != before.state[i];
      CHECK(after.state[i] == want);
    }
    CHECK(changed == 3);  // elements 0, 2 and 5 (gaps 0, 1, 2)
  }
  SECTION("lossy payloads with invalid scales or codes") {
    std::vector<uint16_t> z(n, 0);
    auto lenc = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange);
    auto ldec = make_dec(DType::kF16, 2 * n);
    apply_ok(*ldec, encode(*lenc, z.data()));
    z[5] = float_to_fp16(0.5f);
    auto lf = encode(*lenc, z.data());
    const size_t nb = (n + 255) / 256;
    std::vector<uint8_t> content(4 * nb + n, 0);
    float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(content.data(), &nan, 4);
    expect_refused(*ldec, with_payload(lf, zstd_of(content)), "lossy scale nan of block 0");
    float neg = -1.0f;
    std::memcpy(content.data(), &neg, 4);
    expect_refused(*ldec, with_payload(lf, zstd_of(content)), "expected a finite value >= 0");
    float one = 1.0f;
    std::memcpy(content.data(), &one, 4);
    content[4 * nb + n - 1] = 0x80;
    expect_refused(*ldec, with_payload(lf, zstd_of(content)), "lossy code -128 at element 2999");
    apply_ok(*ldec, lf);
    CHECK(fp16_to_float(reinterpret_cast<const uint16_t*>(ldec->state())[5]) ==
          Approx(0.5).epsilon(0.01));
  }
  // Whatever was refused above, the decoder still takes the real next frame.
  if (dec->last_seq() == 1) {
    apply_ok(*dec, f2);
  }
}

TEST_CASE("oversized declared sizes are refused without allocating", "[snapshot][codec]") {
  const size_t n = 2048;  // 4 KiB buffer
  std::vector<uint16_t> w(n, 0x3c00);
  auto enc = make_enc(DType::kF16, 2 * n);
  auto f0 = encode(*enc, w.data());
  struct Case {
    DType t;
    uint64_t elems, raw, payload;
    const char* needle;
  } cases[] = {
      {DType::kF16, uint64_t(1) << 62, uint64_t(1) << 63, 0, "raw_size 9223372036854775808"},
      {DType::kF32, uint64_t(1) << 62, 0, 0, "overflows 64 bits"},
      {DType::kBytes, UINT64_MAX, UINT64_MAX, 0, "dtype kBytes"},
      {DType::kF16, n, 2 * n, uint64_t(1) << 62, "truncated: payload_size 4611686018427387904"},
  };
  for (const auto& c : cases) {
    INFO(c.needle);
    FrameHeader h = header_of(f0);
    h.dtype = c.t;
    h.elem_count = c.elems;
    h.raw_size = c.raw;
    if (c.payload) h.payload_size = c.payload;
    auto f = f0;
    write_frame_header(h, f.data());
    auto dec = make_dec(DType::kF16, 2 * n);
    g_largest = 0;
    g_watch = true;
    std::string err;
    const bool ok = dec->apply(f.data(), f.size(), &err);
    g_watch = false;
    CHECK_FALSE(ok);
    CHECK(err.find(c.needle) != std::string::npos);
    INFO(err);
    CHECK(g_largest.load() < 4096);  // error strings only; nothing sized from the frame
    CHECK_FALSE(dec->has_state());
  }
  // A zstd frame declaring 2^40 bytes of content (header + one empty raw block).
  std::vector<uint8_t> z = {0x28, 0xb5, 0x2f, 0xfd, 0xe0};  // magic; 8-byte size, single segment
  for (int i = 0; i < 8; ++i) z.push_back(uint8_t((uint64_t(1) << 40) >> (8 * i)));
  z.insert(z.end(), {0x01, 0x00, 0x00});  // last block, raw, 0 bytes
  REQUIRE(ZSTD_getFrameContentSize(z.data(), z.size()) == (uint64_t(1) << 40));
  auto dec = make_dec(DType::kF16, 2 * n);
  auto f = with_payload(f0, z);
  g_largest = 0;
  g_watch = true;
  std::string err;
  const bool ok = dec->apply(f.data(), f.size(), &err);
  g_watch = false;
  CHECK_FALSE(ok);
  CHECK(err.find("zstd frame content size 1099511627776, expected 4096") != std::string::npos);
  CHECK(g_largest.load() < 4096);
  // The decoder's own scratch is sized from the registered buffer: a valid frame allocates
  // about the buffer, no more.
  g_largest = 0;
  g_watch = true;
  const bool ok2 = dec->apply(f0.data(), f0.size(), &err);
  g_watch = false;
  CHECK(ok2);
  CHECK(g_largest.load() <= 2 * n + 4 * ((n + 255) / 256));
}

TEST_CASE("fuzz: 2000 random mutations of valid frames never crash", "[snapshot][codec]") {
  const size_t n = 3000;  // 12 lossy blocks
  std::mt19937_64 rng(2024);
  auto w = weights(n, false, rng);
  auto ll = make_enc(DType::kF16, 2 * n, Codec::kLossless);
  auto ly = make_enc(DType::kF16, 2 * n, Codec::kLossyDynRange);
  const auto base = encode(*ll, w.data());
  encode(*ly, w.data());
  step(&w, 0.2, 1e-3f, false, rng);
  const auto ldelta = encode(*ll, w.data());
  const auto ydelta = encode(*ly, w.data());
  const std::vector<uint8_t>* frames[] = {&base, &ldelta, &ydelta};

  int accepted = 0, refused = 0, unsealed_accepted = 0;
  for (int it = 0; it < 2000; ++it) {
    const int which = int(rng() % 3);
    const auto& orig = *frames[which];
    auto f = orig;
    switch (rng() % 6) {
      case 0:  // flip 1..8 bits anywhere
        for (int k = 1 + int(rng() % 8); k > 0; --k)
          f[rng() % f.size()] ^= uint8_t(1u << (rng() % 8));
        break;
      case 1:  // random bytes in the header
        for (int k = 1 + int(rng() % 4); k > 0; --k) f[rng() % kFrameHeaderBytes] = uint8_t(rng());
        break;
      case 2:  // truncate
        f.resize(rng() % f.size());
        break;
      case 3:  // append garbage
        for (int k = 1 + int(rng() % 64); k > 0; --k) f.push_back(uint8_t(rng()));
        break;
      case 4: {  // an extreme value in one 64-bit header field (seq .. payload_size)
        const size_t off = 16 + 8 * (rng() % 5);
        const uint64_t vals[] = {0, 1, UINT64_MAX, uint64_t(1) << 62, uint64_t(1) << 32, rng()};
        const uint64_t v = vals[rng() % 6];
        for (int i = 0; i < 8; ++i) f[off + size_t(i)] = uint8_t(v >> (8 * i));
        break;
      }
      default:  // random bytes in the payload
        for (int k = 1 + int(rng() % 16); k > 0; --k)
          f[kFrameHeaderBytes + rng() % (f.size() - kFrameHeaderBytes)] = uint8_t(rng());
        break;
    }
    const bool sealed = rng() % 2 == 0;  // recompute the CRCs: reach zstd and the lossy checks
    if (sealed) reseal(&f);
    auto dec = make_dec(DType::kF16, 2 * n);
    if (which > 0) apply_ok(*dec, base);  // the lossy encoder's base is the same frame
    const View before = view(*dec);
    std::string err;
    if (dec->apply(f.data(), f.size(), &err)) {
      ++accepted;
      if (!sealed && f != orig) ++unsealed_accepted;
    } else {
      ++refused;
      CHECK(!err.empty());
      if (!(view(*dec) == before)) FAIL("a refused frame changed the decoder: " << err);
    }
  }
  WARN("fuzz: " << accepted << " accepted, " << refused << " refused of 2000");
  CHECK(unsealed_accepted == 0);  // the CRCs catch every change that was not resealed
  CHECK(refused > 1500);
}
