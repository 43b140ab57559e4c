// The must-show matrix of issues 4 and 29: for each of the seven architectures and each of {gptq
// 4-bit sym, gptq 4-bit desc_act, gptq 8-bit, gptq_v2 asym, awq, compressed-tensors 4-bit sym,
// 4-bit asym actorder group, 8-bit channel}: synth -> inspect -> run --check through the
// CLI, on the CPU (and on the GPU when this build has CUDA and a GPU is present). Each checkpoint
// is then copied with config.json re-saved in the other spelling of every aliased key (the
// library's alias tables: transformers 5 names where synth writes the 4.x ones; respell_util.h):
// inspect must print the same, and run --check must pass with output bit-identical to the
// original spelling's on the same input. Prints the table.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "io_test_util.h"
#include "respell_util.h"
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
  const test::SpellingTables tables = test::spelling_tables();
  ASSERT_FALSE(tables.model.empty());
  ASSERT_FALSE(tables.quant.empty());
  ScratchDir d;
  std::string table =
      "| arch | format | spelling | synth | inspect | device | run --check rel_error (tolerance) | result |\n"
      "|---|---|---|---|---|---|---|---|\n";
  int rows = 0, passed = 0, re_rows = 0, re_passed = 0, re_renamed = 0;
  std::set<std::string> renames_seen;   // "model_type: from->to" over all respelled rows
  std::string renames_by_row;           // what each respelled checkpoint renamed
  // "check: rel_error 2.3e-03 vs the float64 reference (tolerance 1.5e-02 for ...": the two numbers.
  auto error_of = [](const std::string& out) -> std::string {
    const size_t a = out.find("rel_error "), b = out.find("(tolerance ");
    if (a == std::string::npos || b == std::string::npos) return "n/a";
    const std::string e = out.substr(a + 10, out.find(' ', a + 10) - a - 10);
    const std::string t = out.substr(b + 11, out.find(' ', b + 11) - b - 11);
    return e + " (" + t + ")";
  };
  // inspect's text with the checkpoint directory replaced, to compare the two spellings.
  auto without_dir = [](std::string s, const std::string& dir) {
    for (size_t p; (p = s.find(dir)) != std::string::npos;) s.replace(p, dir.size(), "DIR");
    return s;
  };
  auto row = [&](const std::string& arch, const std::string& label, const std::string& spelling, bool s, bool i,
                 const std::string& dev, const std::string& err, bool ok) {
    table += "| " + arch + " | " + label + " | " + spelling + " | " + (s ? "ok" : "FAILED") + " | " +
             (i ? "ok" : "FAILED") + " | " + dev + " | " + err + " | " + (ok ? "PASSED" : "FAILED") + " |\n";
  };
  int n = 0;
  for (const char* arch : archs) {
    for (const Variant& v : variants) {
      const std::string tag = std::string(arch) + "-" + std::to_string(n++);
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
        row(arch, v.label, "as synth", s.exit_code == 0, i.exit_code == 0, dev, error_of(r.out), ok);
        ++rows;
        passed += ok;
      }
      if (s.exit_code != 0) continue;

      // The same checkpoint, config.json re-saved in the other spelling.
      SCOPED_TRACE("respelled");
      const std::string rdir = dir + ".respelled";
      std::filesystem::copy(dir, rdir, std::filesystem::copy_options::recursive);
      std::vector<std::string> renamed;
      test::write_file(rdir + "/config.json", test::respell_config(test::read_file(dir + "/config.json"), tables, &renamed));
      std::string list;
      for (const auto& k : renamed) {
        renames_seen.insert(std::string(arch) + ": " + k);
        list += (list.empty() ? "" : ", ") + k;
      }
      renames_by_row += std::string(arch) + " / " + v.label + ": " + (list.empty() ? "(no aliased key)" : list) + "\n";
      re_renamed += !renamed.empty();
      auto ri = test::run_cli("inspect " + rdir);
      EXPECT_EQ(ri.exit_code, 0) << ri.out << ri.err;
      const bool same_inspect = without_dir(ri.out, rdir) == without_dir(i.out, dir);
      EXPECT_TRUE(same_inspect) << ri.out << "\n---- original spelling:\n" << i.out;
      for (const auto& dev : devices) {
        const std::string y = d / (tag + "." + dev + ".y.safetensors"), ry = d / (tag + ".respelled." + dev + ".y.safetensors");
        auto r = test::run_cli("run " + rdir + " --layer 1 --input " + x + " --output " + ry + " --device " + dev + " --check");
        EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
        const std::string out = test::read_file(ry);
        const bool same_output = !out.empty() && out == test::read_file(y);
        EXPECT_TRUE(same_output) << "run output differs from the original spelling's";
        const bool ok = ri.exit_code == 0 && same_inspect && r.exit_code == 0 &&
                        r.out.find("PASSED") != std::string::npos && same_output;
        row(arch, v.label, "respelled", true, ri.exit_code == 0 && same_inspect, dev,
            error_of(r.out) + (same_output ? ", output identical" : ", output DIFFERS"), ok);
        ++re_rows;
        re_passed += ok;
      }
    }
  }
  std::printf("\n%s\nkeys renamed in the respelled copies:\n%s\n%d/%d rows passed as synth writes them; %d/%d rows passed "
              "respelled (%d checkpoints with at least one key renamed)\n",
              table.c_str(), renames_by_row.c_str(), passed, rows, re_passed, re_rows, re_renamed);
  EXPECT_EQ(passed, rows);
  EXPECT_GE(rows, 40);
  EXPECT_EQ(re_passed, re_rows);
  EXPECT_EQ(re_rows, rows);
  // Every model-config alias of the library was exercised by some row, in one direction or the other.
  for (const auto& a : tables.model) {
    const bool seen = renames_seen.count(a.model_type + ": " + a.canonical + "->" + a.alternative) ||
                      renames_seen.count(a.model_type + ": " + a.alternative + "->" + a.canonical);
    EXPECT_TRUE(seen) << a.model_type << " " << a.canonical << " / " << a.alternative << " never renamed in the matrix";
  }
}

}  // namespace
}  // namespace wna16
