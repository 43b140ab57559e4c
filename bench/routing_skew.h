// `wna16 bench --routing uniform|zipf:S`: skewed expert popularity, as real traffic has it, and the
// routing statistics and floor of each timed call. Shared by the CPU and CUDA benches, host only.
//
// zipf:S puts a per-expert offset into the layer's selection scores through its generated inputs,
// so the layer's own router and routing kernels still compute the routing that is timed:
//  - softmax-family routing (softmax top-k, group-limited greedy): the activations carry x[:, 0] = 1
//    and router column 0 holds the offset (bf16-exact), so logit[m, e] gains exactly offset[e];
//  - noaux_tc (DeepSeek-V3): the offset is added to the correction bias (selection only, the
//    weights stay the unbiased sigmoid scores), activations unchanged.
// The offsets are calibrated on the reference routing of random tokens so that expert e, of
// popularity rank r(e) in a seeded random permutation, is picked by a token with probability
// min(1, c (r+1)^-S) (c: the k picks of a token sum to k; the cap is top-k without replacement).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "wna16/half.h"
#include "wna16/moe.h"

namespace wna16::bench {

struct RoutingOption {
  double zipf_s = 0;  // 0: uniform, the inputs as generated
  bool uniform() const { return zipf_s == 0; }
  std::string name() const;  // "uniform" or "zipf:1.2"
};
// "uniform" or "zipf:S" with 0 < S <= 10; throws Error naming the value otherwise.
RoutingOption parse_routing(const std::string& s);

// The law per popularity rank (0 = most popular): the probability that a token picks that expert,
// min(1, c (r+1)^-S) summing to k.
std::vector<double> zipf_inclusion(int E, int k, double S);

// What zipf:S did to a layer; uniform: x_component false and empty vectors.
struct RoutingSkew {
  bool x_component = false;    // activations must carry x[:, 0] = 1
  std::vector<int> rank;       // [E]: popularity rank of each expert
  std::vector<double> target;  // [E]: the law's pick probability of each expert
};
// Calibrates and writes the offsets into w (router column 0 or correction_bias); uniform: no-op.
RoutingSkew apply_routing(const MoeLayerSpec& spec, const RoutingOption& o, MoeLayerWeights& w, uint64_t seed);
// x [rows, H] in place: x[:, 0] = 1 when s.x_component (exact in bf16 and f16).
void skew_activations(const RoutingSkew& s, float* x, int64_t rows, int64_t H);
void skew_activations(const RoutingSkew& s, uint16_t* x, int64_t rows, int64_t H, DType t);  // bf16 or f16 bits

// The routing of rows x [rows, H] as the layer computes it: fp32 logits, then route_reference.
// Returns topk ids [rows, k].
std::vector<int32_t> route_rows(const MoeLayerSpec& spec, const MoeLayerWeights& w, const float* x, int64_t rows);

// Tokens per expert of one call: ids [M, k], each in [0, E).
std::vector<int> expert_counts(const int32_t* ids, int64_t M, int k, int E);

// One call's routing and the roofline inputs it implies.
struct CallCost {
  int active = 0;           // routed experts with a token
  int max_tokens = 0;       // most tokens on one expert
  double mean_tokens = 0;   // slots / active
  double bytes = 0;         // expert_bytes per active expert + fixed + activations
  double flops = 0;         // 2 x slots x 3 I H + 2 M x 3 I_shared H
};
struct CostModel {
  int64_t expert_bytes = 0;   // stored bytes of one routed expert's three linears
  int64_t fixed_bytes = 0;    // read every call: shared expert, router (+ shared gate)
  int64_t H = 0, I = 0, Is = 0;
  int64_t act_size = 2;       // bytes per activation element (x in, out)
};
CallCost call_cost(const std::vector<int>& counts, int64_t M, const CostModel& m);

}  // namespace wna16::bench
