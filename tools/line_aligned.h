// An allocator whose storage starts on a 64-byte cache line, as a framework's tensors do (PyTorch's
// CPU allocator aligns to 64 bytes); a std::vector of it is what the benchmarks and the tests put
// their tensors in, so that where rows start is the layout's choice, not malloc's.
#pragma once

#include <cstddef>
#include <new>

namespace flashback {

template <class X>
struct LineAligned {
  using value_type = X;
  static constexpr std::align_val_t kAlignment{64};
  LineAligned() = default;
  template <class Y>
  LineAligned(const LineAligned<Y>&) {}
  X* allocate(size_t n) { return static_cast<X*>(::operator new(n * sizeof(X), kAlignment)); }
  void deallocate(X* p, size_t) { ::operator delete(p, kAlignment); }
  bool operator==(const LineAligned&) const { return true; }
};

} // namespace flashback
