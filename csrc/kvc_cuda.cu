// CUDA kernels that copy engine KV pages to kvcache chunks and back, by block id.
//
// One launch moves every page of every chunk: grid.x walks the block list (after the
// skipped prefix), grid.y walks (layer, kv). The kernels move bytes and never look at
// dtype; the launcher picks the widest unit (16, 4, 2, 1 bytes) that divides the page,
// the block stride and every address.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>

#include "kvc_cuda.h"
#include "kvc_page.h"

namespace kvc {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::ostringstream msg;
    msg << what << ": " << cudaGetErrorString(err);
    throw std::runtime_error(msg.str());
  }
}

// Makes ``device`` current for a scope and restores the caller's device afterwards, so a
// copy for one GPU never changes which GPU the calling thread's later CUDA work targets.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// grid: (n_blocks - skip_blocks, num_layers * kv); block: launch_shape's threads, one page.
// The address arithmetic and the body are kvc_page.h's, which the CPU twin and the host
// emulation of this kernel share.
template <typename Word, bool kToChunks>
__global__ void copy_pages_kernel(
    const uint64_t* __restrict__ page_base,   // [num_layers * kv] block 0 page of (l, k)
    const int64_t* __restrict__ block_ids,    // [n_blocks]
    const uint64_t* __restrict__ chunk_ptrs,  // [n_chunks] chunk [kv, NL, T, NH*HS]
    int64_t skip_blocks, CopyGeometry g) {
  const PagePair p = page_pair(page_base, block_ids, chunk_ptrs, g,
                               skip_blocks + static_cast<int64_t>(blockIdx.x), blockIdx.y);
  copy_page_part<Word, kToChunks>(p, g.page_bytes, threadIdx.x, blockDim.x);
}

template <typename Word>
void launch(bool to_chunks, dim3 grid, dim3 block, cudaStream_t stream, const uint64_t* base,
            const int64_t* ids, const uint64_t* chunks, const TransferSpec& s,
            const PageTable& t) {
  const CopyGeometry g = copy_geometry(t, s);
  if (to_chunks) {
    copy_pages_kernel<Word, true><<<grid, block, 0, stream>>>(base, ids, chunks, s.skip_blocks, g);
  } else {
    copy_pages_kernel<Word, false><<<grid, block, 0, stream>>>(base, ids, chunks, s.skip_blocks, g);
  }
}

}  // namespace

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

// Staging slots, used in turn: a submit only waits for the upload of the job kStagingSlots
// submits before it (the host may not rewrite pinned memory an upload still reads), so
// back-to-back submits do not wait on each other's uploads.
constexpr int kStagingSlots = 2;

// One job's block ids and chunk pointers travel packed, [n ids int64][n chunks uint64], in
// one upload: each cudaMemcpyAsync costs the submitting thread a few microseconds.
struct StagingSlot {
  char* d_staging = nullptr;           // device: the packed upload
  char* h_staging = nullptr;           // pinned: the packed upload, written by the host
  cudaEvent_t staging_free = nullptr;  // this slot's last upload has left h_staging
  cudaEvent_t kernel_done = nullptr;   // the last kernel reading this slot's device buffers is done
};

// Owns every device resource; its destructor frees whatever was allocated, so a
// constructor that fails half-way leaks nothing.
struct CudaTransfer::Impl {
  uint64_t* d_base = nullptr;
  StagingSlot slots[kStagingSlots];
  int next_slot = 0;
  std::mutex mu;  // one submit at a time picks a slot and launches

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {  // the caller has made the owning device current
    for (auto& slot : slots) {
      if (slot.kernel_done != nullptr) cudaEventSynchronize(slot.kernel_done);
      if (slot.staging_free != nullptr) cudaEventSynchronize(slot.staging_free);
    }
    for (auto& slot : slots) {
      if (slot.d_staging != nullptr) cudaFree(slot.d_staging);
      if (slot.h_staging != nullptr) cudaFreeHost(slot.h_staging);
      if (slot.staging_free != nullptr) cudaEventDestroy(slot.staging_free);
      if (slot.kernel_done != nullptr) cudaEventDestroy(slot.kernel_done);
    }
    if (d_base != nullptr) cudaFree(d_base);
  }
};

CudaTransfer::CudaTransfer(const PageTable& table, int device, int64_t max_block_ids,
                           int64_t max_chunks)
    : table_(table), device_(device), max_block_ids_(max_block_ids), max_chunks_(max_chunks) {
  if (cuda_device_count() <= device) {
    throw CudaUnavailable("no CUDA device " + std::to_string(device) + " is visible");
  }
  DeviceGuard guard(device);
  auto impl = std::make_unique<Impl>();  // freed (on this device) if a step below throws
  const size_t base_bytes = table.base.size() * sizeof(uint64_t);
  const size_t id_bytes = static_cast<size_t>(max_block_ids) * sizeof(int64_t);
  const size_t chunk_bytes = static_cast<size_t>(max_chunks) * sizeof(uint64_t);
  check(cudaMalloc(&impl->d_base, base_bytes), "cudaMalloc(page table)");
  check(cudaMemcpy(impl->d_base, table.base.data(), base_bytes, cudaMemcpyHostToDevice),
        "cudaMemcpy(page table)");
  for (auto& slot : impl->slots) {
    check(cudaMalloc(reinterpret_cast<void**>(&slot.d_staging), id_bytes + chunk_bytes),
          "cudaMalloc(staging)");
    check(cudaHostAlloc(reinterpret_cast<void**>(&slot.h_staging), id_bytes + chunk_bytes,
                        cudaHostAllocDefault),
          "cudaHostAlloc(staging)");
    check(cudaEventCreateWithFlags(&slot.staging_free, cudaEventDisableTiming),
          "cudaEventCreate");
    check(cudaEventCreateWithFlags(&slot.kernel_done, cudaEventDisableTiming),
          "cudaEventCreate");
  }
  impl_ = impl.release();
}

CudaTransfer::~CudaTransfer() {
  if (impl_ == nullptr) return;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  cudaSetDevice(device_);
  delete impl_;
  if (prev >= 0) cudaSetDevice(prev);
}

void CudaTransfer::copy(const TransferSpec& spec, uint64_t stream_handle) {
  validate(table_, spec);
  if (spec.n_blocks > max_block_ids_) {
    throw std::invalid_argument("more block ids than the context's max_block_ids (" +
                                std::to_string(max_block_ids_) + ")");
  }
  if (spec.n_chunks > max_chunks_) {
    throw std::invalid_argument("more chunks than the context's staging holds (" +
                                std::to_string(max_chunks_) + ")");
  }
  const int64_t todo = spec.n_blocks - spec.skip_blocks;
  if (todo == 0) return;
  if (table_.num_layers * table_.kv > 65535) {
    throw std::invalid_argument("num_layers * kv exceeds the grid's y limit (65535)");
  }
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  std::lock_guard<std::mutex> lock(impl_->mu);
  DeviceGuard device_guard(device_);
  StagingSlot& slot = impl_->slots[impl_->next_slot];
  impl_->next_slot = (impl_->next_slot + 1) % kStagingSlots;

  // The host may only rewrite this slot's pinned staging once its previous upload left
  // it; its device buffers may only be overwritten once the kernel that read them is done
  // (a device-side wait: it matters when copies come on different streams).
  check(cudaEventSynchronize(slot.staging_free), "cudaEventSynchronize(staging)");
  const size_t id_bytes = static_cast<size_t>(spec.n_blocks) * sizeof(int64_t);
  const size_t chunk_bytes = static_cast<size_t>(spec.n_chunks) * sizeof(uint64_t);
  std::memcpy(slot.h_staging, spec.block_ids, id_bytes);
  std::memcpy(slot.h_staging + id_bytes, spec.chunk_ptrs, chunk_bytes);
  check(cudaStreamWaitEvent(stream, slot.kernel_done, 0), "cudaStreamWaitEvent");
  check(cudaMemcpyAsync(slot.d_staging, slot.h_staging, id_bytes + chunk_bytes,
                        cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync(block ids and chunk pointers)");
  check(cudaEventRecord(slot.staging_free, stream), "cudaEventRecord(staging)");
  const auto* d_ids = reinterpret_cast<const int64_t*>(slot.d_staging);
  const auto* d_chunks = reinterpret_cast<const uint64_t*>(slot.d_staging + id_bytes);

  const int unit = copy_unit_bytes(table_, spec.chunk_ptrs, spec.n_chunks);
  last_unit_ = unit;
  const LaunchShape shape = launch_shape(table_, spec, unit);
  const dim3 grid(static_cast<unsigned>(shape.grid_x), static_cast<unsigned>(shape.grid_y));
  const dim3 block(static_cast<unsigned>(shape.threads));
  switch (unit) {
    case 16:
      launch<int4>(spec.to_chunks, grid, block, stream, impl_->d_base, d_ids, d_chunks, spec, table_);
      break;
    case 4:
      launch<unsigned int>(spec.to_chunks, grid, block, stream, impl_->d_base, d_ids,
                           d_chunks, spec, table_);
      break;
    case 2:
      launch<unsigned short>(spec.to_chunks, grid, block, stream, impl_->d_base, d_ids,
                             d_chunks, spec, table_);
      break;
    default:
      launch<unsigned char>(spec.to_chunks, grid, block, stream, impl_->d_base, d_ids,
                            d_chunks, spec, table_);
  }
  check(cudaGetLastError(), "copy_pages_kernel launch");
  check(cudaEventRecord(slot.kernel_done, stream), "cudaEventRecord(kernel)");
}

}  // namespace kvc
