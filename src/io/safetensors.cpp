// safetensors reader (mmap + the reference reader's validation rules) and atomic writer.
#include "wna16/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include "io/json_util.h"
#include "wna16/error.h"
#include "wna16/half.h"

// NOTE: safetensors data is little-endian; the readers memcpy it straight into host integers.
static_assert(std::endian::native == std::endian::little, "wna16's safetensors I/O assumes a little-endian host");

namespace wna16 {

namespace {

struct DtypeRow {
  StDtype t;
  const char* name;
  int bits;
};
constexpr DtypeRow kDtypes[] = {
    {StDtype::Bool, "BOOL", 8},      {StDtype::F4, "F4", 4},           {StDtype::F6_E2M3, "F6_E2M3", 6},
    {StDtype::F6_E3M2, "F6_E3M2", 6}, {StDtype::U8, "U8", 8},          {StDtype::I8, "I8", 8},
    {StDtype::F8_E5M2, "F8_E5M2", 8}, {StDtype::F8_E4M3, "F8_E4M3", 8}, {StDtype::F8_E8M0, "F8_E8M0", 8},
    {StDtype::I16, "I16", 16},       {StDtype::U16, "U16", 16},        {StDtype::F16, "F16", 16},
    {StDtype::BF16, "BF16", 16},     {StDtype::I32, "I32", 32},        {StDtype::U32, "U32", 32},
    {StDtype::F32, "F32", 32},       {StDtype::C64, "C64", 64},        {StDtype::F64, "F64", 64},
    {StDtype::I64, "I64", 64},       {StDtype::U64, "U64", 64},
};

std::string sys_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

// numel * bits / 8 with overflow checks; false if it overflows or is not a whole number of bytes.
bool tensor_bytes(const std::vector<int64_t>& shape, int bits, uint64_t* out) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / uint64_t(d)) return false;
    n *= uint64_t(d);
  }
  if (n > std::numeric_limits<uint64_t>::max() / uint64_t(bits)) return false;
  uint64_t b = n * uint64_t(bits);
  if (b % 8 != 0) return false;
  *out = b / 8;
  return true;
}

}  // namespace

const char* st_dtype_name(StDtype t) {
  for (const auto& r : kDtypes)
    if (r.t == t) return r.name;
  return "?";
}

int st_dtype_bits(StDtype t) {
  for (const auto& r : kDtypes)
    if (r.t == t) return r.bits;
  return 0;
}

StDtype parse_st_dtype(const std::string& s) {
  for (const auto& r : kDtypes)
    if (s == r.name) return r.t;
  std::string known;
  for (const auto& r : kDtypes) known += std::string(known.empty() ? "" : " ") + r.name;
  throw Error("unknown safetensors dtype " + io::quoted(s) + " (known: " + known + ")");
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---- reader -------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (map_) munmap(map_, map_len_);
    origin_ = std::move(o.origin_);
    base_ = o.base_;
    buffer_ = o.buffer_;
    size_ = o.size_;
    header_size_ = o.header_size_;
    map_ = o.map_;
    map_len_ = o.map_len_;
    tensors_ = std::move(o.tensors_);
    metadata_ = std::move(o.metadata_);
    o.map_ = nullptr;
    o.map_len_ = 0;
    o.base_ = o.buffer_ = nullptr;
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) munmap(map_, map_len_);
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.origin_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(sys_error("cannot open", path));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    std::string msg = sys_error("cannot stat", path);
    ::close(fd);
    throw Error(msg);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  f.size_ = uint64_t(st.st_size);
  if (f.size_ > 0) {
    // NOTE: a MAP_PRIVATE read-only map; nothing here assumes the tensors inside are aligned.
    void* p = mmap(nullptr, size_t(f.size_), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string msg = sys_error("cannot map", path);
      ::close(fd);
      throw Error(msg);
    }
    f.map_ = p;
    f.map_len_ = size_t(f.size_);
    f.base_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  f.parse();
  return f;
}

SafetensorsFile SafetensorsFile::parse_memory(const uint8_t* data, size_t size, const std::string& origin) {
  SafetensorsFile f;
  f.origin_ = origin;
  f.base_ = data;
  f.size_ = size;
  f.parse();
  return f;
}

void SafetensorsFile::parse() {
  const std::string& o = origin_;
  if (size_ < 8)
    throw Error(o + ": file is " + std::to_string(size_) + " bytes, too short for the 8-byte header length");
  uint64_t n = 0;
  std::memcpy(&n, base_, 8);
  if (n > kMaxSafetensorsHeader)
    throw Error(o + ": header length " + std::to_string(n) + " is over the limit of " +
                std::to_string(kMaxSafetensorsHeader) + " bytes");
  if (n > size_ - 8)
    throw Error(o + ": header length " + std::to_string(n) + " runs past the end of the file (" +
                std::to_string(size_) + " bytes)");
  header_size_ = n;
  buffer_ = base_ + 8 + n;
  const uint64_t buffer_len = size_ - 8 - n;

  std::string_view text(reinterpret_cast<const char*>(base_ + 8), size_t(n));
  nlohmann::json j = io::parse_json_strict<nlohmann::json>(text, o + ": header");
  if (!j.is_object()) throw Error(o + ": header is JSON but not an object");

  tensors_.clear();
  metadata_.clear();
  tensors_.reserve(j.size());
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) throw Error(o + ": __metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          throw Error(o + ": __metadata__ value of " + io::quoted(m.key()) + " is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = o + ": tensor " + io::quoted(name);
    if (!v.is_object()) throw Error(where + ": entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || sh == v.end() || off == v.end())
      throw Error(where + ": entry needs dtype, shape and data_offsets");
    if (!dt->is_string()) throw Error(where + ": dtype is not a string");
    TensorInfo t;
    t.name = name;
    try {
      t.dtype = parse_st_dtype(dt->get<std::string>());
    } catch (const Error& e) {
      throw Error(where + ": " + e.what());
    }
    if (!sh->is_array()) throw Error(where + ": shape is not an array");
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        throw Error(where + ": shape " + sh->dump() + " has an entry that is not a non-negative integer");
      t.shape.push_back(int64_t(d.get<uint64_t>()));
    }
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      throw Error(where + ": data_offsets " + off->dump() + " is not a pair of non-negative integers");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.end < t.begin)
      throw Error(where + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                  "] end before begin");
    uint64_t want = 0;
    if (!tensor_bytes(t.shape, st_dtype_bits(t.dtype), &want))
      throw Error(where + ": shape " + t.shape_str() + " x " + st_dtype_name(t.dtype) +
                  " overflows or is not a whole number of bytes");
    if (t.end - t.begin != want)
      throw Error(where + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] hold " +
                  std::to_string(t.end - t.begin) + " bytes but shape " + t.shape_str() + " x " +
                  st_dtype_name(t.dtype) + " needs " + std::to_string(want));
    tensors_.push_back(std::move(t));
  }

  // The tensors, sorted by offset, must tile [0, buffer_len) exactly: no holes, no overlaps.
  std::vector<const TensorInfo*> by_off;
  by_off.reserve(tensors_.size());
  for (const auto& t : tensors_) by_off.push_back(&t);
  std::sort(by_off.begin(), by_off.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t pos = 0;
  for (const TensorInfo* t : by_off) {
    if (t->begin != pos)
      throw Error(o + ": tensor " + io::quoted(t->name) + " starts at offset " + std::to_string(t->begin) +
                  " but the previous tensor ends at " + std::to_string(pos) +
                  (t->begin > pos ? " (a gap)" : " (an overlap)") + "; data offsets must tile the buffer");
    pos = t->end;
  }
  if (pos != buffer_len)
    throw Error(o + ": tensors end at data offset " + std::to_string(pos) + " but the data buffer is " +
                std::to_string(buffer_len) + " bytes (8 + header " + std::to_string(n) + " + data must be the file length " +
                std::to_string(size_) + ")");
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const TensorInfo& SafetensorsFile::at(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) throw Error(origin_ + ": no tensor " + io::quoted(name));
  return *t;
}

std::vector<float> read_floats(const SafetensorsFile& f, const TensorInfo& t) {
  const uint64_t n = t.numel();
  std::vector<float> out(size_t(n), 0.0f);
  const uint8_t* p = f.data(t);
  switch (t.dtype) {
    case StDtype::F32:
      if (n) std::memcpy(out.data(), p, size_t(n) * 4);
      break;
    case StDtype::F16:
    case StDtype::BF16:
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = t.dtype == StDtype::F16 ? f16_to_float(h) : bf16_to_float(h);
      }
      break;
    case StDtype::F64:
      for (uint64_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = float(d);
      }
      break;
    default:
      throw Error(f.path() + ": tensor " + io::quoted(t.name) + " has dtype " + st_dtype_name(t.dtype) +
                  ", expected a float dtype (F32, F16, BF16 or F64)");
  }
  return out;
}

std::vector<int32_t> read_i32(const SafetensorsFile& f, const TensorInfo& t) {
  if (t.dtype != StDtype::I32)
    throw Error(f.path() + ": tensor " + io::quoted(t.name) + " has dtype " + st_dtype_name(t.dtype) + ", expected I32");
  std::vector<int32_t> out(size_t(t.numel()));
  if (!out.empty()) std::memcpy(out.data(), f.data(t), out.size() * 4);
  return out;
}

// ---- writer -------------------------------------------------------------------------------

namespace {

std::string header_json(const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata,
                        uint64_t* data_len) {
  std::vector<TensorHeader> hs;
  hs.reserve(tensors.size());
  for (const auto& t : tensors) {
    uint64_t want = 0;
    if (tensor_bytes(t.shape, st_dtype_bits(t.dtype), &want) && want != t.data.size()) {
      TensorInfo ti;
      ti.shape = t.shape;
      throw Error("tensor " + io::quoted(t.name) + ": " + std::to_string(t.data.size()) + " bytes of data but shape " +
                  ti.shape_str() + " x " + st_dtype_name(t.dtype) + " needs " + std::to_string(want));
    }
    hs.push_back(TensorHeader{t.name, t.dtype, t.shape});
  }
  return safetensors_header(hs, metadata, data_len);
}

// Writes all chunks to a temp file next to `path`, fsyncs and renames it over `path`.
void write_chunks_atomic(const std::string& path, const std::vector<std::pair<const void*, size_t>>& chunks) {
  std::string dir = ".";
  std::string base = path;
  if (auto slash = path.rfind('/'); slash != std::string::npos) {
    dir = slash == 0 ? "/" : path.substr(0, slash);
    base = path.substr(slash + 1);
  }
  if (base.empty()) throw Error("cannot write " + io::quoted(path) + ": not a file name");
  std::string tmpl = (dir == "/" ? "" : dir) + "/." + base + ".tmp-XXXXXX";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = mkstemp(name.data());
  if (fd < 0) throw Error(sys_error("cannot create a temporary file in", dir));
  const std::string tmp(name.data());
  auto fail = [&](const std::string& msg) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw Error(msg);
  };
  for (const auto& [p, len] : chunks) {
    const char* c = static_cast<const char*>(p);
    size_t left = len;
    while (left > 0) {
      ssize_t w = ::write(fd, c, left);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail(sys_error("cannot write", tmp));
      }
      c += w;
      left -= size_t(w);
    }
  }
  if (::fchmod(fd, 0644) != 0) fail(sys_error("cannot chmod", tmp));
  if (::fsync(fd) != 0) fail(sys_error("cannot fsync", tmp));
  if (::close(fd) != 0) {
    std::string msg = sys_error("cannot close", tmp);
    ::unlink(tmp.c_str());
    throw Error(msg);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string msg = sys_error("cannot rename the temporary file onto", path);
    ::unlink(tmp.c_str());
    throw Error(msg);
  }
}

template <class T, class F>
TensorToWrite make_tensor(const std::string& name, std::vector<int64_t> shape, StDtype dt, const std::vector<T>& v,
                          F convert) {
  TensorToWrite t;
  t.name = name;
  t.dtype = dt;
  t.shape = std::move(shape);
  const size_t esize = size_t(st_dtype_bits(dt) / 8);
  t.data.resize(v.size() * esize);
  for (size_t i = 0; i < v.size(); ++i) {
    auto x = convert(v[i]);
    static_assert(sizeof(x) <= 8);
    std::memcpy(t.data.data() + i * esize, &x, esize);
  }
  return t;
}

}  // namespace

std::string safetensors_header(const std::vector<TensorHeader>& tensors, const std::map<std::string, std::string>& metadata,
                               uint64_t* data_len) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  std::set<std::string> seen;
  uint64_t pos = 0;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__") throw Error("cannot write a tensor named __metadata__");
    if (!seen.insert(t.name).second) throw Error("duplicate tensor name " + io::quoted(t.name) + " in a write");
    uint64_t want = 0;
    if (!tensor_bytes(t.shape, st_dtype_bits(t.dtype), &want)) {
      TensorInfo ti;
      ti.shape = t.shape;
      throw Error("tensor " + io::quoted(t.name) + ": shape " + ti.shape_str() + " x " + st_dtype_name(t.dtype) +
                  " is not a valid size");
    }
    nlohmann::ordered_json e;
    e["dtype"] = st_dtype_name(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {pos, pos + want};
    h[t.name] = e;
    pos += want;
  }
  *data_len = pos;
  std::string s = h.dump();
  // Pad with spaces so the data buffer starts 8-byte aligned in the file, as the reference writer does.
  while ((8 + s.size()) % 8 != 0) s.push_back(' ');
  return s;
}

uint64_t safetensors_file_size(const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata) {
  uint64_t data_len = 0;
  std::string h = header_json(tensors, metadata, &data_len);
  return 8 + h.size() + data_len;
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  uint64_t data_len = 0;
  std::string h;
  try {
    h = header_json(tensors, metadata, &data_len);
  } catch (const Error& e) {
    throw Error(path + ": not written: " + e.what());
  }
  const uint64_t n = h.size();
  std::vector<std::pair<const void*, size_t>> chunks;
  chunks.push_back({&n, 8});
  chunks.push_back({h.data(), h.size()});
  for (const auto& t : tensors)
    if (!t.data.empty()) chunks.push_back({t.data.data(), t.data.size()});
  write_chunks_atomic(path, chunks);
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  write_chunks_atomic(path, {{bytes.data(), bytes.size()}});
}

TensorToWrite tensor_f32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  return make_tensor(name, std::move(shape), StDtype::F32, v, [](float x) { return x; });
}
TensorToWrite tensor_f16(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  return make_tensor(name, std::move(shape), StDtype::F16, v, [](float x) { return float_to_f16(x); });
}
TensorToWrite tensor_bf16(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
  return make_tensor(name, std::move(shape), StDtype::BF16, v, [](float x) { return float_to_bf16(x); });
}
TensorToWrite tensor_i32(const std::string& name, std::vector<int64_t> shape, const std::vector<int32_t>& v) {
  return make_tensor(name, std::move(shape), StDtype::I32, v, [](int32_t x) { return x; });
}

}  // namespace wna16
