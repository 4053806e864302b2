// Layout table evaluation, validation and the CPU twin of the transfer kernels.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "kvc.h"
#include "kvc_page.h"

namespace kvc {

const std::vector<LayoutInfo>& layout_table() {
  static const std::vector<LayoutInfo> rows = {
#define KVC_LAYOUT(NAME, ID, KV, DEPTH, RANK, NTENSORS, TENSOR, OFFSET, STRIDE) \
  {#NAME, ID, KV, DEPTH, RANK},
#include "layouts.def"
#undef KVC_LAYOUT
  };
  return rows;
}

const LayoutInfo& layout_info(int fmt) {
  for (const auto& row : layout_table()) {
    if (row.id == fmt) return row;
  }
  throw std::invalid_argument("unknown KV layout id " + std::to_string(fmt));
}

int64_t expected_num_tensors(int fmt, int64_t num_layers) {
  const int64_t NL = num_layers;
  (void)NL;
  switch (static_cast<Format>(fmt)) {
#define KVC_LAYOUT(NAME, ID, KV, DEPTH, RANK, NTENSORS, TENSOR, OFFSET, STRIDE) \
  case Format::NAME:                                                            \
    return (NTENSORS);
#include "layouts.def"
#undef KVC_LAYOUT
  }
  throw std::invalid_argument("unknown KV layout id " + std::to_string(fmt));
}

std::vector<PagePlacement> page_placements(int fmt, int64_t num_layers, int64_t num_blocks,
                                           int64_t* stride_pages_out) {
  const int64_t NL = num_layers;
  const int64_t NB = num_blocks;
  (void)NB;
  const int64_t kv = layout_info(fmt).kv;
  std::vector<PagePlacement> out(static_cast<size_t>(NL * kv));
  int64_t stride = 0;
  switch (static_cast<Format>(fmt)) {
#define KVC_LAYOUT(NAME, ID, KV, DEPTH, RANK, NTENSORS, TENSOR, OFFSET, STRIDE) \
  case Format::NAME:                                                            \
    for (int64_t l = 0; l < NL; ++l) {                                          \
      for (int64_t k = 0; k < kv; ++k) {                                        \
        out[l * kv + k] = PagePlacement{(TENSOR), (OFFSET)};                    \
      }                                                                         \
    }                                                                           \
    stride = (STRIDE);                                                          \
    break;
#include "layouts.def"
#undef KVC_LAYOUT
  }
  if (stride_pages_out != nullptr) *stride_pages_out = stride;
  return out;
}

namespace {

// The end (exclusive, in bytes from the tensor's start) of the last page of (l, k):
// (offset + (num_blocks - 1) * stride + 1) pages, computed without int64 overflow.
// Returns false when that end cannot be represented (it then lies outside any tensor).
bool last_page_end(int64_t offset_pages, int64_t stride_pages, int64_t num_blocks,
                   int64_t page_bytes, int64_t* end_bytes) {
  int64_t pages = 0;
  if (offset_pages < 0 || stride_pages < 0 ||
      __builtin_mul_overflow(num_blocks - 1, stride_pages, &pages) ||
      __builtin_add_overflow(pages, offset_pages + 1, &pages)) {
    return false;
  }
  return !__builtin_mul_overflow(pages, page_bytes, end_bytes);
}

}  // namespace

PageTable make_page_table(int fmt, int64_t num_layers, int64_t num_blocks, int64_t page_bytes,
                          const std::vector<uint64_t>& tensor_ptrs,
                          const std::vector<int64_t>& tensor_bytes) {
  if (num_layers <= 0 || num_blocks <= 0 || page_bytes <= 0) {
    throw std::invalid_argument("num_layers, num_blocks and page_bytes must be positive");
  }
  const int64_t want = expected_num_tensors(fmt, num_layers);
  if (static_cast<int64_t>(tensor_ptrs.size()) != want ||
      tensor_bytes.size() != tensor_ptrs.size()) {
    std::ostringstream msg;
    msg << "layout " << layout_info(fmt).name << " with " << num_layers << " layers needs "
        << want << " tensors, got " << tensor_ptrs.size() << " addresses and "
        << tensor_bytes.size() << " sizes";
    throw std::invalid_argument(msg.str());
  }
  PageTable t;
  t.fmt = fmt;
  t.num_layers = num_layers;
  t.kv = layout_info(fmt).kv;
  t.num_blocks = num_blocks;
  t.page_bytes = page_bytes;
  int64_t stride_pages = 0;
  const auto places = page_placements(fmt, num_layers, num_blocks, &stride_pages);
  t.block_stride_bytes = stride_pages * page_bytes;
  t.base.resize(places.size());
  for (size_t i = 0; i < places.size(); ++i) {
    const auto tensor = static_cast<size_t>(places[i].tensor);
    int64_t end = 0;
    if (tensor >= tensor_bytes.size() ||
        !last_page_end(places[i].offset_pages, stride_pages, num_blocks, page_bytes, &end) ||
        end > tensor_bytes[tensor]) {
      std::ostringstream msg;
      msg << "layout " << layout_info(fmt).name << ": the pages of layer "
          << static_cast<int64_t>(i) / t.kv << " kv " << static_cast<int64_t>(i) % t.kv
          << " would reach byte " << end << " of tensor " << tensor << ", which holds "
          << (tensor < tensor_bytes.size() ? tensor_bytes[tensor] : 0) << " bytes";
      throw std::invalid_argument(msg.str());
    }
    t.base[i] = tensor_ptrs[static_cast<size_t>(places[i].tensor)] +
                static_cast<uint64_t>(places[i].offset_pages * page_bytes);
  }
  return t;
}

static std::string out_of_range_message(int64_t position, int64_t block_id, int64_t nb) {
  std::ostringstream msg;
  msg << "block id " << block_id << " at position " << position << " is outside [0, " << nb
      << ")";
  return msg.str();
}

BlockIdOutOfRange::BlockIdOutOfRange(int64_t pos, int64_t id, int64_t nb)
    : std::out_of_range(out_of_range_message(pos, id, nb)), position(pos), block_id(id) {}

void validate(const PageTable& table, const TransferSpec& spec) {
  if (spec.n_blocks < 0 || spec.n_chunks <= 0 || spec.blocks_per_chunk <= 0) {
    throw std::invalid_argument("empty transfer: need at least one chunk and block");
  }
  if (spec.last_chunk_blocks <= 0 || spec.last_chunk_blocks > spec.blocks_per_chunk) {
    throw std::invalid_argument("last_chunk_blocks must be in [1, blocks_per_chunk]");
  }
  const int64_t covered = (spec.n_chunks - 1) * spec.blocks_per_chunk + spec.last_chunk_blocks;
  if (covered != spec.n_blocks) {
    std::ostringstream msg;
    msg << spec.n_chunks << " chunks hold " << covered << " blocks but " << spec.n_blocks
        << " block ids were given";
    throw std::invalid_argument(msg.str());
  }
  if (spec.skip_blocks < 0 || spec.skip_blocks > spec.n_blocks) {
    throw std::invalid_argument("skip_blocks must be in [0, number of block ids]");
  }
  for (int64_t j = 0; j < spec.n_blocks; ++j) {
    const int64_t id = spec.block_ids[j];
    if (id < 0 || id >= table.num_blocks) throw BlockIdOutOfRange(j, id, table.num_blocks);
  }
}

namespace {

// A run of block-list positions [start, start + length) inside one chunk whose engine
// pages are adjacent, so one memcpy moves all of them.
struct Run {
  int64_t start;
  int64_t length;
};

std::vector<Run> find_runs(const PageTable& table, const TransferSpec& spec) {
  std::vector<Run> runs;
  const bool pages_adjacent = table.block_stride_bytes == table.page_bytes;
  int64_t j = spec.skip_blocks;
  while (j < spec.n_blocks) {
    const int64_t chunk_end = std::min(spec.n_blocks, (j / spec.blocks_per_chunk + 1) *
                                                          spec.blocks_per_chunk);
    int64_t end = j + 1;
    if (pages_adjacent) {
      while (end < chunk_end && spec.block_ids[end] == spec.block_ids[end - 1] + 1) ++end;
    }
    runs.push_back(Run{j, end - j});
    j = end;
  }
  return runs;
}

}  // namespace

void cpu_copy(const PageTable& table, const TransferSpec& spec, int num_threads) {
  validate(table, spec);
  const std::vector<Run> runs = find_runs(table, spec);
  const int64_t lk_count = table.num_layers * table.kv;
  const int64_t n_runs = static_cast<int64_t>(runs.size());
  const int64_t tasks = lk_count * n_runs;
  const CopyGeometry g = copy_geometry(table, spec);
  if (num_threads <= 0) num_threads = omp_get_max_threads();

#pragma omp parallel for schedule(static) num_threads(num_threads) if (tasks > 1)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t lk = t / n_runs;
    const Run run = runs[static_cast<size_t>(t % n_runs)];
    // The kernel's own arithmetic for the run's first page; the rest of the run follows
    // it on both sides (consecutive slots of one chunk, adjacent engine pages).
    const PagePair p = page_pair(table.base.data(), spec.block_ids, spec.chunk_ptrs, g, run.start, lk);
    const size_t nbytes = static_cast<size_t>(run.length * table.page_bytes);
    if (spec.to_chunks) {
      std::memcpy(p.chunk, p.engine, nbytes);
    } else {
      std::memcpy(p.engine, p.chunk, nbytes);
    }
  }
}

namespace {

// 16-byte word of the host emulation (the kernel moves int4, a CUDA type).
struct alignas(16) Word16 {
  uint64_t lo, hi;
};

template <typename Word, bool kToChunks>
void emulate_grid(const PageTable& table, const TransferSpec& spec, const LaunchShape& shape) {
  const CopyGeometry g = copy_geometry(table, spec);
  for (int64_t bx = 0; bx < shape.grid_x; ++bx) {
    for (int64_t by = 0; by < shape.grid_y; ++by) {
      const PagePair p = page_pair(table.base.data(), spec.block_ids, spec.chunk_ptrs, g,
                                   spec.skip_blocks + bx, by);
      for (int64_t tid = 0; tid < shape.threads; ++tid) {
        copy_page_part<Word, kToChunks>(p, g.page_bytes, tid, shape.threads);
      }
    }
  }
}

template <typename Word>
void emulate_word(const PageTable& table, const TransferSpec& spec, const LaunchShape& shape) {
  if (spec.to_chunks) {
    emulate_grid<Word, true>(table, spec, shape);
  } else {
    emulate_grid<Word, false>(table, spec, shape);
  }
}

}  // namespace

int emulate_kernel(const PageTable& table, const TransferSpec& spec) {
  validate(table, spec);
  const int unit = copy_unit_bytes(table, spec.chunk_ptrs, spec.n_chunks);
  const LaunchShape shape = launch_shape(table, spec, unit);
  switch (unit) {
    case 16:
      emulate_word<Word16>(table, spec, shape);
      break;
    case 4:
      emulate_word<uint32_t>(table, spec, shape);
      break;
    case 2:
      emulate_word<uint16_t>(table, spec, shape);
      break;
    default:
      emulate_word<uint8_t>(table, spec, shape);
  }
  return unit;
}

void parallel_memcpy(uint64_t dst, uint64_t src, int64_t nbytes, int num_threads) {
  if (num_threads <= 0) num_threads = omp_get_max_threads();
  const int64_t piece = 1 << 20;
  const int64_t pieces = (nbytes + piece - 1) / piece;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t p = 0; p < pieces; ++p) {
    const int64_t off = p * piece;
    const int64_t len = std::min(piece, nbytes - off);
    std::memcpy(reinterpret_cast<char*>(dst) + off, reinterpret_cast<const char*>(src) + off,
                static_cast<size_t>(len));
  }
}

int copy_unit_bytes(const PageTable& table, const uint64_t* chunk_ptrs, int64_t n_chunks) {
  uint64_t bits = static_cast<uint64_t>(table.page_bytes) |
                  static_cast<uint64_t>(table.block_stride_bytes);
  for (uint64_t b : table.base) bits |= b;
  for (int64_t c = 0; c < n_chunks; ++c) bits |= chunk_ptrs[c];
  for (int unit : {16, 4, 2}) {
    if ((bits % static_cast<uint64_t>(unit)) == 0) return unit;
  }
  return 1;
}

}  // namespace kvc
