// Which instruction set the CPU backend runs: probed once (cpuid + what the OS saves), capped by the
// environment variable FLASHBACK_ISA (scalar | avx2 | avx512 | amx), like oneDNN's ONEDNN_MAX_CPU_ISA.
#pragma once

namespace flashback::cpu {

// Ordered: each level implies the ones below it.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, amx = 3 };

const char* isa_name(Isa isa);
bool parse_isa(const char* name, Isa* isa);

// What this machine and OS support, ignoring FLASHBACK_ISA.
Isa machine_isa();
// machine_isa() capped by FLASHBACK_ISA; read once, on first use.
Isa active_isa();

} // namespace flashback::cpu
