// Chunk keys in native code: BLAKE2b (RFC 7693) and the key chain of kvcache.keys, for the
// daemon's batched lookup (one call hashes every prompt of a scheduler step).
//
// The chain is the one kvcache/keys.py defines, byte for byte: a chunk's digest is BLAKE2b
// with a 16-byte digest and the personalisation "kvcache-chunk-v1" over the previous digest
// (the root digest for the first chunk), the uint32 tag byte and the chunk's token ids as
// little-endian uint32. tests/test_keys.py checks it against hashlib on random prompts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvc {

constexpr size_t kKeyBytes = 16;

struct Digest {
  uint8_t b[kKeyBytes];
};

// One prompt's packed uint32 ids: only its whole chunks are hashed.
struct PackedIds {
  const uint8_t* data;
  size_t bytes;
};

// The keys of a run of prompts of one key scope, in order: digests[i] holds prompt i's
// whole-chunk digests, and shared[i] how many leading chunks it has in common with prompt
// i - 1 (those digests are copied, not hashed again). `chunk_bytes` is chunk_size * 4.
void chain_keys_u32(const Digest& root, const uint8_t person[16], const std::vector<PackedIds>& prompts,
                    size_t chunk_bytes, std::vector<std::vector<Digest>>& digests,
                    std::vector<size_t>& shared);

// BLAKE2b of `parts` concatenated, unkeyed, with a 16-byte digest and the given
// personalisation (the only form the chain uses; exposed for the test against hashlib).
Digest blake2b_16(const uint8_t person[16], const std::vector<PackedIds>& parts);

}  // namespace kvc
