// The safetensors reader and writer: round trips, and every malformed input is an error message
// (never a crash, a hang or an out-of-bounds read; run under ASan to see the last).
#include "safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>

namespace st = flashback::safetensors;

namespace {

// A file from a header text and a data buffer of `data_bytes` bytes (0, 1, 2, ...).
std::vector<std::byte> file_of(const std::string& header, size_t data_bytes) {
  std::vector<std::byte> out(8 + header.size() + data_bytes);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(out.data() + 8, header.data(), header.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = static_cast<std::byte>(i & 0xff);
  return out;
}

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

// The parser's error, or "" when it accepts the file.
std::string error_of(const std::vector<std::byte>& file) {
  auto r = st::parse_header(file);
  return r.ok() ? "" : r.error();
}

std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

std::filesystem::path temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  auto dir = std::filesystem::temp_directory_path() /
             ("flashback_st_" + std::to_string(::getpid()) + "_" + info->name());
  std::filesystem::create_directories(dir);
  return dir;
}

} // namespace

// --- Round trips -------------------------------------------------------------------------------------

TEST(SafetensorsWrite, RoundTripThroughBytes) {
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f};
  const std::vector<float> scalar = {42.0f};
  const std::vector<uint16_t> half = {0x3c00, 0xc000, 0x7bff}; // 1, -2, 65504
  const std::vector<uint16_t> bf = {0x3f80, 0xc040};           // 1, -3
  const std::vector<st::TensorRef> tensors = {
      st::f32_tensor("a", {2, 3}, a),
      st::f32_tensor("scalar", {}, scalar),
      st::f32_tensor("empty", {0, 5}, {}),
      {"half", st::DType::F16, {3}, std::as_bytes(std::span(half))},
      {"bf", st::DType::BF16, {1, 2}, std::as_bytes(std::span(bf))},
  };
  auto bytes = st::serialize(tensors, {{"producer", "test"}, {"note", "x"}});
  ASSERT_TRUE(bytes.ok()) << bytes.error();
  auto archive = st::Archive::from_bytes(bytes.value());
  ASSERT_TRUE(archive.ok()) << archive.error();
  const auto& ar = archive.value();
  EXPECT_EQ(ar.header().data_start % 8, 0u);
  EXPECT_EQ(ar.header().metadata.at("producer"), "test");
  EXPECT_EQ(ar.header().metadata.size(), 2u);
  ASSERT_EQ(ar.tensors().size(), 5u);

  const auto* ta = ar.find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, st::DType::F32);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  const auto va = ar.to_f32(*ta);
  ASSERT_EQ(va.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(std::bit_cast<uint32_t>(va[i]), std::bit_cast<uint32_t>(a[i]));

  const auto* ts = ar.find("scalar");
  ASSERT_NE(ts, nullptr);
  EXPECT_TRUE(ts->shape.empty());
  EXPECT_EQ(ts->numel(), 1);
  EXPECT_EQ(ar.to_f32(*ts), scalar);

  const auto* te = ar.find("empty");
  ASSERT_NE(te, nullptr);
  EXPECT_EQ(te->numel(), 0);
  EXPECT_EQ(ar.bytes(*te).size(), 0u);

  EXPECT_EQ(ar.to_f32(*ar.find("half")), (std::vector<float>{1.0f, -2.0f, 65504.0f}));
  EXPECT_EQ(ar.to_f32(*ar.find("bf")), (std::vector<float>{1.0f, -3.0f}));
  EXPECT_EQ(ar.find("missing"), nullptr);
}

TEST(SafetensorsWrite, RoundTripThroughFile) {
  const auto dir = temp_dir();
  const std::string path = (dir / "t.safetensors").string();
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f;
  const std::vector<st::TensorRef> tensors = {st::f32_tensor("v", {10, 100}, v)};
  ASSERT_EQ(st::write_file(path, tensors), "");
  auto archive = st::Archive::from_file(path);
  ASSERT_TRUE(archive.ok()) << archive.error();
  EXPECT_EQ(archive.value().to_f32(*archive.value().find("v")), v);
  // Nothing but the file itself is left behind (the temporary was renamed).
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);
  std::filesystem::remove_all(dir);
}

TEST(SafetensorsRead, AcceptsHandWrittenHeaders) {
  // Unpadded, keys in any order, tensors listed out of data order, extra fields ignored.
  const std::string header = R"({"b":)" + entry("F32", "[2]", "[8,16]") + R"(,"a":{"shape":[2],"data_offsets":[0,8],)"
                             R"("dtype":"F32","extra":[1,2]},"__metadata__":{"format":"pt"}})";
  auto r = st::Archive::from_bytes(file_of(header, 16));
  ASSERT_TRUE(r.ok()) << r.error();
  ASSERT_EQ(r.value().tensors().size(), 2u);
  EXPECT_EQ(r.value().tensors()[0].name, "a"); // sorted by offset
  EXPECT_EQ(r.value().header().metadata.at("format"), "pt");
  // Trailing spaces (the spec's padding) and an empty file of tensors are fine.
  EXPECT_EQ(error_of(file_of("{}      ", 0)), "");
  // Zero-size tensors may share an offset.
  EXPECT_EQ(error_of(file_of(R"({"a":)" + entry("F32", "[0]", "[0,0]") + R"(,"b":)" + entry("F32", "[0, 3]", "[0,0]") +
                             R"(,"c":)" + entry("BF16", "[2]", "[0,4]") + "}",
                             4)),
            "");
  // No elements, whatever the other dims: numel() is 0, not the overflowing product of the rest.
  auto empty = st::Archive::from_bytes(file_of(R"({"e":)" + entry("F32", "[4066116818427387904, 4, 0]", "[0,0]") + "}", 0));
  ASSERT_TRUE(empty.ok()) << empty.error();
  EXPECT_EQ(empty.value().tensors()[0].numel(), 0);
  EXPECT_TRUE(empty.value().to_f32(empty.value().tensors()[0]).empty());
}

TEST(SafetensorsRead, FileErrors) {
  auto missing = st::Archive::from_file("/nonexistent/dir/x.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().find("No such file"), std::string::npos) << missing.error();
  const auto dir = temp_dir();
  auto directory = st::Archive::from_file(dir.string());
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.error().find("is a directory"), std::string::npos) << directory.error();
  std::filesystem::remove_all(dir);
  // A device could block or never end: only regular files are read.
  auto device = st::Archive::from_file("/dev/zero");
  ASSERT_FALSE(device.ok());
  EXPECT_NE(device.error().find("not a regular file"), std::string::npos) << device.error();
}

// --- Malformed input: each is an error naming the problem ---------------------------------------------

struct Malformed {
  const char* name;
  std::vector<std::byte> file;
  const char* expected; // a substring of the error
};

void PrintTo(const Malformed& m, std::ostream* os) { *os << m.name; }

std::vector<Malformed> malformed_cases() {
  const std::string ok_a = R"("a":)" + entry("F32", "[2]", "[0,8]");
  std::vector<Malformed> c = {
      {"empty_file", {}, "truncated file"},
      {"five_bytes", bytes_of(std::string("\x02\0\0\0\0", 5)), "truncated file: expected at least 8 bytes (the header size), got 5"},
      {"size_larger_than_file", [] {
         auto f = file_of("{}", 0);
         f[0] = std::byte{100};
         return f;
       }(), "larger than the rest of the file"},
      {"size_near_2_64", [] {
         auto f = file_of("{}", 0);
         for (int i = 0; i < 8; ++i) f[i] = std::byte{0xff};
         return f;
       }(), "larger than the rest of the file"},
      {"zero_size_header", file_of("", 0), "not valid JSON"},
      {"not_json", file_of("{not json", 0), "not valid JSON"},
      {"json_then_garbage", file_of("{} x", 0), "not valid JSON"},
      {"comments_are_not_json", file_of("{/* c */}", 0), "not valid JSON"},
      {"invalid_utf8", file_of("{\"\xff\xfe\":1}", 0), "not valid JSON"},
      {"nul_in_header", file_of(std::string("{\0}", 3), 0), "not valid JSON"},
      {"array_header", file_of("[]", 0), "expected a JSON object, got array"},
      {"number_header", file_of("3", 0), "expected a JSON object, got number"},
      {"string_header", file_of("\"x\"", 0), "expected a JSON object, got string"},
      {"deep_nesting", file_of(std::string(100000, '[') + std::string(100000, ']'), 0), "nested deeper"},
      {"entry_not_object", file_of(R"({"a":3})", 0), "tensor 'a': expected an object"},
      {"entry_null", file_of(R"({"a":null})", 0), "expected an object"},
      {"missing_dtype", file_of(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), "missing 'dtype'"},
      {"dtype_not_string", file_of(R"({"a":{"dtype":1,"shape":[2],"data_offsets":[0,8]}})", 8),
       "'dtype' must be a string"},
      {"unknown_dtype", file_of(R"({"a":)" + entry("F99", "[2]", "[0,8]") + "}", 8), "unknown dtype 'F99'"},
      {"lowercase_dtype", file_of(R"({"a":)" + entry("f32", "[2]", "[0,8]") + "}", 8), "unknown dtype 'f32'"},
      {"unsupported_i64", file_of(R"({"a":)" + entry("I64", "[1]", "[0,8]") + "}", 8),
       "dtype I64 is not supported"},
      {"unsupported_f64", file_of(R"({"a":)" + entry("F64", "[1]", "[0,8]") + "}", 8),
       "dtype F64 is not supported"},
      {"unsupported_bool", file_of(R"({"a":)" + entry("BOOL", "[8]", "[0,8]") + "}", 8),
       "dtype BOOL is not supported"},
      {"missing_shape", file_of(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8), "missing 'shape'"},
      {"shape_not_array", file_of(R"({"a":)" + entry("F32", "2", "[0,8]") + "}", 8), "'shape' must be an array"},
      {"negative_dim", file_of(R"({"a":)" + entry("F32", "[-2]", "[0,8]") + "}", 8),
       "shape[0] must be a non-negative integer"},
      {"fractional_dim", file_of(R"({"a":)" + entry("F32", "[1, 2.5]", "[0,8]") + "}", 8),
       "shape[1] must be a non-negative integer"},
      {"float_dim", file_of(R"({"a":)" + entry("F32", "[2.0]", "[0,8]") + "}", 8),
       "shape[0] must be a non-negative integer"},
      {"string_dim", file_of(R"({"a":)" + entry("F32", R"(["2"])", "[0,8]") + "}", 8),
       "shape[0] must be a non-negative integer"},
      {"dim_above_int64", file_of(R"({"a":)" + entry("F32", "[18446744073709551615]", "[0,8]") + "}", 8),
       "shape[0] must be a non-negative integer"},
      {"dim_above_uint64", file_of(R"({"a":)" + entry("F32", "[18446744073709551616]", "[0,8]") + "}", 8),
       "shape[0] must be a non-negative integer"},
      {"numel_overflow", file_of(R"({"a":)" + entry("F32", "[4294967296, 4294967296, 16]", "[0,8]") + "}", 8),
       "more elements than int64 can count"},
      {"numel_past_int64", file_of(R"({"a":)" + entry("F32", "[4611686018427387904, 2]", "[0,8]") + "}", 8),
       "more elements than int64 can count"},
      {"number_beyond_double", file_of(R"({"a":1e400})", 0), "not valid JSON"},
      {"bytes_overflow", file_of(R"({"a":)" + entry("F32", "[4611686018427387904]", "[0,8]") + "}", 8),
       "more bytes than 64 bits"},
      {"missing_offsets", file_of(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "missing 'data_offsets'"},
      {"offsets_one_value", file_of(R"({"a":)" + entry("F32", "[2]", "[0]") + "}", 8),
       "'data_offsets' must be an array [begin, end]"},
      {"offsets_three_values", file_of(R"({"a":)" + entry("F32", "[2]", "[0,8,9]") + "}", 8),
       "'data_offsets' must be an array [begin, end]"},
      {"offsets_object", file_of(R"({"a":)" + entry("F32", "[2]", R"({"b":0})") + "}", 8),
       "'data_offsets' must be an array [begin, end]"},
      {"offsets_negative", file_of(R"({"a":)" + entry("F32", "[2]", "[-8,0]") + "}", 8),
       "two non-negative integers"},
      {"offsets_fractional", file_of(R"({"a":)" + entry("F32", "[2]", "[0,8.5]") + "}", 8),
       "two non-negative integers"},
      {"begin_after_end", file_of(R"({"a":)" + entry("F32", "[2]", "[8,0]") + "}", 8), "begin is after end"},
      {"end_past_buffer", file_of(R"({"a":)" + entry("F32", "[100]", "[0,400]") + "}", 16),
       "runs past the end of the data buffer (16 bytes)"},
      {"end_at_2_64_minus_1",
       file_of(R"({"a":)" + entry("F32", "[2]", "[0,18446744073709551615]") + "}", 8), "runs past the end"},
      {"size_mismatch", file_of(R"({"a":)" + entry("F32", "[2]", "[0,12]") + "}", 12),
       "hold 12 bytes, but shape [2] of F32 needs 8"},
      {"size_mismatch_bf16", file_of(R"({"a":)" + entry("BF16", "[2, 2]", "[0,16]") + "}", 16),
       "shape [2, 2] of BF16 needs 8"},
      {"overlap", file_of("{" + ok_a + R"(,"b":)" + entry("F32", "[2]", "[4,12]") + "}", 12), "overlap"},
      {"same_range_twice", file_of("{" + ok_a + R"(,"b":)" + entry("F32", "[2]", "[0,8]") + "}", 8), "overlap"},
      {"hole", file_of("{" + ok_a + R"(,"b":)" + entry("F32", "[2]", "[12,20]") + "}", 20),
       "bytes [8, 12) of the data buffer belong to no tensor"},
      {"hole_at_start", file_of(R"({"a":)" + entry("F32", "[2]", "[4,12]") + "}", 12), "bytes [0, 4)"},
      {"trailing_bytes", file_of("{" + ok_a + "}", 12), "trailing bytes"},
      {"duplicate_name", file_of("{" + ok_a + "," + ok_a + "}", 8), "duplicate tensor name 'a'"},
      {"duplicate_field", file_of(R"({"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8),
       "duplicate key 'dtype'"},
      {"metadata_not_object", file_of(R"({"__metadata__":[1]})", 0), "__metadata__: expected an object"},
      {"metadata_value_not_string", file_of(R"({"__metadata__":{"k":1}})", 0),
       "__metadata__ 'k': expected a string value"},
      {"control_chars_in_name_are_escaped", file_of("{\"a\\u0001\":3}", 0), "tensor 'a\\x01'"},
  };
  return c;
}

class SafetensorsMalformed : public ::testing::TestWithParam<Malformed> {};

TEST_P(SafetensorsMalformed, IsAnErrorNamingTheProblem) {
  const Malformed& m = GetParam();
  const std::string error = error_of(m.file);
  ASSERT_FALSE(error.empty()) << "accepted";
  EXPECT_NE(error.find(m.expected), std::string::npos) << "error: " << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << "one line: " << error;
  // The archive reports the same thing.
  auto archive = st::Archive::from_bytes(m.file);
  ASSERT_FALSE(archive.ok());
  EXPECT_EQ(archive.error(), error);
}

INSTANTIATE_TEST_SUITE_P(Cases, SafetensorsMalformed, ::testing::ValuesIn(malformed_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// Random damage to a valid file: every outcome is an error or a header whose tensors lie inside the
// file. Cheap stand-in for a fuzzer (and one to run under ASan).
TEST(SafetensorsRead, SurvivesRandomDamage) {
  const std::vector<float> a(6, 1.0f), b(3, 2.0f);
  const std::vector<st::TensorRef> tensors = {st::f32_tensor("alpha", {2, 3}, a), st::f32_tensor("b", {3}, b)};
  const auto valid = st::serialize(tensors, {{"k", "v"}}).value();
  std::mt19937_64 rng(7);
  int accepted = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    auto f = valid;
    const int action = static_cast<int>(rng() % 4);
    if (action == 0) {
      f.resize(rng() % (f.size() + 1)); // truncate
    } else if (action == 1) {
      const size_t flips = 1 + rng() % 4;
      for (size_t i = 0; i < flips; ++i) f[rng() % f.size()] ^= static_cast<std::byte>(1u << (rng() % 8));
    } else if (action == 2) {
      f[8 + rng() % (f.size() - 8)] = static_cast<std::byte>("{}[]\",:0123456789-.eE \x80"[rng() % 24]);
    } else {
      for (int i = 0; i < 8; ++i) f[i] = static_cast<std::byte>(rng()); // random size field
    }
    auto r = st::parse_header(f);
    if (!r.ok()) {
      EXPECT_FALSE(r.error().empty());
      continue;
    }
    ++accepted;
    for (const auto& t : r.value().tensors) {
      ASSERT_LE(t.begin, t.end);
      ASSERT_LE(r.value().data_start + t.end, f.size());
    }
  }
  EXPECT_GT(accepted, 0); // some flips land in the data and keep the file valid
}

// --- Writer errors -------------------------------------------------------------------------------------

TEST(SafetensorsWrite, RefusesBadTensors) {
  const std::vector<float> two = {1, 2};
  auto err = [](std::vector<st::TensorRef> t) {
    auto r = st::serialize(t);
    return r.ok() ? std::string() : r.error();
  };
  EXPECT_NE(err({st::f32_tensor("a", {2}, two), st::f32_tensor("a", {2}, two)}).find("duplicate name"),
            std::string::npos);
  EXPECT_NE(err({st::f32_tensor("__metadata__", {2}, two)}).find("reserved"), std::string::npos);
  EXPECT_NE(err({st::f32_tensor("a", {3}, two)}).find("needs 3 elements, got 8 bytes"), std::string::npos);
  EXPECT_NE(err({st::f32_tensor("a", {-2}, two)}).find("negative"), std::string::npos);
  EXPECT_NE(err({st::f32_tensor("a", {int64_t{1} << 62, 4}, two)}).find("more elements than int64"), std::string::npos);
  // No elements, whatever the other dims (as the reader counts): written, and read back the same.
  const std::vector<float> none;
  const std::vector<st::TensorRef> empty_tensor = {st::f32_tensor("e", {int64_t{1} << 62, 4, 0}, none)};
  auto empty = st::serialize(empty_tensor);
  ASSERT_TRUE(empty.ok()) << empty.error();
  auto back = st::Archive::from_bytes(empty.value());
  ASSERT_TRUE(back.ok()) << back.error();
  EXPECT_EQ(back.value().tensors()[0].shape, (std::vector<int64_t>{int64_t{1} << 62, 4, 0}));
  EXPECT_NE(err({st::f32_tensor("\xff", {2}, two)}).find("UTF-8"), std::string::npos);
  EXPECT_NE(st::write_file("/nonexistent/dir/x.safetensors", std::vector{st::f32_tensor("a", {2}, two)})
                .find("cannot write '/nonexistent/dir/x.safetensors'"),
            std::string::npos);
}

// --- Float conversions ---------------------------------------------------------------------------------

TEST(SafetensorsConvert, F16MatchesTheCompiler) {
#ifndef __FLT16_MANT_DIG__ // _Float16: GCC 12 on x86-64; clang from 15
  GTEST_SKIP() << "this compiler has no _Float16 here";
#else
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = st::f16_to_f32(static_cast<uint16_t>(h));
    const float want = static_cast<float>(std::bit_cast<_Float16>(static_cast<uint16_t>(h)));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << h;
    // Every f16 survives the trip back.
    ASSERT_EQ(st::f32_to_f16(got), h) << h;
  }
  std::mt19937 rng(3);
  std::vector<float> values = {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, 1e9f, -1e9f, 5.96e-8f, 2.98e-8f,
                               2.99e-8f, 1e-10f, std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min(), 6.1e-5f, 6.09e-5f};
  for (int i = 0; i < 200000; ++i) values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  for (float f : values) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(st::f16_to_f32(st::f32_to_f16(f))));
      continue;
    }
    const uint16_t want = std::bit_cast<uint16_t>(static_cast<_Float16>(f));
    ASSERT_EQ(st::f32_to_f16(f), want) << f;
  }
#endif
}

TEST(SafetensorsConvert, Bf16RoundsToNearestEven) {
  EXPECT_EQ(st::f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(st::f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80); // tie: to even (down)
  EXPECT_EQ(st::f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82); // tie: to even (up)
  EXPECT_EQ(st::f32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(st::f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80); // rounds up to inf
  EXPECT_EQ(st::f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_TRUE(std::isnan(st::bf16_to_f32(st::f32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(st::bf16_to_f32(st::f32_to_bf16(std::bit_cast<float>(0x7f800001u))))); // payload low bits
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = st::bf16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      ASSERT_EQ(st::f32_to_bf16(f), h);
    }
  }
}
