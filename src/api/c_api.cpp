// The C API: validate (core), size and provide the workspace, run (CPU backend); every exception
// becomes a status and a thread-local message.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "api/workspace.h"
#include "core/problem.h"
#include "cpu/backend.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "flashback/flashback.h"

namespace {

thread_local std::string g_last_error;

template <class F>
fb_status guarded(F&& body) {
  try {
    body();
    g_last_error.clear();
    return FB_SUCCESS;
  } catch (const flashback::core::Error& e) {
    g_last_error = e.what();
    return e.status();
  } catch (const std::bad_alloc&) {
    g_last_error = "out of memory while allocating the workspace";
    return FB_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
    return FB_ERROR_INTERNAL;
  } catch (...) {
    g_last_error = "internal error: unknown exception";
    return FB_ERROR_INTERNAL;
  }
}

void check_out_pointer(const void* p, const char* name) {
  if (p == nullptr)
    throw flashback::core::Error(FB_ERROR_INVALID_ARGUMENT,
                                 std::string(name) + ": expected a pointer to receive the size, got NULL");
}

// Never destroyed, so that a call from another static object's destructor still finds it; what it keeps
// at exit the process gives back.
flashback::api::WorkspaceCache& workspace_cache() {
  static auto* cache = new flashback::api::WorkspaceCache;
  return *cache;
}

// Runs `run` on the caller's workspace, or on the library's (workspace_cache) when the caller passed none.
template <class Run>
void with_workspace(size_t needed, void* workspace, size_t workspace_bytes, Run&& run) {
  using flashback::core::Error;
  if (workspace == nullptr && workspace_bytes != 0)
    throw Error(FB_ERROR_INVALID_ARGUMENT, "workspace: expected a pointer to " + std::to_string(workspace_bytes) +
                                               " bytes (workspace_bytes), got NULL");
  if (workspace == nullptr) {
    struct Held { // back to the cache however the call ends
      std::unique_ptr<flashback::api::OwnedWorkspace> ws;
      ~Held() { workspace_cache().put(std::move(ws)); }
    } held{workspace_cache().take(needed)};
    run(held.ws->data());
    return;
  }
  if (workspace_bytes < needed)
    throw Error(FB_ERROR_INVALID_ARGUMENT, "workspace_bytes: expected at least " + std::to_string(needed) +
                                               " (see fb_*_workspace_size), got " + std::to_string(workspace_bytes));
  run(workspace);
}

// The value a C caller passed for an enum parameter, whatever it is. C lets any int through an enum
// parameter; C++ gives an enum without a fixed type only the values its enumerators' bits span (fb_dtype:
// 0 to 3), and loading another one as the enum is undefined behavior (which clang's UBSan reports:
// fb_cpu_kernels_isa(7), fb_status_name(99)). Its bytes, read as the int it is, are defined.
template <class E>
int32_t enum_value(const E& e) {
  static_assert(sizeof(E) == sizeof(int32_t));
  int32_t v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

fb_tensor contiguous(void* data, int32_t dtype, int rank, const int64_t* shape) {
  fb_tensor t;
  std::memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  t.device = FB_DEVICE_CPU;
  t.rank = rank;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride;
    stride *= shape[i] > 0 ? shape[i] : 1;
  }
  return t;
}

} // namespace

extern "C" {

void fb_params_init(fb_params* params) {
  if (params == nullptr) return;
  std::memset(params, 0, sizeof *params);
  params->struct_size = sizeof(fb_params);
  params->window_left = -1;
  params->window_right = -1;
}

fb_tensor fb_tensor_contiguous4(void* data, fb_dtype dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  const int64_t shape[4] = {d0, d1, d2, d3};
  return contiguous(data, enum_value(dtype), 4, shape);
}

fb_tensor fb_tensor_contiguous3(void* data, fb_dtype dtype, int64_t d0, int64_t d1, int64_t d2) {
  const int64_t shape[3] = {d0, d1, d2};
  return contiguous(data, enum_value(dtype), 3, shape);
}

fb_status fb_forward_workspace_size(const fb_tensor* q, const fb_tensor* k, const fb_tensor* v, const fb_tensor* o,
                                    const fb_tensor* lse, const fb_params* params, size_t* workspace_bytes) {
  return guarded([&] {
    check_out_pointer(workspace_bytes, "workspace_bytes");
    const auto p = flashback::core::validate_forward(q, k, v, o, lse, params);
    *workspace_bytes = flashback::cpu::forward_workspace_bytes(p);
  });
}

fb_status fb_forward(const fb_tensor* q, const fb_tensor* k, const fb_tensor* v, const fb_tensor* o,
                     const fb_tensor* lse, const fb_params* params, void* workspace, size_t workspace_bytes) {
  return guarded([&] {
    const auto p = flashback::core::validate_forward(q, k, v, o, lse, params);
    with_workspace(flashback::cpu::forward_workspace_bytes(p), workspace, workspace_bytes,
                   [&](void* ws) { flashback::cpu::forward(p, ws); });
  });
}

fb_status fb_backward_workspace_size(const fb_tensor* dout, const fb_tensor* q, const fb_tensor* k,
                                     const fb_tensor* v, const fb_tensor* o, const fb_tensor* lse,
                                     const fb_tensor* dq, const fb_tensor* dk, const fb_tensor* dv,
                                     const fb_tensor* delta, const fb_params* params, size_t* workspace_bytes) {
  return guarded([&] {
    check_out_pointer(workspace_bytes, "workspace_bytes");
    const auto p = flashback::core::validate_backward(dout, q, k, v, o, lse, dq, dk, dv, delta, params);
    *workspace_bytes = flashback::cpu::backward_workspace_bytes(p);
  });
}

fb_status fb_backward(const fb_tensor* dout, const fb_tensor* q, const fb_tensor* k, const fb_tensor* v,
                      const fb_tensor* o, const fb_tensor* lse, const fb_tensor* dq, const fb_tensor* dk,
                      const fb_tensor* dv, const fb_tensor* delta, const fb_params* params, void* workspace,
                      size_t workspace_bytes) {
  return guarded([&] {
    const auto p = flashback::core::validate_backward(dout, q, k, v, o, lse, dq, dk, dv, delta, params);
    with_workspace(flashback::cpu::backward_workspace_bytes(p), workspace, workspace_bytes,
                   [&](void* ws) { flashback::cpu::backward(p, ws); });
  });
}

int fb_default_num_threads(void) { return flashback::cpu::default_threads(); }

size_t fb_workspace_cache_bytes(void) { return workspace_cache().bytes(); }

void fb_workspace_cache_release(void) { workspace_cache().release(); }

const char* fb_last_error(void) { return g_last_error.c_str(); }

const char* fb_status_name(fb_status status_arg) {
  switch (enum_value(status_arg)) {
    case FB_SUCCESS: return "FB_SUCCESS";
    case FB_ERROR_INVALID_ARGUMENT: return "FB_ERROR_INVALID_ARGUMENT";
    case FB_ERROR_UNSUPPORTED: return "FB_ERROR_UNSUPPORTED";
    case FB_ERROR_OUT_OF_MEMORY: return "FB_ERROR_OUT_OF_MEMORY";
    case FB_ERROR_INTERNAL: return "FB_ERROR_INTERNAL";
  }
  return "FB_STATUS_UNKNOWN";
}

const char* fb_version(void) { return "0.1.0"; }

const char* fb_cpu_isa(void) { return flashback::cpu::active_isa_name(); }

const char* fb_cpu_kernels_isa(fb_dtype dtype_arg) {
  const int32_t dtype = enum_value(dtype_arg);
  if (dtype != FB_F32 && dtype != FB_BF16 && dtype != FB_F16) return nullptr;
  const flashback::cpu::Isa active = flashback::cpu::active_isa();
  return flashback::cpu::level_name(
      flashback::cpu::kernels_for(active, static_cast<flashback::core::DType>(dtype)).isa);
}

} // extern "C"
