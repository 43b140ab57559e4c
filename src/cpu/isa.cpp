#include "cpu/isa.h"

#include <cstdlib>

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

bool isa_supported(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // NOTE: __builtin_cpu_supports also checks that the OS saves the wider registers (XGETBV).
  __builtin_cpu_init();
  switch (isa) {
    case Isa::Scalar: return true;
    case Isa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::Avx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             isa_supported(Isa::Avx2);
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
  if (const char* env = std::getenv("WNA16_CPU_ISA"); env && *env) {
    const Isa want = parse_isa(env);
    if (!isa_supported(want))
      throw Error(std::string("WNA16_CPU_ISA=") + env + " is not supported by this CPU");
    return want;
  }
  return supported_isas().back();
}

}  // namespace wna16::cpu
