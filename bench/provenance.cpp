// Date and commit of a benchmark run (see provenance.h).
#include "bench/provenance.h"

#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "common/knobs.h"

namespace wna16::bench {

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char b[64];
  std::strftime(b, sizeof b, "%Y-%m-%d %H:%M UTC", &tm);
  return b;
}

std::string git_commit() {
  if (std::string c = knobs::git_commit(); !c.empty()) return c;
  std::string out;
  if (FILE* p = popen("git rev-parse --short=12 HEAD 2>/dev/null", "r")) {
    char b[128];
    while (std::fgets(b, sizeof b, p)) out += b;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

}  // namespace wna16::bench
