// CUDA face of the native core. Implemented in kvc_cuda.cu when nvcc is present,
// otherwise in kvc_cuda_stub.cpp, whose every entry throws CudaUnavailable.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "kvc.h"

namespace kvc {

class CudaUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

bool cuda_compiled();
int cuda_device_count();  // 0 when no driver or no device; never throws

// Owns the device copy of a PageTable and the staging buffers for block ids and chunk
// addresses: pinned host buffers feeding asynchronous copies into preallocated device
// buffers on the caller's stream, two slots used in turn (a copy waits on the host only
// for the upload of the copy two before it; see kStagingSlots in kvc_cuda.cu).
class CudaTransfer {
 public:
  CudaTransfer(const PageTable& table, int device, int64_t max_block_ids, int64_t max_chunks);
  ~CudaTransfer();
  CudaTransfer(const CudaTransfer&) = delete;
  CudaTransfer& operator=(const CudaTransfer&) = delete;

  // Validates, stages ids and chunk addresses, launches one kernel for all chunks.
  // Chunk addresses may be device memory or pinned host memory (zero-copy).
  void copy(const TransferSpec& spec, uint64_t stream);

  int64_t max_block_ids() const { return max_block_ids_; }
  int last_copy_unit() const { return last_unit_; }

 private:
  struct Impl;
  PageTable table_;
  int device_;
  int64_t max_block_ids_;
  int64_t max_chunks_;
  int last_unit_ = 0;
  Impl* impl_ = nullptr;
};

}  // namespace kvc
