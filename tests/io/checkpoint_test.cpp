// Loading layers from checkpoints: what load_layer returns is checked against an independent
// decoding of the raw file bytes (formats.md, written out here a second time), plus the decisions
// the loader takes from the tensors: act-order, sym, dense expert linears, quantized routers,
// which quantization config file wins.
#include <gtest/gtest.h>

#include <cmath>

#include "io_test_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"
#include "wna16/reference.h"

namespace wna16 {
namespace {

using test::ScratchDir;

struct Raw {
  std::vector<int32_t> qweight, qzeros, g_idx;
  std::vector<float> scales;
};

Raw raw(const Checkpoint& ck, const std::string& module) {
  Raw r;
  auto get = [&](const std::string& n) { return ck.tensors().find(module + "." + n); };
  auto qw = get("qweight"), qz = get("qzeros"), sc = get("scales"), gi = get("g_idx");
  EXPECT_TRUE(qw.file && qz.file && sc.file) << module;
  r.qweight = read_i32(*qw.file, *qw.info);
  r.qzeros = read_i32(*qz.file, *qz.info);
  r.scales = read_floats(*sc.file, *sc.info);
  if (gi.file) r.g_idx = read_i32(*gi.file, *gi.info);
  return r;
}

// formats.md, GPTQ: qweight [K*b/32, N] packed along K LSB first; qzeros packed along N; v1 stores zero-1.
std::vector<double> decode_gptq(const Raw& r, int64_t K, int64_t N, int b, bool v1) {
  const int pack = 32 / b;
  const uint32_t mask = (1u << b) - 1;
  std::vector<double> w(size_t(K * N));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) {
      const int32_t g = r.g_idx[size_t(k)];
      const uint32_t q = (uint32_t(r.qweight[size_t((k / pack) * N + n)]) >> (b * (k % pack))) & mask;
      const uint32_t zs = (uint32_t(r.qzeros[size_t(g * (N / pack) + n / pack)]) >> (b * (n % pack))) & mask;
      const double z = double(zs) + (v1 ? 1.0 : 0.0);
      w[size_t(k * N + n)] = double(r.scales[size_t(g * N + n)]) * (double(q) - z);
    }
  return w;
}

// formats.md, AWQ gemm: qweight [K, N/8], column 8c+j in nibble REVERSE[j].
std::vector<double> decode_awq(const Raw& r, int64_t K, int64_t N, int64_t group) {
  static const int kReverse[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  std::vector<double> w(size_t(K * N));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t g = k / group;
      const uint32_t q = (uint32_t(r.qweight[size_t(k * (N / 8) + n / 8)]) >> (4 * kReverse[n % 8])) & 0xF;
      const uint32_t z = (uint32_t(r.qzeros[size_t(g * (N / 8) + n / 8)]) >> (4 * kReverse[n % 8])) & 0xF;
      w[size_t(k * N + n)] = (double(q) - double(z)) * double(r.scales[size_t(g * N + n)]);
    }
  return w;
}

struct Case {
  Arch arch;
  Format format;
  int bits;
  bool desc_act, asym;
};

class LoadMatchesRawBytes : public ::testing::TestWithParam<Case> {};

TEST_P(LoadMatchesRawBytes, EveryLinearOfOneExpertAndTheSharedExpert) {
  const Case c = GetParam();
  ScratchDir d;
  synth_checkpoint(test::synth_opts(d.path(), c.arch, c.format, c.bits, c.desc_act, c.asym, /*sharded=*/true));
  const Checkpoint ck = Checkpoint::open(d.path());
  const int64_t L = 1;
  std::vector<std::string> notes;
  const MoeLayerWeights w = ck.load_layer(L, &notes);
  EXPECT_TRUE(notes.empty()) << notes.front();
  const MoeLayerSpec spec = ck.config().layer_spec(L);
  const std::string pre = ck.config().mlp_prefix(L);
  const bool mixtral = c.arch == Arch::Mixtral;
  struct Item {
    std::string module;
    const QuantizedLinear* q;
  };
  const int e = 3;
  std::vector<Item> items = {
      {pre + ".experts.3." + (mixtral ? "w1" : "gate_proj"), &w.experts[e].gate},
      {pre + ".experts.3." + (mixtral ? "w3" : "up_proj"), &w.experts[e].up},
      {pre + ".experts.3." + (mixtral ? "w2" : "down_proj"), &w.experts[e].down},
  };
  if (c.arch == Arch::Qwen2Moe) items.push_back({pre + ".shared_expert.down_proj", &w.shared->down});
  if (c.arch == Arch::DeepseekV2 || c.arch == Arch::DeepseekV3)
    items.push_back({pre + ".shared_experts.gate_proj", &w.shared->gate});
  for (const auto& it : items) {
    SCOPED_TRACE(it.module);
    const QuantizedLinear& q = *it.q;
    EXPECT_EQ(q.scheme.bits, c.bits);
    EXPECT_EQ(q.scheme.format, c.format);
    // act-order comes from the g_idx in the file: with one group (K = 128 = group size) there is none.
    EXPECT_EQ(q.scheme.act_order, c.desc_act && q.K > 128);
    EXPECT_EQ(q.scheme.sym, c.format != Format::Awq && !c.asym);
    const Raw r = raw(ck, it.module);
    const std::vector<double> want = c.format == Format::Awq ? decode_awq(r, q.K, q.N, 128)
                                                             : decode_gptq(r, q.K, q.N, c.bits, c.format == Format::GptqV1);
    const std::vector<double> got = dequantize(q);
    ASSERT_EQ(got.size(), want.size());
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
    EXPECT_EQ(bad, 0u) << "elements differing from the independent decode of the file bytes";
  }
  // Act-order as GPTQ writes it: gate and up read the same input, so they share one channel order
  // (g_idx); down has its own.
  if (c.desc_act && c.format != Format::Awq) {
    EXPECT_EQ(w.experts[e].gate.g_idx, w.experts[e].up.g_idx);
    if (w.shared) {
      EXPECT_EQ(w.shared->gate.g_idx, w.shared->up.g_idx);
    }
  }
  // Router [E, H] exactly the file's fp16 values, in torch layout.
  auto rt = ck.tensors().find(pre + ".gate.weight");
  EXPECT_EQ(w.router, read_floats(*rt.file, *rt.info));
  EXPECT_EQ(w.router.size(), size_t(spec.routing.num_experts * spec.hidden));
  if (c.arch == Arch::DeepseekV3) {
    EXPECT_EQ(w.correction_bias.size(), size_t(spec.routing.num_experts));
  }
  if (c.arch == Arch::Qwen2Moe) {
    EXPECT_EQ(w.shared_gate.size(), size_t(spec.hidden));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, LoadMatchesRawBytes,
                         ::testing::Values(Case{Arch::Mixtral, Format::GptqV1, 4, true, false},
                                           Case{Arch::Qwen2Moe, Format::GptqV1, 8, false, false},
                                           Case{Arch::Qwen3Moe, Format::GptqV2, 4, false, true},
                                           Case{Arch::DeepseekV2, Format::GptqV2, 8, true, true},
                                           Case{Arch::DeepseekV3, Format::Awq, 4, false, true},
                                           Case{Arch::Mixtral, Format::Awq, 4, false, true},
                                           Case{Arch::Qwen2Moe, Format::GptqV1, 4, false, true}));

// Rewrites the single model.safetensors of `dir` through `fn`.
template <class F>
void mutate(const std::string& dir, F fn) {
  auto ts = test::load_all(dir + "/model.safetensors");
  fn(ts);
  write_safetensors(dir + "/model.safetensors", ts);
}

void drop(std::vector<TensorToWrite>& ts, const std::string& prefix) {
  ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const TensorToWrite& t) { return t.name.rfind(prefix, 0) == 0; }),
           ts.end());
}

TEST(Checkpoint, DenseExpertLinearIsQuantizedOnLoad) {
  ScratchDir d;
  synth_checkpoint(test::synth_opts(d.path(), Arch::Qwen3Moe, Format::GptqV1));
  const int64_t H = 256, I = 128;
  std::vector<float> w_nk(size_t(I * H));  // torch layout [N=I, K=H]
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd(0.0, 0.05);
  for (auto& v : w_nk) v = f16_to_float(float_to_f16(float(nd(rng))));
  const std::string m = "model.layers.1.mlp.experts.2.up_proj";
  mutate(d.path(), [&](std::vector<TensorToWrite>& ts) {
    drop(ts, m + ".");
    ts.push_back(tensor_f16(m + ".weight", {I, H}, w_nk));
  });
  const Checkpoint ck = Checkpoint::open(d.path());
  LayerInfo li = ck.describe_layer(1);
  EXPECT_TRUE(li.problems.empty());
  std::vector<std::string> notes;
  MoeLayerWeights w = ck.load_layer(1, &notes);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find(m + " is dense (F16); quantized on load to gptq 8-bit g128 sym"), std::string::npos) << notes[0];
  const QuantizedLinear& q = w.experts[2].up;
  EXPECT_EQ(q.scheme.bits, 8);
  std::vector<double> dq = dequantize(q);  // [K=H, N=I]
  double num = 0, den = 0;
  for (int64_t k = 0; k < H; ++k)
    for (int64_t n = 0; n < I; ++n) {
      const double ref = w_nk[size_t(n * H + k)];
      num += (dq[size_t(k * I + n)] - ref) * (dq[size_t(k * I + n)] - ref);
      den += ref * ref;
    }
  EXPECT_LT(std::sqrt(num / den), 0.01) << "8-bit RTN of the dense weight, transposed to [K, N]";
}

TEST(Checkpoint, QuantizedRouterIsDequantized) {
  ScratchDir d;
  synth_checkpoint(test::synth_opts(d.path(), Arch::Mixtral, Format::GptqV1, 8));
  const std::string r = "model.layers.0.block_sparse_moe.gate";
  QuantScheme s;
  s.bits = 8;
  s.group_size = 128;
  std::vector<float> w_he(256 * 8);
  for (size_t i = 0; i < w_he.size(); ++i) w_he[i] = float(int(i % 13) - 6) * 0.01f;
  QuantizedLinear q = quantize(w_he, 256, 8, s);
  mutate(d.path(), [&](std::vector<TensorToWrite>& ts) {
    drop(ts, r + ".");
    ts.push_back(tensor_i32(r + ".qweight", {256 * 8 / 32, 8}, q.qweight));
    ts.push_back(tensor_i32(r + ".qzeros", {2, 8 * 8 / 32}, q.qzeros));
    ts.push_back(tensor_f16(r + ".scales", {2, 8}, q.scales));
  });
  const Checkpoint ck = Checkpoint::open(d.path());
  std::vector<std::string> notes;
  MoeLayerWeights w = ck.load_layer(0, &notes);
  ASSERT_FALSE(notes.empty());
  std::vector<double> dq = dequantize(q);  // [H, E]
  for (int e = 0; e < 8; ++e)
    for (int h = 0; h < 256; ++h) ASSERT_EQ(w.router[size_t(e * 256 + h)], float(dq[size_t(h * 8 + e)]));
}

TEST(Checkpoint, StaticGroupsAndStrayZerosAreDecidedByTheTensors) {
  ScratchDir d;
  synth_checkpoint(test::synth_opts(d.path(), Arch::Mixtral, Format::GptqV1));
  // Claim desc_act in the config while g_idx is k / g (static_groups): no act-order.
  std::string cfg = test::read_file(d / "config.json");
  cfg.replace(cfg.find("\"desc_act\": false"), 17, "\"desc_act\": true");
  test::write_file(d / "config.json", cfg);
  // Sym in the config, but one linear stores other zeros.
  const std::string m = "model.layers.0.block_sparse_moe.experts.1.w2";
  mutate(d.path(), [&](std::vector<TensorToWrite>& ts) {
    TensorToWrite* z = test::find_tensor(ts, m + ".qzeros");
    ASSERT_NE(z, nullptr);
    z->data[0] = 0x35;
  });
  const Checkpoint ck = Checkpoint::open(d.path());
  EXPECT_TRUE(ck.quant().scheme.act_order);
  std::vector<std::string> notes;
  MoeLayerWeights w = ck.load_layer(0, &notes);
  EXPECT_FALSE(w.experts[0].gate.scheme.act_order);
  EXPECT_TRUE(w.experts[0].gate.scheme.sym);
  EXPECT_FALSE(w.experts[1].down.scheme.sym);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("sym=true but"), std::string::npos) << notes[0];
}

TEST(Checkpoint, QuantConfigSources) {
  ScratchDir d;
  synth_checkpoint(test::synth_opts(d.path(), Arch::Mixtral, Format::GptqV2, 8));
  EXPECT_NE(Checkpoint::open(d.path()).quant().origin.find("config.json quantization_config"), std::string::npos);
  // Without quantization_config in config.json, AutoGPTQ's quantize_config.json is used.
  std::string cfg = test::read_file(d / "config.json");
  const size_t at = cfg.find(",\n  \"quantization_config\"");
  ASSERT_NE(at, std::string::npos);
  test::write_file(d / "config.json", cfg.substr(0, at) + "\n}\n");
  Checkpoint ck = Checkpoint::open(d.path());
  EXPECT_NE(ck.quant().origin.find("quantize_config.json"), std::string::npos);
  EXPECT_EQ(ck.quant().scheme.bits, 8);
  EXPECT_EQ(ck.quant().scheme.format, Format::GptqV2);
  // And with neither file the quantized tensors are refused by name.
  test::fs::remove(d / "quantize_config.json");
  Checkpoint none = Checkpoint::open(d.path());
  try {
    none.load_layer(0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no quantization config"), std::string::npos) << e.what();
  }
  // Old AutoAWQ quant_config.json.
  ScratchDir a;
  synth_checkpoint(test::synth_opts(a.path(), Arch::Mixtral, Format::Awq));
  cfg = test::read_file(a / "config.json");
  test::write_file(a / "config.json", cfg.substr(0, cfg.find(",\n  \"quantization_config\"")) + "\n}\n");
  test::write_file(a / "quant_config.json", R"({"zero_point": true, "q_group_size": 128, "w_bit": 4, "version": "GEMM"})");
  Checkpoint old = Checkpoint::open(a.path());
  EXPECT_EQ(old.quant().method, QuantMethod::Awq);
  EXPECT_EQ(old.load_layer(1).experts.size(), 8u);
}

TEST(Checkpoint, SynthLayoutIsHuggingFaces) {
  ScratchDir d;
  SynthResult r = synth_checkpoint(test::synth_opts(d.path() + "/m", Arch::DeepseekV3, Format::GptqV1, 4, false, false, true));
  EXPECT_EQ(r.moe_layers, std::vector<int64_t>{1});
  const auto files = test::list_dir(d / "m");
  EXPECT_TRUE(std::find(files.begin(), files.end(), "model.safetensors.index.json") != files.end());
  EXPECT_TRUE(std::find(files.begin(), files.end(), "model-00001-of-00005.safetensors") != files.end());
  EXPECT_TRUE(std::find(files.begin(), files.end(), "quantize_config.json") != files.end());
  const Checkpoint ck = Checkpoint::open(d / "m");
  for (const char* n : {"model.layers.0.mlp.gate_proj.qweight", "model.layers.1.mlp.gate.weight",
                        "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.15.down_proj.g_idx",
                        "model.layers.1.mlp.shared_experts.up_proj.scales"})
    EXPECT_TRUE(ck.tensors().has(n)) << n;
  EXPECT_EQ(ck.tensors().find("model.layers.1.mlp.gate.weight").info->dtype, StDtype::F16);
  EXPECT_EQ(ck.tensors().find("model.layers.1.mlp.gate.e_score_correction_bias").info->dtype, StDtype::F32);
  // Refuses to write into a non-empty directory.
  EXPECT_THROW(synth_checkpoint(test::synth_opts(d / "m", Arch::Mixtral, Format::GptqV1)), Error);
  // Deterministic for a seed.
  ScratchDir e;
  synth_checkpoint(test::synth_opts(e.path() + "/m", Arch::DeepseekV3, Format::GptqV1, 4, false, false, true));
  EXPECT_EQ(test::read_file(d / "m/model-00003-of-00005.safetensors"), test::read_file(e / "m/model-00003-of-00005.safetensors"));
}

TEST(Checkpoint, RunCommandDtypesAndShapes) {
  ScratchDir d;
  const std::string m = d / "m";
  ASSERT_EQ(test::run_cli("synth " + m + " --arch qwen2_moe --format gptq").exit_code, 0);
  struct In {
    DType dt;
    std::vector<int64_t> shape;
  };
  for (const In& in : {In{DType::F16, {5, 256}}, In{DType::F32, {2, 3, 256}}, In{DType::BF16, {0, 256}}}) {
    const std::string x = d / "x.safetensors", y = d / "y.safetensors";
    int64_t M = 1;
    for (size_t i = 0; i + 1 < in.shape.size(); ++i) M *= in.shape[i];
    test::write_random_input(x, M, 256, in.dt, 5, in.shape);
    auto r = test::run_cli("run " + m + " --layer 1 --input " + x + " --output " + y + " --device cpu --check");
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("PASSED"), std::string::npos) << r.out;
    HiddenStates out = read_hidden_states(y);
    EXPECT_EQ(out.dtype, in.dt);
    EXPECT_EQ(out.shape, in.shape);
    if (in.dt == DType::F32) {
      EXPECT_NE(r.out.find("bf16 activations"), std::string::npos) << "F32 input runs with bf16 activations";
      for (float v : out.values) EXPECT_EQ(v, round_to(DType::BF16, v));
    }
  }
}

TEST(Checkpoint, InspectReports) {
  ScratchDir d;
  const std::string m = d / "m";
  ASSERT_EQ(test::run_cli("synth " + m + " --arch deepseek_v2 --format awq --layers 3").exit_code, 0);
  auto r = test::run_cli("inspect " + m);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  for (const char* s : {"architecture: deepseek_v2", "layers: MoE 1-2; dense 0", "16 routed, top-4",
                        "shared: 2 expert(s), fused width 256", "group_limited_greedy", "scaled by routed_scaling_factor 16",
                        "awq 4-bit, group_size 128", "mlp.experts.*.down_proj", "awq 4-bit g128 asym x 32",
                        "mlp.gate ", "dense F16 x 2", "per routed expert", "problems: none", "PASSED"})
    EXPECT_NE(r.out.find(s), std::string::npos) << "missing \"" << s << "\" in\n" << r.out;
}

}  // namespace
}  // namespace wna16
