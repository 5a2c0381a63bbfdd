// libFuzzer target: arbitrary bytes into the safetensors reader (tools/safetensors.h).
// The reader must never crash, hang, read outside the bytes it was given or throw; every rejection is a
// message, never an "internal error". What it accepts must be consistent: parse_header and
// Archive::from_bytes agree, the tensors tile the data buffer, every tensor's bytes and values can be
// read, and writing the archive back (serialize) gives a file that reads back the same.
// Build: cmake -DFLASHBACK_FUZZ=ON with clang (RELIABILITY.md); seeds in fuzz/corpus/fuzz_safetensors.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "safetensors.h"

namespace st = flashback::safetensors;

namespace {

[[noreturn]] void fail(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "fuzz_safetensors: %s%s%s\n", what, detail.empty() ? "" : ": ", detail.c_str());
  std::abort();
}

void check(bool ok, const char* what, const std::string& detail = "") {
  if (!ok) fail(what, detail);
}

// guarded() in safetensors.cpp turns an escaped exception into "<stage>: internal error..." or
// "<stage>: out of memory" (the stage being "header" or "reading"); other messages may quote the input.
void check_rejection(const std::string& error) {
  check(!error.empty(), "a rejection without a message");
  for (const char* stage : {"header: ", "reading: "})
    for (const char* what : {"internal error", "out of memory"})
      check(error.rfind(std::string(stage) + what, 0) != 0, "the reader hit an internal error", error);
}

// Everything an accepted archive promises.
void check_archive(const st::Archive& a, size_t file_size) {
  const st::Header& h = a.header();
  check(h.data_start >= 8 && h.data_start <= file_size, "data_start outside the file");
  uint64_t covered = 0;
  for (const st::TensorInfo& t : a.tensors()) {
    check(t.begin == covered, "tensors do not tile the data buffer", t.name);
    check(t.begin <= t.end && t.end <= file_size - h.data_start, "a tensor outside the data buffer", t.name);
    covered = t.end;
    bool empty = false;
    for (int64_t d : t.shape) {
      check(d >= 0, "a negative dim", t.name);
      empty = empty || d == 0;
    }
    uint64_t numel = empty ? 0 : 1;
    for (int64_t d : t.shape)
      if (!empty)
        check(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) && numel <= INT64_MAX,
              "an element count past int64", t.name);
    check(numel * st::dtype_size(t.dtype) == t.end - t.begin, "the byte range does not match the shape", t.name);
    check(t.numel() == static_cast<int64_t>(numel), "TensorInfo::numel() disagrees", t.name);
    const std::span<const std::byte> bytes = a.bytes(t);
    check(bytes.size() == t.end - t.begin, "bytes() has the wrong size", t.name);
    volatile unsigned sum = 0; // read every byte: ASan sees any read outside the file
    for (std::byte b : bytes) sum = sum + static_cast<unsigned>(b);
    const std::vector<float> values = a.to_f32(t);
    check(values.size() == numel, "to_f32() has the wrong size", t.name);
    check(a.find(t.name) == &t, "find() does not find the tensor by its name", t.name);
  }
  check(covered == file_size - h.data_start, "trailing bytes after the last tensor were accepted");
}

// Writing the archive back and reading it again gives the same tensors, bytes and metadata.
void check_round_trip(const st::Archive& a) {
  std::vector<st::TensorRef> refs;
  for (const st::TensorInfo& t : a.tensors()) refs.push_back({t.name, t.dtype, t.shape, a.bytes(t)});
  auto file = st::serialize(refs, a.header().metadata);
  check(file.ok(), "serialize() refuses an archive the reader accepted", file.ok() ? "" : file.error());
  const size_t size = file.value().size();
  auto again = st::Archive::from_bytes(std::move(file).value());
  check(again.ok(), "the reader refuses what serialize() wrote", again.ok() ? "" : again.error());
  const st::Archive& b = again.value();
  check(b.header().metadata == a.header().metadata, "metadata changed in a round trip");
  check(b.tensors().size() == a.tensors().size(), "the tensor count changed in a round trip");
  check(b.header().data_start % 8 == 0, "serialize() did not align the data to 8 bytes");
  for (const st::TensorInfo& t : a.tensors()) {
    const st::TensorInfo* u = b.find(t.name);
    check(u != nullptr, "a tensor was lost in a round trip", t.name);
    check(u->dtype == t.dtype && u->shape == t.shape, "a tensor's dtype or shape changed in a round trip", t.name);
    const auto x = a.bytes(t), y = b.bytes(*u);
    check(x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size()) == 0),
          "a tensor's bytes changed in a round trip", t.name);
  }
  check_archive(b, size);
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* first = reinterpret_cast<const std::byte*>(data);
  // An exactly sized copy: ASan reports a read one byte past the end.
  std::vector<std::byte> file(first, first + size);
  const auto header = st::parse_header(std::span<const std::byte>(file));
  auto archive = st::Archive::from_bytes(file);
  check(header.ok() == archive.ok(), "parse_header and Archive::from_bytes disagree",
        header.ok() ? archive.error() : header.error());
  if (!archive.ok()) {
    check_rejection(archive.error());
    return 0;
  }
  check(header.value().tensors.size() == archive.value().tensors().size(), "the two parses differ");
  check_archive(archive.value(), size);
  check_round_trip(archive.value());
  return 0;
}
