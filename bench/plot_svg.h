// `wna16 bench --plot FILE.svg`: time and % of the roofline against M, one panel per preset, with
// the roofline floor drawn and the baselines measured in the same run. Plain SVG text, no
// dependencies; both benches (CPU and CUDA) fill a PlotInput from their results.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace wna16::bench {

// One measured M of one series. NaN where a value is unknown (a failed or skipped case).
struct PlotPoint {
  int64_t M = 0;
  double us = 0;  // median microseconds per layer call
};

struct PlotSeries {
  std::string name;  // "wna16", "per-expert loop", "cuBLAS bf16 (dequantised)", ...
  std::vector<PlotPoint> points;
};

struct PlotPreset {
  std::string name;   // "deepseek-v3"
  std::string shape;  // "E256 k8 H7168 I2048 shared 2048"
  // Our layer first; then the baselines of the same run. series[0] is the one whose % of the
  // roofline is drawn.
  std::vector<PlotSeries> series;
  // The roofline floor per M: max(bytes / read ceiling, FLOPs / compute ceiling), microseconds.
  std::vector<PlotPoint> floor;
};

struct PlotInput {
  std::string title;                  // "wna16 bench --device cuda: int4 gptq g128 sym, bf16"
  std::string provenance;             // "2026-12-02 14:03 UTC, NVIDIA H200, commit 3866c77e"
  std::vector<std::string> ceilings;  // "read 4543 GB/s", "cuBLAS bf16 797 TFLOP/s"
  std::vector<PlotPreset> presets;
};

// The SVG document. Throws wna16::Error naming the value for an empty input or a non-positive M.
std::string render_svg(const PlotInput& in);
// Writes render_svg(in) to path through a temporary file renamed into place (no half-written
// file); throws wna16::Error naming the path when it cannot be written.
void write_svg(const PlotInput& in, const std::string& path);

}  // namespace wna16::bench
