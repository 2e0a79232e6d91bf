// tests/faulty_file.hpp: a file on a failing disk, for the DISK tests of I/O errors.
//
// FaultyFile mounts a small FUSE file system (libfuse3, served by a child process: Note [A FUSE
// server in a process of its own] in faulty_file.cpp) holding one read-only file of the bytes
// given. A read the kernel sends it that overlaps the bad range fails with EIO, as a read of a bad
// sector does; every other read returns the bytes. Nothing else can make a real read fail on
// demand: the kernel reports a disk's errors, and the test machines have no faulty disk (nor
// device-mapper's "error" target).
//
// Mounting needs libfuse3 at build time, /dev/fuse and root (the fixture unmounts with umount2):
// where any is missing, mount() says which, and the test skips with that reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace tinydev::testing {

class FaultyFile {
 public:
  // Mounts a fresh file system at a new folder under the temporary directory; the file FaultyFile
  // serves, its path(), holds `bytes`, and reads overlapping [bad_begin, bad_end) fail with EIO.
  // The FaultyFile, or why it could not be mounted.
  static std::variant<std::unique_ptr<FaultyFile>, std::string> mount(std::vector<std::byte> bytes,
                                                                      std::uint64_t bad_begin, std::uint64_t bad_end);
  // Unmounts and removes the folder. Whoever still has the file open must have closed it (a DISK
  // device closes it with its last buffer): the kernel keeps a lazily unmounted file system
  // served until then, and the destructor waits 10 s for that before it kills the server (reads
  // of the file then fail with ENOTCONN).
  ~FaultyFile();
  FaultyFile(const FaultyFile&) = delete;
  FaultyFile& operator=(const FaultyFile&) = delete;

  const std::string& path() const noexcept;
  const std::vector<std::byte>& bytes() const noexcept;
  // Reads the server failed with EIO so far (the test's proof that the fault was reached).
  // Thread-safe.
  std::uint64_t failed_reads() const noexcept;

  struct State;  // the file system's side, shared with its thread (faulty_file.cpp)

 private:
  explicit FaultyFile(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace tinydev::testing
