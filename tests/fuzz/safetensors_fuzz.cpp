// libFuzzer target: a whole safetensors file from memory (header length, JSON header, offsets,
// dtype x shape sizes, tiling, file length), then reading every float and I32 tensor it accepted.
// Seeds: tests/data/fuzz/safetensors. Run by scripts/fuzz.
#include <cstddef>
#include <cstdint>

#include "wna16/error.h"
#include "wna16/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto f = wna16::SafetensorsFile::parse_memory(data, size, "fuzz.safetensors");
    for (const auto& t : f.tensors()) {
      try {
        if (t.dtype == wna16::StDtype::I32) {
          (void)wna16::read_i32(f, t);
        } else {
          (void)wna16::read_floats(f, t);
        }
      } catch (const wna16::Error&) {
      }
    }
  } catch (const wna16::Error&) {
  }
  return 0;
}
