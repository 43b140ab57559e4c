// A Hugging Face GPTQ/AWQ MoE checkpoint: config + quantization config + tensors, and the loading
// of one MoE layer into MoeLayerSpec + MoeLayerWeights. The path a tensor takes:
// shard (mmap) -> validated QuantizedLinear here -> repack in the backend (make_layer).
#include "wna16/checkpoint.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/json_util.h"
#include "io/quant_util.h"
#include "wna16/error.h"

namespace wna16 {

namespace fs = std::filesystem;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error("cannot read " + p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

bool is_float_dtype(StDtype t) {
  return t == StDtype::F32 || t == StDtype::F16 || t == StDtype::BF16 || t == StDtype::F64;
}

// Where a tensor lives, for messages: "DIR/model-00001-of-00002.safetensors: tensor NAME".
std::string tensor_where(const TensorStore::Entry& e) {
  return e.file->path() + ": tensor " + e.info->name;
}

// Names of one layer's linears, per architecture (formats.md).
struct LayerNames {
  std::string prefix;                 // model.layers.L.mlp / .block_sparse_moe
  std::string router, bias, shared_gate;
  std::string expert(int e, int which) const {  // which: 0 gate, 1 up, 2 down
    static const char* hf[] = {"gate_proj", "up_proj", "down_proj"};
    static const char* mixtral[] = {"w1", "w3", "w2"};
    return prefix + ".experts." + std::to_string(e) + "." + (is_mixtral ? mixtral[which] : hf[which]);
  }
  std::string shared(int which) const {
    static const char* hf[] = {"gate_proj", "up_proj", "down_proj"};
    return shared_prefix + "." + hf[which];
  }
  std::string dense(int which) const {
    static const char* hf[] = {"gate_proj", "up_proj", "down_proj"};
    return prefix + "." + hf[which];
  }
  bool is_mixtral = false;
  std::string shared_prefix;  // empty: no shared expert
};

LayerNames layer_names(const ModelConfig& c, int64_t L) {
  LayerNames n;
  n.prefix = c.mlp_prefix(L);
  n.is_mixtral = c.arch == Arch::Mixtral;
  n.router = n.prefix + ".gate.weight";
  if (arch_has_correction_bias(c.arch)) n.bias = n.prefix + ".gate.e_score_correction_bias";
  if ((c.arch == Arch::Qwen2Moe || c.arch == Arch::Qwen3Next) && c.shared_expert_inter > 0) {
    n.shared_prefix = n.prefix + ".shared_expert";
    n.shared_gate = n.prefix + ".shared_expert_gate.weight";
  }
  if (arch_is_deepseek_like(c.arch) && c.n_shared_experts > 0) n.shared_prefix = n.prefix + ".shared_experts";
  return n;
}

// The stored form of one linear, checked against K, N and the config; throws Error naming file,
// tensor, shape and the expected shape.
// compressed-tensors (ct): qweight, scales, qzeros and g_idx hold weight_packed [N, K*b/32],
// weight_scale [N, G], weight_zero_point [N*b/32, G] (asym only) and weight_g_idx.
struct LinearPlan {
  std::string module;
  int64_t K = 0, N = 0;
  bool quantized = false;
  bool ct = false;
  QuantScheme scheme;
  TensorStore::Entry qweight{}, qzeros{}, scales{}, g_idx{}, weight{}, bias{};
  uint64_t bytes = 0;
};

void expect_shape(const TensorStore::Entry& e, const std::vector<int64_t>& want, const std::string& why) {
  if (e.info->shape != want)
    throw Error(tensor_where(e) + " has shape " + e.info->shape_str() + " but " + why + " needs " + shape_str(want));
}

void expect_dtype(const TensorStore::Entry& e, StDtype want) {
  if (e.info->dtype != want)
    throw Error(tensor_where(e) + " has dtype " + st_dtype_name(e.info->dtype) + ", expected " + st_dtype_name(want));
}

void expect_float(const TensorStore::Entry& e) {
  if (!is_float_dtype(e.info->dtype))
    throw Error(tensor_where(e) + " has dtype " + st_dtype_name(e.info->dtype) + ", expected F16, BF16 or F32");
}

const char* method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::None: return "no quantization config";
    case QuantMethod::Gptq: return "gptq";
    case QuantMethod::Awq: return "awq";
    case QuantMethod::CompressedTensors: return "compressed-tensors";
  }
  return "?";
}

// weight_shape [2] (I32, or I64 as torch.tensor(weight.shape) saves it) must say [N, K].
void check_weight_shape(const TensorStore::Entry& e, int64_t K, int64_t N) {
  if (e.info->dtype != StDtype::I32 && e.info->dtype != StDtype::I64)
    throw Error(tensor_where(e) + " has dtype " + st_dtype_name(e.info->dtype) + ", expected I32 or I64");
  expect_shape(e, {2}, "a shape [out, in]");
  int64_t v[2];
  for (int i = 0; i < 2; ++i) {
    if (e.info->dtype == StDtype::I64) {
      std::memcpy(&v[i], e.file->data(*e.info) + 8 * i, 8);
    } else {
      int32_t x;
      std::memcpy(&x, e.file->data(*e.info) + 4 * i, 4);
      v[i] = x;
    }
  }
  if (v[0] != N || v[1] != K)
    throw Error(tensor_where(e) + " = [" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + "] but the config gives this linear [out, in] = [" +
                std::to_string(N) + ", " + std::to_string(K) + "]");
}

// The compressed-tensors tensors of a pack-quantized linear, checked against K, N and the scheme.
void plan_ct(const TensorStore& st, const QuantConfig& q, LinearPlan& p) {
  const std::string& m = p.module;
  const int64_t K = p.K, N = p.N;
  const int b = p.scheme.bits;
  p.ct = true;
  p.scales = st.find(m + ".weight_scale");
  p.qzeros = st.find(m + ".weight_zero_point");
  p.g_idx = st.find(m + ".weight_g_idx");
  const TensorStore::Entry shape = st.find(m + ".weight_shape");
  const std::string next = " (next to " + tensor_where(p.qweight) + ")";
  if (!p.scales.file) throw Error("missing tensor " + m + ".weight_scale" + next);
  if (!shape.file) throw Error("missing tensor " + m + ".weight_shape" + next);
  expect_dtype(p.qweight, StDtype::I32);
  expect_float(p.scales);
  check_weight_shape(shape, K, N);
  const int64_t G = p.scheme.num_groups(K);
  const std::string gcfg = "K=" + std::to_string(K) + (p.scheme.group_size > 0 ? " with group_size=" + std::to_string(p.scheme.group_size) : std::string(", strategy channel")) +
                           " (" + std::to_string(G) + " group" + (G == 1 ? "" : "s") + ")";
  expect_shape(p.qweight, {N, K * b / 32},
               "K=" + std::to_string(K) + ", N=" + std::to_string(N) + " at " + std::to_string(b) + " bits (compressed-tensors, [out, in*bits/32], packed along the input)");
  expect_shape(p.scales, {N, G}, gcfg + " ([out, groups])");
  if (p.scheme.sym && p.qzeros.file)
    throw Error(tensor_where(p.qzeros) + " is present but " + q.origin + " says symmetric: true for " + m + ": the config contradicts the tensors");
  if (!p.scheme.sym) {
    if (!p.qzeros.file) throw Error("missing tensor " + m + ".weight_zero_point (" + q.origin + " says symmetric: false)" + next);
    expect_dtype(p.qzeros, StDtype::I32);
    expect_shape(p.qzeros, {N * b / 32, G}, gcfg + " at " + std::to_string(b) + " bits (compressed-tensors, packed along the output)");
    p.bytes += p.qzeros.info->nbytes();
  }
  if (p.scheme.act_order && !p.g_idx.file)
    throw Error("missing tensor " + m + ".weight_g_idx (" + q.origin + " says actorder \"group\")" + next);
  if (p.g_idx.file) {
    if (!p.scheme.act_order)
      throw Error(tensor_where(p.g_idx) + " is present but " + q.origin + " sets no actorder \"group\" for " + m +
                  ": the config contradicts the tensors");
    expect_dtype(p.g_idx, StDtype::I32);
    expect_shape(p.g_idx, {K}, "K=" + std::to_string(K));
    p.bytes += p.g_idx.info->nbytes();
  }
  p.bytes += p.qweight.info->nbytes() + p.scales.info->nbytes() + shape.info->nbytes();
}

LinearPlan plan_linear(const TensorStore& st, const QuantConfig& q, const std::string& module, int64_t K, int64_t N) {
  LinearPlan p;
  p.module = module;
  p.K = K;
  p.N = N;
  p.qweight = st.find(module + ".qweight");
  const TensorStore::Entry packed = st.find(module + ".weight_packed");
  p.weight = st.find(module + ".weight");
  p.bias = st.find(module + ".bias");
  const bool ct = q.method == QuantMethod::CompressedTensors;
  if (!p.qweight.file && !p.weight.file && !packed.file)
    throw Error("missing linear " + module + ": neither " + module + (ct ? ".weight_packed" : ".qweight") + " nor " + module +
                ".weight is in " + st.dir() + " (" + st.layout() + ")");
  std::vector<std::string> stored;
  for (const auto& [e, n] : {std::pair{p.qweight, ".qweight"}, {packed, ".weight_packed"}, {p.weight, ".weight"}})
    if (e.file) stored.push_back(n);
  if (stored.size() > 1)
    throw Error("linear " + module + " has " + (stored.size() == 2 ? "both " + stored[0] : stored[0] + ", " + stored[1]) +
                " and " + stored.back() + "; cannot tell how it is stored");
  if (packed.file && !ct)
    throw Error(tensor_where(packed) + " is compressed-tensors pack-quantized, but the quantization config is " +
                (q.method == QuantMethod::None ? std::string("missing") : method_name(q.method) + std::string(" (") + q.origin + ")"));
  if (p.qweight.file && ct)
    throw Error(tensor_where(p.qweight) + " is a GPTQ/AWQ tensor, but " + q.origin +
                " is compressed-tensors (which stores .weight_packed): the config contradicts the tensors");
  if (packed.file) p.qweight = packed;
  if (p.bias.file) {
    expect_float(p.bias);
    expect_shape(p.bias, {N}, "N=" + std::to_string(N));
    p.bytes += p.bias.info->nbytes();
  }
  if (p.weight.file) {  // dense (unquantized) linear: torch layout [out, in] = [N, K]
    expect_float(p.weight);
    expect_shape(p.weight, {N, K}, "a dense linear with K=" + std::to_string(K) + " inputs and N=" + std::to_string(N) + " outputs");
    if (ct && q.scheme_for(module))
      throw Error(tensor_where(p.weight) + " is dense, but " + q.origin + " quantizes " + module +
                  " (a config_groups target, not in ignore): the config contradicts the tensors");
    p.bytes += p.weight.info->nbytes();
    return p;
  }
  p.quantized = true;
  if (q.method == QuantMethod::None)
    throw Error(tensor_where(p.qweight) + " is quantized but " + st.dir() +
                " has no quantization config (config.json quantization_config, quantize_config.json or quant_config.json)");
  std::optional<QuantScheme> s;
  try {
    s = q.scheme_for(module);
  } catch (const Error& e) {
    throw Error(module + ": " + e.what());
  }
  if (!s)
    throw Error(tensor_where(p.qweight) + " is quantized but " + q.origin +
                " leaves module " + module + " unquantized (" +
                (ct ? "in ignore, or no config_groups target matches it" : "modules_to_not_convert or a \"-:\" dynamic rule") +
                "): the config contradicts the tensors");
  p.scheme = *s;
  try {
    p.scheme.validate(K, N);
  } catch (const Error& e) {
    throw Error(module + " (" + q.origin + ": " + p.scheme.describe() + "): " + e.what());
  }
  if (ct) {
    plan_ct(st, q, p);
    return p;
  }
  p.qzeros = st.find(module + ".qzeros");
  p.scales = st.find(module + ".scales");
  p.g_idx = st.find(module + ".g_idx");
  if (!p.scales.file) throw Error("missing tensor " + module + ".scales (next to " + tensor_where(p.qweight) + ")");
  if (!p.qzeros.file) throw Error("missing tensor " + module + ".qzeros (next to " + tensor_where(p.qweight) + ")");
  expect_dtype(p.qweight, StDtype::I32);
  expect_dtype(p.qzeros, StDtype::I32);
  expect_float(p.scales);
  const int b = p.scheme.bits;
  const int64_t G = p.scheme.num_groups(K);
  const std::string cfg = "K=" + std::to_string(K) + ", N=" + std::to_string(N) + " at " + std::to_string(b) + " bits";
  const std::string gcfg = "K=" + std::to_string(K) + " with group_size=" + std::to_string(p.scheme.group_size) +
                           " (" + std::to_string(G) + " group" + (G == 1 ? "" : "s") + ")";
  if (p.scheme.format == Format::Awq) {
    expect_shape(p.qweight, {K, N / 8}, cfg + " (AWQ gemm, packed along N)");
    expect_shape(p.scales, {G, N}, gcfg);
    expect_shape(p.qzeros, {G, N / 8}, gcfg + " (AWQ, packed along N)");
  } else {
    expect_shape(p.qweight, {K * b / 32, N}, cfg + " (GPTQ, packed along K)");
    expect_shape(p.scales, {G, N}, gcfg);
    expect_shape(p.qzeros, {G, N * b / 32}, gcfg + " at " + std::to_string(b) + " bits (GPTQ, packed along N)");
    if (p.g_idx.file) {
      expect_dtype(p.g_idx, StDtype::I32);
      expect_shape(p.g_idx, {K}, "K=" + std::to_string(K));
      p.bytes += p.g_idx.info->nbytes();
    }
  }
  p.bytes += p.qweight.info->nbytes() + p.qzeros.info->nbytes() + p.scales.info->nbytes();
  return p;
}

// Expected stored qzeros word when every zero is 2^(b-1) (GPTQ sym): v1 stores zero-1.
uint32_t sym_zero_word(Format f, int bits) {
  const uint32_t field = (1u << (bits - 1)) - (f == Format::GptqV1 ? 1u : 0u);
  uint32_t w = 0;
  for (int i = 0; i < 32 / bits; ++i) w |= field << (i * bits);
  return w;
}

// compressed-tensors -> GPTQ v2. Both pack b-bit fields LSB first (value i of a word at bits
// [b*i, b*i+b)) and store q + 2^(b-1) for the signed q in [-2^(b-1), 2^(b-1)), so the stored
// unsigned fields are GPTQ's codes and zeros as they are: only the word matrices transpose.
// weight_packed [N, K*b/32] -> qweight [K*b/32, N]; weight_zero_point [N*b/32, G] -> qzeros
// [G, N*b/32]; weight_scale [N, G] -> scales [G, N]. Symmetric: zero 2^(b-1) everywhere.
void load_ct(const LinearPlan& p, QuantizedLinear& ql) {
  const int b = p.scheme.bits;
  const int64_t G = p.scheme.num_groups(p.K), kw = p.K * b / 32, nw = p.N * b / 32;
  ql.qweight = io::transpose(read_i32(*p.qweight.file, *p.qweight.info), p.N, kw);
  ql.scales = io::transpose(read_floats(*p.scales.file, *p.scales.info), p.N, G);
  if (p.qzeros.file) {
    ql.qzeros = io::transpose(read_i32(*p.qzeros.file, *p.qzeros.info), nw, G);
  } else {
    ql.qzeros.assign(size_t(G * nw), int32_t(sym_zero_word(Format::GptqV2, b)));
  }
}

QuantizedLinear load_linear(const LinearPlan& p, std::vector<std::string>* notes) {
  if (!p.quantized) {
    // NOTE: the MoE layer only carries quantized linears, so a dense expert linear is quantized
    // here to GPTQ 8-bit; its error (<~0.5% per weight) is far below the bf16 activation error.
    std::vector<float> w_nk = read_floats(*p.weight.file, *p.weight.info);
    QuantScheme s = dense_fallback_scheme(p.K);
    QuantizedLinear ql;
    try {
      ql = quantize(io::transpose(w_nk, p.N, p.K), p.K, p.N, s);
    } catch (const Error& e) {
      throw Error(tensor_where(p.weight) + ": cannot quantize this dense linear to " + s.describe() + ": " + e.what());
    }
    if (p.bias.file) ql.bias = read_floats(*p.bias.file, *p.bias.info);
    if (notes) notes->push_back(p.module + " is dense (" + st_dtype_name(p.weight.info->dtype) + "); quantized on load to " + s.describe());
    return ql;
  }
  QuantizedLinear ql;
  ql.scheme = p.scheme;
  ql.K = p.K;
  ql.N = p.N;
  if (p.ct) {
    load_ct(p, ql);
  } else {
    ql.qweight = read_i32(*p.qweight.file, *p.qweight.info);
    ql.qzeros = read_i32(*p.qzeros.file, *p.qzeros.info);
    ql.scales = read_floats(*p.scales.file, *p.scales.info);
  }
  if (p.bias.file) ql.bias = read_floats(*p.bias.file, *p.bias.info);
  for (size_t i = 0; i < ql.scales.size(); ++i) {
    const float v = ql.scales[i];
    if (!(v == v) || v > 3.4e38f || v < -3.4e38f)
      throw Error(tensor_where(p.scales) + " holds a non-finite scale at flat index " + std::to_string(i));
  }
  // act-order is decided by the g_idx the file holds: desc_act with static_groups (or g=-1)
  // stores g_idx = k / g, which is no act-order at all.
  const int64_t G = p.scheme.num_groups(p.K);
  const int64_t glen = p.scheme.group_len(p.K);
  ql.scheme.act_order = false;
  if (p.g_idx.file && p.scheme.format != Format::Awq) {
    std::vector<int32_t> g = read_i32(*p.g_idx.file, *p.g_idx.info);
    bool trivial = true;
    for (int64_t k = 0; k < p.K; ++k) {
      if (g[size_t(k)] < 0 || g[size_t(k)] >= G)
        throw Error(tensor_where(p.g_idx) + "[" + std::to_string(k) + "] = " + std::to_string(g[size_t(k)]) +
                    " is not a group index in [0, " + std::to_string(G) + ")");
      trivial = trivial && g[size_t(k)] == k / glen;
    }
    if (!trivial) {
      ql.g_idx = std::move(g);
      ql.scheme.act_order = true;
      if (notes && !p.scheme.act_order)
        notes->push_back(p.module + ": g_idx is not k / group_size although the config says desc_act=false; using g_idx (act-order)");
    }
  }
  // Sym is decided by the zeros the file holds; kernels may hard-code 2^(b-1) for sym schemes.
  if (p.scheme.sym && p.scheme.format != Format::Awq) {
    const uint32_t want = sym_zero_word(p.scheme.format, p.scheme.bits);
    bool all = true;
    for (int32_t w : ql.qzeros) all = all && uint32_t(w) == want;
    if (!all) {
      ql.scheme.sym = false;
      if (notes)
        notes->push_back(p.module + ": the config says sym=true but " + p.module +
                         ".qzeros holds other zero points; using the stored zeros (asym)");
    }
  }
  try {
    ql.validate();
  } catch (const Error& e) {
    throw Error(p.module + " (" + tensor_where(p.qweight) + "): " + e.what());
  }
  return ql;
}

// A dense matrix in torch layout [rows, cols] (router, shared_expert_gate): from .weight, or
// dequantized from .qweight if a file quantized it.
std::vector<float> load_dense_matrix(const TensorStore& st, const QuantConfig& q, const std::string& module, int64_t rows,
                                     int64_t cols, std::vector<std::string>* notes) {
  LinearPlan p = plan_linear(st, q, module, cols, rows);
  if (!p.quantized) return read_floats(*p.weight.file, *p.weight.info);
  std::vector<double> w = dequantize(load_linear(p, notes));  // [K=cols, N=rows]
  std::vector<float> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[size_t(r * cols + c)] = float(w[size_t(c * rows + r)]);
  if (notes) notes->push_back(module + " is quantized; dequantized to fp32 on load");
  return out;
}

std::string strip_weight(const std::string& name) { return name.substr(0, name.size() - 7); }  // ".weight"

}  // namespace

QuantScheme dense_fallback_scheme(int64_t K) {
  QuantScheme s;
  s.format = Format::GptqV1;
  s.bits = 8;
  s.sym = true;
  s.act_order = false;
  s.group_size = -1;
  for (int g : {128, 64, 32})
    if (K % g == 0) {
      s.group_size = g;
      break;
    }
  return s;
}

Checkpoint Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  c.dir_ = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(dir + ": not a directory");
  const fs::path cfg = fs::path(dir) / "config.json";
  if (!fs::exists(cfg, ec)) throw Error(dir + ": no config.json");
  const std::string text = read_text(cfg);
  c.config_ = parse_model_config(text, cfg.string());

  auto j = io::parse_json_strict<nlohmann::ordered_json>(text, cfg.string());
  auto qc = j.find("quantization_config");
  if (qc != j.end() && !qc->is_null()) {
    c.quant_ = parse_quant_config(qc->dump(), cfg.string(), "quantization_config");
  } else if (fs::exists(fs::path(dir) / "quantize_config.json", ec)) {
    const fs::path p = fs::path(dir) / "quantize_config.json";
    c.quant_ = parse_quant_config(read_text(p), p.string(), "quantize_config.json");
  } else if (fs::exists(fs::path(dir) / "quant_config.json", ec)) {
    const fs::path p = fs::path(dir) / "quant_config.json";
    c.quant_ = parse_quant_config(read_text(p), p.string(), "quant_config.json");
  } else {
    c.quant_.origin = "(none)";
  }
  c.store_ = std::make_unique<TensorStore>(TensorStore::open_dir(dir));
  return c;
}

LayerInfo Checkpoint::describe_layer(int64_t L) const {
  LayerInfo info;
  info.layer = L;
  info.kind = config_.layer_kind(L);
  const ModelConfig& c = config_;
  const LayerNames n = layer_names(c, L);
  const std::string pre = n.prefix + ".";
  const std::string expert0 = n.prefix + ".experts.0.";
  info.bytes = store_->bytes_under(pre);
  info.expert_bytes = store_->bytes_under(expert0);
  info.present = info.bytes > 0 || store_->has(n.router);

  auto has_linear = [&](const std::string& module) {
    return store_->has(module + ".qweight") || store_->has(module + ".weight_packed") || store_->has(module + ".weight");
  };
  auto add = [&](const std::string& module, int64_t K, int64_t N) {
    LinearInfo li;
    li.module = module;
    li.K = K;
    li.N = N;
    try {
      LinearPlan p = plan_linear(*store_, quant_, module, K, N);
      li.present = true;
      li.quantized = p.quantized;
      li.scheme = p.scheme;
      li.bytes = p.bytes;
      if (!p.quantized) li.dense_dtype = st_dtype_name(p.weight.info->dtype);
      const std::string d = p.scheme.describe();  // "gptq_v2 4-bit g128 sym": ct keeps all but the layout name
      li.storage = !p.quantized ? "dense " + li.dense_dtype : p.ct ? "compressed-tensors" + d.substr(d.find(' ')) : d;
    } catch (const Error& e) {
      li.present = has_linear(module);
      info.problems.push_back(e.what());
    }
    info.linears.push_back(li);
  };

  if (info.kind == LayerKind::Dense) {
    // Dense MLP layers are not run by wna16; their tensors may be absent (synth omits nothing
    // here, real checkpoints have them). Check them when present.
    if (c.dense_inter > 0 && c.arch != Arch::Mixtral && has_linear(n.dense(0))) {
      add(n.dense(0), c.hidden, c.dense_inter);
      add(n.dense(1), c.hidden, c.dense_inter);
      add(n.dense(2), c.dense_inter, c.hidden);
    }
    return info;
  }
  if (info.kind == LayerKind::Mtp && !info.present) return info;  // MTP layers are often dropped

  const MoeLayerSpec spec = c.layer_spec(L);
  add(strip_weight(n.router), c.hidden, c.num_experts);
  if (!n.bias.empty()) {
    auto e = store_->find(n.bias);
    try {
      if (!e.file) throw Error("missing tensor " + n.bias + " (noaux_tc routing needs e_score_correction_bias)");
      expect_float(e);
      expect_shape(e, {int64_t(c.num_experts)}, std::to_string(c.num_experts) + " experts");
    } catch (const Error& err) {
      info.problems.push_back(err.what());
    }
  }
  for (int e = 0; e < c.num_experts; ++e) {
    add(n.expert(e, 0), spec.hidden, spec.inter);
    add(n.expert(e, 1), spec.hidden, spec.inter);
    add(n.expert(e, 2), spec.inter, spec.hidden);
  }
  if (!n.shared_prefix.empty()) {
    add(n.shared(0), spec.hidden, spec.shared_inter);
    add(n.shared(1), spec.hidden, spec.shared_inter);
    add(n.shared(2), spec.shared_inter, spec.hidden);
  }
  if (!n.shared_gate.empty()) add(strip_weight(n.shared_gate), c.hidden, 1);
  return info;
}

MoeLayerWeights Checkpoint::load_layer(int64_t L, std::vector<std::string>* notes) const {
  const ModelConfig& c = config_;
  const MoeLayerSpec spec = c.layer_spec(L);
  const LayerNames n = layer_names(c, L);
  MoeLayerWeights w;
  w.router = load_dense_matrix(*store_, quant_, strip_weight(n.router), c.num_experts, c.hidden, notes);
  if (!n.bias.empty()) {
    auto e = store_->find(n.bias);
    if (!e.file) throw Error("missing tensor " + n.bias + " in " + dir_ + " (noaux_tc routing needs e_score_correction_bias)");
    expect_float(e);
    expect_shape(e, {int64_t(c.num_experts)}, std::to_string(c.num_experts) + " experts");
    w.correction_bias = read_floats(*e.file, *e.info);
  }
  auto linear = [&](const std::string& module, int64_t K, int64_t N) {
    return load_linear(plan_linear(*store_, quant_, module, K, N), notes);
  };
  w.experts.reserve(size_t(c.num_experts));
  for (int e = 0; e < c.num_experts; ++e) {
    ExpertWeights ex;
    ex.gate = linear(n.expert(e, 0), spec.hidden, spec.inter);
    ex.up = linear(n.expert(e, 1), spec.hidden, spec.inter);
    ex.down = linear(n.expert(e, 2), spec.inter, spec.hidden);
    w.experts.push_back(std::move(ex));
  }
  if (!n.shared_prefix.empty()) {
    ExpertWeights sh;
    sh.gate = linear(n.shared(0), spec.hidden, spec.shared_inter);
    sh.up = linear(n.shared(1), spec.hidden, spec.shared_inter);
    sh.down = linear(n.shared(2), spec.shared_inter, spec.hidden);
    w.shared = std::move(sh);
  }
  if (!n.shared_gate.empty()) w.shared_gate = load_dense_matrix(*store_, quant_, strip_weight(n.shared_gate), 1, c.hidden, notes);
  try {
    w.validate(spec);
  } catch (const Error& e) {
    throw Error(dir_ + " layer " + std::to_string(L) + ": " + e.what());
  }
  return w;
}

std::vector<std::string> Checkpoint::quantized_modules() const {
  std::vector<std::string> out;
  for (const std::string& name : store_->names())
    for (const char* suffix : {".qweight", ".weight_packed"}) {
      const size_t n = std::strlen(suffix);
      if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0) out.push_back(name.substr(0, name.size() - n));
    }
  return out;
}

QuantizedLinear Checkpoint::load_quantized_linear(const std::string& module) const {
  const bool ct = quant_.method == QuantMethod::CompressedTensors;
  const TensorStore::Entry q = store_->find(module + (ct ? ".weight_packed" : ".qweight"));
  if (!q.file) throw Error("missing tensor " + module + (ct ? ".weight_packed" : ".qweight") + " in " + dir_ + " (" + store_->layout() + ")");
  std::optional<QuantScheme> s;
  try {
    s = quant_.scheme_for(module);
  } catch (const Error& e) {
    throw Error(module + ": " + e.what());
  }
  // K and N from the stored shapes (any linear, not only the MoE layer's): compressed-tensors'
  // weight_shape [out, in]; GPTQ qweight [K*b/32, N]; AWQ qweight [K, N/8]. plan_linear checks
  // every tensor against them.
  if (!s)
    throw Error(tensor_where(q) + " is quantized but " + quant_.origin + " leaves module " + module +
                " unquantized: the config contradicts the tensors");
  if (q.info->shape.size() != 2)
    throw Error(tensor_where(q) + " has shape " + q.info->shape_str() + ", expected a matrix");
  int64_t K = 0, N = 0;
  if (ct) {
    const TensorStore::Entry shape = store_->find(module + ".weight_shape");
    if (!shape.file) throw Error("missing tensor " + module + ".weight_shape (next to " + tensor_where(q) + ")");
    N = q.info->shape[0];
    K = q.info->shape[1] * 32 / s->bits;
    check_weight_shape(shape, K, N);
  } else if (s->format == Format::Awq) {
    K = q.info->shape[0];
    N = q.info->shape[1] * 8;
  } else {
    K = q.info->shape[0] * 32 / s->bits;
    N = q.info->shape[1];
  }
  return load_linear(plan_linear(*store_, quant_, module, K, N), nullptr);
}

}  // namespace wna16
