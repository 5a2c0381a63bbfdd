// The machine's f32 FMA ceiling: a register-only probe (no memory traffic), measured in the same run
// as the benchmarks it is compared with.
#pragma once

// FLOP/s of `threads` threads each running independent FMA chains for about `seconds`; uses the widest
// vector FMA this machine has (AVX-512, else AVX2 + FMA). Returns 0 without either.
double fma_ceiling_flops(int threads, double seconds);
const char* fma_ceiling_isa();

// The same for bf16 products: vdpbf16ps (AVX512_BF16) and AMX TDPBF16PS. 0 when the CPU lacks it.
double dpbf16_ceiling_flops(int threads, double seconds);
double amx_ceiling_flops(int threads, double seconds); // needs the library's AMX permission first

// The library's f32 microkernel (AVX-512, else AVX2 + FMA, as fma_ceiling_isa) on m x n x k blocks in
// L1, one per thread (bench/kernel_probe.h). 0 without either or on a non-x86 build.
double f32_microkernel_flops(int threads, double seconds, int m, int n, int k);

// The library's AMX microkernel (cpu/amx/amx_micro.h) on m x n x k blocks in L1, one per thread,
// with A as one bf16 (hi_lo false: the products of S and dP) or as hi + lo (true: those of P and dS);
// FLOP counted per TDPBF16PS, so hi + lo counts twice; after_vector: each product right after a
// stretch of AVX-512 work, only the products timed. 0 where the library does not run AMX.
double amx_microkernel_flops(int threads, double seconds, int m, int n, int k, bool hi_lo, bool after_vector = false);

// The library's vdpbf16ps microkernel (cpu/dot_bf16_micro.h) on m x n x k blocks in L1, one per
// thread, A as one bf16 or as hi + lo (FLOP counted per product, so hi + lo counts twice). 0 without
// AVX512_BF16.
double dot_microkernel_flops(int threads, double seconds, int m, int n, int k, bool hi_lo);
