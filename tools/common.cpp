#include "common.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace flashback::cli {

const char* dtype_flag_name(fb_dtype dtype) {
  switch (dtype) {
    case FB_F32: return "f32";
    case FB_BF16: return "bf16";
    case FB_F16: return "f16";
  }
  return "?";
}

size_t dtype_bytes(fb_dtype dtype) { return dtype == FB_F32 ? 4 : 2; }

void check_library(fb_status status, fb_dtype dtype, const std::string& what) {
  if (status == FB_SUCCESS) return;
  std::string message = what + ": " + fb_last_error();
  if (status == FB_ERROR_UNSUPPORTED && dtype != FB_F32) {
    std::string upper = dtype_flag_name(dtype);
    std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
    message = upper + " is not supported yet (" + message + ")";
  }
  throw Failure(kLibrary, message);
}

// --- validators --------------------------------------------------------------------------------------

namespace {

std::optional<int64_t> parse_int(const std::string& s) {
  if (s.empty()) return std::nullopt;
  try {
    size_t used = 0;
    const long long v = std::stoll(s, &used, 10);
    if (used != s.size()) return std::nullopt;
    return v;
  } catch (...) {
    return std::nullopt;
  }
}

} // namespace

CLI::Validator int_in(int64_t min, int64_t max) {
  const std::string want = max == INT64_MAX ? "an integer >= " + std::to_string(min)
                                            : "an integer in " + std::to_string(min) + ".." + std::to_string(max);
  return CLI::Validator(
      [min, max, want](std::string& s) -> std::string {
        const auto v = parse_int(s);
        if (!v || *v < min || *v > max) return "expected " + want + ", got '" + s + "'";
        return "";
      },
      max == INT64_MAX ? "INT>=" + std::to_string(min) : "INT in " + std::to_string(min) + ".." + std::to_string(max));
}

CLI::Validator int_at_least(int64_t min) { return int_in(min, INT64_MAX); }

CLI::Validator positive_finite() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(s, &used);
          if (used == s.size() && std::isfinite(v) && v > 0) return "";
        } catch (...) {
        }
        return "expected a finite number > 0, got '" + s + "'";
      },
      "NUMBER>0");
}

CLI::Validator one_of(std::vector<std::string> choices) {
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  return CLI::Validator(
      [choices, list](std::string& s) -> std::string {
        if (std::find(choices.begin(), choices.end(), s) != choices.end()) return "";
        return "expected one of " + list + ", got '" + s + "'";
      },
      "{" + list + "}");
}

CLI::Validator window_spec() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const auto comma = s.find(',');
        if (comma != std::string::npos) {
          const auto l = parse_int(s.substr(0, comma)), r = parse_int(s.substr(comma + 1));
          if (l && r && *l >= -1 && *r >= -1) return "";
        }
        return "expected L,R with each >= -1 (-1: unbounded), got '" + s + "'";
      },
      "L,R");
}

std::pair<int64_t, int64_t> parse_window(const std::string& spec) {
  const auto comma = spec.find(',');
  return {*parse_int(spec.substr(0, comma)), *parse_int(spec.substr(comma + 1))};
}

const char* layout_name(Layout layout) { return layout == Layout::bhsd ? "bhsd" : "bshd"; }

namespace {

void add_common_mask(CLI::App* cmd, bool& causal, std::string& window, double& scale, std::string& layout,
                     int64_t& threads) {
  cmd->add_flag("--causal", causal, "Bottom-right causal mask: query i sees key j <= i + Sk - Sq (= --window L,0)")
      ->disable_flag_override();
  cmd->add_option("--window", window,
                  "Local attention: query i sees keys [i+Sk-Sq-L, i+Sk-Sq+R]; -1 = unbounded on that side")
      ->check(window_spec());
  cmd->add_option("--scale", scale, "Softmax scale (default 1/sqrt(head_dim))")->check(positive_finite());
  cmd->add_option("--layout", layout, "Memory layout of q, k, v, o and their gradients")
      ->check(one_of({"bhsd", "bshd"}))
      ->capture_default_str();
  cmd->add_option("--threads", threads, "Threads (0: FLASHBACK_NUM_THREADS, else OpenMP's default)")
      ->check(int_in(0, 1024))
      ->capture_default_str();
}

} // namespace

void add_problem_flags(CLI::App* cmd, ProblemFlags& f) {
  cmd->add_option("--batch", f.batch, "Batch size B")->check(int_at_least(1))->capture_default_str();
  cmd->add_option("--heads", f.heads, "Query heads Hq")->check(int_at_least(1))->capture_default_str();
  cmd->add_option("--kv-heads", f.kv_heads, "Key/value heads Hk, a divisor of Hq (default: Hq)")
      ->check(int_at_least(1));
  cmd->add_option("--seqlen", f.seqlen, "Sequence length of queries and keys")
      ->check(int_at_least(1))
      ->capture_default_str();
  cmd->add_option("--seqlen-q", f.seqlen_q, "Query sequence length Sq (default: --seqlen)")->check(int_at_least(1));
  cmd->add_option("--seqlen-k", f.seqlen_k, "Key sequence length Sk (default: --seqlen)")->check(int_at_least(1));
  cmd->add_option("--head-dim", f.head_dim, "Head dim D of q and k")->check(int_at_least(1))->capture_default_str();
  cmd->add_option("--head-dim-v", f.head_dim_v, "Head dim Dv of v and o (default: D)")->check(int_at_least(1));
  cmd->add_option("--dtype", f.dtype, "Element type of q, k, v, o and gradients (lse is always f32)")
      ->check(one_of({"f32", "bf16", "f16"}))
      ->capture_default_str();
  cmd->add_option("--seed", f.seed, "Seed of the random inputs")->capture_default_str();
  add_common_mask(cmd, f.causal, f.window, f.scale, f.layout, f.threads);
}

void add_mask_flags(CLI::App* cmd, MaskFlags& f) {
  add_common_mask(cmd, f.causal, f.window, f.scale, f.layout, f.threads);
}

fb_params Problem::params() const {
  fb_params p;
  fb_params_init(&p);
  p.causal = causal ? 1 : 0;
  p.window_left = window_left;
  p.window_right = window_right;
  p.has_scale = scale > 0 ? 1 : 0;
  p.scale = scale;
  p.num_threads = threads;
  return p;
}

double Problem::effective_scale() const {
  // The library rounds the scale to float32; so does this, to compare like with like.
  return scale > 0 ? static_cast<double>(static_cast<float>(scale)) : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

void apply_mask_flags(const MaskFlags& f, Problem& p) {
  p.causal = f.causal;
  if (!f.window.empty()) std::tie(p.window_left, p.window_right) = parse_window(f.window);
  p.scale = f.scale;
  p.layout = f.layout == "bshd" ? Layout::bshd : Layout::bhsd;
  p.threads = static_cast<int>(f.threads);
}

Problem resolve(const ProblemFlags& f) {
  Problem p{};
  p.batch = f.batch;
  p.heads_q = f.heads;
  p.heads_kv = f.kv_heads > 0 ? f.kv_heads : f.heads;
  p.seqlen_q = f.seqlen_q > 0 ? f.seqlen_q : f.seqlen;
  p.seqlen_k = f.seqlen_k > 0 ? f.seqlen_k : f.seqlen;
  p.head_dim = f.head_dim;
  p.head_dim_v = f.head_dim_v > 0 ? f.head_dim_v : f.head_dim;
  p.dtype = f.dtype == "bf16" ? FB_BF16 : f.dtype == "f16" ? FB_F16 : FB_F32;
  MaskFlags m{f.causal, f.window, f.scale, f.layout, f.threads};
  apply_mask_flags(m, p);
  if (p.heads_q % p.heads_kv != 0)
    throw Failure(kUsage, "--kv-heads: expected a divisor of --heads (" + std::to_string(p.heads_q) + "), got " +
                              std::to_string(p.heads_kv));
  return p;
}

int default_threads() { return fb_default_num_threads(); }

int64_t visible_pairs(const Problem& p) {
  const int64_t left = p.window_left, right = p.right();
  int64_t pairs = 0;
  for (int64_t i = 0; i < p.seqlen_q; ++i) {
    const int64_t diag = i + p.seqlen_k - p.seqlen_q;
    const int64_t lo = left >= 0 ? std::max<int64_t>(0, diag - left) : 0;
    const int64_t hi = right >= 0 ? std::min<int64_t>(p.seqlen_k - 1, diag + right) : p.seqlen_k - 1;
    if (hi >= lo) pairs += hi - lo + 1;
  }
  return pairs;
}

Flops count_flops(const Problem& p) {
  Flops f;
  const double full = static_cast<double>(p.seqlen_q) * static_cast<double>(p.seqlen_k);
  if (p.window_left < 0 && p.right() < 0) {
    f.pairs = full;
    f.convention = "FlashAttention's: pairs = Sq*Sk";
  } else if (p.window_left < 0 && p.right() == 0) {
    f.pairs = full / 2;
    f.convention = "FlashAttention's: causal, pairs = Sq*Sk/2";
  } else {
    f.pairs = static_cast<double>(visible_pairs(p));
    f.convention = "window: pairs = exact count of visible (i, j)";
  }
  f.forward = 2.0 * p.batch * p.heads_q * f.pairs * static_cast<double>(p.head_dim + p.head_dim_v);
  f.backward = 2.5 * f.forward;
  return f;
}

// --- progress ----------------------------------------------------------------------------------------

namespace {
std::atomic<Progress::Mode> g_progress_mode{Progress::Mode::automatic};
std::atomic<int64_t> g_progress_delay_ms{2000};
}

void Progress::set_mode(Mode mode) { g_progress_mode = mode; }
void Progress::set_delay(std::chrono::milliseconds delay) { g_progress_delay_ms = delay.count(); }

Progress::Progress(std::string what)
    : what_(std::move(what)), start_(std::chrono::steady_clock::now()), delay_(g_progress_delay_ms.load()) {
  const Mode mode = g_progress_mode;
  if (mode == Mode::never || (mode == Mode::automatic && !::isatty(STDERR_FILENO))) return;
  thread_ = std::thread([this] { loop(); });
}

Progress::~Progress() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  wake_.notify_all();
  thread_.join();
  if (shown_) std::fprintf(stderr, "\r\033[K"), std::fflush(stderr);
}

void Progress::stage(const std::string& text) {
  std::lock_guard lock(mutex_);
  stage_ = text;
}

void Progress::loop() {
  std::unique_lock lock(mutex_);
  if (wake_.wait_for(lock, delay_, [this] { return done_; })) return;
  while (!done_) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "\r\033[Kflashback %s: %s  %.1f s", what_.c_str(), stage_.c_str(), s);
    std::fflush(stderr);
    shown_ = true;
    wake_.wait_for(lock, std::chrono::milliseconds(250), [this] { return done_; });
  }
}

} // namespace flashback::cli
