// Helpers for the checkpoint (io) tests: scratch directories, raw safetensors bytes, running the CLI.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"
#include "wna16/safetensors.h"

namespace wna16::test {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed (with its contents) on destruction.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (fs::temp_directory_path() / "wna16-io-XXXXXX").string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Two layer specs describe the same layer: sizes, routing and shared expert.
inline void expect_same_spec(const MoeLayerSpec& a, const MoeLayerSpec& b) {
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.inter, b.inter);
  EXPECT_EQ(a.routing.method, b.routing.method);
  EXPECT_EQ(a.routing.num_experts, b.routing.num_experts);
  EXPECT_EQ(a.routing.top_k, b.routing.top_k);
  EXPECT_EQ(a.routing.renormalize, b.routing.renormalize);
  EXPECT_EQ(a.routing.n_group, b.routing.n_group);
  EXPECT_EQ(a.routing.topk_group, b.routing.topk_group);
  EXPECT_DOUBLE_EQ(a.routing.routed_scaling_factor, b.routing.routed_scaling_factor);
  EXPECT_EQ(a.shared_kind, b.shared_kind);
  EXPECT_EQ(a.shared_inter, b.shared_inter);
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// A safetensors file from a header string and data bytes: u64 length + header + data.
inline std::string st_bytes(const std::string& header, const std::string& data = "", int64_t declared_len = -1) {
  uint64_t n = declared_len < 0 ? header.size() : uint64_t(declared_len);
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Files of a directory (names only), sorted: to check that nothing stray (temp files) was left.
inline std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}


// Every tensor of a safetensors file, as writable copies (to mutate and write back).
inline std::vector<TensorToWrite> load_all(const std::string& path) {
  auto f = SafetensorsFile::open(path);
  std::vector<TensorToWrite> v;
  for (const auto& t : f.tensors()) {
    TensorToWrite w;
    w.name = t.name;
    w.dtype = t.dtype;
    w.shape = t.shape;
    w.data.assign(f.data(t), f.data(t) + t.nbytes());
    v.push_back(std::move(w));
  }
  return v;
}

inline TensorToWrite* find_tensor(std::vector<TensorToWrite>& v, const std::string& name) {
  for (auto& t : v)
    if (t.name == name) return &t;
  return nullptr;
}

// A small synthetic checkpoint in one model.safetensors file (easy to mutate) unless sharded.
inline SynthOptions synth_opts(const std::string& dir, Arch arch, Format f, int bits = 4, bool desc_act = false,
                               bool asym = false, bool sharded = false) {
  SynthOptions o;
  o.dir = dir;
  o.arch = arch;
  o.format = f;
  o.bits = bits;
  o.desc_act = desc_act;
  o.asym = asym;
  o.max_shard_size = sharded ? 256 * 1024 : (uint64_t(1) << 40);
  return o;
}

// Random hidden states [M, H] rounded to dtype, written to `path`.
inline void write_random_input(const std::string& path, int64_t M, int64_t H, DType dt, uint64_t seed = 7,
                               std::vector<int64_t> shape = {}) {
  HiddenStates h;
  h.dtype = dt;
  h.shape = shape.empty() ? std::vector<int64_t>{M, H} : shape;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  h.values.resize(size_t(M * H));
  for (auto& v : h.values) v = round_to(dt, float(nd(rng)));
  write_hidden_states(path, h);
}

// ---- config.json text edits (config tests; origin "dir/config.json") ----------------------------

inline ModelConfig parse_config(const std::string& text) { return parse_model_config(text, "dir/config.json"); }

// The refusal parse_config gives `text`, or "(accepted)".
inline std::string config_error(const std::string& text) {
  try {
    parse_config(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

// `text` with key `from` renamed to `to` (value and position kept).
inline std::string rename_key(const std::string& text, const std::string& from, const std::string& to) {
  nlohmann::ordered_json in = nlohmann::ordered_json::parse(text), out = nlohmann::ordered_json::object();
  if (!in.contains(from)) throw std::runtime_error("test setup: no key " + from);
  for (auto it = in.begin(); it != in.end(); ++it) out[it.key() == from ? to : it.key()] = it.value();
  return out.dump();
}

inline std::string with_key(const std::string& text, const std::string& key, const nlohmann::ordered_json& value) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text);
  j[key] = value;
  return j.dump();
}

inline std::string without_key(const std::string& text, const std::string& key) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text);
  j.erase(key);
  return j.dump();
}

// `wna16 inspect DIR` succeeds and prints `architecture_line`; `wna16 run DIR --layer 1 --check` on
// random bf16 hidden states (written under `scratch`) passes on the CPU.
inline void expect_inspects_and_runs(const std::string& dir, const std::string& scratch, const std::string& architecture_line) {
  auto i = run_cli("inspect " + dir);
  EXPECT_EQ(i.exit_code, 0) << i.out << i.err;
  EXPECT_NE(i.out.find(architecture_line), std::string::npos) << i.out;
  const std::string x = scratch + "/x.safetensors", y = scratch + "/y.safetensors";
  write_random_input(x, 5, 256, DType::BF16);
  auto r = run_cli("run " + dir + " --layer 1 --input " + x + " --output " + y + " --device cpu --check");
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

}  // namespace wna16::test
