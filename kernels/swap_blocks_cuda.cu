// kvcascade batch copy, CUDA implementation.
//
// A plain C ABI over the CUDA runtime, with no torch headers, so that it compiles standalone
// (`nvcc -c`, see check_nvcc.sh) and links into the torch extension built from swap_blocks.cpp.
//
// kvcascade_cuda_batch_copy(src, dst, sizes, n, stream) enqueues n copies (src[i] -> dst[i],
// sizes[i] bytes; addresses are unified virtual addresses, host or device) on `stream` and returns
// a cudaError_t as int (0 = success). The descriptor arrays are host memory and are only read during
// the call. With CUDA runtime >= 12.8 and a non-legacy stream it uses cudaMemcpyBatchAsync (one
// driver call for the whole batch); otherwise, or when the driver does not support batched copies,
// one cudaMemcpyAsync per descriptor. Zero-size descriptors are skipped.

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include <vector>

namespace {

cudaError_t copy_one_by_one(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes,
                            size_t n, cudaStream_t stream, size_t* failed_index) {
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] == 0) continue;
    cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]),
                                      reinterpret_cast<const void*>(src[i]),
                                      static_cast<size_t>(sizes[i]), cudaMemcpyDefault, stream);
    if (err != cudaSuccess) {
      if (failed_index) *failed_index = i;
      return err;
    }
  }
  return cudaSuccess;
}

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
bool batch_unsupported(cudaError_t err) {
  return err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver;
}

cudaError_t copy_batched(const uint64_t* src, const uint64_t* dst, const uint64_t* sizes, size_t n,
                         cudaStream_t stream, int src_access_any, bool* unsupported) {
  std::vector<void*> d;
  std::vector<const void*> s;
  std::vector<size_t> z;
  d.reserve(n);
  s.reserve(n);
  z.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] == 0) continue;
    d.push_back(reinterpret_cast<void*>(dst[i]));
    s.push_back(reinterpret_cast<const void*>(src[i]));
    z.push_back(static_cast<size_t>(sizes[i]));
  }
  if (z.empty()) return cudaSuccess;
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder =
      src_access_any ? cudaMemcpySrcAccessOrderAny : cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  cudaError_t err = cudaMemcpyBatchAsync(d.data(), s.data(), z.data(), z.size(), &attr,
                                         &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  cudaError_t err = cudaMemcpyBatchAsync(d.data(), const_cast<void**>(s.data()), z.data(),
                                         z.size(), &attr, &attr_index, 1, &fail_index, stream);
#endif
  if (batch_unsupported(err)) {
    cudaGetLastError();  // clear the non-sticky error before falling back
    *unsupported = true;
  }
  return err;
}
#endif

}  // namespace

extern "C" int kvcascade_cuda_batch_copy_ex(const uint64_t* src, const uint64_t* dst,
                                            const uint64_t* sizes, size_t n, cudaStream_t stream,
                                            int src_access_any, size_t* failed_index) {
  if (failed_index) *failed_index = 0;
  if (n == 0) return static_cast<int>(cudaSuccess);
  if (src == nullptr || dst == nullptr || sizes == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  // The batch API rejects the legacy NULL stream.
  if (stream != nullptr && stream != cudaStreamLegacy) {
    bool unsupported = false;
    cudaError_t err = copy_batched(src, dst, sizes, n, stream, src_access_any, &unsupported);
    if (!unsupported) return static_cast<int>(err);
  }
#else
  (void)src_access_any;
#endif
  return static_cast<int>(copy_one_by_one(src, dst, sizes, n, stream, failed_index));
}

extern "C" int kvcascade_cuda_batch_copy(const uint64_t* src, const uint64_t* dst,
                                         const uint64_t* sizes, size_t n, cudaStream_t stream) {
  return kvcascade_cuda_batch_copy_ex(src, dst, sizes, n, stream, 0, nullptr);
}

extern "C" const char* kvcascade_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
