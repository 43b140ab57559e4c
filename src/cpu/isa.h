// Runtime SIMD dispatch for the CPU backend. Every kernel exists in three builds of the same
// packed layout (packed_linear.h): AVX-512 with VNNI int8 dot products, AVX2 + FMA + F16C (int8
// pmaddubsw products for 4-bit codes, fp32 for 8-bit), and portable scalar code. The best one the
// CPU supports is used unless WNA16_CPU_ISA names another (the tests run every one the machine can
// execute).
#pragma once
#include <string>
#include <vector>

namespace wna16::cpu {

enum class Isa {
  Scalar,      // portable C++
  Avx2,        // AVX2 + FMA + F16C: 4-bit codes x int8 activation terms (pmaddubsw); 8-bit in fp32
  Avx512Vnni,  // AVX-512 F/BW/VL + VNNI: codes as u8, activations split in int8 terms, vpdpbusd
};

const char* isa_name(Isa isa);
Isa parse_isa(const std::string& s);  // "scalar" | "avx2" | "avx512vnni"; throws Error naming s
bool isa_supported(Isa isa);          // can this CPU (and OS) run it?
std::vector<Isa> supported_isas();    // ascending
// The ISA new layers use: WNA16_CPU_ISA when set (throws Error if unsupported), else the best.
Isa default_isa();

}  // namespace wna16::cpu
