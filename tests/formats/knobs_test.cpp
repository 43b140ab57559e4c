// The library's environment variables (src/common/knobs.h): unset gives the default, a malformed
// value is refused with the variable and the value named, flags are off for "0".
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/knobs.h"
#include "wna16/error.h"

namespace wna16 {
namespace {

// Sets `name` for one scope and restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) had_ = true, old_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, old_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST(Knobs, DefaultsWhenUnset) {
  ScopedEnv a("WNA16_DIAG_STAGES", nullptr), b("WNA16_CPU_THREADS", nullptr), c("WNA16_CPU_TRACE", nullptr),
      d("WNA16_CUDA_DEBUG_SYNC", nullptr), e("WNA16_CPU_ISA", nullptr), f("WNA16_GIT_COMMIT", nullptr);
  EXPECT_EQ(knobs::diag_stages(), 6);
  EXPECT_EQ(knobs::cpu_threads(), 0);
  EXPECT_FALSE(knobs::cpu_trace());
  EXPECT_FALSE(knobs::cuda_debug_sync());
  EXPECT_EQ(knobs::cpu_isa(), "");
  EXPECT_EQ(knobs::git_commit(), "");
}

TEST(Knobs, ValuesAndFlags) {
  ScopedEnv a("WNA16_DIAG_STAGES", "3"), b("WNA16_CPU_TRACE", "0"), c("WNA16_CUDA_DEBUG_SYNC", "1"),
      d("WNA16_CPU_ISA", "avx2"), e("WNA16_GIT_COMMIT", "0123abcd");
  EXPECT_EQ(knobs::diag_stages(), 3);
  EXPECT_FALSE(knobs::cpu_trace());
  EXPECT_TRUE(knobs::cuda_debug_sync());
  EXPECT_EQ(knobs::cpu_isa(), "avx2");
  EXPECT_EQ(knobs::git_commit(), "0123abcd");
}

TEST(Knobs, MalformedNumbersAreRefusedNamingTheValue) {
  for (const char* bad : {"0", "7", "-1", "x", "2x", "99999999999"}) {
    ScopedEnv a("WNA16_DIAG_STAGES", bad);
    try {
      (void)knobs::diag_stages();
      ADD_FAILURE() << "WNA16_DIAG_STAGES=" << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("WNA16_DIAG_STAGES=") + bad), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace wna16
