// Activation rows prepared for the kernels (kernels.h: XRow): gathered into a linear's kernel K
// order, converted to the kernel's input format, with per-group sums for the zero-point term.
#pragma once
#include <cstdint>

#include "cpu/kernels.h"
#include "cpu/packed_linear.h"

namespace wna16::cpu {

// Where one prepared row's parts live inside a row of `stride` bytes (each part 64-byte aligned).
struct RowLayout {
  int64_t hi = -1, lo = -1, f = -1, xs = 0, stride = 0;
};

// bf16: hi (and lo when `lo`) parts, else an fp32 part; always the group sums.
RowLayout row_layout(const PackedLinear& L, bool bf16, bool lo);
XRow view_row(const RowLayout& r, const uint8_t* row);
// Gathers x (original K order, values exact in the activation dtype) into L's kernel order.
void prep_row(const PackedLinear& L, const RowLayout& r, const float* x, uint8_t* row);

}  // namespace wna16::cpu
