// `wna16 dequantize DIR OUT`: a bf16 copy of a quantized checkpoint in the Hugging Face layout.
// Every quantized linear (GPTQ/AWQ .qweight + .qzeros/.scales/.g_idx, compressed-tensors
// .weight_packed + .weight_scale/.weight_zero_point/.weight_g_idx/.weight_shape) becomes one
// `.weight` [out, in] in BF16; every other tensor is copied byte for byte; each output shard holds
// the tensors of the input shard of the same name. One tensor is in memory at a time. Everything is
// written under a temporary directory next to OUT, renamed onto OUT at the end.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "io/json_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"
#include "wna16/half.h"

namespace wna16 {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The tensors a quantized linear is stored as, besides .qweight / .weight_packed (and .bias, kept).
const char* const kGptqAux[] = {".qzeros", ".scales", ".g_idx"};
const char* const kCtAux[] = {".weight_scale", ".weight_zero_point", ".weight_g_idx", ".weight_shape"};

// One output tensor: copied from the input, or the dequantized weight of `module`.
struct OutTensor {
  TensorHeader header;
  std::string source;  // input tensor name (copy) or "" (dequantize module)
  std::string module;
};

// Dequantized W^T in torch's layout [N, K], BF16: W[k, n] = scale * (q - zero), computed in
// double as dequantize() does, rounded once to BF16.
std::vector<uint8_t> dequantized_bf16(const QuantizedLinear& ql) {
  const UnpackedLinear u = unpack(ql);
  std::vector<uint8_t> out(size_t(u.K * u.N) * 2);
  for (int64_t n = 0; n < u.N; ++n)
    for (int64_t k = 0; k < u.K; ++k) {
      const int64_t g = u.g_idx[size_t(k)];
      const double w = double(u.scales[size_t(g * u.N + n)]) *
                       (double(u.q[size_t(k * u.N + n)]) - double(u.zeros[size_t(g * u.N + n)]));
      const uint16_t b = float_to_bf16(float(w));
      std::memcpy(out.data() + size_t(n * u.K + k) * 2, &b, 2);
    }
  return out;
}

void write_all(std::ofstream& f, const void* p, size_t n, const std::string& path) {
  f.write(static_cast<const char*>(p), std::streamsize(n));
  if (!f) throw Error("cannot write " + path);
}

// A fresh directory next to `out` for the partial output.
std::string make_temp_dir(const fs::path& out) {
  const fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  std::string base = ".";  // (built in steps: GCC 12 warns falsely on "." + std::string&&)
  base += out.filename().string();
  base += ".tmp-XXXXXX";
  std::string tmpl = (parent / base).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  if (!mkdtemp(name.data())) throw Error("dequantize: cannot create a temporary directory in " + parent.string() + ": " + std::strerror(errno));
  return name.data();
}

}  // namespace

DequantizeResult dequantize_checkpoint(const std::string& dir, const std::string& out) {
  const Checkpoint ck = Checkpoint::open(dir);
  const QuantConfig& q = ck.quant();
  if (q.method == QuantMethod::None)
    throw Error("dequantize: " + dir + " has no quantization config (config.json quantization_config, "
                "quantize_config.json or quant_config.json): nothing to dequantize");
  std::error_code ec;
  const fs::path out_path = fs::path(out).lexically_normal();
  if (out_path.filename().empty()) throw Error("dequantize: " + out + " is not a directory name");
  if (fs::exists(out_path, ec) && !(fs::is_directory(out_path, ec) && fs::is_empty(out_path, ec)))
    throw Error("dequantize: " + out + " exists and is not an empty directory; choose a new one");
  if (fs::equivalent(fs::path(dir), out_path, ec))
    throw Error("dequantize: OUT " + out + " is the input directory");

  const TensorStore& st = ck.tensors();
  const bool ct = q.method == QuantMethod::CompressedTensors;
  const std::vector<std::string> modules = ck.quantized_modules();
  const std::set<std::string> quantized(modules.begin(), modules.end());

  // The plan: per input shard (relative path), its output tensors in name order.
  std::map<std::string, std::vector<OutTensor>> shards;
  auto rel = [&](const TensorStore::Entry& e) { return fs::path(e.file->path()).lexically_relative(dir).string(); };
  DequantizeResult res;
  for (const std::string& name : st.names()) {
    const TensorStore::Entry e = st.find(name);
    const std::string stored = ct ? ".weight_packed" : ".qweight";
    if (ends_with(name, stored) && quantized.count(name.substr(0, name.size() - stored.size()))) {
      const std::string m = name.substr(0, name.size() - stored.size());
      // The stored shapes give K and N without reading the weights; load_quantized_linear checks them.
      const QuantizedLinear ql = ck.load_quantized_linear(m);
      shards[rel(e)].push_back(OutTensor{TensorHeader{m + ".weight", StDtype::BF16, {ql.N, ql.K}}, "", m});
      ++res.dequantized;
      continue;
    }
    bool aux = false;
    for (const char* s : ct ? std::vector<const char*>(std::begin(kCtAux), std::end(kCtAux))
                            : std::vector<const char*>(std::begin(kGptqAux), std::end(kGptqAux))) {
      if (!ends_with(name, s)) continue;
      const std::string m = name.substr(0, name.size() - std::strlen(s));
      if (!quantized.count(m))
        throw Error("dequantize: " + e.file->path() + ": tensor " + name + " belongs to a quantized linear, but " + m +
                    stored + " is not in " + dir + " (" + st.layout() + ")");
      aux = true;
    }
    if (ends_with(name, ".weight") && quantized.count(name.substr(0, name.size() - 7)))
      throw Error("dequantize: " + e.file->path() + ": tensor " + name + " is dense, but " + name.substr(0, name.size() - 7) +
                  stored + " quantizes the same linear");
    if (aux) continue;
    shards[rel(e)].push_back(OutTensor{TensorHeader{name, e.info->dtype, e.info->shape}, name, ""});
    ++res.copied;
  }

  const std::string tmp = make_temp_dir(out_path);
  try {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (const auto& [file, tensors] : shards) {
      std::vector<TensorHeader> hs;
      for (const auto& t : tensors) hs.push_back(t.header);
      uint64_t data_len = 0;
      const std::string header = safetensors_header(hs, {{"format", "pt"}}, &data_len);
      const std::string path = (fs::path(tmp) / file).string();
      fs::create_directories(fs::path(path).parent_path());
      std::ofstream f(path, std::ios::binary | std::ios::trunc);
      if (!f) throw Error("cannot create " + path);
      const uint64_t n = header.size();
      write_all(f, &n, 8, path);
      write_all(f, header.data(), header.size(), path);
      for (const auto& t : tensors) {
        if (t.source.empty()) {
          const std::vector<uint8_t> w = dequantized_bf16(ck.load_quantized_linear(t.module));
          write_all(f, w.data(), w.size(), path);
        } else {
          const TensorStore::Entry e = st.find(t.source);
          write_all(f, e.file->data(*e.info), size_t(e.info->nbytes()), path);
        }
        weight_map[t.header.name] = file;
      }
      f.close();
      if (!f) throw Error("cannot write " + path);
      res.total_bytes += data_len;
      res.files.push_back(file);
    }
    if (fs::exists(fs::path(dir) / "model.safetensors.index.json", ec)) {
      nlohmann::ordered_json index;
      index["metadata"]["total_size"] = res.total_bytes;
      index["weight_map"] = weight_map;
      write_file_atomic(tmp + "/model.safetensors.index.json", index.dump(2) + "\n");
      res.files.push_back("model.safetensors.index.json");
    }
    // config.json without quantization_config; the weights are now bf16.
    auto cfg = io::parse_json_strict<nlohmann::ordered_json>(
        [&] {
          std::ifstream in(fs::path(dir) / "config.json", std::ios::binary);
          return std::string(std::istreambuf_iterator<char>(in), {});
        }(),
        dir + "/config.json");
    cfg.erase("quantization_config");
    for (const char* k : {"torch_dtype", "dtype"})
      if (cfg.contains(k)) cfg[k] = "bfloat16";
    write_file_atomic(tmp + "/config.json", cfg.dump(2) + "\n");
    res.files.push_back("config.json");
    // The other files of the model directory (tokenizer, generation config, ...), except the
    // quantization configs and what was rewritten above.
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (!entry.is_regular_file() || shards.count(name) || name == "config.json" || name == "quantize_config.json" ||
          name == "quant_config.json" || name == "model.safetensors.index.json" || ends_with(name, ".safetensors"))
        continue;
      fs::copy_file(entry.path(), fs::path(tmp) / name);
      res.files.push_back(name);
    }
    fs::permissions(tmp, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec | fs::perms::others_read |
                             fs::perms::others_exec);
    fs::rename(tmp, out_path);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return res;
}

}  // namespace wna16
