#include "cpu/isa.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define FLASHBACK_X86 1
#endif

namespace flashback::cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512bf16: return "avx512bf16";
    case Isa::amx: return "amx";
  }
  return "?";
}

bool parse_isa(const char* name, Isa* isa) {
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512bf16, Isa::amx})
    if (std::strcmp(name, isa_name(i)) == 0) {
      *isa = i;
      return true;
    }
  return false;
}

#ifdef FLASHBACK_X86
namespace {

unsigned long long xgetbv0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

bool bit(unsigned reg, int b) { return (reg >> b) & 1u; }

// Linux keeps AMX tile state off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA = 18); without it the first tile instruction faults.
bool request_amx_permission() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

Isa probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::scalar;
  const bool osxsave = bit(c, 27), fma = bit(c, 12), f16c = bit(c, 29);
  if (!osxsave) return Isa::scalar;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_saved = (xcr0 & 0x6) == 0x6;           // SSE and AVX state
  const bool zmm_saved = (xcr0 & 0xE6) == 0xE6;         // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool tiles_saved = (xcr0 & 0x60000) == 0x60000; // XTILECFG, XTILEDATA
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Isa::scalar;
  const bool avx2 = bit(b, 5), avx512f = bit(b, 16), avx512dq = bit(b, 17), avx512bw = bit(b, 30),
             avx512vl = bit(b, 31);
  const bool amx_bf16 = bit(d, 22), amx_tile = bit(d, 24);
  const bool avx512_bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && bit(a, 5);
  if (!(ymm_saved && avx2 && fma && f16c)) return Isa::scalar;
  if (!(zmm_saved && avx512f && avx512dq && avx512bw && avx512vl)) return Isa::avx2;
  if (!avx512_bf16) return Isa::avx512;
  if (!(tiles_saved && amx_tile && amx_bf16 && request_amx_permission())) return Isa::avx512bf16;
  return Isa::amx;
}

} // namespace

Isa machine_isa() {
  static const Isa isa = probe();
  return isa;
}

// bf16_dot_fast_on (isa.h) for this CPU.
static bool bf16_dot_fast() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; // "AuthenticAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned family = ((a >> 8) & 0xFu) + (((a >> 8) & 0xFu) == 0xFu ? (a >> 20) & 0xFFu : 0u);
  return bf16_dot_fast_on(amd, family);
}
#else
Isa machine_isa() { return Isa::scalar; }
static bool bf16_dot_fast() { return false; }
#endif

bool bf16_dot_preferred() {
  static const bool preferred = [] {
    const char* env = std::getenv("FLASHBACK_BF16_DOT");
    if (env && *env) {
      if (std::strcmp(env, "1") == 0) return true;
      if (std::strcmp(env, "0") == 0) return false;
      std::fprintf(stderr, "flashback: FLASHBACK_BF16_DOT=%s is not 0 or 1; ignored\n", env);
    }
    // By default at the avx512bf16 level only (the amx level has tiles), where the CPU is fast at it or
    // where the level is emulated (which then tests these kernels).
    return active_isa() == Isa::avx512bf16 && (bf16_dot_fast() || emulated_level() == Isa::avx512bf16);
  }();
  return preferred;
}

Isa emulated_level() {
  static const Isa level = [] {
    const char* env = std::getenv("FLASHBACK_EMULATION");
    Isa wanted;
    if (!env || !*env) return Isa::scalar;
    if (!parse_isa(env, &wanted) || wanted < Isa::avx512) {
      std::fprintf(stderr, "flashback: FLASHBACK_EMULATION=%s is not one of avx512, avx512bf16, amx; ignored\n", env);
      return Isa::scalar;
    }
    const Isa machine = machine_isa();
    return machine >= Isa::avx2 && machine < wanted ? wanted : Isa::scalar;
  }();
  return level;
}

Isa active_isa() {
  static const Isa isa = [] {
    Isa cap = std::max(machine_isa(), emulated_level()), wanted; // the emulated level is above the machine's
    const char* env = std::getenv("FLASHBACK_ISA");
    if (env && *env && !parse_isa(env, &wanted)) {
      // A typo must not silently test or benchmark another instruction set than the one asked for.
      std::fprintf(stderr, "flashback: FLASHBACK_ISA=%s is not one of scalar, avx2, avx512, avx512bf16, amx; ignored\n",
                   env);
    } else if (env && *env && wanted < cap) {
      cap = wanted;
    }
    return cap;
  }();
  return isa;
}

const char* active_isa_name() { return level_name(active_isa()); }

const char* level_name(Isa isa) {
  if (isa <= machine_isa()) return isa_name(isa);
  switch (isa) {
    case Isa::avx512: return "avx512-emulated";
    case Isa::avx512bf16: return "avx512bf16-emulated";
    default: return "amx-emulated";
  }
}

} // namespace flashback::cpu
