#include "cpu/isa.h"

#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "common/knobs.h"
#include "wna16/error.h"

namespace wna16::cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512Vnni: return "avx512vnni";
  }
  return "?";
}

Isa parse_isa(const std::string& s) {
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni})
    if (s == isa_name(i)) return i;
  throw Error("unknown CPU ISA '" + s + "' (expected scalar, avx2 or avx512vnni)");
}

namespace {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// CPUID feature bits plus the OS check (XGETBV: the OS saves the wider registers). Done by hand:
// __builtin_cpu_supports does not know "f16c" in every compiler we build with.
struct X86Features {
  bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512bw = false, avx512vl = false,
       avx512vnni = false;
};

X86Features detect() {
  X86Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return f;
  unsigned xlo = 0, xhi = 0;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool os_avx = (xlo & 0x6u) == 0x6u;        // XMM and YMM state
  const bool os_avx512 = (xlo & 0xE6u) == 0xE6u;   // + opmask, ZMM0-15 high, ZMM16-31
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = os_avx && (b & (1u << 5));
  f.fma = os_avx && fma;
  f.f16c = os_avx && f16c;
  f.avx512f = os_avx512 && (b & (1u << 16));
  f.avx512bw = os_avx512 && (b & (1u << 30));
  f.avx512vl = os_avx512 && (b & (1u << 31));
  f.avx512vnni = os_avx512 && (c & (1u << 11));
  return f;
}
#endif
}  // namespace

bool isa_supported(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const X86Features f = detect();
  switch (isa) {
    case Isa::Scalar: return true;
    case Isa::Avx2: return f.avx2 && f.fma && f.f16c;
    case Isa::Avx512Vnni: return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni && f.avx2 && f.fma && f.f16c;
  }
  return false;
#else
  return isa == Isa::Scalar;
#endif
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> v;
  for (Isa i : {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni})
    if (isa_supported(i)) v.push_back(i);
  return v;
}

Isa default_isa() {
  if (const std::string env = knobs::cpu_isa(); !env.empty()) {
    const Isa want = parse_isa(env);
    if (!isa_supported(want)) throw Error("WNA16_CPU_ISA=" + env + " is not supported by this CPU");
    return want;
  }
  return supported_isas().back();
}

}  // namespace wna16::cpu
