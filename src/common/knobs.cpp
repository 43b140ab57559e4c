#include "common/knobs.h"

#include <cstdlib>
#include <string>

#include "wna16/error.h"

namespace wna16::knobs {
namespace {

// Each variable's name is spelled out at its std::getenv call, so that one grep lists them all.
const char* nonempty(const char* v) { return v && *v ? v : nullptr; }
bool flag(const char* v) { return v && std::string(v) != "0"; }
// A whole number in [lo, hi] and nothing else: a typo must not silently pick a value.
int whole(const char* name, const char* v, int lo, int hi, const char* what) {
  const std::string s = v;
  const bool digits = !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos;
  const long n = digits ? std::stol(s) : -1;
  if (n < lo || n > hi)
    throw Error(std::string(name) + "=" + s + " is not " + what + " from " + std::to_string(lo) + " to " +
                std::to_string(hi));
  return int(n);
}

}  // namespace

int cpu_threads() {
  const char* v = nonempty(std::getenv("WNA16_CPU_THREADS"));
  return v ? whole("WNA16_CPU_THREADS", v, 1, 4096, "a thread count") : 0;
}
std::string cpu_isa() {
  const char* v = nonempty(std::getenv("WNA16_CPU_ISA"));
  return v ? v : "";
}
bool cpu_trace() { return flag(nonempty(std::getenv("WNA16_CPU_TRACE"))); }
bool cuda_debug_sync() { return flag(nonempty(std::getenv("WNA16_CUDA_DEBUG_SYNC"))); }
int diag_stages() {
  const char* v = nonempty(std::getenv("WNA16_DIAG_STAGES"));
  return v ? whole("WNA16_DIAG_STAGES", v, 1, 6, "a stage count") : 6;
}
std::string git_commit() {
  const char* v = nonempty(std::getenv("WNA16_GIT_COMMIT"));
  return v ? v : "";
}

}  // namespace wna16::knobs
