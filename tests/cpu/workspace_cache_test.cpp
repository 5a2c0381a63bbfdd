// The cache of the library's own workspace (src/api/workspace.h: WorkspaceCache) on its own. Through the
// C API calls return their workspace one at a time unless they run at once (tests/api_test.cpp:
// Api.LibraryWorkspaceIsKeptForTheNextCall); here two buffers are out together, so which one is kept
// when both come back can be seen.
#include <gtest/gtest.h>

#include <utility>

#include "api/workspace.h"

namespace {

using flashback::api::WorkspaceCache;

TEST(WorkspaceCache, KeepsTheLargerOfTwoBuffersThatCallsReturn) {
  ASSERT_TRUE(WorkspaceCache::enabled()) << "FLASHBACK_WORKSPACE_CACHE=0 in the environment";
  for (const bool larger_first : {false, true}) {
    SCOPED_TRACE(larger_first ? "the larger buffer back first" : "the smaller buffer back first");
    WorkspaceCache cache;
    EXPECT_EQ(cache.bytes(), 0u);
    auto small = cache.take(1000), large = cache.take(5000); // two calls at once: a buffer each
    ASSERT_NE(small->data(), large->data());
    const char* const kept = large->data();
    if (larger_first) {
      cache.put(std::move(large));
      cache.put(std::move(small));
    } else {
      cache.put(std::move(small));
      cache.put(std::move(large));
    }
    EXPECT_GE(cache.bytes(), 5000u);

    auto next = cache.take(3000); // fits: the kept buffer, out of the cache while the call runs
    EXPECT_EQ(next->data(), kept);
    EXPECT_EQ(cache.bytes(), 0u);
    cache.put(std::move(next));
    const size_t capacity = cache.bytes();
    EXPECT_GE(capacity, 5000u);

    auto larger = cache.take(capacity + 1); // does not fit: the kept one is freed, a larger one made
    EXPECT_GE(larger->capacity(), capacity + 1);
    EXPECT_EQ(cache.bytes(), 0u);
    cache.put(std::move(larger));
    EXPECT_GE(cache.bytes(), capacity + 1);
    cache.release();
    EXPECT_EQ(cache.bytes(), 0u);
  }
}

} // namespace
