// The CUDA benchmark's --plot figure from a run's results (bench/cuda/bench_report.h): series per
// preset in the documented order, the roofline floor the "% ceil" column divides by, and the
// title, provenance and ceilings. Host only: runs without a GPU.
#include "gpu/gpu_test_util.h"

#ifdef WNA16_HAVE_CUDA
#include <cmath>
#include <string>

#include "bench/cuda/bench_report.h"
#include "bench/report_cases.h"

namespace {

using namespace wna16::cuda::bench;
using wna16::cuda::bench::test_cases::make_case;

Report two_presets() {
  Report r;
  r.date = "2026-12-02 14:03 UTC";
  r.commit = "3866c77e";
  r.switches = "none";
  r.scheme = "gptq 4-bit g128 sym";
  r.act = "bf16";
  r.ceil.gpu = "NVIDIA H200";
  r.ceil.read_gbs = 4000;     // 4e6 bytes: 1 us
  r.ceil.gemm_tflops = 800;   // 1e9 FLOPs: 1.25 us
  PresetInfo a, b;
  a.name = "mixtral-8x7b";
  a.shape = "E8 k2 H4096 I14336 shared 0, softmax_topk";
  b.name = "deepseek-v3";
  b.error = "out of memory";  // no case: left out of the plot
  r.presets = {a, b};
  r.cases = {make_case("mixtral-8x7b", 1, 4e6, 1e9, 5.0, 20.0, kNaN),        // compute floor 1.25 us
             make_case("mixtral-8x7b", 16, 8e6, 1e8, kNaN, 22.0, kNaN)};     // failed; memory floor 2 us
  return r;
}

TEST(CudaBenchPlot, SeriesFloorsAndLabelsFromTheReport) {
  const Report r = two_presets();
  const wna16::bench::PlotInput in = plot_input(r);
  EXPECT_EQ(in.title, "wna16 bench --device cuda: gptq 4-bit g128 sym, bf16");
  EXPECT_EQ(in.provenance, "2026-12-02 14:03 UTC, NVIDIA H200, commit 3866c77e");
  ASSERT_EQ(in.ceilings.size(), 2u);
  EXPECT_EQ(in.ceilings[0], "read 4000 GB/s");
  EXPECT_EQ(in.ceilings[1], "cuBLAS bf16 800 TFLOP/s");

  ASSERT_EQ(in.presets.size(), 1u);
  const wna16::bench::PlotPreset& p = in.presets[0];
  EXPECT_EQ(p.name, "mixtral-8x7b");
  EXPECT_EQ(p.shape, r.presets[0].shape);
  // Ours first, then the loop; the cuBLAS baseline measured nothing and is left out.
  ASSERT_EQ(p.series.size(), 2u);
  EXPECT_EQ(p.series[0].name, "wna16");
  EXPECT_EQ(p.series[1].name, "per-expert loop");
  ASSERT_EQ(p.series[0].points.size(), 2u);
  EXPECT_EQ(p.series[0].points[0].M, 1);
  EXPECT_DOUBLE_EQ(p.series[0].points[0].us, 5.0);
  EXPECT_TRUE(std::isnan(p.series[0].points[1].us));  // the failed case stays, as NaN
  EXPECT_DOUBLE_EQ(p.series[1].points[1].us, 22.0);

  ASSERT_EQ(p.floor.size(), 2u);
  EXPECT_NEAR(p.floor[0].us, 1.25, 1e-12);
  EXPECT_NEAR(p.floor[1].us, 2.0, 1e-12);
  // The same floor as the table's "% ceil" column.
  EXPECT_NEAR(derive(r.cases[0], r.ceil).pct, 1.25 / 5.0 * 100.0, 1e-9);
}

TEST(CudaBenchPlot, SwitchesJoinTheProvenanceAndCublasIsKeptWhenMeasured) {
  Report r = two_presets();
  r.switches = "WNA16_DIAG_STAGES=3";
  r.cases[1].cublas.median_us = 30.0;
  const wna16::bench::PlotInput in = plot_input(r);
  EXPECT_EQ(in.provenance, "2026-12-02 14:03 UTC, NVIDIA H200, commit 3866c77e, WNA16_DIAG_STAGES=3");
  ASSERT_EQ(in.presets.size(), 1u);
  ASSERT_EQ(in.presets[0].series.size(), 3u);
  EXPECT_EQ(in.presets[0].series[2].name, "cuBLAS bf16 GEMMs (dequantised)");
  EXPECT_TRUE(std::isnan(in.presets[0].series[2].points[0].us));
  EXPECT_DOUBLE_EQ(in.presets[0].series[2].points[1].us, 30.0);
}

}  // namespace
#endif  // WNA16_HAVE_CUDA
