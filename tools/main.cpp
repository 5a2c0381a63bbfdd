// flashback: the command-line program. Subcommands bench, check, forward, backward, info; every error
// is one line on stderr and an exit code (see the --help footer).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "common.h"

namespace flashback::cli {

CLI::App* add_info_command(CLI::App& app, InfoFlags& f) {
  auto* cmd = app.add_subcommand("info", "Print the library version, the instruction set it runs and its thread count");
  cmd->add_flag("--json", f.json, "Print one JSON object")->disable_flag_override();
  return cmd;
}

int run_info(const InfoFlags& f) {
  const char* isa_cap = std::getenv("FLASHBACK_ISA");
  const char* threads_env = std::getenv("FLASHBACK_NUM_THREADS");
  const char* emulation = std::getenv("FLASHBACK_EMULATION");
  if (f.json) {
    nlohmann::json j = {{"version", fb_version()},
                        {"isa", fb_cpu_isa()},
                        {"threads", default_threads()},
                        {"FLASHBACK_ISA", isa_cap ? isa_cap : ""},
                        {"kernels",
                         {{"f32", fb_cpu_kernels_isa(FB_F32)},
                          {"bf16", fb_cpu_kernels_isa(FB_BF16)},
                          {"f16", fb_cpu_kernels_isa(FB_F16)}}},
                        {"FLASHBACK_EMULATION", emulation ? emulation : ""},
                        {"FLASHBACK_NUM_THREADS", threads_env ? threads_env : ""}};
    std::cout << j.dump(2) << std::endl;
    return kOk;
  }
  std::printf("flashback %s\n", fb_version());
  std::printf("isa:     %s%s%s\n", fb_cpu_isa(), isa_cap ? "  (capped by FLASHBACK_ISA=" : "",
              isa_cap ? (std::string(isa_cap) + ")").c_str() : "");
  if (emulation && *emulation)
    std::printf("         FLASHBACK_EMULATION=%s: levels this machine lacks run emulated (tests; slow)\n",
                emulation);
  const std::string f16 = fb_cpu_kernels_isa(FB_F16);
  std::printf("kernels: f32 %s, bf16 %s, f16 %s%s  (the level of each dtype's kernels; README \"Instruction sets\")\n",
              fb_cpu_kernels_isa(FB_F32), fb_cpu_kernels_isa(FB_BF16), f16.c_str(),
              f16.rfind("amx", 0) == 0 ? " (head dims >= 64; the f32 kernels below)" : "");
  std::printf("threads: %d  (%s)\n", default_threads(),
              threads_env ? ("FLASHBACK_NUM_THREADS=" + std::string(threads_env)).c_str()
                          : "OpenMP's default; set FLASHBACK_NUM_THREADS or --threads to change it");
  return kOk;
}

} // namespace flashback::cli

int main(int argc, char** argv) {
  using namespace flashback::cli;
  CLI::App app("flashback: exact attention forward and backward on the CPU", "flashback");
  app.footer(
      "Exit codes: 0 ok, 1 an output over tolerance (check, bench), 2 bad flags, 3 bad input file,\n"
      "4 library error, 5 the output cannot be written. Run 'flashback <command> --help' for a command's flags.");
  app.set_version_flag("--version", std::string(fb_version()));
  app.require_subcommand(1);
  app.fallthrough(); // --progress may come after the subcommand
  std::string progress = "auto";
  double progress_after = 2;
  app.add_option("--progress", progress,
                 "Progress line on stderr for runs over --progress-after: auto (when stderr is a terminal), "
                 "always, never")
      ->check(one_of({"auto", "always", "never"}))
      ->capture_default_str();
  app.add_option("--progress-after", progress_after, "Seconds a run lasts before its progress line appears")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();

  BenchFlags bench;
  CheckFlags check;
  FileFlags forward, backward;
  InfoFlags info;
  CLI::App* bench_cmd = add_bench_command(app, bench);
  CLI::App* check_cmd = add_check_command(app, check);
  CLI::App* forward_cmd = add_forward_command(app, forward);
  CLI::App* backward_cmd = add_backward_command(app, backward);
  CLI::App* info_cmd = add_info_command(app, info);

  if (argc == 1) {
    std::fprintf(stderr, "flashback: expected a command: bench, check, forward, backward or info (see --help)\n");
    return kUsage;
  }
  if (argv[1][0] != '-') {
    bool known = false;
    for (const CLI::App* cmd : app.get_subcommands({})) known = known || cmd->get_name() == argv[1];
    if (!known) {
      std::fprintf(stderr, "flashback: unknown command '%s' (expected bench, check, forward, backward or info; see --help)\n",
                   argv[1]);
      return kUsage;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "flashback: %s (see --help)\n", e.what());
    return kUsage;
  }

  Progress::set_mode(progress == "always" ? Progress::Mode::always
                     : progress == "never" ? Progress::Mode::never
                                           : Progress::Mode::automatic);
  Progress::set_delay(std::chrono::milliseconds(static_cast<int64_t>(progress_after * 1000)));
  try {
    if (*bench_cmd) return run_bench(bench);
    if (*check_cmd) return run_check(check);
    if (*forward_cmd) return run_forward(forward);
    if (*backward_cmd) return run_backward(backward);
    if (*info_cmd) return run_info(info);
  } catch (const Failure& e) {
    std::fprintf(stderr, "flashback: %s\n", e.what());
    return e.code;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flashback: out of memory\n");
    return kLibrary;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashback: internal error: %s\n", e.what());
    return kLibrary;
  }
  return kUsage;
}
