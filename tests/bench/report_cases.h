// A benchmark case result for the report tests (bench/cuda/bench_report.h), with its medians.
#pragma once
#include <cstdint>
#include <string>

#include "bench/cuda/bench_report.h"

namespace wna16::cuda::bench::test_cases {

inline CaseResult make_case(const std::string& preset, int64_t M, double bytes, double flops, double ours,
                            double loop, double cublas) {
  CaseResult c;
  c.preset = preset;
  c.M = M;
  c.bytes = bytes;
  c.flops = flops;
  c.ours.median_us = ours;
  c.loop.median_us = loop;
  c.cublas.median_us = cublas;
  return c;
}

}  // namespace wna16::cuda::bench::test_cases
