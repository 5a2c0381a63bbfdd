// The CPU backend: workspace sizes and the threaded phases of forward and backward.
#pragma once

#include <cstddef>

#include "core/problem.h"

namespace flashback::cpu {

// The thread count a call uses: params.num_threads, else default_threads().
int resolve_threads(const core::Problem& p);
// FLASHBACK_NUM_THREADS (read once), else OpenMP's default.
int default_threads();

// The parts the forward cuts each query block's keys into (1: none; see backend.cpp): a function of
// the problem's sizes and band and of the running level's tiles, never of the thread count.
int64_t forward_splits(const core::Problem& p);
// The parts the backward cuts each key block's query blocks into (likewise).
int64_t backward_splits(const core::Problem& p);

size_t forward_workspace_bytes(const core::Problem& p);
size_t backward_workspace_bytes(const core::Problem& p);

// Workspace: at least *_workspace_bytes(p) bytes, any alignment.
void forward(const core::Problem& p, void* workspace);
void backward(const core::Problem& p, void* workspace);

} // namespace flashback::cpu
