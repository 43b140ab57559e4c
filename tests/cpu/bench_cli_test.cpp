// `wna16 bench --device cpu` end to end on the small preset: table, JSON/CSV/SVG files, the
// correctness gate's PASSED line and exit codes.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>

#include "cli_runner.h"

namespace {

using wna16::test::CliRun;
CliRun run_cli(const std::string& args) { return wna16::test::run_cli_combined(args); }

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

std::string slurp(const std::string& path) { return wna16::test::slurp_file(path); }

TEST(CpuBenchCli, SmallPresetWritesTableJsonCsvPlotAndPasses) {
  const std::string dir = ::testing::TempDir();
  const std::string json = dir + "/wna16_cpu_bench_" + std::to_string(getpid()) + ".json";
  const std::string csv = dir + "/wna16_cpu_bench_" + std::to_string(getpid()) + ".csv";
  const std::string svg = dir + "/wna16_cpu_bench_" + std::to_string(getpid()) + ".svg";
  const CliRun r = run_cli("bench --device cpu --model small --m 1,3 --dtype f16 --min-seconds 0.01 --json " + json +
                           " --csv " + csv + " --plot " + svg);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "read bandwidth")) << r.out;
  EXPECT_TRUE(has(r.out, "fp32 FMA peak")) << r.out;
  EXPECT_TRUE(has(r.out, "%FMA")) << r.out;
  EXPECT_TRUE(has(r.out, "check vs float64 reference (M=3)")) << r.out;
  EXPECT_TRUE(has(r.out, "PASSED")) << r.out;
  const std::string j = slurp(json), c = slurp(csv);
  EXPECT_TRUE(has(j, "\"model\": \"small\"")) << j;
  EXPECT_TRUE(has(j, "\"M\": 3")) << j;
  EXPECT_TRUE(has(j, "\"read_bandwidth_gbs\"")) << j;
  EXPECT_TRUE(has(j, "\"fma_peak_gflops\"")) << j;
  EXPECT_TRUE(has(j, "\"pct_fma\"")) << j;
  EXPECT_TRUE(has(j, "\"pct_fma_adjacent\"")) << j;
  EXPECT_TRUE(has(j, "\"dtype\": \"f16\"")) << j;
  EXPECT_TRUE(has(c, "model,M,us")) << c;
  EXPECT_TRUE(has(r.out, "plot: " + svg)) << r.out;
  const std::string p = slurp(svg);
  EXPECT_TRUE(has(p, "<svg") && has(p, "</svg>")) << p.substr(0, 400);
  std::remove(json.c_str());
  std::remove(csv.c_str());
  std::remove(svg.c_str());
}

TEST(CpuBenchCli, UnwritablePlotPathFailsNamingIt) {
  const std::string svg = "/nonexistent-wna16-dir/plot.svg";
  const CliRun r = run_cli("bench --device cpu --model small --m 1 --min-seconds 0.01 --plot " + svg);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, svg)) << r.out;
}

TEST(CpuBenchCli, UnknownModelFailsNamingIt) {
  const CliRun r = run_cli("bench --device cpu --model no-such-model --m 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "no-such-model")) << r.out;
}

TEST(CpuBenchCli, BadMFailsNamingIt) {
  const CliRun r = run_cli("bench --device cpu --model small --m 0");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "M=0")) << r.out;
}

}  // namespace
