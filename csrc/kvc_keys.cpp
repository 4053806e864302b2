// BLAKE2b (RFC 7693, written from the RFC's description) and the chunk-key chain; see kvc_keys.h.
#include "kvc_keys.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVC_HAVE_AVX2_PATH 1
#endif

namespace kvc {
namespace {

constexpr uint64_t kIV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

// The message schedule of each round (rounds 10 and 11 repeat rounds 0 and 1).
constexpr uint8_t kSigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

constexpr size_t kBlock = 128;
constexpr uint8_t kTagU32 = 0x04;  // kvcache.keys._TAG_U32

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // every supported platform is little-endian (as kvcache.keys assumes)
  return v;
}

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define KVC_G(a, b, c, d, x, y) \
  do {                          \
    a = a + b + (x);            \
    d = rotr(d ^ a, 32);        \
    c = c + d;                  \
    b = rotr(b ^ c, 24);        \
    a = a + b + (y);            \
    d = rotr(d ^ a, 16);        \
    c = c + d;                  \
    b = rotr(b ^ c, 63);        \
  } while (0)

class Blake2b16 {
 public:
  explicit Blake2b16(const uint8_t person[16]) {
    for (int i = 0; i < 8; ++i) h_[i] = kIV[i];
    h_[0] ^= 0x01010000ULL ^ kKeyBytes;  // fanout 1, depth 1, no key, 16-byte digest
    h_[6] ^= load64(person);
    h_[7] ^= load64(person + 8);
  }

  void update(const uint8_t* p, size_t n) {
    while (n > 0) {
      if (fill_ == kBlock) {  // a full block with more to come: not the last one
        counted_ += kBlock;
        compress(buf_, false);
        fill_ = 0;
      }
      if (fill_ == 0) {
        while (n > kBlock) {  // whole blocks straight from the input, the last one kept back
          counted_ += kBlock;
          compress(p, false);
          p += kBlock;
          n -= kBlock;
        }
      }
      size_t take = kBlock - fill_ < n ? kBlock - fill_ : n;
      std::memcpy(buf_ + fill_, p, take);
      fill_ += take;
      p += take;
      n -= take;
    }
  }

  Digest digest() {
    counted_ += fill_;
    std::memset(buf_ + fill_, 0, kBlock - fill_);
    compress(buf_, true);
    Digest out;
    std::memcpy(out.b, h_, kKeyBytes);
    return out;
  }

 private:
  void compress(const uint8_t* block, bool last) {
    uint64_t m[16];
    for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
    uint64_t v[16];
    for (int i = 0; i < 8; ++i) {
      v[i] = h_[i];
      v[i + 8] = kIV[i];
    }
    v[12] ^= counted_;  // the byte counter's high word stays 0: a chunk is far below 2**64 bytes
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; ++r) {
      const uint8_t* s = kSigma[r % 10];
      KVC_G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
      KVC_G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
      KVC_G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
      KVC_G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
      KVC_G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
      KVC_G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
      KVC_G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
      KVC_G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h_[i] ^= v[i] ^ v[i + 8];
  }

  uint64_t h_[8];
  uint64_t counted_ = 0;
  uint8_t buf_[kBlock];
  size_t fill_ = 0;
};

#undef KVC_G

Digest chunk_digest(const uint8_t person[16], const Digest& prev, const uint8_t* chunk, size_t bytes) {
  Blake2b16 h(person);
  h.update(prev.b, kKeyBytes);
  h.update(&kTagU32, 1);
  h.update(chunk, bytes);
  return h.digest();
}

#if KVC_HAVE_AVX2_PATH
// Four messages of one length hashed side by side, one per 64-bit lane of the AVX2
// registers: the chunks of a scheduler step's prompts follow the same head digest and do
// not depend on each other, so a step hashes four at a time.
#define KVC_G4(a, b, c, d, x, y)                                         \
  do {                                                                   \
    a = _mm256_add_epi64(_mm256_add_epi64(a, b), x);                     \
    d = _mm256_shuffle_epi32(_mm256_xor_si256(d, a), _MM_SHUFFLE(2, 3, 0, 1)); \
    c = _mm256_add_epi64(c, d);                                          \
    b = _mm256_shuffle_epi8(_mm256_xor_si256(b, c), rot24);              \
    a = _mm256_add_epi64(_mm256_add_epi64(a, b), y);                     \
    d = _mm256_shuffle_epi8(_mm256_xor_si256(d, a), rot16);              \
    c = _mm256_add_epi64(c, d);                                          \
    b = _mm256_xor_si256(b, c);                                          \
    b = _mm256_or_si256(_mm256_srli_epi64(b, 63), _mm256_add_epi64(b, b)); \
  } while (0)

__attribute__((target("avx2"))) void blake2b_16_x4(const uint8_t person[16], const uint8_t* const msg[4],
                                                   size_t len, Digest out[4]) {
  const __m256i rot24 = _mm256_setr_epi8(3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10, 3, 4, 5,
                                         6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10);
  const __m256i rot16 = _mm256_setr_epi8(2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9, 2, 3, 4,
                                         5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9);
  __m256i h[8];
  for (int i = 0; i < 8; ++i) {
    uint64_t w = kIV[i];
    if (i == 0) w ^= 0x01010000ULL ^ kKeyBytes;
    if (i == 6) w ^= load64(person);
    if (i == 7) w ^= load64(person + 8);
    h[i] = _mm256_set1_epi64x(static_cast<long long>(w));
  }
  const size_t blocks = len == 0 ? 1 : (len + kBlock - 1) / kBlock;
  uint8_t tail[4][kBlock];
  for (size_t k = 0; k < blocks; ++k) {
    const bool last = k + 1 == blocks;
    const uint8_t* p[4];
    for (int j = 0; j < 4; ++j) {
      p[j] = msg[j] + k * kBlock;
      if (last) {  // the last block, zero-padded
        const size_t rest = len - k * kBlock;
        std::memset(tail[j], 0, kBlock);
        std::memcpy(tail[j], p[j], rest);
        p[j] = tail[j];
      }
    }
    __m256i m[16];
    for (int w = 0; w < 16; ++w) {
      m[w] = _mm256_set_epi64x(static_cast<long long>(load64(p[3] + 8 * w)),
                               static_cast<long long>(load64(p[2] + 8 * w)),
                               static_cast<long long>(load64(p[1] + 8 * w)),
                               static_cast<long long>(load64(p[0] + 8 * w)));
    }
    const uint64_t counted = last ? len : (k + 1) * kBlock;
    __m256i v[16];
    for (int i = 0; i < 8; ++i) {
      v[i] = h[i];
      v[i + 8] = _mm256_set1_epi64x(static_cast<long long>(kIV[i]));
    }
    v[12] = _mm256_xor_si256(v[12], _mm256_set1_epi64x(static_cast<long long>(counted)));
    if (last) v[14] = _mm256_xor_si256(v[14], _mm256_set1_epi64x(-1));
    for (int r = 0; r < 12; ++r) {
      const uint8_t* s = kSigma[r % 10];
      KVC_G4(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
      KVC_G4(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
      KVC_G4(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
      KVC_G4(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
      KVC_G4(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
      KVC_G4(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
      KVC_G4(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
      KVC_G4(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h[i] = _mm256_xor_si256(h[i], _mm256_xor_si256(v[i], v[i + 8]));
  }
  alignas(32) uint64_t w0[4], w1[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w0), h[0]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(w1), h[1]);
  for (int j = 0; j < 4; ++j) {
    std::memcpy(out[j].b, &w0[j], 8);
    std::memcpy(out[j].b + 8, &w1[j], 8);
  }
}

#undef KVC_G4

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

// One chain step to take: the chunk at `chunk`, after the digest `prev`, into `out`.
struct Step {
  const Digest* prev;
  const uint8_t* chunk;
  Digest* out;
  size_t prompt;
};

// Hash the steps, four at a time where the CPU allows: each message is the previous digest,
// the uint32 tag and the chunk, laid out contiguously.
void take_steps(const uint8_t person[16], const std::vector<Step>& steps, size_t chunk_bytes,
                std::vector<uint8_t>& scratch) {
  const size_t len = kKeyBytes + 1 + chunk_bytes;
  size_t i = 0;
#if KVC_HAVE_AVX2_PATH
  if (steps.size() >= 2 && has_avx2()) {
    scratch.resize(4 * len);
    for (; i < steps.size(); i += 4) {
      const uint8_t* msg[4];
      Digest out[4];
      for (int j = 0; j < 4; ++j) {
        const Step& st = steps[i + j < steps.size() ? i + j : i];  // a short group repeats its first
        uint8_t* m = scratch.data() + j * len;
        std::memcpy(m, st.prev->b, kKeyBytes);
        m[kKeyBytes] = kTagU32;
        std::memcpy(m + kKeyBytes + 1, st.chunk, chunk_bytes);
        msg[j] = m;
      }
      blake2b_16_x4(person, msg, len, out);
      for (size_t j = 0; j < 4 && i + j < steps.size(); ++j) *steps[i + j].out = out[j];
    }
    return;
  }
#endif
  for (; i < steps.size(); ++i) *steps[i].out = chunk_digest(person, *steps[i].prev, steps[i].chunk, chunk_bytes);
}

}  // namespace

Digest blake2b_16(const uint8_t person[16], const std::vector<PackedIds>& parts) {
  Blake2b16 h(person);
  for (const PackedIds& p : parts) h.update(p.data, p.bytes);
  return h.digest();
}

void chain_keys_u32(const Digest& root, const uint8_t person[16], const std::vector<PackedIds>& prompts,
                    size_t chunk_bytes, std::vector<std::vector<Digest>>& digests,
                    std::vector<size_t>& shared) {
  const size_t n = prompts.size();
  digests.assign(n, {});
  shared.assign(n, 0);
  if (chunk_bytes == 0) return;
  std::vector<size_t> known(n, 0);  // leading digests of each prompt known so far
  for (size_t i = 0; i < n; ++i) {
    const size_t chunks = prompts[i].bytes / chunk_bytes;
    digests[i].resize(chunks);
    if (i == 0) continue;
    const size_t limit = chunks < digests[i - 1].size() ? chunks : digests[i - 1].size();
    const uint8_t* a = prompts[i].data;
    const uint8_t* b = prompts[i - 1].data;
    size_t same = 0;  // the head it shares with the prompt before: copied, never hashed again
    while (same < limit && std::memcmp(a + same * chunk_bytes, b + same * chunk_bytes, chunk_bytes) == 0) ++same;
    shared[i] = same;
  }
  // Waves: in each, every prompt whose next chunk can be hashed (its previous digest known)
  // takes one step, and the steps of a wave are hashed together. A shared head is copied
  // from the prompt before as soon as that one knows it.
  std::vector<Step> steps;
  std::vector<uint8_t> scratch;
  for (;;) {
    steps.clear();
    for (size_t i = 0; i < n; ++i) {
      std::vector<Digest>& d = digests[i];
      while (known[i] < shared[i] && known[i] < known[i - 1]) {
        d[known[i]] = digests[i - 1][known[i]];
        ++known[i];
      }
      if (known[i] >= shared[i] && known[i] < d.size()) {
        steps.push_back({known[i] == 0 ? &root : &d[known[i] - 1],
                         prompts[i].data + known[i] * chunk_bytes, &d[known[i]], i});
      }
    }
    if (steps.empty()) break;
    take_steps(person, steps, chunk_bytes, scratch);
    for (const Step& st : steps) ++known[st.prompt];
  }
}

}  // namespace kvc
