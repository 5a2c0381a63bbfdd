// Which instruction set the CPU backend runs: probed once (cpuid + what the OS saves), capped by the
// environment variable FLASHBACK_ISA (scalar | avx2 | avx512 | avx512bf16 | amx), like oneDNN's
// ONEDNN_MAX_CPU_ISA.
#pragma once

namespace flashback::cpu {

// Ordered: each level implies the ones below it.
// avx512bf16 adds AVX512_BF16 to avx512; amx adds AMX-TILE and AMX-BF16.
// avx512bf16 runs avx512's kernels for f32 and f16, and for bf16 too unless bf16_dot_preferred() (below):
// bf16 products with vdpbf16ps were measured slower than converting bf16 to f32 once and multiplying
// with FMA on an Intel Xeon (2.5x; vdpbf16ps runs at half the f32 FMA rate there), but faster on AMD
// Zen 4 and Zen 5 (vdpbf16ps at 2.0x and 1.8x the FMA rate in FLOP; BENCHMARKS.md).
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512bf16 = 3, amx = 4 };

const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* isa);

// What this machine and OS support, ignoring FLASHBACK_ISA.
Isa machine_isa();
// machine_isa(), or the emulated level above it, capped by FLASHBACK_ISA; read once, on first use.
Isa active_isa();

// FLASHBACK_EMULATION=<level> (avx512, avx512bf16 or amx; for tests) on a machine with AVX2 below that
// level: the levels above the machine's, up to <level>, run their kernels' code with software
// stand-ins for what the machine lacks: AVX-512 vectors as pairs of AVX2 vectors (the same blocking,
// tiles and masks as the real avx512 kernels), AMX tiles as arrays (the same packing, padding, edges
// and per-thread configuration). Slow; the outputs are within the same tolerances but not the same
// bits as on real hardware. FLASHBACK_ISA still caps the level.
Isa emulated_level(); // <level> when the emulation is on, else scalar
// Whether bf16 storage takes its products with vdpbf16ps (dot_bf16_micro.h) rather than converting to
// f32 for the f32 kernels: at the avx512bf16 level where the CPU runs vdpbf16ps faster than FMA per
// FLOP (AMD family 25, Zen 4, and later; not Intel's Xeons, where it runs at half the FMA rate) or
// where that level is emulated. FLASHBACK_BF16_DOT=1 asks for it at any level from avx512bf16 up
// (amx included, instead of the tiles), =0 never (for tests and benchmarks).
bool bf16_dot_preferred();
// The CPUs where vdpbf16ps runs faster than f32 FMA per FLOP, by vendor and family (cpuid's family,
// extended family added), measured (BENCHMARKS.md): AMD from family 25 (Zen 4, 2.0x; Zen 3, also
// family 25, has no AVX512_BF16 and never reaches the avx512bf16 level) and 26 (Zen 5, 1.8x); not
// Intel's Xeons (0.5x).
constexpr bool bf16_dot_fast_on(bool amd, unsigned family) { return amd && family >= 0x19; }
// The name of a level, with "-emulated" when the machine lacks it.
const char* level_name(Isa isa);
// level_name(active_isa()).
const char* active_isa_name();

} // namespace flashback::cpu
