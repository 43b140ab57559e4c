// Every environment variable the library reads, read here and nowhere else (README.md's
// "Environment" table lists the same six). Each is read when asked (a caller that wants one
// value per process keeps it); a value that is set but malformed throws wna16::Error naming it.
#pragma once
#include <string>

namespace wna16::knobs {

// WNA16_CPU_THREADS: CPU backend worker threads, 1 to 4096; 0 when unset (the hardware count).
int cpu_threads();
// WNA16_CPU_ISA: the CPU kernels to use ("scalar", "avx2", "avx512vnni"); empty when unset.
std::string cpu_isa();
// WNA16_CPU_TRACE: set and not "0": the CPU backend prints each phase's wall time.
bool cpu_trace();
// WNA16_CUDA_DEBUG_SYNC: set and not "0": the CUDA layer synchronises after every stage.
bool cuda_debug_sync();
// WNA16_DIAG_STAGES: the CUDA layer launches only its first N stages, 1 to 6; 6 when unset.
int diag_stages();
// WNA16_GIT_COMMIT: the commit a benchmark names when run outside its git checkout; empty when unset.
std::string git_commit();

}  // namespace wna16::knobs
