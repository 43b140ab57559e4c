// Subcommand registry of the wna16 CLI. Each cmd_*.cpp registers its subcommands with a static
// A command signals failure by throwing CLI::RuntimeError(exit_code) (main turns it into the exit
// code) or wna16::Error (printed, exit 2).
// CommandRegistrar, so adding a command never touches main.cpp.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "wna16/backend.h"
#include "wna16/parallel.h"
#include "wna16/quant.h"

namespace wna16::cli {

// Flags shared by the layer commands (verify, bench). Not every command uses every flag.
struct CommonOptions {
  std::string model = "small";        // --model PRESET
  std::string format = "gptq";        // --format gptq|gptq_v2|awq
  int bits = 4;                       // --bits 4|8
  int group_size = 128;               // --group-size G (-1 = whole K)
  bool asym = false;                  // --asym (zero points; AWQ is always asymmetric)
  bool desc_act = false;              // --desc-act (GPTQ act-order)
  std::string device;                 // --device cpu|cuda (empty = cuda if present, else cpu)
  std::string dtype = "bf16";         // --dtype bf16|f16 (activations)
  std::vector<int64_t> m = {};        // --m LIST (token counts)
  uint64_t seed = 1;                  // --seed S
  bool portable = false;              // --portable (CUDA: the portable kernel path on any GPU)
  bool batch_invariant = false;       // --batch-invariant (MoeBackendLayer::set_batch_invariant)

  // Adds the flags above to a subcommand; default_m is used when --m is not given.
  void add_to(CLI::App& app);
  QuantScheme scheme() const;         // throws Error naming a bad value
  Device resolved_device() const;
  DType act_dtype() const;            // throws Error naming a bad value
  // --m, or dflt when it was not given; each in [1, 65536], else Error naming the value.
  std::vector<int64_t> token_counts(std::vector<int64_t> dflt) const;
};

// --tp N --ep N of verify and run: the layer sharded over tp x ep ranks, simulated in this process
// with one thread per rank (the in-process communicator).
struct PlanFlags {
  int tp = 1, ep = 1;
  std::string comm = "inprocess";
  void add_to(CLI::App& app);
  ParallelPlan plan() const;  // validated (and --comm); throws Error naming the values
  void check_device(Device d) const;  // --comm nccl needs cuda
  // make_layer, or the threaded sharded layer (over --comm) when the plan has more than one rank.
  std::unique_ptr<MoeBackendLayer> make(Device d, const MoeLayerSpec& spec, const MoeLayerWeights& w) const;
};

using CommandSetup = std::function<void(CLI::App& root)>;
std::vector<CommandSetup>& command_registry();

struct CommandRegistrar {
  explicit CommandRegistrar(CommandSetup setup) { command_registry().push_back(std::move(setup)); }
};

// Parses "1,4,16" (also accepts repeated values); throws Error naming a bad entry.
std::vector<int64_t> parse_int_list(const std::string& s);

}  // namespace wna16::cli
