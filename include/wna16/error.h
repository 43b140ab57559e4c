// wna16: the one exception type the library throws for bad input or unsupported requests.
// Messages name the offending value ("K=10944 is not a multiple of group_size=128").
#pragma once
#include <stdexcept>
#include <string>

namespace wna16 {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace wna16
