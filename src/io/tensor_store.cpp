// A model directory's tensors: sharded (model.safetensors.index.json), single-file, or loose files.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/json_util.h"
#include "wna16/error.h"
#include "wna16/safetensors.h"

namespace wna16 {

namespace fs = std::filesystem;

namespace {

std::string read_text_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error("cannot read " + p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TensorStore TensorStore::open_dir(const std::string& dir) {
  TensorStore s;
  s.dir_ = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(dir + ": not a directory");
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";

  std::map<std::string, size_t> file_index;  // file name -> position in files_
  auto open_file = [&](const std::string& fname) -> size_t {
    auto it = file_index.find(fname);
    if (it != file_index.end()) return it->second;
    s.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open((fs::path(dir) / fname).string())));
    file_index[fname] = s.files_.size() - 1;
    return s.files_.size() - 1;
  };

  if (fs::exists(index, ec)) {
    const std::string origin = index.string();
    // The index is JSON of a few MB at most; the same strict parser rejects duplicate names.
    auto j = io::parse_json_strict<nlohmann::json>(read_text_file(index), origin);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(origin + ": needs an object \"weight_map\" mapping tensor names to file names");
    // NOTE: metadata.total_size is not trusted (formats.md); sizes come from the shards themselves.
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw Error(origin + ": weight_map entry " + io::quoted(it.key()) + " is not a file name string");
      const std::string fname = it.value().get<std::string>();
      if (fname.empty() || fname == "." || fname == ".." || fname.find('/') != std::string::npos ||
          fname.find('\\') != std::string::npos || fname.find('\0') != std::string::npos)
        throw Error(origin + ": weight_map places " + io::quoted(it.key()) + " in " + io::quoted(fname) +
                    ", which is not a plain file name in the model directory");
      if (!fs::exists(fs::path(dir) / fname, ec))
        throw Error(origin + ": weight_map places " + io::quoted(it.key()) + " in " + io::quoted(fname) +
                    ", which does not exist in " + dir);
      size_t fi = open_file(fname);
      const TensorInfo* t = s.files_[fi]->find(it.key());
      if (!t)
        throw Error(origin + ": weight_map places " + io::quoted(it.key()) + " in " + fname +
                    ", but that file has no such tensor");
      s.entries_[it.key()] = Entry{s.files_[fi].get(), t};
    }
    s.layout_ = "model.safetensors.index.json (" + std::to_string(s.files_.size()) + " shard" +
                (s.files_.size() == 1 ? "" : "s") + ")";
    return s;
  }

  std::vector<std::string> names;
  if (fs::exists(single, ec)) {
    names.push_back("model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string n = e.path().filename().string();
      if (n.size() > 12 && n[0] != '.' && n.substr(n.size() - 12) == ".safetensors") names.push_back(n);
    }
    std::sort(names.begin(), names.end());
    if (names.empty())
      throw Error(dir + ": no model.safetensors.index.json, model.safetensors or *.safetensors file");
  }
  for (const auto& n : names) {
    size_t fi = open_file(n);
    for (const auto& t : s.files_[fi]->tensors()) {
      auto [it, fresh] = s.entries_.emplace(t.name, Entry{s.files_[fi].get(), &t});
      if (!fresh)
        throw Error(dir + ": tensor " + io::quoted(t.name) + " is in both " + it->second.file->path() + " and " +
                    s.files_[fi]->path() + " (and there is no index saying which to use)");
    }
  }
  s.layout_ = names.size() == 1 ? names[0] : std::to_string(names.size()) + " *.safetensors files (no index)";
  return s;
}

TensorStore::Entry TensorStore::find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? Entry{nullptr, nullptr} : it->second;
}

uint64_t TensorStore::bytes_under(const std::string& prefix) const {
  uint64_t b = 0;
  for (auto it = entries_.lower_bound(prefix); it != entries_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it)
    b += it->second.info->nbytes();
  return b;
}

std::vector<std::string> TensorStore::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [k, v] : entries_) out.push_back(k);
  return out;
}

}  // namespace wna16
