// Where and when a benchmark ran, for the header of its table, its JSON/CSV and its plot.
#pragma once
#include <string>

namespace wna16::bench {

// "2026-12-02 14:03 UTC".
std::string utc_now();
// The commit: $WNA16_GIT_COMMIT (scripts/gpu-check sets it where the checkout has no .git), else
// `git rev-parse --short=12 HEAD`, else "unknown".
std::string git_commit();

}  // namespace wna16::bench
