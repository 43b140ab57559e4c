// Runs the wna16 CLI from a test (the binary at WNA16_CLI_PATH) and captures exit code, signal,
// stdout and stderr. Shared by the CLI-level tests of every stage.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace wna16::test {

inline std::string slurp_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct CliResult {
  int exit_code = -1;     // -1: killed by a signal (a crash)
  int signal = 0;
  std::string out, err;
};

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs the wna16 CLI with `args` (already shell-quoted where needed), capturing stdout and stderr.
inline CliResult run_cli(const std::string& args) {
  static int counter = 0;
  const std::string base = (std::filesystem::temp_directory_path() / ("wna16-cli-" + std::to_string(getpid()) + "-" +
                                                          std::to_string(counter++))).string();
  const std::string cmd = shell_quote(WNA16_CLI_PATH) + " " + args + " >" + base + ".out 2>" + base + ".err";
  int st = std::system(cmd.c_str());
  CliResult r;
  if (st != -1 && WIFEXITED(st)) {
    r.exit_code = WEXITSTATUS(st);
  } else if (st != -1 && WIFSIGNALED(st)) {
    r.signal = WTERMSIG(st);
  }
  r.out = slurp_file(base + ".out");
  r.err = slurp_file(base + ".err");
  std::remove((base + ".out").c_str());
  std::remove((base + ".err").c_str());
  // A sanitizer report or std::terminate also means a crash even when the exit code is set.
  if (r.err.find("AddressSanitizer") != std::string::npos || r.err.find("runtime error:") != std::string::npos ||
      r.err.find("terminate called") != std::string::npos)
    r.exit_code = -1;
  return r;
}

// For tests that only look for text: the exit code (-1 for a crash) and stdout followed by stderr.
struct CliRun {
  int code = -1;
  std::string out;
};
inline CliRun run_cli_combined(const std::string& args) {
  const CliResult r = run_cli(args);
  return {r.exit_code, r.out + r.err};
}

}  // namespace wna16::test
