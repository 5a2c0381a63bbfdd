// Which instruction set the CPU backend runs: probed once (cpuid + what the OS saves), capped by the
// environment variable FLASHBACK_ISA (scalar | avx2 | avx512 | avx512bf16 | amx), like oneDNN's
// ONEDNN_MAX_CPU_ISA.
#pragma once

namespace flashback::cpu {

// Ordered: each level implies the ones below it.
// avx512bf16 adds AVX512_BF16 to avx512; amx adds AMX-TILE and AMX-BF16.
// avx512bf16 runs avx512's kernels: bf16 products with vdpbf16ps were measured slower than converting
// bf16 to f32 once and multiplying with FMA (2.5x slower on an Intel Xeon, where vdpbf16ps runs at half
// the f32 FMA rate; no faster on AMD Zen 4), so the level only marks where AMX can be emulated.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512bf16 = 3, amx = 4 };

const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* isa);

// What this machine and OS support, ignoring FLASHBACK_ISA.
Isa machine_isa();
// machine_isa() capped by FLASHBACK_ISA; read once, on first use.
Isa active_isa();

// FLASHBACK_AMX_EMULATION=1 on a machine with AVX512_BF16 but no AMX: the amx level runs the AMX
// kernels on emulated tiles (the same code, tile instructions done in software; slow, for tests).
bool amx_emulated();

// The name of active_isa(), with "-emulated" when amx_emulated().
const char* active_isa_name();

} // namespace flashback::cpu
