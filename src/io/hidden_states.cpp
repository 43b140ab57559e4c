// The activation files of `wna16 run`: one tensor "hidden_states", F32, F16 or BF16.
#include "io/json_util.h"
#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {

int64_t HiddenStates::rows() const {
  int64_t r = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) r *= shape[i];
  return shape.empty() ? 0 : r;
}

HiddenStates read_hidden_states(const std::string& path) {
  SafetensorsFile f = SafetensorsFile::open(path);
  const TensorInfo* t = f.find("hidden_states");
  if (!t) {
    std::string names;
    for (const auto& x : f.tensors()) names += (names.empty() ? "" : ", ") + x.name;
    throw Error(path + ": no tensor named \"hidden_states\" (found: " + (names.empty() ? "none" : names) + ")");
  }
  HiddenStates h;
  switch (t->dtype) {
    case StDtype::F32: h.dtype = DType::F32; break;
    case StDtype::F16: h.dtype = DType::F16; break;
    case StDtype::BF16: h.dtype = DType::BF16; break;
    default:
      throw Error(path + ": tensor hidden_states has dtype " + std::string(st_dtype_name(t->dtype)) +
                  ", expected F32, F16 or BF16");
  }
  if (t->shape.size() != 2 && t->shape.size() != 3)
    throw Error(path + ": tensor hidden_states has shape " + t->shape_str() + ", expected [M, H] or [B, S, H]");
  h.shape = t->shape;
  h.values = read_floats(f, *t);
  for (size_t i = 0; i < h.values.size(); ++i) {
    const float v = h.values[i];
    if (!(v == v) || v > 3.4e38f || v < -3.4e38f)
      throw Error(path + ": hidden_states holds a non-finite value at flat index " + std::to_string(i));
  }
  return h;
}

void write_hidden_states(const std::string& path, const HiddenStates& h) {
  std::vector<TensorToWrite> t;
  switch (h.dtype) {
    case DType::F32: t.push_back(tensor_f32("hidden_states", h.shape, h.values)); break;
    case DType::F16: t.push_back(tensor_f16("hidden_states", h.shape, h.values)); break;
    case DType::BF16: t.push_back(tensor_bf16("hidden_states", h.shape, h.values)); break;
  }
  write_safetensors(path, t, {{"format", "pt"}});
}

}  // namespace wna16
