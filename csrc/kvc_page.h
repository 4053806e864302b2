// Per-page address arithmetic and the per-page copy body, shared by the CUDA kernel, the
// CPU twin and the host-side emulation of the kernel.
//
// Separate from kvc.h because nvcc compiles it for the device as well: everything here is
// __host__ __device__ (plain inline on a host-only build). With the arithmetic in one
// place, the CPU tests exercise the kernel's own offsets, and the emulation
// (emulate_kernel in kvc_cpu.cpp) runs the kernel's body over its grid on the CPU.
// Where a layout puts block 0 of (layer, kv) and the stride between block ids come from
// layouts.def through the PageTable; this file only walks those addresses.
#pragma once

#include <cstdint>

#include "kvc.h"

#if defined(__CUDACC__)
#define KVC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVC_HOST_DEVICE inline
#endif

namespace kvc {

// The sizes the arithmetic needs besides the three address arrays; plain values, so a
// kernel takes it by value.
struct CopyGeometry {
  int64_t num_layers;
  int64_t kv;
  int64_t blocks_per_chunk;
  int64_t last_chunk_blocks;
  int64_t n_chunks;
  int64_t block_stride_bytes;
  int64_t page_bytes;
};

inline CopyGeometry copy_geometry(const PageTable& t, const TransferSpec& s) {
  return CopyGeometry{t.num_layers,  t.kv,         s.blocks_per_chunk,   s.last_chunk_blocks,
                      s.n_chunks,    t.block_stride_bytes, t.page_bytes};
}

// Where one page starts on both sides.
struct PagePair {
  char* engine;
  char* chunk;
};

// Page of block-list position j and pair lk = layer * kv + k: the engine page of block
// block_ids[j], and its slot in chunk j / blocks_per_chunk ([kv, NL, T, NH*HS]).
KVC_HOST_DEVICE PagePair page_pair(const uint64_t* page_base,   // [num_layers * kv]
                                   const int64_t* block_ids,    // [n_blocks]
                                   const uint64_t* chunk_ptrs,  // [n_chunks]
                                   const CopyGeometry& g, int64_t j, int64_t lk) {
  const int64_t l = lk / g.kv;
  const int64_t k = lk % g.kv;
  const int64_t c = j / g.blocks_per_chunk;
  const int64_t in_chunk = j % g.blocks_per_chunk;
  const int64_t chunk_blocks = (c == g.n_chunks - 1) ? g.last_chunk_blocks : g.blocks_per_chunk;
  PagePair p;
  p.engine = reinterpret_cast<char*>(page_base[lk]) + block_ids[j] * g.block_stride_bytes;
  p.chunk = reinterpret_cast<char*>(chunk_ptrs[c]) +
            ((k * g.num_layers + l) * chunk_blocks + in_chunk) * g.page_bytes;
  return p;
}

// Streaming loads/stores (evict-first) on the device: chunk traffic is touched once, so it
// stays out of the L2 where the engine's working set lives. Plain on the host.
template <typename T>
KVC_HOST_DEVICE T load_word(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldcs(p);
#else
  return *p;
#endif
}

template <typename T>
KVC_HOST_DEVICE void store_word(T* p, T v) {
#if defined(__CUDA_ARCH__)
  __stcs(p, v);
#else
  *p = v;
#endif
}

// The kernel's body: thread `tid` of `nthreads` moves words tid, tid + nthreads, ... of
// one page, each word of type Word (16, 4, 2 or 1 bytes).
// Measured on an H200 (docs/benchmarks.md, 2026-11-26): 0.85-0.87x of a device memcpy and
// 0.92-0.95x of pinned cudaMemcpyAsync by device time. Unrolling 2, 4 or 8 words per thread
// (loads before stores) and 128 or 512 threads per page were each slower or equal; the
// figures only looked better by the host's clock, which the submit dominated.
template <typename Word, bool kToChunks>
KVC_HOST_DEVICE void copy_page_part(const PagePair& p, int64_t page_bytes, int64_t tid,
                                    int64_t nthreads) {
  const Word* src = reinterpret_cast<const Word*>(kToChunks ? p.engine : p.chunk);
  Word* dst = reinterpret_cast<Word*>(kToChunks ? p.chunk : p.engine);
  const int64_t n = page_bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t i = tid; i < n; i += nthreads) store_word(dst + i, load_word(src + i));
}

// The launch shape: grid (blocks to copy, num_layers * kv), one page per CUDA block,
// threads per block = page words clamped to [32, 256].
struct LaunchShape {
  int64_t grid_x;
  int64_t grid_y;
  int64_t threads;
};

inline LaunchShape launch_shape(const PageTable& t, const TransferSpec& s, int unit) {
  const int64_t words = t.page_bytes / unit;
  const int64_t threads = words < 32 ? 32 : (words > 256 ? 256 : words);
  return LaunchShape{s.n_blocks - s.skip_blocks, t.num_layers * t.kv, threads};
}

}  // namespace kvc
