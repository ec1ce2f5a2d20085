// kvcascade batch copy: the torch binding of the "batch_copy" op.
//
// One descriptor is (source address, destination address, byte count), held in three 1-D int64 CPU
// tensors of equal length. The CPU implementation copies with std::memcpy; when the batch moves more
// than kParallelBytes it splits the concatenated byte stream evenly over a few std::threads (so one
// huge descriptor is split too). The GIL is released while copying.
//
// When built with -DKVCASCADE_WITH_CUDA, batch_copy_cuda enqueues the same batch on a caller-given
// CUDA stream through the plain C ABI in swap_blocks_cuda.cu (kept free of torch headers so that it
// also compiles standalone with nvcc; see check_nvcc.sh).
//
// Descriptors must not overlap (memcpy semantics). Addresses are trusted: the Python wrapper
// kvcascade.ops.swap computes them from validated tensors.
//
// Errors are thrown as plain std::invalid_argument / std::runtime_error (pybind11 turns them into
// ValueError / RuntimeError), never as c10::Error (TORCH_CHECK): on the H200 image's torch 2.11.0
// +cu130 (GCC 13.3) any c10::Error thrown from an extension - even a one-line load_inline one -
// crashed the interpreter with SIGSEGV, while std exceptions were caught normally.

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#ifdef KVCASCADE_WITH_CUDA
// Same definition as in the CUDA runtime headers; declared here to keep this file free of them.
typedef struct CUstream_st* cudaStream_t;
extern "C" int kvcascade_cuda_batch_copy_ex(const uint64_t* src, const uint64_t* dst,
                                            const uint64_t* sizes, size_t n, cudaStream_t stream,
                                            int src_access_any, size_t* failed_index);
extern "C" const char* kvcascade_cuda_error_string(int code);
#endif

namespace {

// TORCH_CHECK_VALUE / TORCH_CHECK without c10::Error (see the note at the top of this file).
#define KVC_CHECK_VALUE(cond, ...)                                     \
  do {                                                                 \
    if (!(cond)) throw std::invalid_argument(c10::str(__VA_ARGS__));   \
  } while (0)
#define KVC_CHECK(cond, ...)                                           \
  do {                                                                 \
    if (!(cond)) throw std::runtime_error(c10::str(__VA_ARGS__));      \
  } while (0)

constexpr int64_t kParallelBytes = int64_t{4} << 20;  // split the batch above 4 MiB
constexpr int64_t kBytesPerThread = int64_t{2} << 20; // at least 2 MiB per thread
constexpr int64_t kMaxThreads = 8;

void check_array(const torch::Tensor& t, const char* name) {
  KVC_CHECK_VALUE(t.device().is_cpu(), "batch_copy: ", name, " must be a CPU tensor, got device ",
                    t.device());
  KVC_CHECK_VALUE(t.scalar_type() == torch::kInt64, "batch_copy: ", name,
                    " must be int64, got ", t.scalar_type());
  KVC_CHECK_VALUE(t.dim() == 1, "batch_copy: ", name, " must be 1-D, got ", t.dim(),
                    " dimensions (shape ", t.sizes(), ")");
  KVC_CHECK_VALUE(t.is_contiguous(), "batch_copy: ", name, " must be contiguous");
}

// Validates the three descriptor arrays; returns the total number of bytes.
int64_t check_descriptors(const torch::Tensor& src, const torch::Tensor& dst,
                          const torch::Tensor& sizes) {
  check_array(src, "src_ptrs");
  check_array(dst, "dst_ptrs");
  check_array(sizes, "sizes");
  KVC_CHECK_VALUE(src.numel() == dst.numel() && src.numel() == sizes.numel(),
                    "batch_copy: lengths differ: src_ptrs ", src.numel(), ", dst_ptrs ",
                    dst.numel(), ", sizes ", sizes.numel());
  const int64_t n = src.numel();
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  const int64_t* z = sizes.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    KVC_CHECK_VALUE(z[i] >= 0, "batch_copy: sizes[", i, "] = ", z[i], " is negative");
    KVC_CHECK_VALUE(z[i] == 0 || (s[i] != 0 && d[i] != 0), "batch_copy: descriptor ", i,
                      " has a null address (src ", s[i], ", dst ", d[i], ")");
    total += z[i];
  }
  return total;
}

// Copies bytes [lo, hi) of the concatenation of all descriptors; offs[i] is where descriptor i
// starts in that concatenation, offs[n] the total.
void copy_slice(const int64_t* s, const int64_t* d, const std::vector<int64_t>& offs, int64_t n,
                int64_t lo, int64_t hi) {
  int64_t i = std::upper_bound(offs.begin(), offs.end(), lo) - offs.begin() - 1;
  for (; i < n && offs[i] < hi; ++i) {
    const int64_t a = std::max(lo, offs[i]);
    const int64_t b = std::min(hi, offs[i + 1]);
    if (b > a) {
      const int64_t skip = a - offs[i];
      std::memcpy(reinterpret_cast<void*>(d[i] + skip), reinterpret_cast<const void*>(s[i] + skip),
                  static_cast<size_t>(b - a));
    }
  }
}

void copy_host(const int64_t* s, const int64_t* d, const int64_t* z, int64_t n, int64_t total) {
  int64_t threads = 1;
  if (total > kParallelBytes) {
    const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
    threads = std::min({hw, kMaxThreads, (total + kBytesPerThread - 1) / kBytesPerThread});
  }
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) {
      if (z[i] > 0) {
        std::memcpy(reinterpret_cast<void*>(d[i]), reinterpret_cast<const void*>(s[i]),
                    static_cast<size_t>(z[i]));
      }
    }
    return;
  }
  std::vector<int64_t> offs(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) offs[i + 1] = offs[i] + z[i];
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

// CPU op: host memcpy per descriptor. Returns the number of bytes copied.
int64_t batch_copy(const torch::Tensor& src_ptrs, const torch::Tensor& dst_ptrs,
                   const torch::Tensor& sizes) {
  const int64_t total = check_descriptors(src_ptrs, dst_ptrs, sizes);
  const int64_t n = src_ptrs.numel();
  if (total == 0) return 0;
  const int64_t* s = src_ptrs.data_ptr<int64_t>();
  const int64_t* d = dst_ptrs.data_ptr<int64_t>();
  const int64_t* z = sizes.data_ptr<int64_t>();
  {
    pybind11::gil_scoped_release no_gil;
    copy_host(s, d, z, n, total);
  }
  return total;
}

#ifdef KVCASCADE_WITH_CUDA
// CUDA op: enqueue the batch on `stream` (a cudaStream_t as an integer; 0 = legacy default stream).
// Returns the number of bytes enqueued; the copy completes in stream order.
int64_t batch_copy_cuda(const torch::Tensor& src_ptrs, const torch::Tensor& dst_ptrs,
                        const torch::Tensor& sizes, int64_t stream, bool src_access_any) {
  const int64_t total = check_descriptors(src_ptrs, dst_ptrs, sizes);
  const int64_t n = src_ptrs.numel();
  if (total == 0) return 0;
  int rc = 0;
  size_t failed = 0;
  {
    pybind11::gil_scoped_release no_gil;
    rc = kvcascade_cuda_batch_copy_ex(
        reinterpret_cast<const uint64_t*>(src_ptrs.data_ptr<int64_t>()),
        reinterpret_cast<const uint64_t*>(dst_ptrs.data_ptr<int64_t>()),
        reinterpret_cast<const uint64_t*>(sizes.data_ptr<int64_t>()), static_cast<size_t>(n),
        reinterpret_cast<cudaStream_t>(stream), src_access_any ? 1 : 0, &failed);
  }
  KVC_CHECK(rc == 0, "batch_copy_cuda: CUDA error ", rc, " (", kvcascade_cuda_error_string(rc),
              ") at descriptor ", failed, " of ", n);
  return total;
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
  m.def("batch_copy", &batch_copy, "Host memcpy per (src, dst, size) descriptor; returns bytes",
        pybind11::arg("src_ptrs"), pybind11::arg("dst_ptrs"), pybind11::arg("sizes"));
#ifdef KVCASCADE_WITH_CUDA
  m.def("batch_copy_cuda", &batch_copy_cuda,
        "Enqueue a batch of copies on a CUDA stream; returns bytes", pybind11::arg("src_ptrs"),
        pybind11::arg("dst_ptrs"), pybind11::arg("sizes"), pybind11::arg("stream"),
        pybind11::arg("src_access_any") = false);
#endif
  m.def("has_cuda", &has_cuda, "Whether the CUDA implementation was compiled in");
}
