// Test helper: every entry under a folder with what it holds, to prove a refused request left
// the filesystem untouched.
//
//   const auto before = SnapshotTree(sandbox);
//   ... a request that must be refused ...
//   EXPECT_EQ(SnapshotTree(sandbox), before);
#ifndef MOED_TESTS_SERVER_FS_SNAPSHOT_H_
#define MOED_TESTS_SERVER_FS_SNAPSHOT_H_

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

namespace moe {

// path -> contents for files, "<dir>" for folders, "-> target" for symbolic links (never
// followed). Empty when `dir` does not exist.
inline std::map<std::string, std::string> SnapshotTree(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> out;
  if (!fs::exists(fs::symlink_status(dir))) return out;
  for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator();
       ++it) {
    const fs::path& p = it->path();
    if (fs::is_symlink(fs::symlink_status(p))) {
      out[p.string()] = "-> " + fs::read_symlink(p).string();
    } else if (fs::is_directory(p)) {
      out[p.string()] = "<dir>";
    } else {
      std::ifstream in(p);
      out[p.string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
  }
  return out;
}

}  // namespace moe

#endif  // MOED_TESTS_SERVER_FS_SNAPSHOT_H_
