// What the flashback program's commands share: exit codes, errors, flag validators, the problem
// flags (shape, mask, dtype, layout), library calls with readable errors, a progress line.
#pragma once

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "flashback/flashback.h"

namespace flashback::cli {

// Exit codes (documented in `flashback --help`).
enum Exit : int {
  kOk = 0,
  kCheckFailed = 1, // an output is over tolerance (check, bench)
  kUsage = 2,       // bad flags
  kBadInput = 3,    // input file unreadable, malformed, missing a tensor, shapes that disagree
  kLibrary = 4,     // the library refused the call or failed (message from fb_last_error)
  kOutput = 5,      // the output file cannot be written
};

// Any failure of a command: main prints "flashback: <message>" and exits with `code`.
struct Failure : std::runtime_error {
  Failure(int code, const std::string& message) : std::runtime_error(message), code(code) {}
  int code;
};

// Throws Failure(kLibrary) with the library's message. An unsupported dtype gets a plain sentence
// in front ("BF16 is not supported yet"), chosen from the library's own status so that it disappears
// by itself once the library accepts the dtype.
void check_library(fb_status status, fb_dtype dtype, const std::string& what);

const char* dtype_flag_name(fb_dtype dtype); // "f32", "bf16", "f16"
size_t dtype_bytes(fb_dtype dtype);

// --- flag validators (CLI11 prints "--flag: <message>") -------------------------------------------
CLI::Validator int_in(int64_t min, int64_t max);
CLI::Validator int_at_least(int64_t min);
CLI::Validator positive_finite();
CLI::Validator one_of(std::vector<std::string> choices);
CLI::Validator window_spec();
std::pair<int64_t, int64_t> parse_window(const std::string& spec); // after window_spec() accepted it

enum class Layout { bhsd, bshd };
const char* layout_name(Layout layout);

// The problem flags shared by bench and check.
struct ProblemFlags {
  int64_t batch = 1, heads = 16, kv_heads = 0; // kv_heads 0: = heads
  int64_t seqlen = 2048, seqlen_q = 0, seqlen_k = 0; // seqlen_q/k 0: = seqlen
  int64_t head_dim = 128, head_dim_v = 0;            // head_dim_v 0: = head_dim
  bool causal = false;
  std::string window;
  double scale = 0; // 0: 1/sqrt(head_dim)
  std::string dtype = "f32";
  std::string layout = "bhsd";
  int64_t threads = 0; // 0: library default
  uint64_t seed = 1;
};
void add_problem_flags(CLI::App* cmd, ProblemFlags& flags);

// Mask and scale flags of forward/backward (the shape comes from the file there).
struct MaskFlags {
  bool causal = false;
  std::string window;
  double scale = 0;
  std::string layout = "bhsd";
  int64_t threads = 0;
};
void add_mask_flags(CLI::App* cmd, MaskFlags& flags);

// The resolved problem.
struct Problem {
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double scale = 0; // 0: default
  fb_dtype dtype = FB_F32;
  Layout layout = Layout::bhsd;
  int threads = 0;

  fb_params params() const;
  int64_t right() const { return causal ? 0 : window_right; } // the effective right edge
  double effective_scale() const;
};
// Throws Failure(kUsage) for combinations a single flag's check cannot see (GQA divisibility).
Problem resolve(const ProblemFlags& flags);
void apply_mask_flags(const MaskFlags& flags, Problem& p);

// The thread count the library will use for num_threads = 0: FLASHBACK_NUM_THREADS, else OpenMP's.
int default_threads();

// Number of (query, key) pairs a (batch, head) sees under the problem's mask.
int64_t visible_pairs(const Problem& p);

// FLOPs with FlashAttention's convention: forward 2 * B * Hq * pairs * (D + Dv), which is
// 4 * B * Hq * Sq * Sk * D when D == Dv; pairs = Sq * Sk, halved when causal; the exact count of
// visible pairs for a window. Backward = 2.5 x forward.
struct Flops {
  double forward = 0, backward = 0;
  double pairs = 0;
  std::string convention;
};
Flops count_flops(const Problem& p);

// A status line on stderr ("\r"-updated) that appears once a run has lasted the delay (set_delay,
// default 2 s), only when stderr is a terminal (or forced). The line is cleared when the Progress ends.
class Progress {
 public:
  enum class Mode { automatic, always, never };
  static void set_mode(Mode mode);
  static void set_delay(std::chrono::milliseconds delay);
  explicit Progress(std::string what);
  ~Progress();
  void stage(const std::string& text); // e.g. "forward 3/6"

 private:
  void loop();
  std::string what_, stage_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::milliseconds delay_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false, shown_ = false;
  std::thread thread_;
};

} // namespace flashback::cli
