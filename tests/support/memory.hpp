// What this test process holds in memory, for tests that measure it:
//   malloc_in_use()       bytes malloc holds now (glibc's mallinfo2: every arena and the mmapped
//                         blocks; torch's CPU allocator is malloc)
//   proc_status_kb(KEY)   a line of /proc/self/status in kB: VmRSS, VmHWM (the peak resident
//                         memory since reset_peak_memory), RssFile, RssShmem, ...; -1 if absent
//   reset_peak_memory()   VmHWM back to the current VmRSS (/proc/self/clear_refs); false where
//                         the kernel does not let this process write it
#pragma once
#include <malloc.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace flowrun::test {

inline double malloc_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
}

inline int64_t proc_status_kb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  return -1;
}

inline bool reset_peak_memory() { return static_cast<bool>(std::ofstream("/proc/self/clear_refs") << "5" << std::flush); }

}  // namespace flowrun::test
