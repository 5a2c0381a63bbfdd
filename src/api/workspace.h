// The workspace the library allocates for a call given none, and the one it keeps for the next such call
// (api/c_api.cpp: with_workspace; fb_workspace_cache_bytes, fb_workspace_cache_release).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <utility>

#if defined(__SANITIZE_ADDRESS__)
#define FLASHBACK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FLASHBACK_ASAN 1
#endif
#endif
#if defined(FLASHBACK_ASAN)
#include <sanitizer/asan_interface.h>
#endif
// Under AddressSanitizer the library's own workspace stays on the heap, where ASan sees an access past
// its end (OwnedWorkspace below); a mapping rounded up to huge pages would hide it.
#if defined(__linux__) && !defined(FLASHBACK_ASAN)
#define FLASHBACK_MAP_WORKSPACE 1
#include <sys/mman.h>
#endif

namespace flashback::api {

// The workspace allocated here when the caller passes none. A fresh buffer's pages are first touched
// by the call itself, each a page fault and a page zeroed: with 4 KiB pages that took 16 ms of a bf16
// backward's 66 (B = 32, Hq = 12, S = 197, D = 64: 61 MB, 310,000 faults; 48 ms on the caller's
// buffer; AMD Zen 4 guest, 2 threads). So on Linux a large one is mapped on its own, 2 MiB-aligned,
// with transparent huge pages asked for (madvise, which the common `madvise` setting of THP needs;
// `never` ignores it): 512 times fewer faults; 60 MB touched once took 4.4 ms instead of 25 there.
// Elsewhere, below kHugePage and under AddressSanitizer, operator new. The cache below keeps one for
// the next call, which may need fewer bytes: under AddressSanitizer the bytes past those a call needs
// are poisoned while it runs, so that an access past its end is still reported.
class OwnedWorkspace {
 public:
  explicit OwnedWorkspace(size_t bytes) : capacity_(bytes) {
#if defined(FLASHBACK_MAP_WORKSPACE)
    if (bytes >= kHugePage) {
      const size_t huge = (bytes + kHugePage - 1) / kHugePage * kHugePage; // whole huge pages
      length_ = huge + kHugePage;                                            // and room to align them
      void* map = mmap(nullptr, length_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (map == MAP_FAILED) throw std::bad_alloc();
      map_ = static_cast<char*>(map);
      data_ = map_ + (kHugePage - reinterpret_cast<uintptr_t>(map_) % kHugePage) % kHugePage;
      capacity_ = huge;
      (void)madvise(data_, huge, MADV_HUGEPAGE); // a hint: where THP is off, the pages stay small
      return;
    }
#endif
    owned_.reset(new char[bytes]);
    data_ = owned_.get();
  }
  ~OwnedWorkspace() {
    use(capacity_); // no byte poisoned when the heap takes it back
#if defined(FLASHBACK_MAP_WORKSPACE)
    if (map_) munmap(map_, length_);
#endif
  }
  OwnedWorkspace(const OwnedWorkspace&) = delete;
  OwnedWorkspace& operator=(const OwnedWorkspace&) = delete;
  char* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  // A call that needs `bytes` (at most capacity()) runs on it.
  void use([[maybe_unused]] size_t bytes) {
#if defined(FLASHBACK_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(data_, bytes);
    ASAN_POISON_MEMORY_REGION(data_ + bytes, capacity_ - bytes);
#endif
  }

 private:
  std::unique_ptr<char[]> owned_;
  char* data_ = nullptr;
  size_t capacity_ = 0;
#if defined(FLASHBACK_MAP_WORKSPACE)
  static constexpr size_t kHugePage = size_t{2} << 20;
  char* map_ = nullptr;
  size_t length_ = 0;
#endif
};

// The library's workspace is kept for the next call that passes none, in any thread: each fresh one
// costs its pages' clearing (above), which took a bf16 backward 3 - 10% of its time even on huge pages
// (BENCHMARKS.md). One buffer is kept in the process: a call takes it if it is large enough, else frees
// it and allocates what it needs; a call that ends puts its buffer back, the larger of the two where
// another came back meanwhile (calls at once each hold their own). oneDNN's library-owned scratchpad
// (its default mode) is likewise one buffer common to its primitives and kept between their runs.
// FLASHBACK_WORKSPACE_CACHE=0 (read once) keeps none;
// fb_workspace_cache_release frees the one kept. Its contents never matter: every call writes what it
// reads (tests/api_test.cpp: KeptWorkspaceOfNonFiniteValuesGivesTheSameBits).
class WorkspaceCache {
 public:
  std::unique_ptr<OwnedWorkspace> take(size_t bytes) {
    std::unique_ptr<OwnedWorkspace> kept;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      kept = std::move(kept_);
    }
    if (!kept || kept->capacity() < bytes) {
      kept.reset(); // freed before the larger one is allocated
      kept = std::make_unique<OwnedWorkspace>(bytes);
    }
    kept->use(bytes);
    return kept;
  }
  void put(std::unique_ptr<OwnedWorkspace> done) {
    if (!enabled()) return;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!kept_ || kept_->capacity() < done->capacity()) std::swap(kept_, done);
    }
    // `done` (the smaller) is freed here, outside the lock
  }
  size_t bytes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return kept_ ? kept_->capacity() : 0;
  }
  void release() {
    std::unique_ptr<OwnedWorkspace> kept;
    const std::lock_guard<std::mutex> lock(mutex_);
    kept.swap(kept_); // freed after the lock is let go (declared before it)
  }
  static bool enabled() {
    static const bool on = [] {
      const char* env = std::getenv("FLASHBACK_WORKSPACE_CACHE");
      return !(env && std::strcmp(env, "0") == 0);
    }();
    return on;
  }

 private:
  std::mutex mutex_;
  std::unique_ptr<OwnedWorkspace> kept_;
};

} // namespace flashback::api
