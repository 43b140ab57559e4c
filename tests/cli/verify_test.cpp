// `wna16 verify` end to end: the table, the final PASSED/FAILED line and the exit codes.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "cli_runner.h"
#include "wna16/backend.h"

namespace {

using wna16::test::CliRun;
CliRun run_cli(const std::string& args) { return wna16::test::run_cli_combined(args); }

std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  const size_t nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

}  // namespace

TEST(CliVerify, DefaultSmallPresetPassesOnCpu) {
  const CliRun r = run_cli("verify --device cpu");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_line(r.out), "PASSED") << r.out;
  EXPECT_TRUE(has(r.out, "small (H=256")) << r.out;
  for (const char* m : {"     1  float32", "     1  cpu", "     7  cpu", "    33  float32", "    33  cpu"})
    EXPECT_TRUE(has(r.out, m)) << m << "\n" << r.out;
  EXPECT_FALSE(has(r.out, "FAIL")) << r.out;
}

TEST(CliVerify, AwqF16AndAListOfM) {
  const CliRun r = run_cli("verify --device cpu --format awq --group-size 64 --dtype f16 --m 2,5 --seed 3");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_line(r.out), "PASSED") << r.out;
  EXPECT_TRUE(has(r.out, "awq 4-bit g64")) << r.out;
  EXPECT_TRUE(has(r.out, "     2  cpu")) << r.out;
  EXPECT_TRUE(has(r.out, "     5  float32")) << r.out;
  EXPECT_FALSE(has(r.out, "    33  ")) << r.out;
}

TEST(CliVerify, GptqV2Asym8BitActOrder) {
  const CliRun r = run_cli("verify --device cpu --format gptq_v2 --bits 8 --asym --desc-act --group-size 64 --m 3");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_line(r.out), "PASSED") << r.out;
}

TEST(CliVerify, BadArgumentsExitTwoNamingTheValue) {
  CliRun r = run_cli("verify --model nope");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "'nope'")) << r.out;
  r = run_cli("verify --format awq --bits 8 --device cpu");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "8")) << r.out;
  r = run_cli("verify --m 0 --device cpu");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--m 0")) << r.out;
  r = run_cli("verify --dtype f8 --device cpu");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "'f8'")) << r.out;
  r = run_cli("verify --device cpu --portable");  // a CUDA kernel path
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--portable") && has(r.out, "cpu")) << r.out;
}

TEST(CliVerify, UnavailableBackendIsAFailedRowNotACrash) {
  if (wna16::cuda_available()) GTEST_SKIP() << "a GPU is present: the cuda backend can run";
  const CliRun r = run_cli("verify --device cuda --m 1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(last_line(r.out), "FAILED") << r.out;
  EXPECT_TRUE(has(r.out, "     1  float32")) << r.out;  // the reference check still ran
  EXPECT_TRUE(has(r.out, "     1  cuda")) << r.out;
  EXPECT_TRUE(has(r.out, "FAIL  (")) << r.out;  // the row carries the backend's message
}

// `wna16 determinism`: the CPU backend is deterministic and batch-invariant on every ISA it runs.
TEST(CliDeterminism, CpuBackendIsBitIdenticalRunToRunAndAcrossBatches) {
  const CliRun r = run_cli("determinism --device cpu --model small --m 1,5,40 --repeat 3");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_line(r.out), "PASSED") << r.out;
  EXPECT_TRUE(has(r.out, "     5  run to run  PASS    3 runs bit-identical")) << r.out;
  EXPECT_TRUE(has(r.out, "     5  in batch    PASS    rows equal the first 5 of the M=40 batch")) << r.out;
  EXPECT_TRUE(has(r.out, "     1  alone       PASS    tokens 0, 20, 39 alone equal their rows of the M=40 batch"))
      << r.out;
}

TEST(CliDeterminism, BadArgumentsExitTwoNamingTheValue) {
  CliRun r = run_cli("determinism --device cpu --repeat 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--repeat 1 is outside [2, 100000]")) << r.out;
  r = run_cli("determinism --device cpu --m 0");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--m 0 is outside [1, 65536]")) << r.out;
}
