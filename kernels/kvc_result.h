// kvcascade extension ops: the result convention and message helpers shared by every .cpp file.
//
// No C++ exception ever crosses into Python and no message is built with iostreams: each op
// returns (result, error kind, message) and the Python wrapper raises (kvcascade.ops.swap._checked,
// kvcascade.tiers.fs). Messages are plain std::string concatenation (kvc::cat). On the H200 image's
// torch 2.11.0+cu130 (GCC 13.3) formatting a message with c10::str (an std::ostringstream) inside
// an extension killed the interpreter with SIGSEGV - TORCH_CHECK in a one-line load_inline module
// did too, while throwing std::runtime_error("literal") was caught normally.
//
// A file that formats values of its own types declares more kvc::piece overloads *before*
// including this header (cat looks them up where it is defined).

#ifndef KVCASCADE_KVC_RESULT_H_
#define KVCASCADE_KVC_RESULT_H_

#include <cstdint>
#include <string>
#include <tuple>

namespace kvc {

// What an op returns: its result, the error kind, the message ("" when kOk).
template <typename T>
using Result = std::tuple<T, int64_t, std::string>;
// The result of a copy op: bytes copied (or enqueued).
using OpResult = Result<int64_t>;

constexpr int64_t kOk = 0;
constexpr int64_t kBadValue = 1;   // raised as ValueError
constexpr int64_t kCudaError = 2;  // raised as RuntimeError
constexpr int64_t kOsError = 3;    // a failed system call: raised as OSError (fs ops)
constexpr int64_t kCorrupt = 4;    // a block file failed its integrity check (fs ops)

inline std::string piece(const char* v) { return v; }
inline std::string piece(const std::string& v) { return v; }
inline std::string piece(int64_t v) { return std::to_string(v); }
inline std::string piece(uint64_t v) { return std::to_string(v); }
inline std::string piece(int v) { return std::to_string(v); }

// The message made of all arguments, without iostreams (see the note at the top of this file).
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  ((out += piece(args)), ...);
  return out;
}

}  // namespace kvc

// Returns "" when the first condition holds, else the message made of the rest.
#define KVC_REQUIRE(cond, ...)                 \
  do {                                         \
    if (!(cond)) return kvc::cat(__VA_ARGS__); \
  } while (0)

#endif  // KVCASCADE_KVC_RESULT_H_
