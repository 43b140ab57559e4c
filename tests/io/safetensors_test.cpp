// safetensors reader rules (each one a test that checks the message), writer atomicity, sharding.
#include "wna16/safetensors.h"

#include <gtest/gtest.h>

#include "io_test_util.h"
#include "wna16/error.h"
#include "wna16/half.h"

namespace wna16 {
namespace {

using test::ScratchDir;
using test::st_bytes;

// Parses bytes from memory; returns the error message or "" on success.
std::string parse_error(const std::string& bytes) {
  try {
    SafetensorsFile::parse_memory(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "t.safetensors");
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

#define EXPECT_REJECTED(bytes, text)                                   \
  do {                                                                 \
    std::string msg_ = parse_error(bytes);                             \
    EXPECT_NE(msg_, "") << "accepted: " #bytes;                        \
    EXPECT_NE(msg_.find(text), std::string::npos) << "message: " << msg_; \
    EXPECT_NE(msg_.find("t.safetensors"), std::string::npos) << msg_;  \
  } while (0)

TEST(SafetensorsRead, AcceptsMinimalAndWhitespace) {
  EXPECT_EQ(parse_error(st_bytes("{}")), "");
  EXPECT_EQ(parse_error(st_bytes("  {}  \n")), "");
  EXPECT_EQ(parse_error(st_bytes(R"({"__metadata__":{"format":"pt"}})")), "");
  // Zero-size tensors take no bytes and may sit anywhere the tiling allows.
  EXPECT_EQ(parse_error(st_bytes(R"({"a":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},)"
                                 R"("b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
                                 "xy")),
            "");
}

TEST(SafetensorsRead, ReadsUnalignedData) {
  // Header of 3 bytes of padding-free JSON puts the data at file offset 8 + N, not a multiple of 4.
  std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"h":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]}})";
  ASSERT_NE((8 + header.size()) % 4, 0u) << "test wants an unaligned data buffer";
  float v[2] = {1.5f, -2.25f};
  uint16_t h = float_to_bf16(3.0f);
  std::string data(reinterpret_cast<const char*>(v), 8);
  data += std::string(reinterpret_cast<const char*>(&h), 2);
  std::string bytes = st_bytes(header, data);
  auto f = SafetensorsFile::parse_memory(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "mem");
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(read_floats(f, f.at("x")), (std::vector<float>{1.5f, -2.25f}));
  EXPECT_EQ(read_floats(f, f.at("h")), (std::vector<float>{3.0f}));
  EXPECT_THROW(read_i32(f, f.at("x")), Error);
}

TEST(SafetensorsRead, RejectsEveryBrokenRule) {
  const std::string ok1 = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_REJECTED(std::string("\x01\x00\x00", 3), "too short");
  EXPECT_REJECTED(st_bytes("{}", "", 100000001), "over the limit");
  EXPECT_REJECTED(st_bytes("{}", "", 1000), "past the end");
  EXPECT_REJECTED(st_bytes("{", ""), "invalid JSON");
  EXPECT_REJECTED(st_bytes("{\"a\xff\":1}", ""), "invalid JSON");  // invalid UTF-8
  EXPECT_REJECTED(st_bytes("[1,2]", ""), "not an object");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                           std::string(8, '\0')),
                  "duplicate key \"a\"");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
                  "unknown safetensors dtype \"Q4\"");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, '\0')),
                  "not a non-negative integer");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", std::string(8, '\0')),
                  "not a non-negative integer");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", std::string(8, '\0')),
                  "not a pair");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, '\0')), "needs dtype, shape and data_offsets");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, '\0')),
                  "end before begin");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')),
                  "needs 12");
  // numel * 4 overflows u64.
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                           std::string(8, '\0')),
                  "overflows");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", std::string(2, '\0')),
                  "whole number of bytes");
  // Gap at the start, gap in the middle, overlap.
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0')), "(a gap)");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                           std::string(12, '\0')),
                  "(a gap)");
  EXPECT_REJECTED(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                           std::string(8, '\0')),
                  "(an overlap)");
  // Trailing bytes after the last tensor, and a file cut short.
  EXPECT_REJECTED(st_bytes(ok1, std::string(9, '\0')), "must be the file length");
  EXPECT_REJECTED(st_bytes(ok1, std::string(7, '\0')), "must be the file length");
  EXPECT_REJECTED(st_bytes(R"({"__metadata__":{"a":1}})"), "is not a string");
  EXPECT_REJECTED(st_bytes(R"({"a":5})"), "not an object");
  EXPECT_REJECTED(st_bytes(std::string(100, '[') + std::string(100, ']')), "nested deeper");
  EXPECT_EQ(parse_error(st_bytes(ok1, std::string(8, '\0'))), "");
}

TEST(SafetensorsWrite, RoundTripAndAlignment) {
  ScratchDir d;
  std::vector<TensorToWrite> ts;
  ts.push_back(tensor_f32("f", {2, 2}, {1, 2, 3, 4}));
  ts.push_back(tensor_f16("h", {3}, {0.5f, -1.0f, 65504.0f}));
  ts.push_back(tensor_bf16("b", {1}, {3.0f}));
  ts.push_back(tensor_i32("i", {2}, {-7, 1 << 30}));
  ts.push_back(tensor_f32("empty", {0}, {}));
  write_safetensors(d / "x.safetensors", ts, {{"format", "pt"}});
  auto f = SafetensorsFile::open(d / "x.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ((8 + f.header_size()) % 8, 0u) << "header padded so the data starts 8-aligned";
  EXPECT_EQ(f.file_size(), safetensors_file_size(ts, {{"format", "pt"}}));
  EXPECT_EQ(read_floats(f, f.at("f")), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(read_floats(f, f.at("h")), (std::vector<float>{0.5f, -1.0f, 65504.0f}));
  EXPECT_EQ(read_floats(f, f.at("b")), (std::vector<float>{3.0f}));
  EXPECT_EQ(read_i32(f, f.at("i")), (std::vector<int32_t>{-7, 1 << 30}));
  EXPECT_EQ(f.at("empty").nbytes(), 0u);
  EXPECT_EQ(test::list_dir(d.path()), std::vector<std::string>{"x.safetensors"});
}

TEST(SafetensorsWrite, FailureLeavesExistingFileUntouched) {
  ScratchDir d;
  const std::string path = d / "out.safetensors";
  test::write_file(path, "precious");
  TensorToWrite bad = tensor_f32("a", {3}, {1, 2});  // 2 values for shape [3]
  try {
    write_safetensors(path, {bad});
    FAIL() << "accepted a tensor whose data does not match its shape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs 12"), std::string::npos) << e.what();
  }
  EXPECT_THROW(write_safetensors(path, {tensor_f32("a", {1}, {1}), tensor_f32("a", {1}, {2})}), Error);
  EXPECT_EQ(test::read_file(path), "precious");
  // A target that is a directory: the rename fails and the temp file is removed.
  test::fs::create_directory(d / "dir.safetensors");
  EXPECT_THROW(write_safetensors(d / "dir.safetensors", {tensor_f32("a", {1}, {1})}), Error);
  EXPECT_THROW(write_safetensors(d / "no/such/dir/x.safetensors", {tensor_f32("a", {1}, {1})}), Error);
  EXPECT_EQ(test::list_dir(d.path()), (std::vector<std::string>{"dir.safetensors", "out.safetensors"}));
}

TEST(SafetensorsOpen, FileErrorsNameThePath) {
  ScratchDir d;
  try {
    SafetensorsFile::open(d / "missing.safetensors");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors"), std::string::npos);
  }
  test::write_file(d / "empty.safetensors", "");
  EXPECT_THROW(SafetensorsFile::open(d / "empty.safetensors"), Error);
  EXPECT_THROW(SafetensorsFile::open(d.path()), Error);  // a directory
}

TEST(TensorStore, IndexAndErrors) {
  ScratchDir d;
  write_safetensors(d / "a.safetensors", {tensor_f32("x", {1}, {1}), tensor_f32("y", {1}, {2})});
  write_safetensors(d / "b.safetensors", {tensor_f32("z", {1}, {3})});
  // No index and no model.safetensors: every *.safetensors file.
  {
    auto s = TensorStore::open_dir(d.path());
    EXPECT_EQ(s.names(), (std::vector<std::string>{"x", "y", "z"}));
    EXPECT_EQ(s.num_files(), 2u);
    EXPECT_EQ(s.bytes_under("x"), 4u);
  }
  // Same name in two loose files.
  write_safetensors(d / "c.safetensors", {tensor_f32("z", {1}, {4})});
  try {
    TensorStore::open_dir(d.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is in both"), std::string::npos) << e.what();
  }
  // With an index only the index counts.
  const std::string idx = d / "model.safetensors.index.json";
  test::write_file(idx, R"({"metadata":{"total_size":1},"weight_map":{"x":"a.safetensors","z":"b.safetensors"}})");
  {
    auto s = TensorStore::open_dir(d.path());
    EXPECT_EQ(s.names(), (std::vector<std::string>{"x", "z"}));
    EXPECT_NE(s.layout().find("2 shards"), std::string::npos);
  }
  auto expect_error = [&](const std::string& index, const std::string& text) {
    test::write_file(idx, index);
    try {
      TensorStore::open_dir(d.path());
      ADD_FAILURE() << "accepted index " << index;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error(R"({"weight_map":{"x":"missing.safetensors"}})", "does not exist");
  expect_error(R"({"weight_map":{"q":"a.safetensors"}})", "has no such tensor");
  expect_error(R"({"weight_map":{"x":"../a.safetensors"}})", "not a plain file name");
  expect_error(R"({"weight_map":{"x":1}})", "not a file name string");
  expect_error(R"({"metadata":{}})", "weight_map");
  expect_error(R"({"weight_map":{"x":"a.safetensors","x":"b.safetensors"}})", "duplicate key");
  expect_error("{", "invalid JSON");
}

}  // namespace
}  // namespace wna16
