// The snapshot delta codec: byte shuffle + zstd (lossless), per-block int8 dynamic range
// (lossy FP16/BF16, closed loop), self-describing frames. See codec.h for the format.
#include "r2ccl/snapshot/codec.h"

#include <zlib.h>
// ZSTD_c_srcSizeHint (zstd >= 1.4.4) is in zstd.h's experimental section: only that enum
// value is used, no experimental function (Debian links libzstd dynamically).
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace r2ccl::snap {

// Element bit patterns are read in host order and scales are stored with memcpy: the frame
// format is little-endian, so is every host this runs on (x86-64, aarch64).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the snapshot codec assumes a little-endian host");

namespace {

constexpr const char* kPfx = "snapshot frame: ";

uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void put16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint16_t get16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// zlib's crc32 over any length (crc32_z takes a z_size_t).
uint32_t crc32_of(uint32_t crc, const uint8_t* p, size_t n) { return uint32_t(crc32_z(crc, p, n)); }

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// Bytes of the lossy payload's content for `elems` elements: one float32 scale per started
// block of 256 (every chunk but the last holds whole blocks), one int8 code per element.
uint64_t lossy_content_bytes(uint64_t elems) {
  return elems + 4 * ceil_div(elems, kLossyBlockElems);
}

// binary32 -> binary16, round to nearest even. The common case (a normal binary16 result, or
// an overflow of the top binade to Inf) is one rebias and one rounding add, without
// data-dependent branches; the rest (Inf/NaN, overflow, subnormals) takes the exact slow path.
inline uint16_t narrow_fp16(float f) {
  const uint32_t x = f2u(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7fffffff;
  if (a >= 0x38800000u && a < 0x47800000u) {                         // [2^-14, 2^16)
    const uint32_t r = a - 0x38000000u;                              // exponent rebiased 127 -> 15
    return uint16_t(sign | ((r + 0xfffu + ((r >> 13) & 1)) >> 13));  // ties to even; may reach Inf
  }
  const uint32_t exp = (x >> 23) & 0xff;
  const uint32_t mant = x & 0x7fffff;
  if (exp == 0xff) {
    if (mant == 0) return uint16_t(sign | 0x7c00);
    return uint16_t(sign | 0x7e00 | (mant >> 13));  // quiet NaN, top payload bits kept
  }
  const int e = int(exp) - 127 + 15;  // the binary16 biased exponent
  if (e >= 31) return uint16_t(sign | 0x7c00);
  if (e <= 0) {
    // Subnormal result: value = m * 2^(exp-150) = h * 2^-24, so h = m >> (14 - e).
    if (e < -10) return sign;  // below 2^-25: rounds to zero (float subnormals included)
    const uint32_t m = mant | 0x800000;
    const int shift = 14 - e;  // 14..24
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;  // may carry into the smallest normal
    return uint16_t(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // a carry may reach Inf: correct
  return uint16_t(sign | h);
}

inline uint16_t narrow_bf16(float f) {
  const uint32_t x = f2u(f);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x0040);  // quiet NaN
  const uint32_t bias = 0x7fff + ((x >> 16) & 1);  // ties to even; overflow reaches Inf
  return uint16_t((x + bias) >> 16);
}

// The lossy reconstruction of one element, shared by encoder and decoder so both compute the
// same bits: prev + scale * code as two float32 roundings (two statements: no FMA
// contraction in ISO C++ mode), narrowed with round-to-nearest-even and saturated to the
// largest finite value (a finite delta never reconstructs to Inf). Code 0 keeps the bits.
template <bool kBF16>
inline uint16_t lossy_step(uint16_t prev_bits, float prev_f, float scale, int code) {
  const float step = scale * static_cast<float>(code);
  const float sum = prev_f + step;
  uint16_t r = kBF16 ? narrow_bf16(sum) : narrow_fp16(sum);
  const uint16_t inf = kBF16 ? 0x7f80 : 0x7c00;
  r = (r & 0x7fff) == inf ? uint16_t((r & 0x8000) | (inf - 1)) : r;
  return code == 0 ? prev_bits : r;
}

// binary16 -> binary32 by table (256 KiB, built once from fp16_to_float: the same values).
const float* fp16_table() {
  static const std::vector<float> t = [] {
    std::vector<float> v(65536);
    for (uint32_t h = 0; h < 65536; ++h) v[h] = fp16_to_float(uint16_t(h));
    return v;
  }();
  return t.data();
}

template <bool kBF16>
inline float widen(uint16_t v, const float* tab) {
  return kBF16 ? bf16_to_float(v) : tab[v];
}

// The byte shuffle of m elements of ES bytes: byte k of element i goes to out[k*m + i]. With
// `xor_prev` the XOR of cur and prev is shuffled. Either way cur is then copied into prev
// (the encoder's reconstruction), in the same pass.
template <size_t ES>
void shuffle_scalar(const uint8_t* cur, uint8_t* prev, size_t i0, size_t m, bool xor_prev,
                    uint8_t* out) {
  for (size_t i = i0; i < m; ++i)
    for (size_t k = 0; k < ES; ++k) {
      const uint8_t c = cur[i * ES + k];
      out[k * m + i] = xor_prev ? uint8_t(c ^ prev[i * ES + k]) : c;
      prev[i * ES + k] = c;
    }
}

#if defined(__SSE2__)
inline __m128i ld(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void st(uint8_t* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }
// Even and odd bytes of the 32 bytes a, b (in order).
inline __m128i even_bytes(__m128i a, __m128i b) {
  const __m128i lo = _mm_set1_epi16(0x00ff);
  return _mm_packus_epi16(_mm_and_si128(a, lo), _mm_and_si128(b, lo));
}
inline __m128i odd_bytes(__m128i a, __m128i b) {
  return _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
}
#endif

void shuffle_copy(size_t es, const uint8_t* cur, uint8_t* prev, size_t m, bool xor_prev,
                  uint8_t* out) {
  size_t i = 0;
  if (es == 1) {
    for (; i < m; ++i) out[i] = xor_prev ? uint8_t(cur[i] ^ prev[i]) : cur[i];
    std::memcpy(prev, cur, m);
    return;
  }
#if defined(__SSE2__)
  if (es == 2) {
    for (; i + 16 <= m; i += 16) {  // 16 elements: 32 bytes in, 16 bytes to each plane
      const __m128i c0 = ld(cur + 2 * i), c1 = ld(cur + 2 * i + 16);
      __m128i x0 = c0, x1 = c1;
      if (xor_prev) {
        x0 = _mm_xor_si128(c0, ld(prev + 2 * i));
        x1 = _mm_xor_si128(c1, ld(prev + 2 * i + 16));
      }
      st(prev + 2 * i, c0);
      st(prev + 2 * i + 16, c1);
      st(out + i, even_bytes(x0, x1));
      st(out + m + i, odd_bytes(x0, x1));
    }
    shuffle_scalar<2>(cur, prev, i, m, xor_prev, out);
    return;
  }
  for (; i + 16 <= m; i += 16) {  // es 4, 16 elements: 64 bytes in, 16 to each plane
    __m128i x[4];
    for (int v = 0; v < 4; ++v) {
      const __m128i c = ld(cur + 4 * i + 16 * v);
      x[v] = xor_prev ? _mm_xor_si128(c, ld(prev + 4 * i + 16 * v)) : c;
      st(prev + 4 * i + 16 * v, c);
    }
    const __m128i e0 = even_bytes(x[0], x[1]), e1 = even_bytes(x[2], x[3]);  // bytes 0,2
    const __m128i o0 = odd_bytes(x[0], x[1]), o1 = odd_bytes(x[2], x[3]);    // bytes 1,3
    st(out + i, even_bytes(e0, e1));
    st(out + m + i, even_bytes(o0, o1));
    st(out + 2 * m + i, odd_bytes(e0, e1));
    st(out + 3 * m + i, odd_bytes(o0, o1));
  }
#endif
  if (es == 2)
    shuffle_scalar<2>(cur, prev, i, m, xor_prev, out);
  else
    shuffle_scalar<4>(cur, prev, i, m, xor_prev, out);
}

// Inverse: state[i*ES + k] = in[k*m + i] (a base) or ^= it (a delta).
template <size_t ES>
void unshuffle_scalar(const uint8_t* in, size_t i0, size_t m, bool xor_into, uint8_t* state) {
  for (size_t i = i0; i < m; ++i)
    for (size_t k = 0; k < ES; ++k) {
      uint8_t& d = state[i * ES + k];
      d = xor_into ? uint8_t(d ^ in[k * m + i]) : in[k * m + i];
    }
}

void unshuffle_any(size_t es, const uint8_t* in, size_t m, bool xor_into, uint8_t* state) {
  size_t i = 0;
  if (es == 1) {
    for (; i < m; ++i) state[i] = xor_into ? uint8_t(state[i] ^ in[i]) : in[i];
    return;
  }
#if defined(__SSE2__)
  auto put = [&](uint8_t* p, __m128i v) { st(p, xor_into ? _mm_xor_si128(ld(p), v) : v); };
  // A sparse delta leaves most groups of 16 elements alone: those are skipped without touching
  // the state (XOR with 0), so applying it costs about a read of the chunk, not a pass over
  // the state.
  const __m128i zero = _mm_setzero_si128();
  auto unchanged = [&](__m128i o) {
    return xor_into && _mm_movemask_epi8(_mm_cmpeq_epi8(o, zero)) == 0xffff;
  };
  if (es == 2) {
    for (; i + 16 <= m; i += 16) {
      const __m128i b0 = ld(in + i), b1 = ld(in + m + i);
      if (unchanged(_mm_or_si128(b0, b1))) continue;
      put(state + 2 * i, _mm_unpacklo_epi8(b0, b1));
      put(state + 2 * i + 16, _mm_unpackhi_epi8(b0, b1));
    }
    unshuffle_scalar<2>(in, i, m, xor_into, state);
    return;
  }
  for (; i + 16 <= m; i += 16) {
    const __m128i b0 = ld(in + i), b1 = ld(in + m + i), b2 = ld(in + 2 * m + i),
                  b3 = ld(in + 3 * m + i);
    if (unchanged(_mm_or_si128(_mm_or_si128(b0, b1), _mm_or_si128(b2, b3)))) continue;
    const __m128i p01l = _mm_unpacklo_epi8(b0, b1), p01h = _mm_unpackhi_epi8(b0, b1);
    const __m128i p23l = _mm_unpacklo_epi8(b2, b3), p23h = _mm_unpackhi_epi8(b2, b3);
    put(state + 4 * i, _mm_unpacklo_epi16(p01l, p23l));
    put(state + 4 * i + 16, _mm_unpackhi_epi16(p01l, p23l));
    put(state + 4 * i + 32, _mm_unpacklo_epi16(p01h, p23h));
    put(state + 4 * i + 48, _mm_unpackhi_epi16(p01h, p23h));
  }
#endif
  if (es == 2)
    unshuffle_scalar<2>(in, i, m, xor_into, state);
  else
    unshuffle_scalar<4>(in, i, m, xor_into, state);
}

// Decodes exactly `want` more content bytes of the zstd stream `in` into out (`done` bytes of
// `expected` came before; 0: not known, tagged chunks). *r: the last ZSTD_decompressStream result
// (0 once the frame ended). False with *why on a zstd error or a payload that ends early.
bool pull_content(ZSTD_DCtx* d, ZSTD_inBuffer* in, uint8_t* out, size_t want, uint64_t done,
                  uint64_t expected, size_t* r, std::string* why) {
  ZSTD_outBuffer o{out, want, 0};
  while (o.pos < o.size) {
    const size_t before_in = in->pos, before_out = o.pos;
    *r = ZSTD_decompressStream(d, &o, in);
    if (ZSTD_isError(*r)) {
      *why = std::string("zstd: ") + ZSTD_getErrorName(*r);
      return false;
    }
    if (o.pos < o.size && (*r == 0 || (in->pos == before_in && o.pos == before_out))) {
      *why = "zstd: the payload ended after " + std::to_string(done + o.pos) +
             " content bytes, expected " +
             (expected ? std::to_string(expected) : std::to_string(done + want) + " or more");
      return false;
    }
  }
  return true;
}

// After all `expected` content bytes were pulled: the zstd frame must end there.
bool stream_ends(ZSTD_DCtx* d, ZSTD_inBuffer* in, size_t r, uint64_t expected, uint8_t* any,
                 std::string* why) {
  if (r == 0) return true;
  ZSTD_outBuffer o{any, 0, 0};
  r = ZSTD_decompressStream(d, &o, in);
  if (ZSTD_isError(r) || r != 0) {
    *why = "zstd: the frame does not end after its " + std::to_string(expected) + " content bytes";
    return false;
  }
  return true;
}

// acc ^= in over n bytes (the compiler vectorises the 8-byte loop).
void xor_into(uint8_t* acc, const uint8_t* in, size_t n) {
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t a, b;
    std::memcpy(&a, acc + j, 8);
    std::memcpy(&b, in + j, 8);
    a ^= b;
    std::memcpy(acc + j, &a, 8);
  }
  for (; j < n; ++j) acc[j] ^= in[j];
}

// ---- tagged chunks (codec.h): the sparse form of a lossless delta's chunk ----

// The encoder writes a chunk sparse when at most m / kSparseDivisor of its elements changed;
// a decoder accepts any count whose entries are no larger than the dense chunk.
constexpr size_t kSparseDivisor = 8;

bool sparse_count_ok(uint64_t n, uint64_t m, uint64_t es) { return n * (4 + es) <= m * es; }

// The elements of the shuffled chunk s (m elements, es byte planes) with a nonzero byte, in
// increasing order, into *idx; false as soon as there are more than `limit` (*idx partial).
bool find_changed(const uint8_t* s, size_t m, size_t es, size_t limit, std::vector<uint32_t>* idx) {
  idx->clear();
  size_t i = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  for (; i + 16 <= m; i += 16) {
    __m128i o = ld(s + i);
    for (size_t k = 1; k < es; ++k) o = _mm_or_si128(o, ld(s + k * m + i));
    unsigned mask = ~unsigned(_mm_movemask_epi8(_mm_cmpeq_epi8(o, zero))) & 0xffffu;
    for (; mask != 0; mask &= mask - 1) {
      if (idx->size() == limit) return false;
      idx->push_back(uint32_t(i + size_t(__builtin_ctz(mask))));
    }
  }
#endif
  for (; i < m; ++i) {
    uint8_t o = 0;
    for (size_t k = 0; k < es; ++k) o = uint8_t(o | s[k * m + i]);
    if (o == 0) continue;
    if (idx->size() == limit) return false;
    idx->push_back(uint32_t(i));
  }
  return true;
}

// A sparse chunk's body for the elements idx of the shuffled chunk s: 4 byte planes of the
// gaps, then es byte planes of the values (n * (4 + es) bytes at out).
void write_sparse(const uint8_t* s, size_t m, size_t es, const std::vector<uint32_t>& idx,
                  uint8_t* out) {
  const size_t n = idx.size();
  uint32_t prev = UINT32_MAX;  // index -1: the first gap is the first index
  for (size_t j = 0; j < n; ++j) {
    const uint32_t gap = idx[j] - prev - 1;
    for (size_t b = 0; b < 4; ++b) out[b * n + j] = uint8_t(gap >> (8 * b));
    prev = idx[j];
  }
  uint8_t* v = out + 4 * n;
  for (size_t k = 0; k < es; ++k)
    for (size_t j = 0; j < n; ++j) v[k * n + j] = s[k * m + idx[j]];
}

// XORs a sparse chunk's n entries (body: gap planes, value planes) into its chunk of m
// elements: the shuffled chunk (byte k of element i at k*m + i) when `shuffled`, else the
// state's chunk (at i*es + k). target null: checks only. False with *why when an index is not
// inside the chunk (`off`: the chunk's first element, for the message).
bool apply_sparse(const uint8_t* body, size_t n, size_t m, size_t es, uint8_t* target,
                  bool shuffled, uint64_t off, std::string* why) {
  const uint8_t* v = body + 4 * n;
  uint64_t next = 0;  // the smallest index entry j may have: index j-1 + 1
  for (size_t j = 0; j < n; ++j) {
    const uint64_t gap = uint64_t(body[j]) | uint64_t(body[n + j]) << 8 |
                         uint64_t(body[2 * n + j]) << 16 | uint64_t(body[3 * n + j]) << 24;
    const uint64_t i = next + gap;
    if (i >= m) {
      *why = "sparse chunk at element " + std::to_string(off) + ": entry " + std::to_string(j) +
             " of " + std::to_string(n) + " has index " + std::to_string(i) +
             ", expected increasing indices below the chunk's " + std::to_string(m) + " elements";
      return false;
    }
    next = i + 1;
    if (!target) continue;
    if (shuffled)
      for (size_t k = 0; k < es; ++k) target[k * m + i] ^= v[k * n + j];
    else
      for (size_t k = 0; k < es; ++k) target[i * es + k] ^= v[k * n + j];
  }
  return true;
}

// Reads a tagged chunk (m elements) from the stream: its tag into *tag, then its body into buf
// (at most m * es bytes: the dense chunk, or a sparse one's entries). *done counts the content
// bytes read so far (for messages); `expected` is the most there may be.
bool pull_tagged(ZSTD_DCtx* d, ZSTD_inBuffer* in, uint8_t* buf, size_t m, size_t es, uint64_t off,
                 uint64_t* done, size_t* r, uint32_t* tag, std::string* why) {
  const std::string where = "the tagged chunk at element " + std::to_string(off);
  uint8_t t[4];
  if (!pull_content(d, in, t, 4, *done, 0, r, why)) {
    *why = where + ", its tag: " + *why;
    return false;
  }
  *done += 4;
  *tag = get32(t);
  size_t body = m * es;
  if (*tag != kChunkDense) {
    if (!sparse_count_ok(*tag, m, es)) {
      *why = where + ": tag " + std::to_string(*tag) +
             ", expected 0xFFFFFFFF (dense) or a count n of changed elements with n * (4 + " +
             std::to_string(es) + ") <= " + std::to_string(m * es);
      return false;
    }
    body = size_t(*tag) * (4 + es);
  }
  if (body > 0 && !pull_content(d, in, buf, body, *done, 0, r, why)) {
    *why = where + ", its " + std::to_string(body) + " bytes (tag " + std::to_string(*tag) +
           "): " + *why;
    return false;
  }
  *done += body;
  return true;
}

// The largest zstd window a decoder of `size` bytes (`elems` elements) accepts: its frames'
// content is at most size + 4 bytes per chunk of at least 256 elements, and zstd never needs a
// window larger than the content (2^10 at least; at most zstd's default limit, 2^27). Without
// it, a frame of unknown content size (tagged chunks) could ask for 128 MiB for a tiny buffer.
int window_log_max(uint64_t size, uint64_t elems) {
  const uint64_t bound = size + 4 * ceil_div(elems, kLossyBlockElems);
  int wl = 10;
  while (wl < 27 && (uint64_t(1) << wl) < bound) ++wl;
  return wl;
}

// One lossy block of bl <= 256 elements at cur/prev (2-byte elements): writes the scale and
// the codes, updates prev to the reconstruction, raises *max_err. Elements whose bits did not
// change get code 0 and keep their bits (a NaN or Inf that stays put included); only the
// changed ones are converted (sparse steps are cheap, dense ones have no unpredictable
// branches). False on a non-finite delta of a changed element (prev untouched then).
template <bool kBF16>
bool lossy_block(const uint8_t* cur, uint8_t* prev, size_t bl, float* scale_out, int8_t* codes,
                 double* max_err, const float* tab) {
  uint16_t cb[kLossyBlockElems], pb[kLossyBlockElems];
  uint16_t idx[kLossyBlockElems];  // the changed elements, compacted without branches
  float cf[kLossyBlockElems], pf[kLossyBlockElems], df[kLossyBlockElems];
  std::memcpy(cb, cur, 2 * bl);
  std::memcpy(pb, prev, 2 * bl);
  size_t nc = 0;
  for (size_t j = 0; j < bl; ++j) {
    idx[nc] = uint16_t(j);
    nc += cb[j] != pb[j];
  }
  std::memset(codes, 0, bl);
  if (nc == 0) {
    *scale_out = 0;
    return true;
  }
  float maxabs = 0;
  bool bad = false;
  for (size_t k = 0; k < nc; ++k) {
    const size_t j = idx[k];
    cf[k] = widen<kBF16>(cb[j], tab);
    pf[k] = widen<kBF16>(pb[j], tab);
    df[k] = cf[k] - pf[k];
    const float a = std::fabs(df[k]);
    bad |= !(a <= FLT_MAX);  // NaN or Inf
    maxabs = std::max(maxabs, a);
  }
  if (bad) return false;
  const float scale = maxabs / 127.0f;
  *scale_out = scale;
  // A scale of 0 with changes (+-0, or all below 127 * the smallest float subnormal): codes 0.
  const bool normal = scale >= FLT_MIN;
  const float inv = normal ? 1.0f / scale : 0.0f;
  double err = *max_err;
  for (size_t k = 0; k < nc; ++k) {
    const size_t j = idx[k];
    int code = 0;
    if (scale > 0) {
      const float q = normal ? df[k] * inv : df[k] / scale;  // |q| <= ~127
      code = static_cast<int>(q + (q >= 0 ? 0.5f : -0.5f));
      code = std::min(127, std::max(-127, code));
    }
    codes[j] = int8_t(code);
    const uint16_t r = lossy_step<kBF16>(pb[j], pf[k], scale, code);
    std::memcpy(prev + 2 * j, &r, 2);
    // |cur - reconstruction|; unchanged elements (a NaN that stays put included) are exact.
    err = std::max(err, std::fabs(double(cf[k]) - double(widen<kBF16>(r, tab))));
  }
  *max_err = err;
  return true;
}

// Applies a validated lossy chunk (m elements at state) from its scales and codes.
template <bool kBF16>
void lossy_apply_chunk(const uint8_t* scales, const int8_t* codes, size_t m, uint8_t* state) {
  const float* tab = fp16_table();
  for (size_t b = 0; b * kLossyBlockElems < m; ++b) {
    float scale;
    std::memcpy(&scale, scales + 4 * b, 4);
    const size_t j0 = b * kLossyBlockElems;
    const size_t bl = std::min<size_t>(kLossyBlockElems, m - j0);
    uint16_t idx[kLossyBlockElems];  // block offsets of the nonzero codes, compacted
    size_t nc = 0;
    for (size_t j = 0; j < bl; ++j) {
      idx[nc] = uint16_t(j);
      nc += codes[j0 + j] != 0;
    }
    for (size_t k = 0; k < nc; ++k) {
      const size_t j = j0 + idx[k];
      uint16_t p;
      std::memcpy(&p, state + 2 * j, 2);
      const uint16_t r = lossy_step<kBF16>(p, widen<kBF16>(p, tab), scale, codes[j]);
      std::memcpy(state + 2 * j, &r, 2);
    }
  }
}

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBytes: return 1;
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBytes: return "kBytes";
    case DType::kF32: return "kF32";
    case DType::kF16: return "kF16";
    case DType::kBF16: return "kBF16";
  }
  return "?";
}

const char* codec_name(Codec c) {
  switch (c) {
    case Codec::kLossless: return "kLossless";
    case Codec::kLossyDynRange: return "kLossyDynRange";
  }
  return "?";
}

uint16_t float_to_fp16(float f) { return narrow_fp16(f); }

float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    const float v = float(mant) * 0x1p-24f;  // exact: subnormal (or zero) binary16
    return sign ? -v : v;
  }
  if (exp == 31) return u2f(sign | 0x7f800000 | (mant << 13));
  return u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t float_to_bf16(float f) { return narrow_bf16(f); }

float bf16_to_float(uint16_t b) { return u2f(uint32_t(b) << 16); }

void write_frame_header(const FrameHeader& h, uint8_t* out) {
  std::memset(out, 0, kFrameHeaderBytes);
  put32(out + 0, kFrameMagic);
  put16(out + 4, h.version);
  put16(out + 6, uint16_t(kFrameHeaderBytes));
  out[8] = uint8_t(h.dtype);
  out[9] = uint8_t(h.codec);
  out[10] = uint8_t((h.base ? kFrameBase : 0) | (h.no_payload_crc ? kFrameNoPayloadCrc : 0) |
                    (h.tagged ? kFrameTagged : 0));
  out[11] = 0;
  put32(out + 12, h.chunk_elems);
  put64(out + 16, h.seq);
  put64(out + 24, h.base_seq);
  put64(out + 32, h.elem_count);
  put64(out + 40, h.raw_size);
  put64(out + 48, h.payload_size);
  put32(out + 56, h.payload_crc);
  put32(out + 60, crc32_of(0, out, 60));
}

bool parse_frame_header(const uint8_t* frame, size_t n, FrameHeader* out, std::string* err) {
  auto fail = [&](const std::string& m) {
    *err = kPfx + m;
    return false;
  };
  if (frame == nullptr || n < kFrameHeaderBytes)
    return fail("truncated: " + std::to_string(frame ? n : 0) + " bytes, a frame starts with a " +
                std::to_string(kFrameHeaderBytes) + "-byte header");
  const uint32_t magic = get32(frame);
  if (magic != kFrameMagic)
    return fail("magic " + hex32(magic) + ", expected " + hex32(kFrameMagic) +
                " ('R2SF'): not a snapshot frame");
  FrameHeader h;
  h.version = get16(frame + 4);
  if (h.version != kFrameVersion)
    return fail("version " + std::to_string(h.version) + ", this decoder reads version " +
                std::to_string(kFrameVersion));
  const uint16_t hbytes = get16(frame + 6);
  if (hbytes != kFrameHeaderBytes)
    return fail("header bytes " + std::to_string(hbytes) + ", version 1 has " +
                std::to_string(kFrameHeaderBytes));
  const uint32_t hcrc = get32(frame + 60), hcrc_calc = crc32_of(0, frame, 60);
  if (hcrc != hcrc_calc)
    return fail("header CRC-32 " + hex32(hcrc) + " does not match the header's " +
                hex32(hcrc_calc) + ": the header is corrupted");
  if (frame[8] > uint8_t(DType::kBF16))
    return fail("dtype " + std::to_string(frame[8]) +
                ", expected 0..3 (kBytes, kF32, kF16, kBF16)");
  if (frame[9] > uint8_t(Codec::kLossyDynRange))
    return fail("codec " + std::to_string(frame[9]) +
                ", expected 0 (kLossless) or 1 (kLossyDynRange)");
  if ((frame[10] & ~(kFrameBase | kFrameNoPayloadCrc | kFrameTagged)) != 0 || frame[11] != 0)
    return fail("flags " + std::to_string(frame[10]) + " / reserved " + std::to_string(frame[11]) +
                ", expected flags 0..7 (bit 0 base, bit 1 no payload CRC, bit 2 tagged chunks) "
                "and reserved 0");
  h.dtype = DType(frame[8]);
  h.codec = Codec(frame[9]);
  h.base = (frame[10] & kFrameBase) != 0;
  h.no_payload_crc = (frame[10] & kFrameNoPayloadCrc) != 0;
  h.tagged = (frame[10] & kFrameTagged) != 0;
  if (h.tagged && (h.base || h.codec != Codec::kLossless))
    return fail(std::string("flag bit 2 (tagged chunks) on a ") + (h.base ? "base" : "delta") +
                " frame with codec " + codec_name(h.codec) +
                ", tagged chunks are for kLossless deltas only");
  h.chunk_elems = get32(frame + 12);
  h.seq = get64(frame + 16);
  h.base_seq = get64(frame + 24);
  h.elem_count = get64(frame + 32);
  h.raw_size = get64(frame + 40);
  h.payload_size = get64(frame + 48);
  h.payload_crc = get32(frame + 56);
  if (h.no_payload_crc && h.payload_crc != 0)
    return fail("payload CRC " + hex32(h.payload_crc) +
                " with flag bit 1 (no payload CRC), "
                "expected 0");
  if (h.chunk_elems == 0 || h.chunk_elems % kLossyBlockElems != 0 || h.chunk_elems > kMaxChunkElems)
    return fail("chunk_elems " + std::to_string(h.chunk_elems) + ", expected a multiple of " +
                std::to_string(kLossyBlockElems) + " in [" + std::to_string(kLossyBlockElems) +
                ", " + std::to_string(kMaxChunkElems) + "]");
  const uint64_t es = dtype_size(h.dtype);
  if (h.elem_count == 0) return fail("elem_count 0, expected >= 1");
  if (h.elem_count > UINT64_MAX / es)
    return fail("elem_count " + std::to_string(h.elem_count) + " times the " + dtype_name(h.dtype) +
                " element size " + std::to_string(es) + " overflows 64 bits");
  if (h.elem_count * es != h.raw_size)
    return fail("raw_size " + std::to_string(h.raw_size) + " bytes, expected elem_count " +
                std::to_string(h.elem_count) + " * " + std::to_string(es) + " = " +
                std::to_string(h.elem_count * es));
  if (h.codec == Codec::kLossyDynRange && h.dtype != DType::kF16 && h.dtype != DType::kBF16)
    return fail(std::string("codec kLossyDynRange with dtype ") + dtype_name(h.dtype) +
                ", the lossy codec is defined for kF16 and kBF16 only");
  if (h.base && h.codec != Codec::kLossless)
    return fail(std::string("base frame with codec ") + codec_name(h.codec) +
                ", a base is always kLossless (the whole buffer, exact)");
  if (h.base && h.base_seq != h.seq)
    return fail("base frame with base_seq " + std::to_string(h.base_seq) + " and seq " +
                std::to_string(h.seq) + ", a base has base_seq == seq");
  if (!h.base && h.base_seq >= h.seq)
    return fail("delta frame with base_seq " + std::to_string(h.base_seq) + " and seq " +
                std::to_string(h.seq) + ", a delta has base_seq < seq");
  const uint64_t avail = n - kFrameHeaderBytes;
  if (h.payload_size > avail)
    return fail("truncated: payload_size " + std::to_string(h.payload_size) + " bytes but " +
                std::to_string(avail) + " follow the header");
  if (h.payload_size < avail)
    return fail(std::to_string(avail - h.payload_size) +
                " trailing bytes after the payload (payload_size " +
                std::to_string(h.payload_size) + ", frame " + std::to_string(n) + " bytes)");
  *out = h;
  return true;
}

// ---------------------------------------------------------------------------------------
// DeltaEncoder

DeltaEncoder::DeltaEncoder(const EncoderConfig& cfg) : cfg_(cfg) {}

DeltaEncoder::~DeltaEncoder() { ZSTD_freeCCtx(cctx_); }

std::unique_ptr<DeltaEncoder> DeltaEncoder::create(const EncoderConfig& cfg, std::string* err) {
  const std::string p = "DeltaEncoder: ";
  const size_t es = dtype_size(cfg.dtype);
  if (es == 0) {
    *err = p + "dtype " + std::to_string(int(cfg.dtype)) + ", expected kBytes, kF32, kF16 or kBF16";
    return nullptr;
  }
  if (cfg.size_bytes == 0 || cfg.size_bytes % es != 0) {
    *err = p + "size_bytes " + std::to_string(cfg.size_bytes) +
           ", expected a positive multiple of the " + dtype_name(cfg.dtype) + " element size " +
           std::to_string(es);
    return nullptr;
  }
  if (cfg.codec != Codec::kLossless && cfg.codec != Codec::kLossyDynRange) {
    *err = p + "codec " + std::to_string(int(cfg.codec)) + ", expected kLossless or kLossyDynRange";
    return nullptr;
  }
  if (cfg.codec == Codec::kLossyDynRange && cfg.dtype != DType::kF16 && cfg.dtype != DType::kBF16) {
    *err = p + "codec kLossyDynRange needs dtype kF16 or kBF16 (got " + dtype_name(cfg.dtype) +
           "); use kLossless for this buffer";
    return nullptr;
  }
  if (cfg.base_every == 0) {
    *err = p + "base_every 0, expected >= 1 (1: every snapshot is a base)";
    return nullptr;
  }
  const ZSTD_bounds lv = ZSTD_cParam_getBounds(ZSTD_c_compressionLevel);
  if (cfg.zstd_level < lv.lowerBound || cfg.zstd_level > lv.upperBound) {
    *err = p + "zstd_level " + std::to_string(cfg.zstd_level) + ", expected " +
           std::to_string(lv.lowerBound) + ".." + std::to_string(lv.upperBound);
    return nullptr;
  }
  if (cfg.zstd_workers < 0 || cfg.zstd_workers > 64) {
    *err = p + "zstd_workers " + std::to_string(cfg.zstd_workers) + ", expected 0..64";
    return nullptr;
  }
  std::unique_ptr<DeltaEncoder> e(new DeltaEncoder(cfg));
  e->esize_ = es;
  e->elems_ = cfg.size_bytes / es;
  e->next_seq_ = cfg.first_seq;
  const size_t m = size_t(std::min<uint64_t>(kChunkElems, e->elems_));
  const size_t scratch = std::max<size_t>(m * es, m + 4 * ceil_div(m, kLossyBlockElems));
  e->prev_ = make_big(cfg.size_bytes, false);
  e->scratch_.reset(new (std::nothrow) uint8_t[scratch]);
  e->sparse_.reset(new (std::nothrow) uint8_t[m * es]);
  e->cctx_ = ZSTD_createCCtx();
  if (!e->prev_ || !e->scratch_ || !e->sparse_ || !e->cctx_) {
    *err = p + "cannot allocate " + std::to_string(cfg.size_bytes + scratch + m * es) + " bytes";
    return nullptr;
  }
  e->changed_.reserve(m / kSparseDivisor);
  e->out_stage_.resize(ZSTD_CStreamOutSize());
  size_t r = ZSTD_CCtx_setParameter(e->cctx_, ZSTD_c_compressionLevel, cfg.zstd_level);
  if (!ZSTD_isError(r)) r = ZSTD_CCtx_setParameter(e->cctx_, ZSTD_c_checksumFlag, 0);
  if (!ZSTD_isError(r)) r = ZSTD_CCtx_setParameter(e->cctx_, ZSTD_c_contentSizeFlag, 1);
  if (ZSTD_isError(r)) {
    *err = p + "zstd: " + ZSTD_getErrorName(r);
    return nullptr;
  }
  // Tagged deltas stream without a content size (codec.h): the hint (at most their content,
  // the buffer + 4 bytes per chunk) sizes zstd's window and tables as for a known size, as the
  // decoder's window limit expects. A libzstd without it writes untagged deltas instead.
  if (e->cfg_.sparse_chunks) {
    const uint64_t bound = cfg.size_bytes + 4 * ceil_div(e->elems_, kChunkElems);
    const int hint = int(std::min<uint64_t>(bound, uint64_t(INT32_MAX)));
    if (ZSTD_isError(ZSTD_CCtx_setParameter(e->cctx_, ZSTD_c_srcSizeHint, hint)))
      e->cfg_.sparse_chunks = false;
  }
  if (cfg.zstd_workers > 0) {
    r = ZSTD_CCtx_setParameter(e->cctx_, ZSTD_c_nbWorkers, cfg.zstd_workers);
    if (ZSTD_isError(r)) {
      *err = p + "zstd_workers " + std::to_string(cfg.zstd_workers) +
             " refused by libzstd (built without multithreading?): " + ZSTD_getErrorName(r);
      return nullptr;
    }
  }
  return e;
}

bool DeltaEncoder::begin_stream(uint64_t content_bytes, std::string* err) {
  size_t r = ZSTD_CCtx_reset(cctx_, ZSTD_reset_session_only);
  if (!ZSTD_isError(r)) r = ZSTD_CCtx_setPledgedSrcSize(cctx_, content_bytes);
  if (ZSTD_isError(r)) {
    *err = std::string("DeltaEncoder: zstd: ") + ZSTD_getErrorName(r);
    return false;
  }
  crc_ = 0;
  return true;
}

bool DeltaEncoder::push(const uint8_t* data, size_t n, bool last, std::vector<uint8_t>* frame,
                        std::string* err) {
  ZSTD_inBuffer in{data, n, 0};
  const ZSTD_EndDirective mode = last ? ZSTD_e_end : ZSTD_e_continue;
  for (;;) {
    ZSTD_outBuffer out{out_stage_.data(), out_stage_.size(), 0};
    const size_t rem = ZSTD_compressStream2(cctx_, &out, &in, mode);
    if (ZSTD_isError(rem)) {
      *err = std::string("DeltaEncoder: zstd: ") + ZSTD_getErrorName(rem);
      return false;
    }
    if (out.pos > 0) {
      if (cfg_.payload_crc) crc_ = crc32_of(crc_, out_stage_.data(), out.pos);
      frame->insert(frame->end(), out_stage_.data(), out_stage_.data() + out.pos);
    }
    if (last ? rem == 0 : in.pos == in.size) return true;
  }
}

bool DeltaEncoder::encode_lossless(const uint8_t* cur, bool base, std::vector<uint8_t>* frame,
                                   std::string* err) {
  frame->assign(kFrameHeaderBytes, 0);
  // A base is about as large as the buffer: one allocation instead of a doubling series.
  // (Reserving touches no pages; deltas, usually small, grow as needed.)
  if (base) frame->reserve(kFrameHeaderBytes + ZSTD_compressBound(cfg_.size_bytes));
  // Tagged chunks' content size is known only at the end: not pledged (codec.h).
  const bool tagged = !base && cfg_.sparse_chunks;
  if (!begin_stream(tagged ? ZSTD_CONTENTSIZE_UNKNOWN : cfg_.size_bytes, err)) return false;
  for (uint64_t off = 0; off < elems_; off += kChunkElems) {
    const size_t m = size_t(std::min<uint64_t>(kChunkElems, elems_ - off));
    const bool last = off + m == elems_;
    shuffle_copy(esize_, cur + off * esize_, prev_.get() + off * esize_, m, !base, scratch_.get());
    if (!tagged) {
      if (!push(scratch_.get(), m * esize_, last, frame, err)) return false;
      continue;
    }
    uint8_t tag[4];
    if (find_changed(scratch_.get(), m, esize_, m / kSparseDivisor, &changed_)) {
      const size_t n = changed_.size();
      write_sparse(scratch_.get(), m, esize_, changed_, sparse_.get());
      put32(tag, uint32_t(n));
      if (!push(tag, 4, false, frame, err) ||
          !push(sparse_.get(), n * (4 + esize_), last, frame, err))
        return false;
    } else {
      put32(tag, kChunkDense);
      if (!push(tag, 4, false, frame, err) || !push(scratch_.get(), m * esize_, last, frame, err))
        return false;
    }
  }
  return true;
}

int DeltaEncoder::encode_lossy(const uint8_t* cur, std::vector<uint8_t>* frame, double* max_err,
                               std::string* err) {
  frame->assign(kFrameHeaderBytes, 0);
  if (!begin_stream(lossy_content_bytes(elems_), err)) return 0;
  const bool bf = cfg_.dtype == DType::kBF16;
  const float* tab = fp16_table();
  double me = 0;
  for (uint64_t off = 0; off < elems_; off += kChunkElems) {
    const size_t m = size_t(std::min<uint64_t>(kChunkElems, elems_ - off));
    const size_t nb = size_t(ceil_div(m, kLossyBlockElems));
    uint8_t* scales = scratch_.get();
    int8_t* codes = reinterpret_cast<int8_t*>(scratch_.get() + 4 * nb);
    for (size_t b = 0; b < nb; ++b) {
      const size_t j0 = b * kLossyBlockElems;
      const size_t bl = std::min<size_t>(kLossyBlockElems, m - j0);
      const uint8_t* c = cur + (off + j0) * 2;
      uint8_t* p = prev_.get() + (off + j0) * 2;
      float scale = 0;
      const bool ok = bf ? lossy_block<true>(c, p, bl, &scale, codes + j0, &me, tab)
                         : lossy_block<false>(c, p, bl, &scale, codes + j0, &me, tab);
      if (!ok) return -1;
      std::memcpy(scales + 4 * b, &scale, 4);
    }
    if (!push(scratch_.get(), 4 * nb + m, off + m == elems_, frame, err)) return 0;
  }
  *max_err = me;
  return 1;
}

bool DeltaEncoder::encode(const void* cur_v, std::vector<uint8_t>* frame, EncodeStats* st,
                          std::string* err) {
  const auto t0 = std::chrono::steady_clock::now();
  if (cur_v == nullptr || frame == nullptr) {
    *err = "DeltaEncoder: encode() needs a buffer and a frame (got null)";
    return false;
  }
  if (next_seq_ == UINT64_MAX) {
    *err = "DeltaEncoder: sequence numbers exhausted (seq 2^64-1); create a new encoder";
    return false;
  }
  const uint8_t* cur = static_cast<const uint8_t*>(cur_v);
  const uint64_t seq = next_seq_;
  bool base = need_base_ || seq - base_seq_ >= cfg_.base_every;
  Codec used = Codec::kLossless;
  double max_err = 0;
  bool done = false;
  if (!base && cfg_.codec == Codec::kLossyDynRange) {
    const int r = encode_lossy(cur, frame, &max_err, err);
    if (r == 0) {
      need_base_ = true;
      return false;
    }
    if (r > 0) {
      used = Codec::kLossyDynRange;
      done = true;
    } else {
      base = true;  // a non-finite value: an exact base restarts the chain
    }
  }
  if (!done && !encode_lossless(cur, base, frame, err)) {
    need_base_ = true;
    return false;
  }
  FrameHeader h;
  h.dtype = cfg_.dtype;
  h.codec = used;
  h.base = base;
  h.chunk_elems = kChunkElems;
  h.seq = seq;
  h.base_seq = base ? seq : base_seq_;
  h.elem_count = elems_;
  h.raw_size = cfg_.size_bytes;
  h.payload_size = frame->size() - kFrameHeaderBytes;
  h.payload_crc = cfg_.payload_crc ? crc_ : 0;
  h.no_payload_crc = !cfg_.payload_crc;
  h.tagged = used == Codec::kLossless && !base && cfg_.sparse_chunks;
  write_frame_header(h, frame->data());
  if (base) base_seq_ = seq;
  need_base_ = false;
  next_seq_ = seq + 1;
  if (st) {
    st->seq = seq;
    st->base_seq = h.base_seq;
    st->is_base = base;
    st->codec = used;
    st->raw_bytes = cfg_.size_bytes;
    st->frame_bytes = frame->size();
    st->max_abs_error = max_err;
    st->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// DeltaDecoder

DeltaDecoder::DeltaDecoder(DType dtype, size_t size_bytes)
    : dtype_(dtype),
      size_(size_bytes),
      esize_(dtype_size(dtype)),
      elems_(size_bytes / esize_),
      window_log_max_(window_log_max(size_bytes, elems_)) {}

DeltaDecoder::~DeltaDecoder() {
  ZSTD_freeDCtx(dctx_);
  for (ZSTD_DCtx* d : extra_dctx_) ZSTD_freeDCtx(d);
}

std::unique_ptr<DeltaDecoder> DeltaDecoder::create(DType dtype, size_t size_bytes, std::string* err,
                                                   uint8_t* state) {
  const size_t es = dtype_size(dtype);
  if (es == 0) {
    *err = "DeltaDecoder: dtype " + std::to_string(int(dtype)) +
           ", expected kBytes, kF32, kF16 or kBF16";
    return nullptr;
  }
  if (size_bytes == 0 || size_bytes % es != 0) {
    *err = "DeltaDecoder: size_bytes " + std::to_string(size_bytes) +
           ", expected a positive multiple of the " + dtype_name(dtype) + " element size " +
           std::to_string(es);
    return nullptr;
  }
  std::unique_ptr<DeltaDecoder> d(new DeltaDecoder(dtype, size_bytes));
  if (state) {
    d->state_ = state;
  } else {
    d->own_state_ = make_big(size_bytes, true);  // zeroed
    d->state_ = d->own_state_.get();
  }
  d->dctx_ = ZSTD_createDCtx();
  if (d->dctx_) ZSTD_DCtx_setParameter(d->dctx_, ZSTD_d_windowLogMax, d->window_log_max_);
  if (!d->state_ || !d->dctx_) {
    *err = "DeltaDecoder: cannot allocate " + std::to_string(size_bytes) + " bytes";
    return nullptr;
  }
  return d;
}

bool DeltaDecoder::check(const uint8_t* frame, size_t n, FrameHeader* hp, uint64_t* content,
                         std::string* err) {
  FrameHeader& h = *hp;
  if (!parse_frame_header(frame, n, &h, err)) return false;
  auto fail = [&](const std::string& m) {
    *err = kPfx + m;
    return false;
  };
  // Against the registered buffer.
  if (h.dtype != dtype_)
    return fail(std::string("dtype ") + dtype_name(h.dtype) + ", this buffer is registered as " +
                dtype_name(dtype_));
  if (h.raw_size != size_)
    return fail("raw_size " + std::to_string(h.raw_size) + " bytes (elem_count " +
                std::to_string(h.elem_count) + "), this buffer is registered with " +
                std::to_string(size_) + " bytes (" + std::to_string(elems_) + " elements)");
  // The chain.
  if (h.base) {
    if (has_state_ && h.seq <= last_seq_)
      return fail("base seq " + std::to_string(h.seq) + " is not after the decoder's last seq " +
                  std::to_string(last_seq_) +
                  " (a base is accepted by an empty decoder or with seq > " +
                  std::to_string(last_seq_) + "; reset() to restart)");
  } else {
    if (!has_state_)
      return fail("delta seq " + std::to_string(h.seq) + " (base_seq " +
                  std::to_string(h.base_seq) +
                  ") but the decoder holds no chain: a chain starts with a base frame");
    if (h.base_seq != base_seq_)
      return fail("delta base_seq " + std::to_string(h.base_seq) +
                  " does not match the decoder's chain base " + std::to_string(base_seq_) +
                  " (a delta must name base_seq " + std::to_string(base_seq_) +
                  "; a new chain starts with a base frame)");
    if (last_seq_ == UINT64_MAX || h.seq != last_seq_ + 1)
      return fail("delta seq " + std::to_string(h.seq) +
                  " does not follow the decoder's last seq " + std::to_string(last_seq_) +
                  " (the next delta must have seq " + std::to_string(last_seq_ + 1) + ")");
  }
  // The payload.
  const uint8_t* payload = frame + kFrameHeaderBytes;
  const size_t psz = size_t(h.payload_size);
  const uint32_t crc = h.no_payload_crc ? 0 : crc32_of(0, payload, psz);
  if (!h.no_payload_crc && crc != h.payload_crc)
    return fail("payload CRC-32 " + hex32(crc) + " does not match the header's " +
                hex32(h.payload_crc) + ": the payload is corrupted");
  const bool lossy = h.codec == Codec::kLossyDynRange;
  // Tagged chunks: a u32 tag per chunk, and no chunk larger than its dense form.
  const uint64_t expected = lossy      ? lossy_content_bytes(elems_)
                            : h.tagged ? uint64_t(size_) + 4 * ceil_div(elems_, h.chunk_elems)
                                       : uint64_t(size_);
  const size_t fsz = ZSTD_findFrameCompressedSize(payload, psz);
  if (ZSTD_isError(fsz) || fsz != psz)
    return fail("the payload (" + std::to_string(psz) + " bytes) is not exactly one zstd frame (" +
                (ZSTD_isError(fsz) ? std::string(ZSTD_getErrorName(fsz))
                                   : "the first frame has " + std::to_string(fsz) + " bytes") +
                ")");
  const unsigned long long cs = ZSTD_getFrameContentSize(payload, psz);
  if (h.tagged) {
    if (cs == ZSTD_CONTENTSIZE_ERROR ||
        (cs != ZSTD_CONTENTSIZE_UNKNOWN &&
         (cs > expected || cs < 4 * ceil_div(elems_, h.chunk_elems))))
      return fail("zstd frame content size " +
                  (cs == ZSTD_CONTENTSIZE_ERROR ? std::string("unreadable") : std::to_string(cs)) +
                  ", expected unknown or " + std::to_string(4 * ceil_div(elems_, h.chunk_elems)) +
                  ".." + std::to_string(expected) + " bytes for " + std::to_string(elems_) + " " +
                  dtype_name(dtype_) + " elements in tagged chunks of " +
                  std::to_string(h.chunk_elems));
    *content = expected;
    return true;
  }
  if (cs != expected)
    return fail("zstd frame content size " +
                (cs == ZSTD_CONTENTSIZE_UNKNOWN ? std::string("unknown")
                 : cs == ZSTD_CONTENTSIZE_ERROR ? std::string("unreadable")
                                                : std::to_string(cs)) +
                ", expected " + std::to_string(expected) + " bytes for " + std::to_string(elems_) +
                " " + dtype_name(dtype_) + " elements (" + codec_name(h.codec) + ")");
  *content = expected;
  return true;
}

bool DeltaDecoder::apply(const uint8_t* frame, size_t n, std::string* err) {
  FrameHeader h;
  uint64_t expected = 0;
  if (!check(frame, n, &h, &expected, err)) return false;
  auto fail = [&](const std::string& m) {
    *err = kPfx + m;
    return false;
  };
  if (h.tagged) {
    // Tagged chunks have no fixed content size: decoded once to check every tag, count and
    // index (nothing written), then again into the state (one chunk of scratch either way).
    std::string why;
    if (!stream(frame, h, expected, false, &why)) return fail(why);
    if (!stream(frame, h, expected, true, &why)) {
      has_state_ = false;  // cannot happen: the same bytes passed the first decode
      return fail(why + " (found while decoding: the state was partly written and is discarded)");
    }
    has_state_ = true;
    last_seq_ = h.seq;
    base_seq_ = h.base_seq;
    return true;
  }
  const bool lossy = h.codec == Codec::kLossyDynRange;
  const uint8_t* payload = frame + kFrameHeaderBytes;
  const size_t psz = size_t(h.payload_size);
  // Sized from the registered buffer only.
  if (scratch_size_ < expected) {
    scratch_.reset(new (std::nothrow) uint8_t[expected]);
    scratch_size_ = scratch_ ? size_t(expected) : 0;
    if (!scratch_) return fail("cannot allocate " + std::to_string(expected) + " bytes");
  }
  const size_t got = ZSTD_decompressDCtx(dctx_, scratch_.get(), size_t(expected), payload, psz);
  if (ZSTD_isError(got) || got != expected)
    return fail(std::string("zstd: ") + (ZSTD_isError(got)
                                             ? ZSTD_getErrorName(got)
                                             : "decoded " + std::to_string(got) +
                                                   " bytes, expected " + std::to_string(expected)));
  const uint64_t chunk = h.chunk_elems;
  if (lossy) {
    // Check every scale and code before touching the state.
    size_t pos = 0;
    for (uint64_t off = 0; off < elems_; off += chunk) {
      const size_t m = size_t(std::min<uint64_t>(chunk, elems_ - off));
      const size_t nb = size_t(ceil_div(m, kLossyBlockElems));
      for (size_t b = 0; b < nb; ++b) {
        float s;
        std::memcpy(&s, scratch_.get() + pos + 4 * b, 4);
        if (!(s >= 0 && s <= FLT_MAX))
          return fail("lossy scale " + std::to_string(s) + " of block " +
                      std::to_string(off / kLossyBlockElems + b) +
                      ", expected a finite value >= 0");
      }
      const int8_t* codes = reinterpret_cast<const int8_t*>(scratch_.get() + pos + 4 * nb);
      bool bad = false;
      for (size_t j = 0; j < m; ++j) bad |= codes[j] == -128;
      if (bad) {
        size_t j = 0;
        while (codes[j] != -128) ++j;
        return fail("lossy code -128 at element " + std::to_string(off + j) +
                    ", expected -127..127");
      }
      pos += 4 * nb + m;
    }
  }
  // Everything checked: apply.
  size_t pos = 0;
  for (uint64_t off = 0; off < elems_; off += chunk) {
    const size_t m = size_t(std::min<uint64_t>(chunk, elems_ - off));
    uint8_t* st = state_ + off * esize_;
    if (lossy) {
      const size_t nb = size_t(ceil_div(m, kLossyBlockElems));
      const uint8_t* scales = scratch_.get() + pos;
      const int8_t* codes = reinterpret_cast<const int8_t*>(scales + 4 * nb);
      if (dtype_ == DType::kBF16)
        lossy_apply_chunk<true>(scales, codes, m, st);
      else
        lossy_apply_chunk<false>(scales, codes, m, st);
      pos += 4 * nb + m;
    } else {
      unshuffle_any(esize_, scratch_.get() + pos, m, !h.base, st);
      pos += m * esize_;
    }
  }
  has_state_ = true;
  last_seq_ = h.seq;
  base_seq_ = h.base_seq;
  return true;
}

bool DeltaDecoder::apply_streaming(const uint8_t* frame, size_t n, std::string* err) {
  FrameHeader h;
  uint64_t expected = 0;
  if (!check(frame, n, &h, &expected, err)) return false;
  std::string why;
  if (!stream(frame, h, expected, true, &why)) {
    *err = kPfx + why + " (found while decoding: the state was partly written and is discarded)";
    has_state_ = false;
    return false;
  }
  has_state_ = true;
  last_seq_ = h.seq;
  base_seq_ = h.base_seq;
  return true;
}

bool DeltaDecoder::stream(const uint8_t* frame, const FrameHeader& h, uint64_t expected, bool write,
                          std::string* why) {
  const bool lossy = h.codec == Codec::kLossyDynRange;
  const uint64_t chunk = h.chunk_elems;
  // One chunk, of at most the registered buffer's elements (not what the header says).
  const uint64_t cm = std::min<uint64_t>(chunk, elems_);
  const size_t chunk_bytes =
      lossy ? size_t(4 * ceil_div(cm, kLossyBlockElems) + cm) : size_t(cm * esize_);
  if (scratch_size_ < chunk_bytes) {
    scratch_.reset(new (std::nothrow) uint8_t[chunk_bytes]);
    scratch_size_ = scratch_ ? chunk_bytes : 0;
    if (!scratch_) {
      *why = "cannot allocate " + std::to_string(chunk_bytes) + " bytes";
      return false;
    }
  }
  size_t r = ZSTD_DCtx_reset(dctx_, ZSTD_reset_session_only);
  if (ZSTD_isError(r)) {
    *why = std::string("zstd: ") + ZSTD_getErrorName(r);
    return false;
  }
  ZSTD_inBuffer in{frame + kFrameHeaderBytes, size_t(h.payload_size), 0};
  r = 1;
  uint64_t done = 0;  // content bytes read
  uint8_t* buf = scratch_.get();
  for (uint64_t off = 0; off < elems_; off += chunk) {
    const size_t m = size_t(std::min<uint64_t>(chunk, elems_ - off));
    const size_t nb = size_t(ceil_div(m, kLossyBlockElems));
    const size_t want = lossy ? 4 * nb + m : m * esize_;
    uint8_t* st = state_ + off * esize_;
    if (h.tagged) {
      uint32_t tag = 0;
      if (!pull_tagged(dctx_, &in, buf, m, esize_, off, &done, &r, &tag, why)) return false;
      if (tag != kChunkDense) {
        if (!apply_sparse(buf, tag, m, esize_, write ? st : nullptr, false, off, why)) return false;
        continue;
      }
    } else {
      if (!pull_content(dctx_, &in, buf, want, done, expected, &r, why)) return false;
      done += want;
    }
    if (lossy) {
      const uint8_t* scales = buf;
      const int8_t* codes = reinterpret_cast<const int8_t*>(scales + 4 * nb);
      for (size_t b = 0; b < nb; ++b) {
        float sc;
        std::memcpy(&sc, scales + 4 * b, 4);
        if (!(sc >= 0 && sc <= FLT_MAX)) {
          *why = "lossy scale " + std::to_string(sc) + " of block " +
                 std::to_string(off / kLossyBlockElems + b) + ", expected a finite value >= 0";
          return false;
        }
      }
      bool bad = false;
      for (size_t j = 0; j < m; ++j) bad |= codes[j] == -128;
      if (bad) {
        size_t j = 0;
        while (codes[j] != -128) ++j;
        *why = "lossy code -128 at element " + std::to_string(off + j) + ", expected -127..127";
        return false;
      }
      if (!write) continue;
      if (dtype_ == DType::kBF16)
        lossy_apply_chunk<true>(scales, codes, m, st);
      else
        lossy_apply_chunk<false>(scales, codes, m, st);
    } else if (write) {
      if (!h.base) {
        // A sparse delta in the untagged layout: most chunks are all zero (nothing changed),
        // and XOR with 0 is a no-op.
        uint64_t acc = 0;
        size_t j = 0;
        for (; j + 8 <= want; j += 8) {
          uint64_t v;
          std::memcpy(&v, buf + j, 8);
          acc |= v;
        }
        for (; j < want; ++j) acc |= buf[j];
        if (acc == 0) continue;
      }
      unshuffle_any(esize_, buf, m, !h.base, st);
    }
  }
  return stream_ends(dctx_, &in, r, done, buf, why);
}

bool DeltaDecoder::apply_chain(const uint8_t* const* frames, const size_t* sizes, size_t count,
                               std::string* err, bool* writing) {
  if (writing) *writing = false;
  if (count == 0 || !frames || !sizes) {
    *err = std::string(kPfx) + "apply_chain: no frame (expected at least one)";
    return false;
  }
  // Every frame is checked, in chain order, before anything is written: check() reads the
  // chain position from has_state_/last_seq_/base_seq_, so they advance as each frame passes
  // and are put back afterwards.
  const bool had = has_state_;
  const uint64_t had_last = last_seq_, had_base = base_seq_;
  std::vector<FrameHeader> hs(count);
  std::vector<uint64_t> bound(count, 0);  // each frame's content bytes, at most
  bool fused = count > 1 && count <= kMaxFusedFrames;
  for (size_t k = 0; k < count; ++k) {
    const bool ok = check(frames[k], sizes[k], &hs[k], &bound[k], err);
    if (!ok) {
      *err = "chain frame " + std::to_string(k) + " of " + std::to_string(count) + ": " + *err;
      has_state_ = had;
      last_seq_ = had_last;
      base_seq_ = had_base;
      return false;
    }
    has_state_ = true;
    last_seq_ = hs[k].seq;
    base_seq_ = hs[k].base_seq;
    fused = fused && hs[k].codec == Codec::kLossless && hs[k].chunk_elems == hs[0].chunk_elems &&
            (k == 0 || !hs[k].base);
  }
  has_state_ = had;
  last_seq_ = had_last;
  base_seq_ = had_base;
  if (writing) *writing = true;
  if (!fused) {
    // Lossy deltas add in float32 and a base mid-chain restarts it: one frame at a time.
    for (size_t k = 0; k < count; ++k)
      if (!apply_streaming(frames[k], sizes[k], err)) return false;
    return true;
  }
  auto fail = [&](size_t k, const std::string& m) {
    *err = kPfx +
           ("chain frame " + std::to_string(k) + " (seq " + std::to_string(hs[k].seq) + "): " + m +
            " (found while decoding: the state was partly written and is "
            "discarded)");
    has_state_ = false;
    return false;
  };
  // Lossless frames XOR the previous snapshot's bits and shuffle them by the same permutation
  // (chunk_elems), so per chunk the frames' decoded contents XOR together in the shuffled
  // domain and the state is written once: one pass over it for the whole chain, not one per
  // frame.
  const uint64_t chunk = hs[0].chunk_elems;
  const size_t chunk_bytes = size_t(std::min<uint64_t>(chunk, elems_) * esize_);
  if (scratch_size_ < 2 * chunk_bytes) {
    scratch_.reset(new (std::nothrow) uint8_t[2 * chunk_bytes]);
    scratch_size_ = scratch_ ? 2 * chunk_bytes : 0;
    if (!scratch_) {
      *err = std::string(kPfx) + "cannot allocate " + std::to_string(2 * chunk_bytes) + " bytes";
      return false;
    }
  }
  while (extra_dctx_.size() + 1 < count) {
    ZSTD_DCtx* d = ZSTD_createDCtx();
    if (d) ZSTD_DCtx_setParameter(d, ZSTD_d_windowLogMax, window_log_max_);
    if (!d) {
      *err = std::string(kPfx) + "cannot allocate a zstd decompression context";
      return false;
    }
    extra_dctx_.push_back(d);
  }
  std::vector<ZSTD_inBuffer> in(count);
  std::vector<size_t> r(count, 1);
  std::vector<uint64_t> done(count, 0);  // content bytes read, per frame
  for (size_t k = 0; k < count; ++k) {
    ZSTD_DCtx* d = k ? extra_dctx_[k - 1] : dctx_;
    const size_t rr = ZSTD_DCtx_reset(d, ZSTD_reset_session_only);
    if (ZSTD_isError(rr)) return fail(k, std::string("zstd: ") + ZSTD_getErrorName(rr));
    in[k] = ZSTD_inBuffer{frames[k] + kFrameHeaderBytes, size_t(hs[k].payload_size), 0};
  }
  uint8_t* acc = scratch_.get();
  uint8_t* tmp = acc + chunk_bytes;
  std::string why;
  for (uint64_t off = 0; off < elems_; off += chunk) {
    const size_t m = size_t(std::min<uint64_t>(chunk, elems_ - off));
    const size_t want = m * esize_;
    for (size_t k = 0; k < count; ++k) {
      ZSTD_DCtx* d = k ? extra_dctx_[k - 1] : dctx_;
      if (!hs[k].tagged) {
        if (!pull_content(d, &in[k], k ? tmp : acc, want, done[k], bound[k], &r[k], &why))
          return fail(k, why);
        done[k] += want;
        if (k) xor_into(acc, tmp, want);
        continue;
      }
      uint32_t tag = 0;
      if (!pull_tagged(d, &in[k], tmp, m, esize_, off, &done[k], &r[k], &tag, &why))
        return fail(k, why);
      if (tag == kChunkDense) {
        if (k)
          xor_into(acc, tmp, want);
        else
          std::memcpy(acc, tmp, want);
        continue;
      }
      // A sparse chunk: its entries XOR straight into the shuffled chunk.
      if (k == 0) std::memset(acc, 0, want);
      if (!apply_sparse(tmp, tag, m, esize_, acc, true, off, &why)) return fail(k, why);
    }
    unshuffle_any(esize_, acc, m, !hs[0].base, state_ + off * esize_);
  }
  for (size_t k = 0; k < count; ++k)
    if (!stream_ends(k ? extra_dctx_[k - 1] : dctx_, &in[k], r[k], done[k], tmp, &why))
      return fail(k, why);
  has_state_ = true;
  last_seq_ = hs[count - 1].seq;
  base_seq_ = hs[count - 1].base_seq;
  return true;
}

}  // namespace r2ccl::snap
