// The must-show matrix of issues 4 and 29: for each of the seven architectures and each of {gptq
// 4-bit sym, gptq 4-bit desc_act, gptq 8-bit, gptq_v2 asym, awq, compressed-tensors 4-bit sym,
// 4-bit asym actorder group, 8-bit channel}: synth -> inspect -> run --check through the
// CLI, on the CPU (and on the GPU when this build has CUDA and a GPU is present). Prints the table.
#include <gtest/gtest.h>

#include <cstdio>

#include "io_test_util.h"
#include "wna16/backend.h"

namespace wna16 {
namespace {

using test::ScratchDir;

struct Variant {
  const char* label;
  const char* flags;
};

TEST(CheckpointMatrix, SynthInspectRunCheckAllArchitecturesAndFormats) {
  const char* archs[] = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next"};
  const Variant variants[] = {
      {"gptq 4-bit sym", "--format gptq --bits 4"},
      {"gptq 4-bit desc_act", "--format gptq --bits 4 --desc-act"},
      {"gptq 8-bit", "--format gptq --bits 8"},
      {"gptq_v2 4-bit asym", "--format gptq_v2 --bits 4 --asym"},
      {"awq 4-bit", "--format awq"},
      {"compressed-tensors 4-bit sym", "--format compressed-tensors --bits 4"},
      {"compressed-tensors 4-bit asym actorder", "--format compressed-tensors --bits 4 --asym --desc-act"},
      {"compressed-tensors 8-bit channel", "--format compressed-tensors --bits 8 --group-size -1"},
  };
  std::vector<std::string> devices = {"cpu"};
  if (cuda_available()) devices.push_back("cuda");
  ScratchDir d;
  std::string table = "| arch | format | synth | inspect | device | run --check rel_error (tolerance) | result |\n"
                      "|---|---|---|---|---|---|---|\n";
  int rows = 0, passed = 0;
  // "check: rel_error 2.3e-03 vs the float64 reference (tolerance 1.5e-02 for ...": the two numbers.
  auto error_of = [](const std::string& out) -> std::string {
    const size_t a = out.find("rel_error "), b = out.find("(tolerance ");
    if (a == std::string::npos || b == std::string::npos) return "n/a";
    const std::string e = out.substr(a + 10, out.find(' ', a + 10) - a - 10);
    const std::string t = out.substr(b + 11, out.find(' ', b + 11) - b - 11);
    return e + " (" + t + ")";
  };
  for (const char* arch : archs) {
    for (const Variant& v : variants) {
      const std::string tag = std::string(arch) + "-" + std::to_string(rows);
      const std::string dir = d / tag, x = d / (tag + ".x.safetensors");
      SCOPED_TRACE(std::string(arch) + " " + v.label);
      auto s = test::run_cli("synth " + dir + " --arch " + arch + " " + v.flags + " --example-input " + x + " --tokens 33");
      EXPECT_EQ(s.exit_code, 0) << s.out << s.err;
      auto i = test::run_cli("inspect " + dir);
      EXPECT_EQ(i.exit_code, 0) << i.out << i.err;
      EXPECT_NE(i.out.find("problems: none"), std::string::npos) << i.out;
      for (const auto& dev : devices) {
        const std::string y = d / (tag + "." + dev + ".y.safetensors");
        auto r = test::run_cli("run " + dir + " --layer 1 --input " + x + " --output " + y + " --device " + dev + " --check");
        EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
        const bool ok = s.exit_code == 0 && i.exit_code == 0 && r.exit_code == 0 && r.out.find("PASSED") != std::string::npos;
        const std::string err = error_of(r.out);
        table += "| " + std::string(arch) + " | " + v.label + " | " + (s.exit_code == 0 ? "ok" : "FAILED") + " | " +
                 (i.exit_code == 0 ? "ok" : "FAILED") + " | " + dev + " | " + err + " | " + (ok ? "PASSED" : "FAILED") + " |\n";
        ++rows;
        passed += ok;
      }
    }
  }
  std::printf("\n%s\n%d/%d rows passed\n", table.c_str(), passed, rows);
  EXPECT_EQ(passed, rows);
  EXPECT_GE(rows, 40);
}

}  // namespace
}  // namespace wna16
