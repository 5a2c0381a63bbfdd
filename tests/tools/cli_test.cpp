// The flashback program end to end: files written with the safetensors writer, the built binary run
// on them, its outputs read back and compared with the float64 reference; exit codes and messages of
// the error paths; check, bench --json, info and --help.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "reference.h"
#include "safetensors.h"

namespace st = flashback::safetensors;
namespace fs = std::filesystem;

namespace {

struct Result {
  int code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Random values that float32 holds exactly, so the file and the reference see the same inputs.
std::vector<float> random_values(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Dense [B, H, S, D] <-> the layout's storage order.
std::vector<float> to_layout(const std::vector<float>& bhsd, int64_t b, int64_t h, int64_t s, int64_t d, bool bshd) {
  if (!bshd) return bhsd;
  std::vector<float> out(bhsd.size());
  for (int64_t ib = 0; ib < b; ++ib)
    for (int64_t ih = 0; ih < h; ++ih)
      for (int64_t is = 0; is < s; ++is)
        for (int64_t id = 0; id < d; ++id)
          out[((ib * s + is) * h + ih) * d + id] = bhsd[((ib * h + ih) * s + is) * d + id];
  return out;
}
std::vector<float> from_layout(const std::vector<float>& stored, int64_t b, int64_t h, int64_t s, int64_t d,
                               bool bshd) {
  if (!bshd) return stored;
  std::vector<float> out(stored.size());
  for (int64_t ib = 0; ib < b; ++ib)
    for (int64_t ih = 0; ih < h; ++ih)
      for (int64_t is = 0; is < s; ++is)
        for (int64_t id = 0; id < d; ++id)
          out[((ib * h + ih) * s + is) * d + id] = stored[((ib * s + is) * h + ih) * d + id];
  return out;
}
std::vector<int64_t> stored_shape(int64_t b, int64_t h, int64_t s, int64_t d, bool bshd) {
  return bshd ? std::vector<int64_t>{b, s, h, d} : std::vector<int64_t>{b, h, s, d};
}

// The program's documented f32 tolerance: max|out - ref| <= 1e-4 * max|ref|. Equal infinities
// (the lse of a row that sees no key) match.
void expect_close(const std::string& name, const std::vector<float>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size()) << name;
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i])) {
      ASSERT_EQ(static_cast<double>(got[i]), want[i]) << name << "[" << i << "]";
      continue;
    }
    ASSERT_TRUE(std::isfinite(got[i])) << name << "[" << i << "] = " << got[i];
    max_err = std::max(max_err, std::abs(got[i] - want[i]));
    max_ref = std::max(max_ref, std::abs(want[i]));
  }
  EXPECT_LE(max_err, 1e-4 * std::max(max_ref, 1e-30)) << name << ": max|err| " << max_err << ", max|ref| " << max_ref;
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (char& c : name)
      if (c == '/') c = '_';
    dir_ = fs::temp_directory_path() / ("flashback_cli_" + std::to_string(::getpid()) + "_" + name);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_); // kept on failure, to look at
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  Result run(const std::string& args) const {
    const std::string out = path("stdout.txt"), err = path("stderr.txt");
    const std::string cmd = std::string("'") + FLASHBACK_CLI + "' " + args + " >'" + out + "' 2>'" + err + "'";
    const int status = std::system(cmd.c_str());
    Result r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  // An error: the expected code, one line on stderr starting "flashback: " and containing `text`.
  void expect_error(const Result& r, int code, const std::string& text) const {
    EXPECT_EQ(r.code, code) << r.err;
    EXPECT_TRUE(r.err.starts_with("flashback: ")) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(text), std::string::npos) << "stderr: " << r.err << "\nexpected: " << text;
  }

  fs::path dir_;
};

// --- forward / backward against the reference --------------------------------------------------------

struct Case {
  const char* name;
  ref::Shape s;
  ref::Options o;
  bool bshd;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string flags_of(const Case& c) {
  std::string f = c.bshd ? " --layout bshd" : " --layout bhsd";
  if (c.o.causal) f += " --causal";
  if (c.o.window_left != -1 || c.o.window_right != -1)
    f += " --window " + std::to_string(c.o.window_left) + "," + std::to_string(c.o.window_right);
  if (c.o.scale > 0) {
    std::ostringstream s;
    s.precision(17);
    s << c.o.scale;
    f += " --scale " + s.str();
  }
  return f;
}

// Shapes around small tiles, GQA, Sq != Sk (including rows that see no key), Dv != D.
const Case kCases[] = {
    {"bhsd_plain_gqa", {2, 4, 2, 33, 47, 16, 16}, {}, false},
    {"bshd_causal_rows_without_keys", {1, 3, 1, 40, 29, 8, 8}, {true, -1, -1, 0}, true},
    {"bhsd_window_dv", {1, 2, 2, 50, 50, 32, 24}, {false, 5, 3, 0}, false},
    {"bshd_window_left_scale", {2, 2, 1, 17, 64, 16, 16}, {false, 8, -1, 0.3}, true},
    {"bhsd_causal_and_window", {1, 2, 1, 31, 31, 8, 8}, {true, 4, -1, 0}, false},
};

class CliCase : public Cli, public ::testing::WithParamInterface<Case> {
 protected:
  struct Data {
    std::vector<float> q, k, v, dout; // dense [B, H, S, D]
  };
  Data make() const {
    const ref::Shape& s = GetParam().s;
    Data d;
    d.q = random_values(s.batch * s.heads_q * s.seqlen_q * s.head_dim, 1);
    d.k = random_values(s.batch * s.heads_kv * s.seqlen_k * s.head_dim, 2);
    d.v = random_values(s.batch * s.heads_kv * s.seqlen_k * s.head_dim_v, 3);
    d.dout = random_values(s.batch * s.heads_q * s.seqlen_q * s.head_dim_v, 4);
    return d;
  }
  // Stores a dense tensor in the case's layout; the vector must outlive the write.
  st::TensorRef tensor(const char* name, std::vector<float>& storage, const std::vector<float>& dense, int64_t h,
                       int64_t s, int64_t d) const {
    const auto& sh = GetParam().s;
    storage = to_layout(dense, sh.batch, h, s, d, GetParam().bshd);
    return st::f32_tensor(name, stored_shape(sh.batch, h, s, d, GetParam().bshd), storage);
  }
  // Reads a 4-d output back as dense [B, H, S, D], checking its stored shape.
  std::vector<float> read4(const st::Archive& a, const char* name, int64_t h, int64_t s, int64_t d) const {
    const auto& sh = GetParam().s;
    const auto* t = a.find(name);
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    EXPECT_EQ(t->dtype, st::DType::F32);
    EXPECT_EQ(t->shape, stored_shape(sh.batch, h, s, d, GetParam().bshd)) << name;
    return from_layout(a.to_f32(*t), sh.batch, h, s, d, GetParam().bshd);
  }
  std::vector<float> read_lse(const st::Archive& a) const {
    const auto& sh = GetParam().s;
    const auto* t = a.find("lse");
    EXPECT_NE(t, nullptr);
    if (!t) return {};
    EXPECT_EQ(t->shape, (std::vector<int64_t>{sh.batch, sh.heads_q, sh.seqlen_q}));
    return a.to_f32(*t);
  }
};

TEST_P(CliCase, ForwardMatchesReference) {
  const Case& c = GetParam();
  const ref::Shape& s = c.s;
  const Data d = make();
  std::vector<float> sq, sk, sv;
  const std::vector<st::TensorRef> in = {tensor("q", sq, d.q, s.heads_q, s.seqlen_q, s.head_dim),
                                         tensor("k", sk, d.k, s.heads_kv, s.seqlen_k, s.head_dim),
                                         tensor("v", sv, d.v, s.heads_kv, s.seqlen_k, s.head_dim_v)};
  ASSERT_EQ(st::write_file(path("in.safetensors"), in), "");
  const Result r = run("forward --in " + path("in.safetensors") + " --out " + path("out.safetensors") + flags_of(c));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  auto out = st::Archive::from_file(path("out.safetensors"));
  ASSERT_TRUE(out.ok()) << out.error();
  EXPECT_EQ(out.value().tensors().size(), 2u);

  std::vector<double> o, lse;
  ref::forward(s, c.o, widen(d.q), widen(d.k), widen(d.v), o, lse);
  expect_close("o", read4(out.value(), "o", s.heads_q, s.seqlen_q, s.head_dim_v), o);
  expect_close("lse", read_lse(out.value()), lse);
}

TEST_P(CliCase, BackwardMatchesReference) {
  const Case& c = GetParam();
  const ref::Shape& s = c.s;
  const Data d = make();
  std::vector<double> o, lse, dq, dk, dv, delta;
  ref::forward(s, c.o, widen(d.q), widen(d.k), widen(d.v), o, lse);
  ref::backward(s, c.o, widen(d.q), widen(d.k), widen(d.v), widen(d.dout), dq, dk, dv, delta);

  // Without o and lse (the program runs the forward), then with them (from the reference).
  for (bool with_forward : {false, true}) {
    SCOPED_TRACE(with_forward ? "o and lse given" : "o and lse computed");
    std::vector<float> sq, sk, sv, sdo, so;
    std::vector<st::TensorRef> in = {tensor("q", sq, d.q, s.heads_q, s.seqlen_q, s.head_dim),
                                     tensor("k", sk, d.k, s.heads_kv, s.seqlen_k, s.head_dim),
                                     tensor("v", sv, d.v, s.heads_kv, s.seqlen_k, s.head_dim_v),
                                     tensor("do", sdo, d.dout, s.heads_q, s.seqlen_q, s.head_dim_v)};
    const std::vector<float> of(o.begin(), o.end()), lsef(lse.begin(), lse.end());
    if (with_forward) {
      in.push_back(tensor("o", so, of, s.heads_q, s.seqlen_q, s.head_dim_v));
      in.push_back(st::f32_tensor("lse", {s.batch, s.heads_q, s.seqlen_q}, lsef));
    }
    ASSERT_EQ(st::write_file(path("in.safetensors"), in), "");
    const Result r = run("backward --in " + path("in.safetensors") + " --out " + path("out.safetensors") + flags_of(c));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    auto out = st::Archive::from_file(path("out.safetensors"));
    ASSERT_TRUE(out.ok()) << out.error();
    const auto& a = out.value();
    EXPECT_EQ(a.tensors().size(), 5u);
    expect_close("dq", read4(a, "dq", s.heads_q, s.seqlen_q, s.head_dim), dq);
    expect_close("dk", read4(a, "dk", s.heads_kv, s.seqlen_k, s.head_dim), dk);
    expect_close("dv", read4(a, "dv", s.heads_kv, s.seqlen_k, s.head_dim_v), dv);
    expect_close("o", read4(a, "o", s.heads_q, s.seqlen_q, s.head_dim_v), o);
    expect_close("lse", read_lse(a), lse);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CliCase, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// --- Error paths -----------------------------------------------------------------------------------

// q, k, v (and do) of a small valid problem, with overrides.
std::vector<st::TensorRef> small_inputs(std::vector<std::vector<float>>& keep, std::vector<int64_t> q_shape = {1, 2, 8, 4},
                                        std::vector<int64_t> k_shape = {1, 2, 8, 4},
                                        std::vector<int64_t> v_shape = {1, 2, 8, 4}) {
  auto numel = [](const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return static_cast<size_t>(n);
  };
  keep = {random_values(numel(q_shape), 1), random_values(numel(k_shape), 2), random_values(numel(v_shape), 3)};
  return {st::f32_tensor("q", q_shape, keep[0]), st::f32_tensor("k", k_shape, keep[1]),
          st::f32_tensor("v", v_shape, keep[2])};
}

TEST_F(Cli, MalformedInputFileIsExitCode3) {
  std::ofstream(path("bad.safetensors")) << "this is not a safetensors file";
  const Result r = run("forward --in " + path("bad.safetensors") + " --out " + path("o.safetensors"));
  expect_error(r, 3, "bad.safetensors");
  EXPECT_NE(r.err.find("header size"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(path("o.safetensors")));

  // A valid size field over a broken header.
  std::string header = R"({"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},})";
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(header.size());
  std::ofstream(path("bad2.safetensors"), std::ios::binary) << bytes << header << "abcd";
  expect_error(run("backward --in " + path("bad2.safetensors") + " --out " + path("o.safetensors")), 3,
               "header is not valid JSON");
}

TEST_F(Cli, MissingFileIsExitCode3) {
  expect_error(run("forward --in " + path("nope.safetensors") + " --out " + path("o.safetensors")), 3,
               "No such file or directory");
}

TEST_F(Cli, MissingTensorIsExitCode3) {
  std::vector<std::vector<float>> keep;
  auto in = small_inputs(keep);
  in.pop_back(); // no v
  ASSERT_EQ(st::write_file(path("in.safetensors"), in), "");
  expect_error(run("forward --in " + path("in.safetensors") + " --out " + path("o.safetensors")), 3,
               "missing tensor 'v' (the file holds: q, k)");
  // backward needs do as well
  expect_error(run("backward --in " + path("in.safetensors") + " --out " + path("o.safetensors")), 3,
               "missing tensor");
}

TEST_F(Cli, ShapesThatDisagreeAreExitCode3) {
  std::vector<std::vector<float>> keep;
  ASSERT_EQ(st::write_file(path("d.safetensors"), small_inputs(keep, {1, 2, 8, 4}, {1, 2, 8, 5}, {1, 2, 8, 4})), "");
  expect_error(run("forward --in " + path("d.safetensors") + " --out " + path("o.safetensors")), 3,
               "tensor 'k': expected shape [1, *, *, 4] ([B, Hk, Sk, D] for --layout bhsd; B and D of q), got [1, 2, 8, 5]");
  ASSERT_EQ(st::write_file(path("v.safetensors"), small_inputs(keep, {1, 2, 8, 4}, {1, 2, 8, 4}, {1, 2, 9, 4})), "");
  expect_error(run("forward --in " + path("v.safetensors") + " --out " + path("o.safetensors")), 3, "tensor 'v'");
  ASSERT_EQ(st::write_file(path("r.safetensors"), small_inputs(keep, {2, 8, 4}, {1, 2, 8, 4}, {1, 2, 8, 4})), "");
  expect_error(run("forward --in " + path("r.safetensors") + " --out " + path("o.safetensors")), 3,
               "tensor 'q': expected shape [*, *, *, *]");
  ASSERT_EQ(st::write_file(path("g.safetensors"), small_inputs(keep, {1, 3, 8, 4}, {1, 2, 8, 4}, {1, 2, 8, 4})), "");
  expect_error(run("forward --in " + path("g.safetensors") + " --out " + path("o.safetensors")), 3,
               "divides q's 3");
  // The layout decides what the dims mean: k [1, 1, 3, 4] is Hk=1 in BHSD (fine) but Hk=3 in BSHD,
  // which does not divide q's 8 heads ([1, 2, 8, 4] = B, S, H, D).
  ASSERT_EQ(st::write_file(path("l.safetensors"), small_inputs(keep, {1, 2, 8, 4}, {1, 1, 3, 4}, {1, 1, 3, 4})), "");
  EXPECT_EQ(run("forward --layout bhsd --in " + path("l.safetensors") + " --out " + path("o.safetensors")).code, 0);
  expect_error(run("forward --layout bshd --in " + path("l.safetensors") + " --out " + path("o.safetensors")), 3,
               "tensor 'k': expected a head count that divides q's 8");

  // backward: do must be o's shape
  auto in = small_inputs(keep);
  const std::vector<float> dout(1 * 2 * 7 * 4, 1.0f);
  in.push_back(st::f32_tensor("do", {1, 2, 7, 4}, dout));
  ASSERT_EQ(st::write_file(path("b.safetensors"), in), "");
  expect_error(run("backward --in " + path("b.safetensors") + " --out " + path("o.safetensors")), 3,
               "tensor 'do': expected shape [1, 2, 8, 4]");
}

TEST_F(Cli, MixedDtypesAreExitCode3) {
  std::vector<std::vector<float>> keep;
  auto in = small_inputs(keep);
  const std::vector<uint16_t> half(64, 0x3c00);
  in[1] = {"k", st::DType::BF16, {1, 2, 8, 4}, std::as_bytes(std::span(half))};
  ASSERT_EQ(st::write_file(path("in.safetensors"), in), "");
  expect_error(run("forward --in " + path("in.safetensors") + " --out " + path("o.safetensors")), 3,
               "tensor 'k': expected dtype F32 (the dtype of q), got BF16");
}

TEST_F(Cli, UnwritableOutputIsExitCode5) {
  std::vector<std::vector<float>> keep;
  ASSERT_EQ(st::write_file(path("in.safetensors"), small_inputs(keep)), "");
  expect_error(run("forward --in " + path("in.safetensors") + " --out " + path("no/such/dir/o.safetensors")), 5,
               "cannot write");
  expect_error(run("forward --in " + path("in.safetensors") + " --out " + dir_.string()), 5, "is a directory");
}

TEST_F(Cli, LibraryErrorIsExitCode4) {
  std::vector<std::vector<float>> keep;
  // head_dim 300 is over the library's limit: only the library knows it.
  ASSERT_EQ(st::write_file(path("in.safetensors"), small_inputs(keep, {1, 1, 2, 300}, {1, 1, 2, 300}, {1, 1, 2, 4})),
            "");
  expect_error(run("forward --in " + path("in.safetensors") + " --out " + path("o.safetensors")), 4, "head_dim");
}

TEST_F(Cli, Bf16IsRunOrClearlyUnsupported) {
  // BF16 inputs: until the library accepts them, a clear "not supported yet" (exit 4); afterwards, results.
  std::vector<float> q = random_values(2 * 16 * 8, 1), k = random_values(2 * 16 * 8, 2), v = random_values(2 * 16 * 8, 3);
  std::vector<uint16_t> qb, kb, vb;
  for (auto [src, dst] : {std::pair{&q, &qb}, {&k, &kb}, {&v, &vb}}) {
    for (float& x : *src) {
      dst->push_back(st::f32_to_bf16(x));
      x = st::bf16_to_f32(dst->back()); // the values the file holds
    }
  }
  const std::vector<st::TensorRef> in = {{"q", st::DType::BF16, {1, 2, 16, 8}, std::as_bytes(std::span(qb))},
                                         {"k", st::DType::BF16, {1, 2, 16, 8}, std::as_bytes(std::span(kb))},
                                         {"v", st::DType::BF16, {1, 2, 16, 8}, std::as_bytes(std::span(vb))}};
  ASSERT_EQ(st::write_file(path("in.safetensors"), in), "");
  const Result r = run("forward --in " + path("in.safetensors") + " --out " + path("o.safetensors"));
  if (r.code == 4) {
    expect_error(r, 4, "BF16 is not supported yet");
    return;
  }
  ASSERT_EQ(r.code, 0) << r.err;
  auto out = st::Archive::from_file(path("o.safetensors"));
  ASSERT_TRUE(out.ok()) << out.error();
  const auto* o = out.value().find("o");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->dtype, st::DType::BF16);
  std::vector<double> ro, rlse;
  ref::forward({1, 2, 2, 16, 16, 8, 8}, {}, widen(q), widen(k), widen(v), ro, rlse);
  const auto got = out.value().to_f32(*o);
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    max_err = std::max(max_err, std::abs(got[i] - ro[i]));
    max_ref = std::max(max_ref, std::abs(ro[i]));
  }
  EXPECT_LE(max_err, 2e-2 * max_ref);
}

TEST_F(Cli, BadFlagsAreExitCode2) {
  expect_error(run("bench --window 3"), 2, "--window: expected L,R with each >= -1 (-1: unbounded), got '3'");
  expect_error(run("bench --window -2,0"), 2, "--window: expected L,R with each >= -1");
  expect_error(run("bench --batch 0"), 2, "--batch: expected an integer >= 1, got '0'");
  expect_error(run("bench --seqlen abc"), 2, "--seqlen: expected an integer >= 1, got 'abc'");
  expect_error(run("bench --threads 5000"), 2, "--threads: expected an integer in 0..1024, got '5000'");
  expect_error(run("check --scale -1"), 2, "--scale: expected a finite number > 0, got '-1'");
  expect_error(run("check --dtype f64"), 2, "--dtype: expected one of f32, bf16, f16, got 'f64'");
  expect_error(run("check --heads 4 --kv-heads 3"), 2, "--kv-heads: expected a divisor of --heads (4), got 3");
  expect_error(run("forward --out x"), 2, "--in");
  expect_error(run("forward --in x --out y --layout sbhd"), 2, "--layout: expected one of bhsd, bshd, got 'sbhd'");
  expect_error(run("bench --no-such-flag"), 2, "--no-such-flag");
  expect_error(run(""), 2, "expected a command: bench, check, forward, backward or info");
  expect_error(run("frobnicate"), 2, "unknown command 'frobnicate'");
}

// --- check, bench, info, help ---------------------------------------------------------------------

TEST_F(Cli, CheckPassesOnASmallShape) {
  const Result r = run("check --batch 2 --heads 4 --kv-heads 2 --seqlen-q 37 --seqlen-k 53 --head-dim 16 --head-dim-v 24 "
                    "--causal --layout bshd");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("passed"), std::string::npos) << r.out;
  for (const char* name : {"o ", "lse", "dq", "dk", "dv"}) EXPECT_NE(r.out.find(name), std::string::npos) << name;

  const Result j = run("check --seqlen 40 --heads 2 --head-dim 8 --window 3,2 --json");
  ASSERT_EQ(j.code, 0) << j.out << j.err;
  const auto doc = nlohmann::json::parse(j.out);
  EXPECT_TRUE(doc["check"]["passed"].get<bool>());
  EXPECT_EQ(doc["check"]["outputs"].size(), 5u);
  EXPECT_EQ(doc["params"]["window_left"], 3);
}

// Where every row sees a single key, dq and dk are 0 by cancellation (P = 1, dP = delta) and the
// library returns f32 rounding there: check and bench's sampled check measure it against the size of
// what cancels instead of failing it against a zero reference.
TEST_F(Cli, CheckMeasuresCancelledGradientsAgainstWhatCancels) {
  for (const char* shape : {"--seqlen-q 70 --seqlen-k 1", "--seqlen 70 --window 0,0"}) {
    for (const char* dtype : {"f32", "bf16", "f16"}) {
      SCOPED_TRACE(std::string(shape) + " " + dtype);
      const std::string flags = std::string(" --heads 4 --kv-heads 2 --head-dim 24 --json --dtype ") + dtype + " " + shape;
      const Result c = run("check" + flags);
      ASSERT_EQ(c.code, 0) << c.out << c.err;
      const auto doc = nlohmann::json::parse(c.out)["check"];
      EXPECT_TRUE(doc["passed"].get<bool>()) << c.out;
      for (const char* grad : {"dq", "dk"}) {
        const auto& g = doc["outputs"][grad];
        EXPECT_EQ(g["max_abs_ref"].get<double>(), 0) << grad;
        EXPECT_GT(g["relative_to_cancelled"].get<double>(), 0) << grad;
        EXPECT_EQ(g["tolerance"].get<double>(), 1e-4) << grad; // f32 rounding, in every dtype
      }
      EXPECT_FALSE(doc["outputs"]["dv"].contains("relative_to_cancelled"));
      const Result b = run("bench --repeats 1" + flags);
      ASSERT_EQ(b.code, 0) << b.out << b.err;
      EXPECT_TRUE(nlohmann::json::parse(b.out)["check"]["passed"].get<bool>()) << b.out;
    }
  }
}

// --progress always shows the line without a terminal; --progress-after 0 from the start: a
// "\r"-updated line naming the command and its stage, cleared ("\r\033[K") when the run ends.
TEST_F(Cli, ProgressLineAppearsWhenAskedFor) {
  const Result r = run("check --batch 1 --heads 2 --seqlen 256 --head-dim 32 --progress always --progress-after 0");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("\r\033[Kflashback check: "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.size() >= 4 ? r.err.substr(r.err.size() - 4) : r.err, "\r\033[K") << r.err;
  const Result quiet = run("check --batch 1 --heads 2 --seqlen 256 --head-dim 32 --progress never --progress-after 0");
  ASSERT_EQ(quiet.code, 0) << quiet.out << quiet.err;
  EXPECT_EQ(quiet.err, "");
}

TEST_F(Cli, BenchJsonIsParseable) {
  const Result r = run("bench --batch 1 --heads 2 --kv-heads 1 --seqlen 64 --head-dim 32 --repeats 3 --warmup 1 --json");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.err, ""); // no progress line when stderr is not a terminal
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["command"], "bench");
  EXPECT_EQ(doc["shape"]["seqlen_q"], 64);
  EXPECT_EQ(doc["shape"]["heads_kv"], 1);
  EXPECT_EQ(doc["repeats"], 3);
  EXPECT_FALSE(doc["isa"].get<std::string>().empty());
  EXPECT_GE(doc["threads"].get<int>(), 1);
  for (const char* pass : {"forward", "backward"}) {
    const auto& p = doc[pass];
    EXPECT_EQ(p["seconds"].size(), 3u);
    EXPECT_GT(p["median_s"].get<double>(), 0);
    EXPECT_LE(p["min_s"].get<double>(), p["median_s"].get<double>());
    EXPECT_LE(p["median_s"].get<double>(), p["max_s"].get<double>());
    EXPECT_GT(p["tflops"].get<double>(), 0);
  }
  // FlashAttention's count: 4 * B * Hq * Sq * Sk * D, backward 2.5x.
  EXPECT_DOUBLE_EQ(doc["flops"]["forward"].get<double>(), 4.0 * 2 * 64 * 64 * 32);
  EXPECT_DOUBLE_EQ(doc["flops"]["backward"].get<double>(), 2.5 * 4.0 * 2 * 64 * 64 * 32);
  EXPECT_TRUE(doc["check"]["passed"].get<bool>());
}

TEST_F(Cli, BenchCountsFlops) {
  // causal: half of Sq*Sk; window: the exact count of visible pairs.
  const Result c = run("bench --batch 1 --heads 1 --seqlen 16 --head-dim 8 --repeats 1 --no-check --causal --json");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(c.out)["flops"]["forward"].get<double>(), 4.0 * 16 * 16 * 8 / 2);
  const Result w = run("bench --batch 1 --heads 1 --seqlen 16 --head-dim 8 --head-dim-v 4 --repeats 1 --no-check --window 2,1 --json");
  ASSERT_EQ(w.code, 0) << w.err;
  const auto doc = nlohmann::json::parse(w.out);
  // Each of the 16 rows sees j in [i-2, i+1] within [0, 16): 4 keys except 1 + 2 at the edges.
  const double pairs = 16 * 4 - 2 - 1 - 1;
  EXPECT_DOUBLE_EQ(doc["flops"]["pairs_per_head"].get<double>(), pairs);
  EXPECT_DOUBLE_EQ(doc["flops"]["forward"].get<double>(), 2.0 * pairs * (8 + 4));
  EXPECT_TRUE(doc["check"].contains("skipped"));
}

TEST_F(Cli, BenchTableAndDtypes) {
  const Result r = run("bench --heads 2 --seqlen 32 --head-dim 16 --repeats 2");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* text : {"forward", "backward", "TFLOP/s", "median", "passed"})
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.out;
  for (const char* dtype : {"bf16", "f16"}) {
    const Result d = run(std::string("bench --heads 2 --seqlen 32 --head-dim 16 --repeats 1 --json --dtype ") + dtype);
    if (d.code == 4) {
      expect_error(d, 4, std::string(dtype == std::string("bf16") ? "BF16" : "F16") + " is not supported yet");
    } else {
      EXPECT_EQ(d.code, 0) << d.err;
      EXPECT_TRUE(nlohmann::json::parse(d.out)["check"]["passed"].get<bool>());
    }
  }
}

TEST_F(Cli, InfoAndHelp) {
  const Result info = run("info");
  EXPECT_EQ(info.code, 0);
  EXPECT_NE(info.out.find("isa:"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("threads:"), std::string::npos) << info.out;
  const Result j = run("info --json");
  ASSERT_EQ(j.code, 0);
  EXPECT_FALSE(nlohmann::json::parse(j.out)["version"].get<std::string>().empty());
  EXPECT_TRUE(nlohmann::json::parse(j.out).contains("FLASHBACK_EMULATION")) << j.out;
  EXPECT_NE(info.out.find("kernels:"), std::string::npos) << info.out;
  const nlohmann::json kernels = nlohmann::json::parse(j.out)["kernels"];
  for (const char* dtype : {"f32", "bf16", "f16"}) EXPECT_FALSE(kernels[dtype].get<std::string>().empty()) << j.out;
  // f16 runs the f32 kernels, but the tiles at the amx level (from head dims of 64 up: README)
  const std::string isa = nlohmann::json::parse(j.out)["isa"].get<std::string>();
  if (isa.rfind("amx", 0) == 0)
    EXPECT_EQ(kernels["f16"], isa) << j.out;
  else
    EXPECT_EQ(kernels["f16"], kernels["f32"]) << j.out;
  for (const char* cmd : {"", "bench ", "check ", "forward ", "backward ", "info "}) {
    const Result h = run(std::string(cmd) + "--help");
    EXPECT_EQ(h.code, 0) << cmd;
    EXPECT_NE(h.out.find("Usage"), std::string::npos) << cmd;
    EXPECT_NE(h.out.find("Exit codes"), std::string::npos) << cmd;
  }
}

} // namespace
