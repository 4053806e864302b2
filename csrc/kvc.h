// kvcache native core: a plain C++ API shared by the CPU twin, the CUDA kernels and
// the pybind11 module. Nothing here knows torch: tensors arrive as raw addresses.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc {

// KVFormat ids, expanded from the one layout table.
enum class Format : int {
#define KVC_LAYOUT(NAME, ID, KV, DEPTH, RANK, NTENSORS, TENSOR, OFFSET, STRIDE) NAME = ID,
#include "layouts.def"
#undef KVC_LAYOUT
};

struct LayoutInfo {
  const char* name;
  int id;
  int kv;        // 2 = K and V, 1 = MLA latent
  int depth;     // Python list nesting of the engine object
  int rank;      // rank of each tensor
};

// Rows of layouts.def in table order.
const std::vector<LayoutInfo>& layout_table();
const LayoutInfo& layout_info(int fmt);  // throws std::invalid_argument on unknown id

// Where the pages of (layer, kv) live: index of the tensor and page offset of block 0.
struct PagePlacement {
  int64_t tensor;
  int64_t offset_pages;
};

// Evaluates the table for concrete sizes; entry l * kv + k.
std::vector<PagePlacement> page_placements(int fmt, int64_t num_layers, int64_t num_blocks,
                                           int64_t* stride_pages_out);
int64_t expected_num_tensors(int fmt, int64_t num_layers);

// Resolved addresses of one registered engine cache, built once at registration.
struct PageTable {
  int fmt = 0;
  int64_t num_layers = 0;
  int64_t kv = 0;
  int64_t num_blocks = 0;
  int64_t page_bytes = 0;          // block_size * heads * head_size * element size
  int64_t block_stride_bytes = 0;  // bytes between consecutive block ids
  std::vector<uint64_t> base;      // [num_layers * kv] address of block 0's page of (l, k)
};

// tensor_bytes[i] is the size of tensor i from tensor_ptrs[i]: every page the table can
// address, for every (layer, kv) and block id in [0, num_blocks), must lie inside its own
// tensor's bytes, or this throws std::invalid_argument. The caller checks the same at
// registration; this is the native copy's own guard (defence in depth).
PageTable make_page_table(int fmt, int64_t num_layers, int64_t num_blocks, int64_t page_bytes,
                          const std::vector<uint64_t>& tensor_ptrs,
                          const std::vector<int64_t>& tensor_bytes);

// One copy request. Chunks hold [kv, num_layers, tokens, heads*head_size]; chunk c takes
// block ids [c * blocks_per_chunk, ...), every chunk but the last holds blocks_per_chunk
// blocks, the last holds last_chunk_blocks. The first skip_blocks ids are left alone.
struct TransferSpec {
  const int64_t* block_ids = nullptr;  // [n_blocks], host memory
  int64_t n_blocks = 0;
  const uint64_t* chunk_ptrs = nullptr;  // [n_chunks], host memory
  int64_t n_chunks = 0;
  int64_t blocks_per_chunk = 0;
  int64_t last_chunk_blocks = 0;
  int64_t skip_blocks = 0;
  bool to_chunks = true;  // engine -> chunks (store) or chunks -> engine (retrieve)
};

// Raised when a block id is outside [0, num_blocks); carries the position and the id.
class BlockIdOutOfRange : public std::out_of_range {
 public:
  BlockIdOutOfRange(int64_t position, int64_t block_id, int64_t num_blocks);
  int64_t position;
  int64_t block_id;
};

// Checks sizes and every block id; throws before any byte moves.
void validate(const PageTable& table, const TransferSpec& spec);

// CPU twin: OpenMP over (layer, kv, run of consecutive ids), one memcpy per run.
void cpu_copy(const PageTable& table, const TransferSpec& spec, int num_threads);

// The CUDA kernel's body (kvc_page.h) run over its launch grid on the host, thread by
// thread, with the launcher's word size: the kernel's arithmetic checked on a CPU. Slow;
// for tests. Returns the word size used (16, 4, 2 or 1 bytes).
int emulate_kernel(const PageTable& table, const TransferSpec& spec);

// The CPU ceiling: the same bytes moved by plain memcpy with the same threads.
void parallel_memcpy(uint64_t dst, uint64_t src, int64_t nbytes, int num_threads);

// Largest copy unit (16, 4, 2 or 1 bytes) that divides the page and every address.
int copy_unit_bytes(const PageTable& table, const uint64_t* chunk_ptrs, int64_t n_chunks);

}  // namespace kvc
