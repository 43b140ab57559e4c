// `wna16 verify --tp --ep` and `wna16 run --tp --ep` end to end: PASSED with 2 and 4 simulated
// ranks (issue 32's must-show commands with default flags), bad plans refused with exit 2 and a message naming the values, --help saying how ranks run.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <unistd.h>

#include "cli_runner.h"

namespace {

using wna16::test::CliRun;
CliRun run_cli(const std::string& args) { return wna16::test::run_cli_combined(args); }
bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// Issue 32's must-show commands, exactly as written (default flags: the small preset, gptq 4-bit
// g128, so TP cuts fall inside groups: I=128 gives 64 or 32 rows per rank).
TEST(CliParallel, VerifyPassesForPlansOfTwoAndFourRanksWithDefaultFlags) {
  for (const char* plan : {"--tp 2 --ep 2", "--tp 2", "--ep 2", "--tp 4", "--ep 4"}) {
    const CliRun r = run_cli(std::string("verify --device cpu ") + plan);
    EXPECT_EQ(r.code, 0) << plan << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "gptq 4-bit g128 sym")) << r.out;
    EXPECT_TRUE(has(r.out, "one thread per rank")) << r.out;
    EXPECT_TRUE(has(r.out, "PASSED")) << r.out;
  }
}

TEST(CliParallel, VerifyPassesForEveryFormatAndGroupSize) {
  for (const char* plan : {"--tp 2", "--tp 2 --ep 2", "--tp 4"}) {
    const CliRun r = run_cli(std::string("verify --device cpu --group-size 32 ") + plan);
    EXPECT_EQ(r.code, 0) << plan << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "PASSED")) << r.out;
  }
  for (const char* fmt : {"--format awq --dtype f16", "--format gptq_v2 --bits 8 --asym", "--desc-act",
                          "--desc-act --group-size 64", "--group-size -1 --desc-act"}) {
    const CliRun r = run_cli(std::string("verify --device cpu --tp 2 --ep 2 ") + fmt);
    EXPECT_EQ(r.code, 0) << fmt << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "sharded tp=2 x ep=2 (4 ranks)")) << r.out;
  }
}

TEST(CliParallel, BadPlansAreRefusedNamingTheValues) {
  const struct {
    const char* args;
    const char* message;
  } cases[] = {
      {"--ep 3", "num_experts=8 is not divisible by ep=3"},
      {"--tp 3", "expert width I=128 is not divisible by tp=3"},
      {"--tp 0", "parallel plan: tp=0 must be at least 1"},
      {"--tp 32", "N=4 is not a multiple of 8 (qzeros pack along N)"},
      {"--tp 2 --comm bogus", "unknown communicator 'bogus' (expected inprocess or nccl)"},
      {"--tp 2 --comm nccl", "--comm nccl moves device memory between GPUs: it needs --device cuda"},
  };
  for (const auto& c : cases) {
    const CliRun r = run_cli(std::string("verify --device cpu ") + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r.out, c.message)) << c.args << "\n" << r.out;
  }
}

TEST(CliParallel, VerifySaysWhichCommunicatorTheRanksUse) {
  const CliRun ok = run_cli("verify --device cpu --tp 2 --comm inprocess");
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_TRUE(has(ok.out, "over the inprocess communicator")) << ok.out;
}

TEST(CliParallel, HelpSaysHowRanksRun) {
  for (const char* cmd : {"verify --help", "run --help"}) {
    const CliRun r = run_cli(cmd);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(has(r.out, "--tp")) << r.out;
    EXPECT_TRUE(has(r.out, "one thread per rank")) << r.out;
  }
}

TEST(CliParallel, RunShardsACheckpointLayer) {
  const std::string dir = std::filesystem::temp_directory_path() / ("wna16-par-run-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const CliRun s = run_cli("synth " + dir + "/m --arch deepseek_v3 --format gptq --desc-act --group-size 32 " +
                           "--example-input " + dir + "/x.safetensors");
  ASSERT_EQ(s.code, 0) << s.out;
  for (const char* plan : {"--tp 2 --ep 2", "--ep 4"}) {
    const CliRun r = run_cli("run " + dir + "/m --layer 1 --input " + dir + "/x.safetensors --output " + dir +
                             "/y.safetensors --check " + plan);
    EXPECT_EQ(r.code, 0) << plan << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "check: rel_error")) << r.out;
    EXPECT_TRUE(has(r.out, "PASSED")) << r.out;
  }
  const CliRun bad = run_cli("run " + dir + "/m --layer 1 --input " + dir + "/x.safetensors --output " + dir +
                             "/y.safetensors --ep 3");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_TRUE(has(bad.out, "num_experts=16 is not divisible by ep=3")) << bad.out;
  std::filesystem::remove_all(dir);
}

}  // namespace
