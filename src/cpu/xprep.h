// Activation rows prepared for the kernels (kernels.h: XRow): gathered into a linear's kernel K
// order, converted to the kernel's input format, with per-group sums for the zero-point term.
#pragma once
#include <cstdint>

#include "cpu/kernels.h"
#include "cpu/packed_linear.h"
#include "wna16/half.h"

namespace wna16::cpu {

// Where one prepared row's parts live inside a row of `stride` bytes (each part 64-byte aligned).
struct RowLayout {
  int terms = 0;  // int8 rows: 2 or 3 terms; 0: fp32 rows
  int64_t f = -1, xs = -1, q[3] = {-1, -1, -1}, bscale = -1, bsum = -1, stride = 0;
};

// int8 rows with `terms` terms (kernels.h: XRow), or fp32 rows when terms == 0.
RowLayout row_layout(const PackedLinear& L, int terms);
// The row format a kernel of `isa` takes for activations of dtype `act` (2 terms for bf16, 3 for
// f16 in the int8 kernels).
RowLayout row_layout_for(const PackedLinear& L, Isa isa, DType act);
XRow view_row(const RowLayout& r, const uint8_t* row);
// Gathers x (original K order, values exact in the activation dtype) into L's kernel order.
void prep_row(const PackedLinear& L, const RowLayout& r, const float* x, uint8_t* row);

}  // namespace wna16::cpu
