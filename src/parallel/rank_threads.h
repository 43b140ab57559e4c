// One thread per rank, and the failure rule every World follows (comm.h): a rank that throws
// calls on_failure (which wakes or aborts the others' waits, so that they throw PeerFailed), and
// the lowest rank that failed on its own is reported, prefixed "rank R: ".
#pragma once
#include <functional>
#include <string>

#include "wna16/error.h"

namespace wna16 {

// Thrown in the ranks that were waiting when another rank failed; run() reports the original.
struct PeerFailed : Error {
  explicit PeerFailed(const std::string& who) : Error(who + ": another rank failed") {}
};

// body(r) for r in [0, n): rank 0 on the calling thread, the others on threads of their own.
void run_rank_threads(int n, const std::function<void(int)>& body, const std::function<void()>& on_failure);

}  // namespace wna16
