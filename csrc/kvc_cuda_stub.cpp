// Built instead of kvc_cuda.cu when nvcc is absent: every CUDA entry point says so.
#include "kvc_cuda.h"

namespace kvc {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }

struct CudaTransfer::Impl {};

CudaTransfer::CudaTransfer(const PageTable& table, int device, int64_t max_block_ids,
                           int64_t max_chunks)
    : table_(table), device_(device), max_block_ids_(max_block_ids), max_chunks_(max_chunks) {
  throw CudaUnavailable("kvcache was built without CUDA (set KVCACHE_BUILD_CUDA=1 and rebuild)");
}

CudaTransfer::~CudaTransfer() = default;

void CudaTransfer::copy(const TransferSpec&, uint64_t) {
  throw CudaUnavailable("kvcache was built without CUDA");
}

}  // namespace kvc
