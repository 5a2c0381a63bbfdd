// flashback forward / backward: tensors from a safetensors file in, results to another.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "commands.h"
#include "host_tensor.h"
#include "safetensors.h"

namespace flashback::cli {

namespace {

namespace st = flashback::safetensors;

fb_dtype to_fb(st::DType d) {
  switch (d) {
    case st::DType::F32: return FB_F32;
    case st::DType::BF16: return FB_BF16;
    case st::DType::F16: return FB_F16;
  }
  return FB_F32;
}
st::DType to_st(fb_dtype d) { return d == FB_BF16 ? st::DType::BF16 : d == FB_F16 ? st::DType::F16 : st::DType::F32; }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + (shape[i] < 0 ? "*" : std::to_string(shape[i]));
  return s + "]";
}

// [B, H, S, D] -> the order the layout stores.
std::vector<int64_t> stored(Layout layout, int64_t b, int64_t h, int64_t s, int64_t d) {
  if (layout == Layout::bhsd) return {b, h, s, d};
  return {b, s, h, d};
}
std::string pattern(Layout layout, const char* h, const char* s, const char* d) {
  const auto names = layout == Layout::bhsd ? std::vector<std::string>{"B", h, s, d} : std::vector<std::string>{"B", s, h, d};
  return "[" + names[0] + ", " + names[1] + ", " + names[2] + ", " + names[3] + "]";
}

struct Dims {
  int64_t b, h, s, d;
};

// The input file and the checks on its tensors; every failure is kBadInput naming the file.
class Input {
 public:
  explicit Input(const std::string& path) : path_(path) {
    auto archive = st::Archive::from_file(path);
    if (!archive) throw Failure(kBadInput, archive.error());
    archive_.emplace(std::move(archive).value());
  }

  const st::TensorInfo* find(const char* name) const { return archive_->find(name); }

  const st::TensorInfo& require(const char* name) const {
    if (const auto* t = find(name)) return *t;
    // Names come from the file: printable and few, so the message stays one short line.
    constexpr size_t kMaxNames = 16;
    std::string have;
    const auto& all = archive_->tensors();
    for (size_t i = 0; i < all.size() && i < kMaxNames; ++i) {
      have += i ? ", " : "";
      for (unsigned char c : all[i].name.substr(0, 64)) have += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
    }
    if (all.size() > kMaxNames) have += ", ... (" + std::to_string(all.size()) + " tensors)";
    throw Failure(kBadInput, "'" + path_ + "': missing tensor '" + name + "' (the file holds: " +
                                 (have.empty() ? "no tensors" : have) + ")");
  }

  [[noreturn]] void bad(const st::TensorInfo& t, const std::string& why) const {
    throw Failure(kBadInput, "'" + path_ + "': tensor '" + t.name + "': " + why);
  }

  // The logical [B, H, S, D] of a rank-4 tensor; `expect` (stored order, -1 = any) must match.
  Dims dims(const st::TensorInfo& t, Layout layout, const std::vector<int64_t>& expect, const std::string& pat,
            const std::string& why) const {
    bool ok = t.shape.size() == 4;
    for (size_t i = 0; ok && i < 4; ++i) ok = expect[i] < 0 || expect[i] == t.shape[i];
    if (!ok)
      bad(t, "expected shape " + shape_str(expect) + " (" + pat + " for --layout " + layout_name(layout) +
                 (why.empty() ? "" : "; " + why) + "), got " + shape_str(t.shape));
    if (layout == Layout::bhsd) return {t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
    return {t.shape[0], t.shape[2], t.shape[1], t.shape[3]};
  }

  void same_dtype(const st::TensorInfo& t, const st::TensorInfo& q) const {
    if (t.dtype != q.dtype)
      bad(t, std::string("expected dtype ") + st::dtype_name(q.dtype) + " (the dtype of q), got " +
                 st::dtype_name(t.dtype));
  }

  std::vector<float> f32(const st::TensorInfo& t) const { return archive_->to_f32(t); }

  HostTensor load(const st::TensorInfo& t, Layout layout, const Dims& d) const {
    HostTensor h(to_fb(t.dtype), layout, d.b, d.h, d.s, d.d);
    const auto src = archive_->bytes(t);
    std::copy(src.begin(), src.end(), h.bytes().begin()); // same order and dtype: a plain copy
    return h;
  }

 private:
  std::string path_;
  std::optional<st::Archive> archive_;
};

void check_writable(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw Failure(kOutput, "cannot write '" + path + "': is a directory");
  auto dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  if (::access(dir.c_str(), W_OK) != 0)
    throw Failure(kOutput, "cannot write '" + path + "': " + std::strerror(errno) + " (" + dir.string() + ")");
}

std::map<std::string, std::string> metadata(const char* command, const Problem& p) {
  char scale[32];
  std::snprintf(scale, sizeof scale, "%.9g", p.effective_scale());
  return {{"producer", std::string("flashback ") + fb_version()},
          {"command", command},
          {"layout", layout_name(p.layout)},
          {"causal", p.causal ? "true" : "false"},
          {"window", std::to_string(p.window_left) + "," + std::to_string(p.right())},
          {"scale", scale}};
}

void write_output(const std::string& path, const std::vector<st::TensorRef>& tensors,
                  const std::map<std::string, std::string>& meta) {
  const std::string err = st::write_file(path, tensors, meta);
  if (!err.empty()) throw Failure(kOutput, err);
}

st::TensorRef ref_of(const char* name, const HostTensor& t) {
  return {name, to_st(t.dtype()), t.stored_shape(), t.bytes()};
}
st::TensorRef lse_ref(const std::vector<float>& lse, const Problem& p) {
  return st::f32_tensor("lse", {p.batch, p.heads_q, p.seqlen_q}, lse);
}

// q, k, v read and checked against each other.
struct Inputs {
  Problem p{};
  HostTensor q, k, v;
};

Inputs read_qkv(const Input& in, const MaskFlags& flags) {
  Inputs r;
  Problem& p = r.p;
  apply_mask_flags(flags, p);
  const Layout L = p.layout;
  const auto& q = in.require("q");
  const auto& k = in.require("k");
  const auto& v = in.require("v");
  const Dims dq = in.dims(q, L, {-1, -1, -1, -1}, pattern(L, "Hq", "Sq", "D"), "");
  in.same_dtype(k, q);
  in.same_dtype(v, q);
  const Dims dk = in.dims(k, L, stored(L, dq.b, -1, -1, dq.d), pattern(L, "Hk", "Sk", "D"), "B and D of q");
  const Dims dv = in.dims(v, L, stored(L, dq.b, dk.h, dk.s, -1), pattern(L, "Hk", "Sk", "Dv"), "B, Hk and Sk of k");
  if (dk.h == 0 || dq.h % dk.h != 0)
    in.bad(k, "expected a head count that divides q's " + std::to_string(dq.h) + " (grouped-query heads), got " +
                  std::to_string(dk.h));
  p.batch = dq.b, p.heads_q = dq.h, p.seqlen_q = dq.s, p.head_dim = dq.d;
  p.heads_kv = dk.h, p.seqlen_k = dk.s, p.head_dim_v = dv.d;
  p.dtype = to_fb(q.dtype);
  r.q = in.load(q, L, dq);
  r.k = in.load(k, L, dk);
  r.v = in.load(v, L, dv);
  return r;
}

void forward(const Problem& p, const HostTensor& q, const HostTensor& k, const HostTensor& v, HostTensor& o,
             std::vector<float>& lse) {
  const fb_tensor tq = q.view(), tk = k.view(), tv = v.view(), to = o.view();
  const fb_tensor tl = fb_tensor_contiguous3(lse.data(), FB_F32, p.batch, p.heads_q, p.seqlen_q);
  const fb_params params = p.params();
  check_library(fb_forward(&tq, &tk, &tv, &to, &tl, &params, nullptr, 0), p.dtype, "forward");
}

const char* kLayoutHelp =
    "\nTensors (by name): q [B,Hq,Sq,D], k [B,Hk,Sk,D], v [B,Hk,Sk,Dv] with --layout bhsd, or [B,S,H,D] with\n"
    "--layout bshd; lse is always [B,Hq,Sq] f32. q, k, v, do and o share one dtype, F32, BF16 or F16 (as far\n"
    "as the library supports it); the outputs are written in it.";

} // namespace

CLI::App* add_forward_command(CLI::App& app, FileFlags& f) {
  auto* cmd = app.add_subcommand("forward", "Read q, k, v from a safetensors file; write o and lse");
  cmd->footer(std::string("Reads q, k, v; writes o and lse.") + kLayoutHelp + "\n\n" + app.get_footer());
  cmd->add_option("--in", f.in, "Input safetensors file")->required();
  cmd->add_option("--out", f.out, "Output safetensors file (o in q's layout and dtype, lse)")->required();
  add_mask_flags(cmd, f.mask);
  return cmd;
}

CLI::App* add_backward_command(CLI::App& app, FileFlags& f) {
  auto* cmd = app.add_subcommand("backward", "Read q, k, v, do (o, lse) from a safetensors file; write dq, dk, dv, o, lse");
  cmd->footer(std::string("Reads q, k, v, do and, optionally, o and lse (computed by the forward when absent);\n"
                          "writes dq, dk, dv, o and lse.") +
              kLayoutHelp + "\ndo and o are [B,Hq,Sq,Dv] in the same layout.\n\n" + app.get_footer());
  cmd->add_option("--in", f.in, "Input safetensors file")->required();
  cmd->add_option("--out", f.out, "Output safetensors file (dq, dk, dv, o, lse)")->required();
  add_mask_flags(cmd, f.mask);
  return cmd;
}

int run_forward(const FileFlags& f) {
  std::optional<Progress> progress(std::in_place, "forward");
  progress->stage("reading " + f.in);
  const Input in(f.in);
  Inputs x = read_qkv(in, f.mask);
  const Problem& p = x.p;
  check_writable(f.out);
  HostTensor o(p.dtype, p.layout, p.batch, p.heads_q, p.seqlen_q, p.head_dim_v);
  std::vector<float> lse(static_cast<size_t>(p.batch * p.heads_q * p.seqlen_q));
  progress->stage("computing");
  forward(p, x.q, x.k, x.v, o, lse);
  progress->stage("writing " + f.out);
  write_output(f.out, {ref_of("o", o), lse_ref(lse, p)}, metadata("forward", p));
  return kOk;
}

int run_backward(const FileFlags& f) {
  std::optional<Progress> progress(std::in_place, "backward");
  progress->stage("reading " + f.in);
  const Input in(f.in);
  Inputs x = read_qkv(in, f.mask);
  const Problem& p = x.p;
  const Layout L = p.layout;
  const auto& qi = in.require("q");
  const auto& doi = in.require("do");
  const std::vector<int64_t> o_shape = stored(L, p.batch, p.heads_q, p.seqlen_q, p.head_dim_v);
  const std::string o_pattern = pattern(L, "Hq", "Sq", "Dv");
  in.same_dtype(doi, qi);
  const Dims dd = in.dims(doi, L, o_shape, o_pattern, "B, Hq, Sq of q and Dv of v");
  const HostTensor dout = in.load(doi, L, dd);

  HostTensor o(p.dtype, L, p.batch, p.heads_q, p.seqlen_q, p.head_dim_v);
  std::vector<float> lse(static_cast<size_t>(p.batch * p.heads_q * p.seqlen_q));
  const auto* oi = in.find("o");
  const auto* lsei = in.find("lse");
  if (oi && lsei) {
    in.same_dtype(*oi, qi);
    o = in.load(*oi, L, in.dims(*oi, L, o_shape, o_pattern, "B, Hq, Sq of q and Dv of v"));
    const std::vector<int64_t> lse_shape = {p.batch, p.heads_q, p.seqlen_q};
    if (lsei->dtype != st::DType::F32)
      in.bad(*lsei, std::string("expected dtype F32 (lse is always f32), got ") + st::dtype_name(lsei->dtype));
    if (lsei->shape != lse_shape)
      in.bad(*lsei, "expected shape " + shape_str(lse_shape) + " ([B, Hq, Sq] in every layout), got " +
                        shape_str(lsei->shape));
    lse = in.f32(*lsei);
  }
  check_writable(f.out);
  if (!(oi && lsei)) {
    if (oi || lsei)
      std::fprintf(stderr, "flashback: note: '%s' has '%s' but not '%s'; recomputing o and lse with the forward\n",
                   f.in.c_str(), oi ? "o" : "lse", oi ? "lse" : "o");
    progress->stage("forward (o and lse are not in the input)");
    forward(p, x.q, x.k, x.v, o, lse);
  }
  HostTensor dq(p.dtype, L, p.batch, p.heads_q, p.seqlen_q, p.head_dim);
  HostTensor dk(p.dtype, L, p.batch, p.heads_kv, p.seqlen_k, p.head_dim);
  HostTensor dv(p.dtype, L, p.batch, p.heads_kv, p.seqlen_k, p.head_dim_v);
  progress->stage("computing");
  {
    const fb_tensor tq = x.q.view(), tk = x.k.view(), tv = x.v.view(), to = o.view(), tdo = dout.view();
    const fb_tensor tdq = dq.view(), tdk = dk.view(), tdv = dv.view();
    const fb_tensor tl = fb_tensor_contiguous3(lse.data(), FB_F32, p.batch, p.heads_q, p.seqlen_q);
    const fb_params params = p.params();
    check_library(fb_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, nullptr, &params, nullptr, 0), p.dtype,
                  "backward");
  }
  progress->stage("writing " + f.out);
  write_output(f.out, {ref_of("dq", dq), ref_of("dk", dk), ref_of("dv", dv), ref_of("o", o), lse_ref(lse, p)},
               metadata("backward", p));
  return kOk;
}

} // namespace flashback::cli
