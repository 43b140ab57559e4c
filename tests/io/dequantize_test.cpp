// `wna16 dequantize DIR OUT`: every quantized linear becomes a BF16 .weight [out, in] equal to the
// library's float64 dequantization rounded to BF16; every other tensor is copied byte for byte;
// shards, index and config as the input's minus the quantization; the quantized layer run by
// `wna16 run` equals a float64 MLP on the dequantized tensors within the layer tolerance; bad input
// is refused naming it, and OUT is never left half-written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "wna16/backend.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"
#include "wna16/half.h"
#include "wna16/reference.h"

namespace wna16 {
namespace {

using test::ScratchDir;

struct Case {
  const char* name;
  Arch arch;
  Format format;
  int bits;
  bool desc_act, asym, ct;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<float> floats(const TensorStore& st, const std::string& name) {
  const TensorStore::Entry e = st.find(name);
  if (!e.file) throw Error("test: no tensor " + name);
  return read_floats(*e.file, *e.info);
}

class Dequantize : public ::testing::TestWithParam<Case> {};

TEST_P(Dequantize, EachWeightIsTheFloat64DequantizationInBf16) {
  const Case& c = GetParam();
  ScratchDir d;
  SynthOptions o = test::synth_opts(d / "q", c.arch, c.format, c.bits, c.desc_act, c.asym, /*sharded=*/true);
  o.compressed_tensors = c.ct;
  synth_checkpoint(o);
  const DequantizeResult r = dequantize_checkpoint(o.dir, d / "out");
  const Checkpoint in = Checkpoint::open(o.dir);
  const TensorStore out = TensorStore::open_dir(d / "out");
  const std::vector<std::string> modules = in.quantized_modules();
  ASSERT_FALSE(modules.empty());
  EXPECT_EQ(r.dequantized, int64_t(modules.size()));

  for (const std::string& m : modules) {
    SCOPED_TRACE(m);
    const QuantizedLinear ql = in.load_quantized_linear(m);
    const std::vector<double> want = dequantize(ql);  // [K, N]
    const TensorStore::Entry e = out.find(m + ".weight");
    ASSERT_TRUE(e.file);
    EXPECT_EQ(e.info->dtype, StDtype::BF16);
    ASSERT_EQ(e.info->shape, (std::vector<int64_t>{ql.N, ql.K}));
    const std::vector<float> got = read_floats(*e.file, *e.info);
    int bad = 0;
    for (int64_t n = 0; n < ql.N; ++n)
      for (int64_t k = 0; k < ql.K; ++k) {
        const double w = want[size_t(k * ql.N + n)], g = got[size_t(n * ql.K + k)];
        if (std::fabs(g - w) > std::fabs(w) * (1.0 / 256)) ++bad;  // BF16 rounding: half an ulp is 2^-9
      }
    EXPECT_EQ(bad, 0);
    for (const char* s : {".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale",
                          ".weight_zero_point", ".weight_g_idx", ".weight_shape"})
      EXPECT_FALSE(out.has(m + s)) << s;
  }
  // Everything else byte for byte, in the shard of the same name.
  int copied = 0;
  for (const std::string& name : in.tensors().names()) {
    const std::string mod = name.substr(0, name.rfind('.'));
    bool part_of_quantized = false;
    for (const auto& m : modules) part_of_quantized = part_of_quantized || mod == m;
    if (part_of_quantized) continue;
    const TensorStore::Entry a = in.tensors().find(name), b = out.find(name);
    ASSERT_TRUE(b.file) << name;
    EXPECT_EQ(a.info->dtype, b.info->dtype) << name;
    EXPECT_EQ(a.info->shape, b.info->shape) << name;
    EXPECT_EQ(0, std::memcmp(a.file->data(*a.info), b.file->data(*b.info), size_t(a.info->nbytes()))) << name;
    EXPECT_EQ(test::fs::path(a.file->path()).filename(), test::fs::path(b.file->path()).filename()) << name;
    ++copied;
  }
  EXPECT_EQ(r.copied, copied);
  EXPECT_GT(out.num_files(), 1u);  // sharded like the input
  EXPECT_TRUE(test::fs::exists(d / "out/model.safetensors.index.json"));
  auto cfg = nlohmann::json::parse(test::read_file(d / "out/config.json"));
  EXPECT_FALSE(cfg.contains("quantization_config"));
  EXPECT_EQ(cfg["torch_dtype"], "bfloat16");
  EXPECT_FALSE(test::fs::exists(d / "out/quantize_config.json"));
  EXPECT_EQ(Checkpoint::open(d / "out").quant().method, QuantMethod::None);
}

INSTANTIATE_TEST_SUITE_P(
    Formats, Dequantize,
    ::testing::Values(Case{"gptq_desc_act", Arch::Mixtral, Format::GptqV1, 4, true, false, false},
                      Case{"gptq_v2_asym_8bit", Arch::DeepseekV3, Format::GptqV2, 8, false, true, false},
                      Case{"awq", Arch::Qwen2Moe, Format::Awq, 4, false, false, false},
                      Case{"ct_asym_actorder", Arch::Glm4Moe, Format::GptqV2, 4, true, true, true},
                      Case{"ct_sym", Arch::Qwen3Next, Format::GptqV2, 4, false, false, true}),
    [](const ::testing::TestParamInfo<Case>& p) { return std::string(p.param.name); });

// float64 SwiGLU with torch-layout weights [out, in]: x [M, H] -> [M, H].
std::vector<double> mlp(const TensorStore& st, const std::string& p, const std::vector<double>& x, int64_t M, int64_t H) {
  const std::vector<float> g = floats(st, p + "gate_proj.weight"), u = floats(st, p + "up_proj.weight"),
                           dn = floats(st, p + "down_proj.weight");
  const int64_t I = int64_t(g.size()) / H;
  std::vector<double> out(size_t(M * H), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    std::vector<double> h(static_cast<size_t>(I), 0.0);
    for (int64_t i = 0; i < I; ++i) {
      double a = 0, b = 0;
      for (int64_t k = 0; k < H; ++k) {
        a += x[size_t(m * H + k)] * g[size_t(i * H + k)];
        b += x[size_t(m * H + k)] * u[size_t(i * H + k)];
      }
      h[size_t(i)] = a / (1.0 + std::exp(-a)) * b;
    }
    for (int64_t n = 0; n < H; ++n) {
      double s = 0;
      for (int64_t i = 0; i < I; ++i) s += h[size_t(i)] * dn[size_t(n * I + i)];
      out[size_t(m * H + n)] = s;
    }
  }
  return out;
}

// The layer on the dequantized checkpoint in float64, from its tensors alone.
std::vector<double> layer_from_dense(const std::string& dir, int64_t L, const HiddenStates& xs) {
  const Checkpoint ck = Checkpoint::open(dir);
  const ModelConfig& c = ck.config();
  const MoeLayerSpec spec = c.layer_spec(L);
  const TensorStore& st = ck.tensors();
  const std::string p = c.mlp_prefix(L) + ".";
  const int64_t M = xs.rows(), H = spec.hidden, E = spec.routing.num_experts;
  const std::vector<double> x(xs.values.begin(), xs.values.end());
  const std::vector<float> router = floats(st, p + "gate.weight");
  std::vector<float> logits(size_t(M * E));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t k = 0; k < H; ++k) s += x[size_t(m * H + k)] * router[size_t(e * H + k)];
      logits[size_t(m * E + e)] = float(s);
    }
  std::vector<float> bias;
  if (st.has(p + "gate.e_score_correction_bias")) bias = floats(st, p + "gate.e_score_correction_bias");
  const Routing r = route_reference(spec.routing, logits.data(), M, bias.empty() ? nullptr : bias.data());
  std::vector<double> out(size_t(M * H), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < r.top_k; ++j) {
      const std::vector<double> xm(x.begin() + m * H, x.begin() + (m + 1) * H);
      const std::string ep = p + "experts." + std::to_string(r.ids[size_t(m * r.top_k + j)]) + ".";
      const std::vector<double> y = mlp(st, ep, xm, 1, H);
      for (int64_t n = 0; n < H; ++n) out[size_t(m * H + n)] += double(r.weights[size_t(m * r.top_k + j)]) * y[size_t(n)];
    }
  if (spec.shared_kind != SharedExpertKind::None) {
    const bool gated = spec.shared_kind == SharedExpertKind::SigmoidGated;
    const std::vector<double> y = mlp(st, p + (gated ? "shared_expert." : "shared_experts."), x, M, H);
    const std::vector<float> gw = gated ? floats(st, p + "shared_expert_gate.weight") : std::vector<float>{};
    for (int64_t m = 0; m < M; ++m) {
      double gate = 1.0;
      if (gated) {
        double s = 0;
        for (int64_t k = 0; k < H; ++k) s += x[size_t(m * H + k)] * gw[size_t(k)];
        gate = 1.0 / (1.0 + std::exp(-s));
      }
      for (int64_t n = 0; n < H; ++n) out[size_t(m * H + n)] += gate * y[size_t(m * H + n)];
    }
  }
  return out;
}

TEST(DequantizeRoundTrip, RunOnQuantizedEqualsFloat64OnDequantized) {
  for (Arch arch : {Arch::Qwen3Next, Arch::Glm4Moe}) {
    SCOPED_TRACE(arch_name(arch));
    ScratchDir d;
    SynthOptions o = test::synth_opts(d / "q", arch, Format::GptqV2, 4, true, true);
    o.compressed_tensors = arch == Arch::Glm4Moe;
    synth_checkpoint(o);
    const std::string x = d / "x.safetensors", y = d / "y.safetensors", out = d / "bf16";
    test::write_random_input(x, 9, 256, DType::BF16);
    auto dq = test::run_cli("dequantize " + o.dir + " " + out);
    ASSERT_EQ(dq.exit_code, 0) << dq.out << dq.err;
    EXPECT_NE(dq.out.find("dequantized to bf16"), std::string::npos) << dq.out;
    auto r = test::run_cli("run " + o.dir + " --layer 1 --input " + x + " --output " + y + " --device cpu");
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const HiddenStates got = read_hidden_states(y);
    const std::vector<double> want = layer_from_dense(out, 1, read_hidden_states(x));
    const double err = rel_error(got.values.data(), want.data(), int64_t(want.size()));
    EXPECT_LE(err, layer_tolerance(DType::BF16)) << "rel_error " << err;
  }
}

TEST(DequantizeRefusals, BadInputIsNamedAndOutIsNeverHalfWritten) {
  ScratchDir d;
  SynthOptions o = test::synth_opts(d / "q", Arch::Mixtral, Format::GptqV1);
  synth_checkpoint(o);
  const std::string out = d / "out";
  // A scales tensor of the wrong shape: refused naming file and tensor; nothing at OUT, no temp dir.
  std::vector<TensorToWrite> ts = test::load_all(o.dir + "/model.safetensors");
  test::find_tensor(ts, "model.layers.1.block_sparse_moe.experts.3.w2.scales")->shape = {1, 512};
  write_safetensors(o.dir + "/model.safetensors", ts);
  auto r = test::run_cli("dequantize " + o.dir + " " + out);
  EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("model.safetensors: tensor model.layers.1.block_sparse_moe.experts.3.w2.scales has shape [1, 512]"),
            std::string::npos) << r.err;
  EXPECT_EQ(test::list_dir(d.path()), (std::vector<std::string>{"q"}));

  // An orphan quantization tensor.
  ScratchDir d2;
  SynthOptions o2 = test::synth_opts(d2 / "q", Arch::Mixtral, Format::GptqV1);
  synth_checkpoint(o2);
  ts = test::load_all(o2.dir + "/model.safetensors");
  ts.push_back(tensor_i32("model.layers.0.self_attn.q_proj.g_idx", {4}, {0, 0, 0, 0}));
  write_safetensors(o2.dir + "/model.safetensors", ts);
  EXPECT_THROW(
      try { dequantize_checkpoint(o2.dir, d2 / "out"); } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("model.layers.0.self_attn.q_proj.qweight is not in"), std::string::npos) << e.what();
        throw;
      },
      Error);
  EXPECT_FALSE(test::fs::exists(d2 / "out"));

  // OUT exists and is not empty; DIR has no quantization config.
  ScratchDir d3;
  synth_checkpoint(test::synth_opts(d3 / "q", Arch::Mixtral, Format::GptqV1));
  test::fs::create_directory(d3 / "full");
  test::write_file(d3 / "full/keep", "x");
  r = test::run_cli("dequantize " + (d3 / "q") + " " + (d3 / "full"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("exists and is not an empty directory"), std::string::npos) << r.err;
  EXPECT_EQ(test::read_file(d3 / "full/keep"), "x");
  auto ok = test::run_cli("dequantize " + (d3 / "q") + " " + (d3 / "bf16"));
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  r = test::run_cli("dequantize " + (d3 / "bf16") + " " + (d3 / "again"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("has no quantization config"), std::string::npos) << r.err;
  EXPECT_FALSE(test::fs::exists(d3 / "again"));
}

}  // namespace
}  // namespace wna16
