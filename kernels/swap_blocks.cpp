// kvcascade batch copy: the torch binding of the "batch_copy" op.
//
// One descriptor is (source address, destination address, byte count), held in three 1-D int64 CPU
// tensors of equal length. The CPU implementation copies with std::memcpy; when the batch moves
// more than kParallelBytes it splits the concatenated byte stream evenly over a few std::threads
// (so one huge descriptor is split too). The GIL is released while copying.
//
// When built with -DKVCASCADE_WITH_CUDA, batch_copy_cuda enqueues the same batch on a caller-given
// CUDA stream through the plain C ABI in swap_blocks_cuda.cu (kept free of torch headers so that it
// also compiles standalone with nvcc; see check_nvcc.sh).
//
// Descriptors must not overlap (memcpy semantics). Addresses are trusted: the Python wrapper
// kvcascade.ops.swap computes them from validated tensors.
//
// No C++ exception ever crosses into Python and no message is built with iostreams: each op
// returns (bytes, error kind, message) and the Python wrapper (kvcascade.ops.swap) raises; see
// kvc_result.h for the convention and why.
//
// The module also holds the fs tier's batch I/O ops (fs_io.cpp, registered below).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// Message pieces of torch types; declared before kvc_result.h so that kvc::cat finds them.
namespace kvc {
inline std::string piece(const c10::Device& v) { return v.str(); }
inline std::string piece(c10::ScalarType v) { return c10::toString(v); }
inline std::string piece(c10::IntArrayRef v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}
}  // namespace kvc

#include "kvc_gil.h"
#include "kvc_result.h"
#include "kvc_yield.h"

// fs_io.cpp: the fs tier's batch store/load ops.
void kvcascade_register_fs_io(pybind11::module_& m);

#ifdef KVCASCADE_WITH_CUDA
// Same definition as in the CUDA runtime headers; declared here to keep this file free of them.
typedef struct CUstream_st* cudaStream_t;
extern "C" int kvcascade_cuda_batch_copy_ex(const uint64_t* src, const uint64_t* dst,
                                            const uint64_t* sizes, size_t n, cudaStream_t stream,
                                            int src_access_any, size_t* failed_index);
extern "C" const char* kvcascade_cuda_error_string(int code);
#endif

namespace {

using kvc::cat;
using kvc::kBadValue;
using kvc::kCudaError;
using kvc::kOk;
using kvc::OpResult;

constexpr int64_t kParallelBytes = int64_t{4} << 20;   // split the batch above 4 MiB
constexpr int64_t kBytesPerThread = int64_t{2} << 20;  // at least 2 MiB per thread
constexpr int64_t kMaxThreads = 8;

std::string check_array(const torch::Tensor& t, const char* name) {
  KVC_REQUIRE(t.device().is_cpu(), "batch_copy: ", name, " must be a CPU tensor, got device ",
              t.device());
  KVC_REQUIRE(t.scalar_type() == torch::kInt64, "batch_copy: ", name, " must be int64, got ",
              t.scalar_type());
  KVC_REQUIRE(t.dim() == 1, "batch_copy: ", name, " must be 1-D, got ", t.dim(),
              " dimensions (shape ", t.sizes(), ")");
  KVC_REQUIRE(t.is_contiguous(), "batch_copy: ", name, " must be contiguous");
  return "";
}

// Validates the three descriptor arrays; returns "" and sets `total` (bytes), or the error.
std::string check_descriptors(const torch::Tensor& src, const torch::Tensor& dst,
                              const torch::Tensor& sizes, int64_t& total) {
  for (const auto& [t, name] :
       {std::pair{&src, "src_ptrs"}, std::pair{&dst, "dst_ptrs"}, std::pair{&sizes, "sizes"}}) {
    std::string error = check_array(*t, name);
    if (!error.empty()) return error;
  }
  KVC_REQUIRE(src.numel() == dst.numel() && src.numel() == sizes.numel(),
              "batch_copy: lengths differ: src_ptrs ", src.numel(), ", dst_ptrs ", dst.numel(),
              ", sizes ", sizes.numel());
  const int64_t n = src.numel();
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* z = sizes.data_ptr<int64_t>();
  total = 0;
  for (int64_t i = 0; i < n; ++i) {
    KVC_REQUIRE(z[i] >= 0, "batch_copy: sizes[", i, "] = ", z[i], " is negative");
    KVC_REQUIRE(z[i] == 0 || (s[i] != 0 && d[i] != 0), "batch_copy: descriptor ", i,
                " has a null address (src ", s[i], ", dst ", d[i], ")");
    total += z[i];
  }
  return "";
}

// Copies bytes [lo, hi) of the concatenation of all descriptors; offs[i] is where descriptor i
// starts in that concatenation, offs[n] the total.
void copy_slice(const int64_t* s, const int64_t* d, const std::vector<int64_t>& offs, int64_t n,
                int64_t lo, int64_t hi) {
  kvc::Yielder yielder;
  int64_t i = std::upper_bound(offs.begin(), offs.end(), lo) - offs.begin() - 1;
  for (; i < n && offs[i] < hi; ++i) {
    const int64_t a = std::max(lo, offs[i]);
    const int64_t b = std::min(hi, offs[i + 1]);
    for (int64_t at = a; at < b;) {  // in pieces of kYieldBytes, yielding in between
      const int64_t len = std::min<int64_t>(b - at, static_cast<int64_t>(kvc::kYieldBytes));
      const int64_t skip = at - offs[i];
      std::memcpy(reinterpret_cast<void*>(d[i] + skip), reinterpret_cast<const void*>(s[i] + skip),
                  static_cast<size_t>(len));
      yielder.moved(static_cast<size_t>(len));
      at += len;
    }
  }
}

// Splits the copy over threads above kParallelBytes: at most `max_threads` (0: one core fewer than
// the machine has - the thread serving the scheduler/event loop keeps a core: on 2 cores a
// second memcpy thread added ~8 % bandwidth and pushed an asyncio loop's p99 wake-up lag from
// 0.5 ms to 3 ms), kMaxThreads, and one per kBytesPerThread.
void copy_host(const int64_t* s, const int64_t* d, const int64_t* z, int64_t n, int64_t total,
               int64_t max_threads) {
  int64_t threads = 1;
  if (total > kParallelBytes) {
    const int64_t cores = std::thread::hardware_concurrency();
    const int64_t cap = max_threads > 0 ? max_threads : std::max<int64_t>(1, cores - 1);
    threads = std::min({cap, kMaxThreads, (total + kBytesPerThread - 1) / kBytesPerThread});
  }
  std::vector<int64_t> offs(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) offs[i + 1] = offs[i] + z[i];
  if (threads <= 1) {
    copy_slice(s, d, offs, n, 0, total);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t lo = total * t / threads;
    const int64_t hi = total * (t + 1) / threads;
    pool.emplace_back(copy_slice, s, d, std::cref(offs), n, lo, hi);
  }
  copy_slice(s, d, offs, n, 0, total / threads);
  for (auto& th : pool) th.join();
}

// CPU op: host memcpy per descriptor. Returns (bytes copied, kOk, "") or a kBadValue error.
OpResult batch_copy(const torch::Tensor& src_ptrs, const torch::Tensor& dst_ptrs,
                    const torch::Tensor& sizes, int64_t max_threads) {
  int64_t total = 0;
  std::string error = check_descriptors(src_ptrs, dst_ptrs, sizes, total);
  if (!error.empty()) return {0, kBadValue, std::move(error)};
  const int64_t n = src_ptrs.numel();
  if (total == 0) return {0, kOk, ""};
  const int64_t* s = src_ptrs.data_ptr<int64_t>();
  const int64_t* d = dst_ptrs.data_ptr<int64_t>();
  const int64_t* z = sizes.data_ptr<int64_t>();
  {
    kvc::GilRelease no_gil;
    copy_host(s, d, z, n, total, max_threads);
  }
  return {total, kOk, ""};
}

#ifdef KVCASCADE_WITH_CUDA
// CUDA op: enqueue the batch on `stream` (a cudaStream_t as an integer; 0 = legacy default stream).
// Returns (bytes enqueued, kOk, "") - the copy completes in stream order - or an error.
OpResult batch_copy_cuda(const torch::Tensor& src_ptrs, const torch::Tensor& dst_ptrs,
                         const torch::Tensor& sizes, int64_t stream, bool src_access_any) {
  int64_t total = 0;
  std::string error = check_descriptors(src_ptrs, dst_ptrs, sizes, total);
  if (!error.empty()) return {0, kBadValue, std::move(error)};
  const int64_t n = src_ptrs.numel();
  if (total == 0) return {0, kOk, ""};
  int rc = 0;
  size_t failed = 0;
  {
    kvc::GilRelease no_gil;
    rc = kvcascade_cuda_batch_copy_ex(
        reinterpret_cast<const uint64_t*>(src_ptrs.data_ptr<int64_t>()),
        reinterpret_cast<const uint64_t*>(dst_ptrs.data_ptr<int64_t>()),
        reinterpret_cast<const uint64_t*>(sizes.data_ptr<int64_t>()), static_cast<size_t>(n),
        reinterpret_cast<cudaStream_t>(stream), src_access_any ? 1 : 0, &failed);
  }
  if (rc != 0) {
    return {0, kCudaError,
            cat("batch_copy_cuda: CUDA error ", rc, " (", kvcascade_cuda_error_string(rc),
                ") at descriptor ", failed, " of ", n)};
  }
  return {total, kOk, ""};
}
#endif

bool has_cuda() {
#ifdef KVCASCADE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvcascade batch copy kernels";
  kvc::record_main_thread();
  m.def("batch_copy", &batch_copy,
        "Host memcpy per (src, dst, size) descriptor; returns (bytes, error kind, message)",
        pybind11::arg("src_ptrs"), pybind11::arg("dst_ptrs"), pybind11::arg("sizes"),
        pybind11::arg("max_threads") = 0);
#ifdef KVCASCADE_WITH_CUDA
  m.def("batch_copy_cuda", &batch_copy_cuda,
        "Enqueue a batch of copies on a CUDA stream; returns (bytes, error kind, message)",
        pybind11::arg("src_ptrs"), pybind11::arg("dst_ptrs"), pybind11::arg("sizes"),
        pybind11::arg("stream"), pybind11::arg("src_access_any") = false);
#endif
  m.def("has_cuda", &has_cuda, "Whether the CUDA implementation was compiled in");
  kvcascade_register_fs_io(m);
}
