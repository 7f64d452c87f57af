// CRC32C (Castagnoli: polynomial 0x82f63b78 reflected, init and final xor 0xffffffff; the CRC of
// iSCSI, ext4 and gRPC) for the checksums of checkpoint files, computed while they are written
// and checked when they are read back. Fast: SSE4.2's crc32 instruction in three interleaved
// streams where the CPU has it (chosen at run time; the build needs no -msse4.2), else
// slicing-by-8 tables. FLOWRUN_CRC32C=software forces the tables (read once, at the first call).
// Not for security; a check against torn and corrupted files. Test: tests/formats/crc32c_test.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace flowrun {

// CRC32C of data, continuing `crc` (the value returned for the bytes before): crc32c(b, n) of a whole
// equals crc32c(b + k, n - k, crc32c(b, k)).
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
// "e3069283": 8 lowercase hex digits, as the manifest stores it.
std::string crc32c_hex(uint32_t crc);
// Parses crc32c_hex's form (either case); false, crc untouched, when the text is not 8 hex digits.
bool parse_crc32c_hex(const std::string& text, uint32_t& crc);

namespace detail {  // the two paths, for tests and benchmarks
uint32_t crc32c_software(const void* data, size_t bytes, uint32_t crc = 0);  // slicing-by-8
// The crc32 instruction; only where crc32c_hardware_available() (an x86-64 CPU with SSE4.2).
uint32_t crc32c_hardware(const void* data, size_t bytes, uint32_t crc = 0);
bool crc32c_hardware_available();
// Whether crc32c() takes the hardware path given FLOWRUN_CRC32C's value (nullptr: unset):
// "software" forces the tables, anything else lets the CPU decide.
bool crc32c_use_hardware(const char* env_value);
}  // namespace detail

}  // namespace flowrun
