// The CUDA benchmark's layer-time targets (bench/cuda/bench_report.h print_targets): each measured
// target row against its must and aim, the serving regime's x cuBLAS bar, and no verdicts for a
// scheme or routing the targets are not defined for. Host only: runs without a GPU.
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <string>

#include "bench/cuda/bench_report.h"
#include "bench/report_cases.h"

namespace {

using namespace wna16::cuda::bench;

CaseResult timed(const std::string& preset, int64_t M, double ours, double cublas = kNaN) {
  return test_cases::make_case(preset, M, 1e6, 1e9, ours, kNaN, cublas);
}

Report targets_run() {
  Report r;
  r.scheme = "gptq 4-bit g128 sym";
  r.act = "bf16";
  r.routing = "uniform";
  r.ceil.read_gbs = 4000;
  r.ceil.gemm_tflops = 800;
  r.cases = {timed("deepseek-v3", 256, 1700.0, 5000.0),  // must 1800: PASS, aim 1500 not met; x cuBLAS 2.94
             timed("mixtral-8x7b", 64, 350.0, 700.0),    // must 300: FAIL; x cuBLAS 2.0
             timed("qwen3-30b-a3b", 1, 7.5),             // decode must 11, aim 8: PASS, aim met
             timed("qwen3-30b-a3b", 1024, 400.0, 340.0), // must 360: FAIL; x cuBLAS 0.85: FAIL
             timed("mixtral-8x7b", 2, 50.0)};            // no target at M=2: not printed
  return r;
}

std::string printed(const Report& r, int* missed) {
  ::testing::internal::CaptureStdout();
  *missed = print_targets(r);
  return ::testing::internal::GetCapturedStdout();
}

TEST(CudaBenchTargets, EachMeasuredRowAgainstItsMustAndAim) {
  int missed = -1;
  const std::string out = printed(targets_run(), &missed);
  EXPECT_EQ(missed, 3) << out;  // Mixtral M=64, Qwen3 M=1024 time, Qwen3 M=1024 x cuBLAS
  for (const char* line : {
           "serving  deepseek-v3        M=256      1700.0 us   must   1800  aim   1500   PASS\n",
           "serving  mixtral-8x7b       M=64        350.0 us   must    300  aim    200   FAIL\n",
           "decode   qwen3-30b-a3b      M=1           7.5 us   must     11  aim      8   PASS (aim met)\n",
           "x cuBLAS qwen3-30b-a3b      M=1024       0.85 x    must   0.90  aim   1.00   FAIL\n",
           "x cuBLAS deepseek-v3        M=256        2.94 x    must   0.90  aim   1.00   PASS (aim met)\n"})
    EXPECT_NE(out.find(line), std::string::npos) << "missing: " << line << out;
  EXPECT_EQ(out.find("M=2 "), std::string::npos) << out;  // a case without a target
}

TEST(CudaBenchTargets, NoVerdictsOutsideTheTargetsScheme) {
  for (auto change : {+[](Report& r) { r.scheme = "awq 4-bit g128 asym"; }, +[](Report& r) { r.act = "f16"; },
                      +[](Report& r) { r.routing = "zipf:1.2"; }}) {
    Report r = targets_run();
    change(r);
    int missed = -1;
    const std::string out = printed(r, &missed);
    EXPECT_EQ(missed, 0) << out;
    EXPECT_NE(out.find("not applicable to this run"), std::string::npos) << out;
    EXPECT_EQ(out.find("PASS"), std::string::npos) << out;
    EXPECT_EQ(out.find("FAIL"), std::string::npos) << out;
  }
}

TEST(CudaBenchTargets, SaysSoWhenNoTargetRowWasMeasured) {
  Report r = targets_run();
  r.cases = {timed("mixtral-8x7b", 2, 50.0), timed("deepseek-v3", 256, kNaN)};  // a failed case has no time
  int missed = -1;
  const std::string out = printed(r, &missed);
  EXPECT_EQ(missed, 0) << out;
  EXPECT_NE(out.find("none of the target rows was measured in this run"), std::string::npos) << out;
}

}  // namespace
#endif  // WNA16_HAVE_CUDA
