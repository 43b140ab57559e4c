// The host-side decisions of packing a MoE layer for the CUDA kernels, shared by the device packer
// (device_pack.h) and the host oracle of the tests: the layer's packed shapes, the act-order
// channel orders and, per kernel expert, which source row, column and group feeds each kernel row,
// column and group. Small (O(H + I) per kernel expert) and data-dependent, so they stay on the
// host; the weight bytes are the device's. No CUDA types here.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cuda/moe_gemm.h"
#include "wna16/moe.h"
#include "wna16/quant.h"

namespace wna16::cuda {

// The packed layer's shape, decided from the spec and the linears' schemes (all must share bits;
// gate/up one group size, down one, possibly another). Kernel experts: the S shared slices first,
// then the E routed experts.
struct LayerPackShape {
  int bits = 4;
  bool has_zeros = false;  // some linear is asym: every kernel expert gets a zeros table
  int64_t H = 0, I = 0;
  int E = 0, S = 0, E2 = 0;
  int64_t shared_inter = 0;
  int64_t gl1 = 0, gl2 = 0;  // kernel group lengths of GEMM1 (K = H) and GEMM2 (K = I)
  PackedGemm g1, g2;         // shapes only (E = 0): strides and padded widths
};

// Throws Error naming the value the CUDA kernels cannot take (bits, group size, widths, counts).
// schemes: every linear's (name, scheme), e.g. ("expert 3 gate", ...); names end in gate, up or down.
LayerPackShape plan_layer_shape(const MoeLayerSpec& spec,
                                const std::vector<std::pair<std::string, QuantScheme>>& schemes);

// Stable argsort of g_idx: the act-order channel order. Empty when it is the identity.
std::vector<int32_t> act_order_perm(const std::vector<int32_t>& g_idx);

// g_idx as unpack() fills it (k / group_len when the checkpoint has none), checked as
// QuantizedLinear::validate and unpack() check it; errors start with "<what>: ".
// raw: the checkpoint's K values, or null.
std::vector<int32_t> checked_g_idx(const int32_t* raw, int64_t K, const QuantScheme& s, const std::string& what);

// One source expert (routed, or the shared expert that several slices cut) as the plan sees it:
// each linear's filled g_idx and act-order order.
struct SourceExpertOrder {
  std::vector<int32_t> g_idx[3];  // gate, up, down
  std::vector<int32_t> perm[3];   // act_order_perm of each (empty: identity)
};

// Where kernel expert e2's rows, columns and groups come from.
struct KernelExpertMap {
  std::vector<int32_t> rows_g, rows_u;  // [H] GEMM1 kernel k -> gate / up source channel
  std::vector<int32_t> inter;           // [I] kernel intermediate column -> down's source row, -1: padding
  std::vector<int32_t> grp_g, grp_u;    // [H / gl1] GEMM1 kernel group -> gate / up source group
  std::vector<int32_t> grp_d;           // [I / gl2] GEMM2 kernel group -> down source group, -1: padding only
};

// slice0: the kernel expert's first intermediate column in the source (shared slice s: s * I);
// Isrc: the source's intermediate width. Throws Error when act-order groups are not contiguous
// runs of the kernel group length after sorting, naming the expert (`name`), linear and channel.
KernelExpertMap map_kernel_expert(const SourceExpertOrder& src, const LayerPackShape& shape, int64_t slice0,
                                  int64_t Isrc, const std::string& name);

}  // namespace wna16::cuda
