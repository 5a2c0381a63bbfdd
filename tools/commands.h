// The flashback program's subcommands: each registers its flags on the app and runs from them.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "common.h"

namespace flashback::cli {

struct BenchFlags {
  ProblemFlags problem;
  int64_t warmup = 1, repeats = 5;
  bool json = false, no_check = false;
};
CLI::App* add_bench_command(CLI::App& app, BenchFlags& flags);
int run_bench(const BenchFlags& flags);

struct CheckFlags {
  ProblemFlags problem;
  bool json = false;
};
CLI::App* add_check_command(CLI::App& app, CheckFlags& flags);
int run_check(const CheckFlags& flags);

struct FileFlags {
  std::string in, out;
  MaskFlags mask;
};
CLI::App* add_forward_command(CLI::App& app, FileFlags& flags);
CLI::App* add_backward_command(CLI::App& app, FileFlags& flags);
int run_forward(const FileFlags& flags);
int run_backward(const FileFlags& flags);

struct InfoFlags {
  bool json = false;
};
CLI::App* add_info_command(CLI::App& app, InfoFlags& flags);
int run_info(const InfoFlags& flags);

} // namespace flashback::cli
