// safetensors files: a validating, memory-mapping reader, sharded checkpoints through
// `model.safetensors.index.json`, and a writer that never leaves a half-written file.
// The rules the reader enforces are those of the reference (Rust) reader; see
// ../shared/docs/formats.md and docs/checkpoints.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace wna16 {

// Every dtype of the safetensors format. Sizes are in bits because F4 and F6 are sub-byte.
enum class StDtype {
  Bool, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0,
  I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64,
};
const char* st_dtype_name(StDtype t);       // "BF16", ...
int st_dtype_bits(StDtype t);               // 1..64 (BOOL is one byte: 8)
// Throws Error naming s and the known names.
StDtype parse_st_dtype(const std::string& s);

struct TensorInfo {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data buffer, end exclusive
  uint64_t numel() const;       // product of shape (1 for a scalar); validated not to overflow
  uint64_t nbytes() const { return end - begin; }
  std::string shape_str() const;  // "[32, 512]"
};

// Largest header the reader accepts, as the reference reader (100,000,000 bytes).
inline constexpr uint64_t kMaxSafetensorsHeader = 100000000;

// A parsed, validated safetensors file. Backed either by a read-only memory map of the file
// or by a caller-owned buffer (parse_memory; the buffer must outlive the object).
// Data pointers have no alignment guarantee: read them with memcpy (the copy helpers do).
class SafetensorsFile {
 public:
  // Maps `path` and validates it; throws Error naming the file and the broken rule.
  static SafetensorsFile open(const std::string& path);
  // Validates bytes [data, data+size) as a whole safetensors file; `origin` names it in errors.
  static SafetensorsFile parse_memory(const uint8_t* data, size_t size, const std::string& origin);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return origin_; }
  // Tensors sorted by name.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr if absent
  const TensorInfo& at(const std::string& name) const;    // throws Error naming file and tensor
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Start of the tensor's bytes in the map (unaligned).
  const uint8_t* data(const TensorInfo& t) const { return buffer_ + t.begin; }
  uint64_t header_size() const { return header_size_; }
  uint64_t file_size() const { return size_; }

 private:
  SafetensorsFile() = default;
  void parse();
  std::string origin_;
  const uint8_t* base_ = nullptr;    // whole file
  const uint8_t* buffer_ = nullptr;  // data buffer = base_ + 8 + header
  uint64_t size_ = 0, header_size_ = 0;
  void* map_ = nullptr;              // mmap'ed region owned by this object (nullptr for memory)
  size_t map_len_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Reads a tensor as float, converting F32, F16, BF16 and F64; throws Error naming the file,
// tensor and dtype for anything else.
std::vector<float> read_floats(const SafetensorsFile& f, const TensorInfo& t);
// Reads an I32 tensor (throws Error naming the file, tensor and dtype otherwise).
std::vector<int32_t> read_i32(const SafetensorsFile& f, const TensorInfo& t);

// A model's tensors across one or more files: `model.safetensors.index.json` when present, else
// `model.safetensors`, else every `*.safetensors` file of the directory. Shards are mapped once.
class TensorStore {
 public:
  // Throws Error naming the index, file or tensor at fault (missing shard, a tensor the index
  // places in a shard that lacks it, a file name leaving the directory, a name in two files).
  static TensorStore open_dir(const std::string& dir);

  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  // nullptr-file entry when absent.
  Entry find(const std::string& name) const;
  bool has(const std::string& name) const { return find(name).file != nullptr; }
  // Total bytes of the tensors whose names start with `prefix`.
  uint64_t bytes_under(const std::string& prefix) const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  const std::string& dir() const { return dir_; }
  // "model.safetensors.index.json (3 shards)" or "model.safetensors".
  const std::string& layout() const { return layout_; }
  size_t num_files() const { return files_.size(); }

 private:
  std::string dir_, layout_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> entries_;
};

// A tensor to write. `data` points at exactly numel x dtype-size bytes, little-endian.
struct TensorToWrite {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// The header text of a file holding tensors of these names, dtypes and shapes in this order,
// padded so the data starts 8-byte aligned; *data_len receives the data size. For writers that
// stream the data one tensor at a time. Throws Error for a duplicate or reserved name.
struct TensorHeader {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;
};
std::string safetensors_header(const std::vector<TensorHeader>& tensors, const std::map<std::string, std::string>& metadata,
                               uint64_t* data_len);

// Serialised size of the file write_safetensors would produce.
uint64_t safetensors_file_size(const std::vector<TensorToWrite>& tensors,
                               const std::map<std::string, std::string>& metadata = {});
// Writes a safetensors file (header padded with spaces to a multiple of 8, tensors in the given
// order). Validates names (no duplicates, no "__metadata__") and sizes first. The bytes go to a
// temporary file in the same directory, which is fsync'ed and renamed over `path`: on any
// failure `path` is left exactly as it was and the temporary file is removed.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Same temp-file-and-rename discipline for any small file (config.json, index).
void write_file_atomic(const std::string& path, const std::string& bytes);

// Helpers that build a TensorToWrite from host values.
TensorToWrite tensor_f32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v);
TensorToWrite tensor_f16(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v);
TensorToWrite tensor_bf16(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v);
TensorToWrite tensor_i32(const std::string& name, std::vector<int64_t> shape, const std::vector<int32_t>& v);

}  // namespace wna16
