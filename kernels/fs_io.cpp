// kvcascade fs tier batch I/O: a whole store or load job of block files per call, GIL released.
//
// The file format is kvcascade.tiers.fs's (v2): a 4096-byte header whose first 32 bytes are,
// little-endian, magic "KVCB" | version u16 | flags u16 (0) | payload length u64 |
// xxh3-64(payload) u64 | xxh3-64(offload key) u64, the rest zero; then the payload and the primary
// row's padding up to a multiple of 4096 bytes (the "span"). kvcascade/tiers/fs.py writes and
// reads the same bytes in pure Python; the two paths are interchangeable.
//
// A store job is three calls, so that only the one reading the primary rows runs inside the tier's
// row-access window (kvcascade.tiers.base.SecondaryTier._row_access) and a stall in open or rename
// never holds rows:
//   fs_store_open    per block: the file exists -> kExists (nothing to write); else open
//                    <path><suffix> O_CREAT|O_EXCL 0600 (creating the two parent directories 0700
//                    on ENOENT) -> its fd; a block that cannot be opened -> kFailed
// where <path> = <prefix><hhh>/<hh>_g<group>/<hex>.bin is built here from the offload key and
// resolved from the namespace directory <prefix>, opened once per call (struct Dir)
// (block_path: kvcascade.tiers._file_mapper.FileMapper.relative_path after the namespace; the tier
// checks the two agree before it uses this path).
//   fs_store_write   per opened block (fd >= 0; the others are skipped): xxh3 of the payload,
//                    header, write header + span; a failed write leaves its fd open (abort it)
//   fs_store_commit  per opened block: with mtime_ns > 0 set its mtime (block i: mtime_ns + i, so
//                    that a restart orders the files as written:
//                    kvcascade.tiers.fs.FileSystemTier._stamps), close, rename the temp file onto
//                    <path>; a failed block is closed and its temp file unlinked
// Without the existence check in fs_store_open (the tier keeps no size index), commit renames
// with RENAME_NOREPLACE instead: an existing file is kept and the temp file dropped, the same
// outcome as checking first, without a lookup of every new name before its write (a lookup
// that misses takes the directory lock and waits behind concurrent creates and renames).
//   fs_store_abort   close and unlink temp files (failed writes, blocks not committed)
// A load job is two calls: fs_load_open (open every file) then fs_load_read (read header + span
// straight into the row, verify; closes every fd it is given).
//
// "Fused" I/O (piece_bytes > 0), for filesystems where a read or write is a CPU copy (buffered
// I/O, tmpfs): a span above piece_bytes moves in pieces of that size and each piece is hashed
// right after it was read or written, while it is in the CPU cache, so the checksum costs no
// second pass over the block in DRAM; on stores the header goes last, on loads it comes with the
// first piece. Without it (piece_bytes = 0: O_DIRECT on a device, DMA and no CPU copy) and for
// a span of at most piece_bytes, each block is one vectored write or read of header + span,
// hashed right before the write or after the read.
//
// No op throws (kvc_result.h). A store op goes on after a failing block, so that a store job
// writes every block it can: it returns (values, errnos, error kind, message) with one value and
// one errno per block; a failed block has value kFailed and its errno, and the message is
// "<call>:<file>" of the first failed block (struct Blocks). A load op stops at its first failing
// block, since a prefix is useless after its first gap: it returns (values, error kind, message)
// where values has one entry per block done, and on an error one more, for the failing block (so
// the failing index is values.size() - 1): its errno for kOsError (message "<call>:<file>"), 0
// for kCorrupt (message: what is wrong). fs_store_abort returns (unlink errno per block, kOk, "").

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(__linux__)  // O_PATH, renameat2, statfs: elsewhere the module has no fs ops

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kvc_gil.h"
#include "kvc_result.h"
#include "kvc_yield.h"

#define XXH_STATIC_LINKING_ONLY
#if defined(__x86_64__) || defined(__i386__)
// Runtime dispatch to the SSE2 / AVX2 / AVX-512 xxh3 kernels (as the xxhash Python package does);
// it includes xxhash.h with XXH_INLINE_ALL.
#include "third_party/xxhash/xxh_x86dispatch.c"
#define KVC_XXH3 XXH3_64bits_dispatch
#define KVC_XXH3_UPDATE XXH3_64bits_update_dispatch
#else
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"
#define KVC_XXH3 XXH3_64bits
#define KVC_XXH3_UPDATE XXH3_64bits_update
#endif

namespace {

using kvc::cat;
using kvc::kBadValue;
using kvc::kCorrupt;
using kvc::kOk;
using kvc::kOsError;

using Values = std::vector<int64_t>;
using BatchResult = kvc::Result<Values>;

constexpr size_t kAlign = 4096;
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kFieldBytes = 32;
constexpr char kMagic[4] = {'K', 'V', 'C', 'B'};
constexpr int64_t kExists = -1;  // fs_store_open: the block file exists, nothing to write
constexpr int64_t kExisted = 1;  // fs_store_commit: the block file existed, temp file dropped
constexpr int64_t kFailed = -2;  // a store op: the block failed (its errno says why); no fd
#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

BatchResult os_failure(Values values, int err, const char* call, const std::string& file) {
  values.push_back(err);
  return {std::move(values), kOsError, cat(call, ":", file)};
}

BatchResult corrupt(Values values, std::string why) {
  values.push_back(0);
  return {std::move(values), kCorrupt, std::move(why)};
}

// What a store op returns: (values, errnos, error kind, message), one value and one errno per
// block. A block that failed has value kFailed and its errno (0 for every other block); the kind
// is then kOsError and the message "<call>:<file>" of the first block that failed.
using StoreResult = std::tuple<Values, Values, int64_t, std::string>;

// The per-block outcomes of a store op, in block order.
struct Blocks {
  Values values, errnos;
  int64_t kind = kOk;
  std::string message;
  explicit Blocks(size_t n) {
    values.reserve(n);
    errnos.reserve(n);
  }
  void ok(int64_t value) {
    values.push_back(value);
    errnos.push_back(0);
  }
  void failed(int err, const char* call, const std::string& file) {
    if (kind == kOk) {
      kind = kOsError;
      message = cat(call, ":", file);
    }
    values.push_back(kFailed);
    errnos.push_back(err);
  }
  StoreResult result() && {
    return {std::move(values), std::move(errnos), kind, std::move(message)};
  }
};

// This thread's zeroed, page-aligned header page (O_DIRECT wants aligned memory); allocated on
// first use, freed when the thread exits; nullptr if the allocation failed.
unsigned char* header_page() {
  struct Page {
    unsigned char* data = nullptr;
    Page() {
      void* p = nullptr;
      if (posix_memalign(&p, kAlign, kHeaderBytes) == 0) data = static_cast<unsigned char*>(p);
    }
    ~Page() { free(data); }
  };
  thread_local Page page;
  if (page.data != nullptr) std::memset(page.data, 0, kHeaderBytes);
  return page.data;
}

// Little-endian field access (every supported target is little-endian).
template <typename T>
void put(unsigned char* at, T v) {
  std::memcpy(at, &v, sizeof(T));
}
template <typename T>
T get(const unsigned char* at) {
  T v;
  std::memcpy(&v, at, sizeof(T));
  return v;
}

void encode_header(unsigned char* h, int64_t version, uint64_t length, uint64_t digest,
                   uint64_t key_digest) {
  std::memcpy(h, kMagic, 4);
  put<uint16_t>(h + 4, static_cast<uint16_t>(version));
  put<uint16_t>(h + 6, 0);
  put<uint64_t>(h + 8, length);
  put<uint64_t>(h + 16, digest);
  put<uint64_t>(h + 24, key_digest);
}

uint64_t xxh3(const void* p, size_t n) { return KVC_XXH3(p, n); }

// Streaming xxh3-64 (same digest as one call over the concatenation).
struct Hasher {
  XXH3_state_t state;
  Hasher() { XXH3_64bits_reset(&state); }
  void update(const void* p, size_t n) { KVC_XXH3_UPDATE(&state, p, n); }
  uint64_t digest() { return XXH3_64bits_digest(&state); }
};

unsigned char* row_of(int64_t addr) { return reinterpret_cast<unsigned char*>(addr); }

// Writes all of iov[0..cnt) at `offset`; a short write is continued so that the real error (e.g.
// ENOSPC) shows. Returns 0 or an errno.
int write_all(int fd, struct iovec* iov, int cnt, off_t offset) {
  while (cnt > 0) {
    const ssize_t n = pwritev(fd, iov, cnt, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    offset += n;
    size_t left = static_cast<size_t>(n);
    while (cnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --cnt;
    }
    if (cnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

// One vectored read at `offset` (a short count means end of file). Returns bytes read or -errno.
int64_t read_once(int fd, struct iovec* iov, int cnt, off_t offset) {
  for (;;) {
    const ssize_t n = preadv(fd, iov, cnt, offset);
    if (n >= 0) return n;
    if (errno != EINTR) return -errno;
  }
}

int open_retry(int dir_fd, const std::string& path, int flags, mode_t mode) {
  for (;;) {
    const int fd = openat(dir_fd, path.c_str(), flags, mode);
    if (fd >= 0 || errno != EINTR) return fd;
  }
}

std::string dirname_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

// Creates <hhh>/<hh>_g<group> (the two parents of `path`) with mode 0700; an existing one is fine.
// Returns 0 or the errno of the failing mkdir (its directory in `failed`).
int make_parents(int dir_fd, const std::string& path, std::string& failed) {
  const std::string leaf = dirname_of(path);
  for (const std::string& dir : {dirname_of(leaf), leaf}) {
    if (mkdirat(dir_fd, dir.c_str(), 0700) != 0 && errno != EEXIST) {
      failed = dir;
      return errno;
    }
  }
  return 0;
}

void close_quietly(int64_t fd) {
  if (fd >= 0) close(static_cast<int>(fd));
}

constexpr size_t kGroupBytes = 4;  // an offload key is block-hash bytes + group (u32 big-endian)

// "" when every key has block-hash bytes before its group suffix (kvcascade._keys).
std::string check_keys(const char* op, const std::vector<std::string>& keys) {
  for (size_t i = 0; i < keys.size(); ++i) {
    KVC_REQUIRE(keys[i].size() > kGroupBytes, op, ": keys[", static_cast<uint64_t>(i),
                "] is too short (", static_cast<uint64_t>(keys[i].size()), " bytes)");
  }
  return "";
}

// <prefix><hhh>/<hh>_g<group>/<hex>.bin: FileMapper.relative_path after the namespace, with
// Python's slice rules (a hash of one byte has no <hh>). `key` passed check_keys.
std::string block_path(const std::string& prefix, const std::string& key) {
  static const char digits[] = "0123456789abcdef";
  const size_t n = key.size() - kGroupBytes;
  std::string hex(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    const unsigned char b = static_cast<unsigned char>(key[i]);
    hex[2 * i] = digits[b >> 4];
    hex[2 * i + 1] = digits[b & 15];
  }
  uint64_t group = 0;
  for (size_t i = n; i < key.size(); ++i) group = (group << 8) | static_cast<unsigned char>(key[i]);
  return cat(prefix, hex.substr(0, 3), "/", hex.substr(std::min<size_t>(3, hex.size()), 2), "_g",
             group, "/", hex, ".bin");
}

// The namespace directory `prefix`, opened once per call: block paths are then resolved from it
// (three components, not the whole path, per system call). If it cannot be opened, full paths
// are used and each block meets the error itself, as without it.
struct Dir {
  const std::string& prefix;
  int fd;
  explicit Dir(const std::string& p)
      : prefix(p), fd(open(p.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC)) {}
  ~Dir() {
    if (fd >= 0) close(fd);
  }
  Dir(const Dir&) = delete;
  Dir& operator=(const Dir&) = delete;
  int at() const { return fd >= 0 ? fd : AT_FDCWD; }
  // The name of `key`'s block file to pass with at(); full(name) for messages.
  std::string name(const std::string& key) const { return block_path(fd >= 0 ? "" : prefix, key); }
  std::string full(const std::string& name) const { return fd >= 0 ? prefix + name : name; }
};

// Validates the per-block arrays of a write or read; "" when fine.
std::string check_batch(const char* op, size_t n_fds, size_t n_keys, size_t n_addrs,
                        int64_t payload_bytes, int64_t span_bytes, int64_t version,
                        int64_t piece_bytes) {
  KVC_REQUIRE(n_fds == n_keys && n_fds == n_addrs, op, ": lengths differ: fds ",
              static_cast<uint64_t>(n_fds), ", keys ", static_cast<uint64_t>(n_keys), ", addrs ",
              static_cast<uint64_t>(n_addrs));
  KVC_REQUIRE(payload_bytes > 0, op, ": payload_bytes must be > 0, got ", payload_bytes);
  KVC_REQUIRE(span_bytes >= payload_bytes && span_bytes % static_cast<int64_t>(kAlign) == 0, op,
              ": span_bytes must be a multiple of 4096 >= payload_bytes (", payload_bytes,
              "), got ", span_bytes);
  KVC_REQUIRE(version >= 0 && version <= 0xFFFF, op, ": version must fit in u16, got ", version);
  KVC_REQUIRE(piece_bytes >= 0 && piece_bytes % static_cast<int64_t>(kAlign) == 0, op,
              ": piece_bytes must be 0 or a multiple of 4096, got ", piece_bytes);
  return "";
}

std::string check_addrs(const char* op, const Values& fds, const Values& addrs) {
  for (size_t i = 0; i < fds.size(); ++i) {
    KVC_REQUIRE(fds[i] < 0 || addrs[i] != 0, op, ": addrs[", static_cast<uint64_t>(i), "] is null");
  }
  return "";
}

// -- stores ------------------------------------------------------------------------------------

StoreResult fs_store_open(const std::string& prefix, const std::vector<std::string>& keys,
                          const std::string& suffix, int64_t extra_flags, bool check_exists) {
  std::string error = check_keys("fs_store_open", keys);
  if (!error.empty()) return {{}, {}, kBadValue, std::move(error)};
  Blocks out(keys.size());
  kvc::GilRelease no_gil;
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | static_cast<int>(extra_flags);
  const Dir dir(prefix);
  for (const std::string& key : keys) {
    const std::string path = dir.name(key);
    struct stat st;  // os.path.exists: a store of a present key is a hit
    if (check_exists && fstatat(dir.at(), path.c_str(), &st, 0) == 0) {
      out.ok(kExists);
      continue;
    }
    const std::string tmp = path + suffix;
    int fd = open_retry(dir.at(), tmp, flags, 0600);
    if (fd < 0 && errno == ENOENT) {  // the first block of its directory
      std::string failed;
      const int err = make_parents(dir.at(), path, failed);
      if (err != 0) {
        out.failed(err, "mkdir", dir.full(failed));
        continue;
      }
      fd = open_retry(dir.at(), tmp, flags, 0600);
    }
    if (fd < 0) {
      const int err = errno;  // before building the message
      out.failed(err, "open", dir.full(tmp));
      continue;
    }
    out.ok(fd);
  }
  return std::move(out).result();
}

StoreResult fs_store_write(const Values& fds, const std::vector<std::string>& keys,
                           const Values& addrs, int64_t payload_bytes, int64_t span_bytes,
                           int64_t version, int64_t piece_bytes) {
  std::string error = check_batch("fs_store_write", fds.size(), keys.size(), addrs.size(),
                                  payload_bytes, span_bytes, version, piece_bytes);
  if (error.empty()) error = check_addrs("fs_store_write", fds, addrs);
  if (!error.empty()) return {{}, {}, kBadValue, std::move(error)};
  Blocks out(fds.size());
  kvc::GilRelease no_gil;
  unsigned char* header = header_page();
  const size_t payload = static_cast<size_t>(payload_bytes);
  const size_t span = static_cast<size_t>(span_bytes);
  const size_t piece = static_cast<size_t>(piece_bytes);
  kvc::Yielder yielder;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0) {  // nothing to write (kExists, kFailed)
      out.ok(0);
      continue;
    }
    if (header == nullptr) {
      out.failed(ENOMEM, "posix_memalign", "");
      continue;
    }
    const int fd = static_cast<int>(fds[i]);
    unsigned char* row = row_of(addrs[i]);
    const uint64_t key_digest = xxh3(keys[i].data(), keys[i].size());
    int err = 0;
    if (piece == 0 || span <= piece) {
      encode_header(header, version, payload, xxh3(row, payload), key_digest);
      struct iovec iov[2] = {{header, kHeaderBytes}, {row, span}};
      err = write_all(fd, iov, 2, 0);
    } else {
      Hasher hasher;
      for (size_t off = 0; off < span && err == 0; off += piece) {
        const size_t len = std::min(piece, span - off);
        struct iovec iov[1] = {{row + off, len}};
        err = write_all(fd, iov, 1, static_cast<off_t>(kHeaderBytes + off));
        // Hashed after the write, from the cache the copy just filled (the rows of a job do
        // not change while it runs); measured faster than before it with two busy cores.
        if (err == 0 && off < payload) hasher.update(row + off, std::min(len, payload - off));
        yielder.moved(len);
      }
      if (err == 0) {
        encode_header(header, version, payload, hasher.digest(), key_digest);
        struct iovec iov[1] = {{header, kHeaderBytes}};
        err = write_all(fd, iov, 1, 0);
      }
    }
    if (err != 0) {  // its fd stays open: the caller aborts it
      out.failed(err, "write", "");
      continue;
    }
    if (piece == 0 || span <= piece) yielder.moved(span);
    out.ok(payload_bytes);
  }
  return std::move(out).result();
}

// Closes fds[from..) and unlinks their temp files; returns per block 0 or the unlink errno
// (ENOENT counts as removed).
Values abort_from(const Values& fds, const std::string& prefix,
                  const std::vector<std::string>& keys, const std::string& suffix, size_t from) {
  Values errs;
  const Dir dir(prefix);
  for (size_t i = from; i < fds.size() && i < keys.size(); ++i) {
    int err = 0;
    if (fds[i] >= 0) {
      close_quietly(fds[i]);
      const std::string tmp = dir.name(keys[i]) + suffix;
      if (unlinkat(dir.at(), tmp.c_str(), 0) != 0 && errno != ENOENT) err = errno;
    }
    errs.push_back(err);
  }
  return errs;
}

// "" when fds and keys pair up and every key is well formed.
std::string check_pairs(const char* op, const Values& fds, const std::vector<std::string>& keys) {
  KVC_REQUIRE(fds.size() == keys.size(), op, ": lengths differ: fds ",
              static_cast<uint64_t>(fds.size()), ", keys ", static_cast<uint64_t>(keys.size()));
  return check_keys(op, keys);
}

// Moves `tmp` onto `path`. With `noreplace` an existing `path` is kept (and `existed` set): one
// renameat2(RENAME_NOREPLACE), or where the filesystem lacks it (EINVAL, ENOSYS: NFS, old
// kernels) a stat first. Returns 0 or an errno.
int commit_one(int dir_fd, const std::string& tmp, const std::string& path, bool noreplace,
               bool& existed) {
  existed = false;
  if (noreplace) {
    if (syscall(SYS_renameat2, dir_fd, tmp.c_str(), dir_fd, path.c_str(), RENAME_NOREPLACE) == 0) {
      return 0;
    }
    if (errno == EEXIST) {
      existed = true;
      return 0;
    }
    if (errno != EINVAL && errno != ENOSYS) return errno;
    struct stat st;
    if (fstatat(dir_fd, path.c_str(), &st, 0) == 0) {
      existed = true;
      return 0;
    }
  }
  return renameat(dir_fd, tmp.c_str(), dir_fd, path.c_str()) == 0 ? 0 : errno;
}

StoreResult fs_store_commit(const Values& fds, const std::string& prefix,
                            const std::vector<std::string>& keys, const std::string& suffix,
                            bool noreplace, int64_t mtime_ns) {
  std::string error = check_pairs("fs_store_commit", fds, keys);
  if (!error.empty()) return {{}, {}, kBadValue, std::move(error)};
  Blocks out(fds.size());
  kvc::GilRelease no_gil;
  const Dir dir(prefix);
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] < 0) {
      out.ok(0);
      continue;
    }
    const std::string path = dir.name(keys[i]);
    const std::string tmp = path + suffix;
    const char* call = "close";
    int err = 0;
    bool existed = false;
    if (mtime_ns > 0) {
      const int64_t stamp = mtime_ns + static_cast<int64_t>(i);
      const struct timespec at = {static_cast<time_t>(stamp / 1000000000),
                                  static_cast<long>(stamp % 1000000000)};
      const struct timespec times[2] = {at, at};
      futimens(static_cast<int>(fds[i]), times);  // refused: the file keeps its own mtime
    }
    if (close(static_cast<int>(fds[i])) != 0 && errno != EINTR) {  // EINTR: closed anyway
      err = errno;
    } else {
      call = "rename";
      err = commit_one(dir.at(), tmp, path, noreplace, existed);
    }
    if (err != 0 || existed) unlinkat(dir.at(), tmp.c_str(), 0);
    if (err != 0) {  // closed and its temp file gone: nothing left for the caller to abort
      out.failed(err, call, dir.full(tmp));
      continue;
    }
    out.ok(existed ? kExisted : 0);
  }
  return std::move(out).result();
}

BatchResult fs_store_abort(const Values& fds, const std::string& prefix,
                           const std::vector<std::string>& keys, const std::string& suffix) {
  std::string error = check_pairs("fs_store_abort", fds, keys);
  if (!error.empty()) return {{}, kBadValue, std::move(error)};
  kvc::GilRelease no_gil;
  return {abort_from(fds, prefix, keys, suffix, 0), kOk, ""};
}

// -- loads -------------------------------------------------------------------------------------

BatchResult fs_load_open(const std::string& prefix, const std::vector<std::string>& keys,
                         int64_t extra_flags) {
  std::string error = check_keys("fs_load_open", keys);
  if (!error.empty()) return {{}, kBadValue, std::move(error)};
  Values fds;
  fds.reserve(keys.size() + 1);
  kvc::GilRelease no_gil;
  const int flags = O_RDONLY | O_CLOEXEC | static_cast<int>(extra_flags);
  const Dir dir(prefix);
  for (const std::string& key : keys) {
    const std::string path = dir.name(key);
    const int fd = open_retry(dir.at(), path, flags, 0);
    if (fd < 0) return os_failure(std::move(fds), errno, "open", dir.full(path));
    fds.push_back(fd);
  }
  return {std::move(fds), kOk, ""};
}

// Reads block i (header + span) into `header` and `row`; on success sets `digest` to the xxh3 of
// the payload when the whole file was read. Returns bytes read, or -errno.
int64_t read_block(int fd, unsigned char* header, unsigned char* row, size_t payload, size_t span,
                   size_t piece, uint64_t& digest, kvc::Yielder& yielder) {
  const size_t size = kHeaderBytes + span;
  if (piece == 0 || span <= piece) {
    struct iovec iov[2] = {{header, kHeaderBytes}, {row, span}};
    const int64_t n = read_once(fd, iov, 2, 0);
    if (n == static_cast<int64_t>(size)) digest = xxh3(row, payload);
    yielder.moved(span);
    return n;
  }
  // The header rides with the first piece.
  Hasher hasher;
  int64_t total = 0;
  for (size_t off = 0; off < span; off += piece) {
    const size_t len = std::min(piece, span - off);
    struct iovec iov[2] = {{header, kHeaderBytes}, {row + off, len}};
    const bool first = off == 0;
    const int64_t want = static_cast<int64_t>(len + (first ? kHeaderBytes : 0));
    const int64_t n = read_once(fd, first ? iov : iov + 1, first ? 2 : 1,
                                static_cast<off_t>(first ? 0 : kHeaderBytes + off));
    if (n < 0) return n;
    total += n;
    if (n != want) return total;  // end of file: a short file
    if (off < payload) hasher.update(row + off, std::min(len, payload - off));
    yielder.moved(len);
  }
  digest = hasher.digest();
  return total;
}

BatchResult load_read(const Values& fds, const std::vector<std::string>& keys, const Values& addrs,
                      int64_t payload_bytes, int64_t span_bytes, int64_t version,
                      int64_t piece_bytes) {
  Values done;
  done.reserve(fds.size() + 1);
  unsigned char* header = header_page();
  if (header == nullptr) return os_failure(std::move(done), ENOMEM, "posix_memalign", "");
  const size_t payload = static_cast<size_t>(payload_bytes);
  const size_t span = static_cast<size_t>(span_bytes);
  const int64_t size = static_cast<int64_t>(kHeaderBytes + span);
  kvc::Yielder yielder;
  for (size_t i = 0; i < fds.size(); ++i) {
    uint64_t digest = 0;
    const int64_t n = read_block(static_cast<int>(fds[i]), header, row_of(addrs[i]), payload, span,
                                 static_cast<size_t>(piece_bytes), digest, yielder);
    if (n < 0) return os_failure(std::move(done), static_cast<int>(-n), "read", "");
    // Same checks, in the same order and words, as kvcascade.tiers.fs.check_block.
    if (n != size) {
      return corrupt(std::move(done), cat("short file (", n, " bytes read, expected ", size, ")"));
    }
    const unsigned char* h = header;
    if (std::memcmp(h, kMagic, 4) != 0 || get<uint16_t>(h + 4) != version) {
      return corrupt(std::move(done), cat("not a kvcascade v", version, " block file"));
    }
    const uint64_t length = get<uint64_t>(h + 8);
    if (length != payload) {
      return corrupt(std::move(done),
                     cat("payload is ", length, " bytes, expected ", payload_bytes));
    }
    if (get<uint64_t>(h + 24) != xxh3(keys[i].data(), keys[i].size())) {
      return corrupt(std::move(done), "holds another key's block");
    }
    if (get<uint64_t>(h + 16) != digest) return corrupt(std::move(done), "checksum mismatch");
    done.push_back(payload_bytes);
  }
  return {std::move(done), kOk, ""};
}

BatchResult fs_load_read(const Values& fds, const std::vector<std::string>& keys,
                         const Values& addrs, int64_t payload_bytes, int64_t span_bytes,
                         int64_t version, int64_t piece_bytes) {
  std::string error = check_batch("fs_load_read", fds.size(), keys.size(), addrs.size(),
                                  payload_bytes, span_bytes, version, piece_bytes);
  if (error.empty()) error = check_addrs("fs_load_read", fds, addrs);
  for (size_t i = 0; error.empty() && i < fds.size(); ++i) {
    if (fds[i] < 0) error = cat("fs_load_read: fds[", static_cast<uint64_t>(i), "] is negative");
  }
  kvc::GilRelease no_gil;
  BatchResult result =
      error.empty() ? load_read(fds, keys, addrs, payload_bytes, span_bytes, version, piece_bytes)
                    : BatchResult{{}, kBadValue, std::move(error)};
  for (int64_t fd : fds) close_quietly(fd);  // every fd given, whatever happened
  return result;
}

// -- misc --------------------------------------------------------------------------------------

// The f_type of the filesystem holding `path` (statfs), e.g. 0x01021994 for tmpfs.
kvc::OpResult fs_type(const std::string& path) {
  struct statfs sf;
  int rc;
  {
    kvc::GilRelease no_gil;
    rc = statfs(path.c_str(), &sf);
  }
  if (rc != 0) return {errno, kOsError, cat("statfs:", path)};
  return {static_cast<int64_t>(static_cast<uint64_t>(sf.f_type)), kOk, ""};
}

// The block paths of `keys` under `prefix` (tests compare them with FileMapper's).
kvc::Result<std::vector<std::string>> fs_block_paths(const std::string& prefix,
                                                     const std::vector<std::string>& keys) {
  std::string error = check_keys("fs_block_paths", keys);
  if (!error.empty()) return {{}, kBadValue, std::move(error)};
  std::vector<std::string> paths;
  for (const std::string& key : keys) paths.push_back(block_path(prefix, key));
  return {std::move(paths), kOk, ""};
}

// xxh3-64 of `data` (tests compare it with the xxhash package's).
uint64_t fs_xxh3(const std::string& data) { return xxh3(data.data(), data.size()); }

}  // namespace

void kvcascade_register_fs_io(pybind11::module_& m) {
  xxh3("", 0);  // pick the xxh3 kernel now, under the GIL, not racily on the first I/O threads
  m.attr("FS_EXISTS") = kExists;
  m.attr("FS_EXISTED") = kExisted;
  m.attr("FS_FAILED") = kFailed;
  m.def("fs_store_open", &fs_store_open,
        "Per key: FS_EXISTS if check_exists and its block file exists, else the fd of "
        "<path><suffix> opened O_CREAT|O_EXCL 0600, or FS_FAILED; returns (values, errnos, "
        "error kind, message)",
        pybind11::arg("prefix"), pybind11::arg("keys"), pybind11::arg("suffix"),
        pybind11::arg("extra_flags"), pybind11::arg("check_exists"));
  m.def("fs_store_write", &fs_store_write,
        "Per opened block: header + span written with the payload's xxh3; returns (payload "
        "bytes or FS_FAILED per block, errnos, error kind, message)",
        pybind11::arg("fds"), pybind11::arg("keys"), pybind11::arg("addrs"),
        pybind11::arg("payload_bytes"), pybind11::arg("span_bytes"), pybind11::arg("version"),
        pybind11::arg("piece_bytes"));
  m.def("fs_store_commit", &fs_store_commit,
        "Per opened block: with mtime_ns > 0 set its mtime and atime to mtime_ns + its index "
        "(ns since the epoch), close, rename <path><suffix> onto <path> (noreplace: keep an "
        "existing <path>, value FS_EXISTED; FS_FAILED: closed, temp file unlinked); returns "
        "(values, errnos, error kind, message)",
        pybind11::arg("fds"), pybind11::arg("prefix"), pybind11::arg("keys"),
        pybind11::arg("suffix"), pybind11::arg("noreplace"), pybind11::arg("mtime_ns"));
  m.def("fs_store_abort", &fs_store_abort,
        "Close the fds (>= 0) and unlink their temp files; returns (unlink errno per block, "
        "error kind, message)",
        pybind11::arg("fds"), pybind11::arg("prefix"), pybind11::arg("keys"),
        pybind11::arg("suffix"));
  m.def("fs_load_open", &fs_load_open,
        "Per key: the fd of its block file opened read-only; returns (values, error kind, "
        "message)",
        pybind11::arg("prefix"), pybind11::arg("keys"), pybind11::arg("extra_flags"));
  m.def("fs_load_read", &fs_load_read,
        "Per block: read header + span into the row and verify it; closes every fd; returns "
        "(payload bytes per block, error kind, message)",
        pybind11::arg("fds"), pybind11::arg("keys"), pybind11::arg("addrs"),
        pybind11::arg("payload_bytes"), pybind11::arg("span_bytes"), pybind11::arg("version"),
        pybind11::arg("piece_bytes"));
  m.def("fs_block_paths", &fs_block_paths, "Block paths of keys under prefix",
        pybind11::arg("prefix"), pybind11::arg("keys"));
  m.def("fs_type", &fs_type, "statfs f_type of the filesystem holding path", pybind11::arg("path"));
  m.def("fs_xxh3", &fs_xxh3, "xxh3-64 of bytes", pybind11::arg("data"));
}

#else  // not Linux: the fs tier moves blocks in pure Python

void kvcascade_register_fs_io(pybind11::module_& m) { (void)m; }

#endif
