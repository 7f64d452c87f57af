// IndexKits' Index V2 JSON and the .npz beside it (index_v2.hpp).
#include "formats/index_v2.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "formats/files.hpp"
#include "formats/json_file.hpp"

namespace fs = std::filesystem;

namespace flowrun {

namespace {

[[noreturn]] void fail(const std::string& file, const std::string& what) { throw std::runtime_error(file + ": " + what); }

// ---- .npz: a zip of .npy files ----

uint32_t le32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + static_cast<size_t>(i)]);
  return v;
}
uint16_t le16(const std::string& s, size_t at) {
  return static_cast<uint16_t>(static_cast<unsigned char>(s[at]) | (static_cast<unsigned char>(s[at + 1]) << 8));
}

std::string inflate_raw(const std::string& file, const std::string& name, const char* data, size_t size, size_t out_size) {
  std::string out(out_size, '\0');
  z_stream z{};
  if (inflateInit2(&z, -MAX_WBITS) != Z_OK) fail(file, "zlib cannot start");
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data));
  z.avail_in = static_cast<uInt>(size);
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = inflate(&z, Z_FINISH);
  const size_t got = z.total_out;
  inflateEnd(&z);
  if (rc != Z_STREAM_END || got != out_size) fail(file, "member '" + name + "' does not inflate (damaged .npz)");
  return out;
}

std::vector<int64_t> parse_npy_checked(const std::string& where, const std::string& npy);

// One .npy: magic, version, header dict {'descr': '<i8', 'fortran_order': False, 'shape': (n,)}.
std::vector<int64_t> parse_npy(const std::string& file, const std::string& name, const std::string& npy) {
  const std::string where = file + ": array '" + name + "'";
  try {
    return parse_npy_checked(where, npy);
  } catch (const std::logic_error&) {  // std::stoll, substr on a header that is not NumPy's
    fail(where, "damaged .npy header");
  }
}

std::vector<int64_t> parse_npy_checked(const std::string& where, const std::string& npy) {
  if (npy.size() < 10 || npy.compare(0, 6, "\x93NUMPY") != 0) fail(where, "not a .npy array");
  const int major = static_cast<unsigned char>(npy[6]);
  if (major != 1 && npy.size() < 12) fail(where, "header cut short");
  const size_t header_len = major == 1 ? le16(npy, 8) : le32(npy, 8), start = major == 1 ? 10 : 12;
  if (start + header_len > npy.size()) fail(where, "header cut short");
  const std::string h = npy.substr(start, header_len);
  auto value = [&](const std::string& key) {
    const size_t k = h.find("'" + key + "'");
    if (k == std::string::npos) fail(where, "no '" + key + "' in its header");
    const size_t colon = h.find(':', k);
    return h.substr(colon + 1);
  };
  std::string descr = value("descr");
  descr = descr.substr(descr.find('\'') + 1);
  descr = descr.substr(0, descr.find('\''));
  std::string fortran = value("fortran_order");
  fortran.erase(0, fortran.find_first_not_of(' '));
  if (fortran.compare(0, 5, "False") != 0) fail(where, "Fortran order is not read (IndexKits writes C order)");
  std::string shape = value("shape");
  shape = shape.substr(shape.find('(') + 1, shape.find(')') - shape.find('(') - 1);
  shape.erase(std::remove(shape.begin(), shape.end(), ' '), shape.end());
  if (!shape.empty() && shape.back() == ',') shape.pop_back();
  if (shape.find(',') != std::string::npos || shape.empty())
    fail(where, "shape (" + shape + ") is not 1-D; IndexKits' indices are lists");
  const int64_t n = std::stoll(shape);
  if (n < 0) fail(where, "negative shape");
  const char order = descr.empty() ? '?' : descr[0];
  const std::string type = descr.size() > 1 ? descr.substr(1) : "";
  const size_t width = type.size() == 2 ? static_cast<size_t>(type[1] - '0') : 0;
  const bool is_int = !type.empty() && (type[0] == 'i' || type[0] == 'u') && (width == 1 || width == 2 || width == 4 || width == 8) &&
                      !(type[0] == 'u' && width == 8);
  if (!is_int || (order != '<' && order != '|'))
    fail(where, "dtype '" + descr + "' is not a little-endian integer type of up to 64 bits");
  const size_t data = start + header_len;
  if (static_cast<uint64_t>(n) > npy.size() || data + static_cast<size_t>(n) * width != npy.size())
    fail(where, "holds " + std::to_string(npy.size() - data) + " data bytes for " + std::to_string(n) + " values of " +
                    std::to_string(width) + " bytes");
  std::vector<int64_t> out(static_cast<size_t>(n));
  const char* p = npy.data() + data;
  for (int64_t i = 0; i < n; ++i, p += width) {
    uint64_t u = 0;
    std::memcpy(&u, p, width);  // little-endian host
    int64_t v = static_cast<int64_t>(u);
    if (type[0] == 'i' && width < 8 && (u >> (8 * width - 1)) & 1) v = static_cast<int64_t>(u) - (int64_t{1} << (8 * width));
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

// An index (or .npz) holding more indices than the caller's limit; `raise_with`: the setting.
[[noreturn]] void too_many_indices(const std::string& file, const std::string& count, int64_t max, const std::string& raise_with) {
  fail(file, "holds " + count + " indices, more than the limit of " + std::to_string(max) + " (about 100 bytes of memory each at setup)" +
                 (raise_with.empty() ? "" : ": raise " + raise_with + " if that is meant"));
}

const char* const kMaxEntriesSetting = "image_text_shards' max_index_entries";

// ---- the JSON ----

std::vector<int64_t> int_list(const nlohmann::json& j, const std::string& file, const std::string& key) {
  if (!j.is_array()) fail(file, "key '" + key + "' is not a list of integers");
  std::vector<int64_t> out;
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& v = j[i];
    if (!v.is_number_integer()) fail(file, key + "[" + std::to_string(i) + "] is " + v.dump() + ", not an integer");
    out.push_back(v.get<int64_t>());
  }
  return out;
}

const nlohmann::json& need(const nlohmann::json& j, const std::string& file, const std::string& key) {
  auto it = j.find(key);
  if (it == j.end())
    fail(file, "no key '" + key + "': not an IndexKits Index V2 JSON (made by `idk base`, `idk multireso` or `flowrun prep arrow`)");
  return *it;
}

std::string resolve_arrow(const std::string& json_path, const std::string& name) {
  const fs::path p(name);
  if (p.is_absolute()) return name;
  const fs::path beside = fs::path(json_path).parent_path() / p;
  std::error_code ec;
  if (fs::exists(beside, ec) || !fs::exists(p, ec)) return beside.lexically_normal().string();
  return name;  // only in the current folder, where IndexKits' loader looks
}

}  // namespace

std::map<std::string, std::vector<int64_t>> read_npz_int_arrays(const std::string& path, int64_t max_values,
                                                                const std::string& raise_with) {
  std::string zip;
  try {
    zip = read_file(path);
  } catch (const std::exception& e) {
    throw std::runtime_error(e.what());
  }
  // The end-of-central-directory record: the last 22+ bytes (a comment may follow it).
  size_t eocd = std::string::npos;
  for (size_t i = zip.size() >= 22 ? zip.size() - 22 : std::string::npos; i != std::string::npos; --i) {
    if (le32(zip, i) == 0x06054b50) {
      eocd = i;
      break;
    }
    if (i == 0 || zip.size() - i > 22 + 65535) break;
  }
  if (eocd == std::string::npos) fail(path, "not a .npz (zip) file, or cut short");
  const uint16_t entries = le16(zip, eocd + 10);
  size_t cd = le32(zip, eocd + 16);
  std::map<std::string, std::vector<int64_t>> out;
  int64_t values = 0;
  for (uint16_t e = 0; e < entries; ++e) {
    if (cd + 46 > zip.size() || le32(zip, cd) != 0x02014b50) fail(path, "damaged zip directory");
    const uint16_t method = le16(zip, cd + 10);
    uint64_t csize = le32(zip, cd + 20), usize = le32(zip, cd + 24);
    const uint16_t name_len = le16(zip, cd + 28), extra_len = le16(zip, cd + 30), comment_len = le16(zip, cd + 32);
    uint64_t local = le32(zip, cd + 42);
    if (cd + 46 + name_len + extra_len > zip.size()) fail(path, "damaged zip directory");
    std::string name = zip.substr(cd + 46, name_len);
    // Sizes and offset that do not fit 32 bits are in the zip64 extra field (id 1), in this order.
    const size_t extra_end = cd + 46 + name_len + extra_len;
    for (size_t x = cd + 46 + name_len; x + 4 <= extra_end;) {
      const uint16_t id = le16(zip, x), len = le16(zip, x + 2);
      const size_t end = std::min(extra_end, x + 4 + len);
      size_t at = x + 4;
      if (id == 1)
        for (uint64_t* field : {&usize, &csize, &local})
          if (*field == 0xffffffffu && at + 8 <= end) *field = le32(zip, at) | (uint64_t{le32(zip, at + 4)} << 32), at += 8;
      x += 4 + len;
    }
    cd += 46 + name_len + extra_len + comment_len;
    if (usize >= 0xffffffffu || csize >= 0xffffffffu)
      fail(path, "member '" + name + "' is 4 GiB or more, which is not read (split the index)");
    if (local + 30 > zip.size() || le32(zip, local) != 0x04034b50)
      fail(path, "member '" + name + "': damaged zip header");
    const size_t data = local + 30 + le16(zip, local + 26) + le16(zip, local + 28);
    if (data + csize > zip.size()) fail(path, "member '" + name + "' is cut short");
    // Deflate shrinks at most about 1032:1: a larger claim is damage (and no allocation of it).
    if ((method == 0 && usize != csize) || (method == 8 && usize > csize * 1100 + 1024))
      fail(path, "member '" + name + "': its sizes do not fit its compression (damaged .npz)");
    // The inflated size tells the count before inflating (IndexKits' int64 arrays: 8 bytes a value
    // after NumPy's 128-byte header); the exact count is checked after parsing.
    const auto estimate = static_cast<int64_t>(usize > 128 ? (usize - 128) / 8 : 0);
    if (estimate > max_values - values) too_many_indices(path, "about " + std::to_string(values + estimate), max_values, raise_with);
    std::string npy;
    if (method == 0) npy = zip.substr(data, csize);
    else if (method == 8) npy = inflate_raw(path, name, zip.data() + data, csize, usize);
    else fail(path, "member '" + name + "' uses zip method " + std::to_string(method) + " (np.savez writes 0 or 8)");
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0) name.resize(name.size() - 4);
    out[name] = parse_npy(path, name, npy);
    values += static_cast<int64_t>(out[name].size());
    if (values > max_values) too_many_indices(path, std::to_string(values), max_values, raise_with);
  }
  return out;
}

std::vector<int64_t> align_indices(std::vector<int64_t> v, int64_t align) {
  const auto n = static_cast<int64_t>(v.size());
  if (align <= 1 || n == 0 || n % align == 0) return v;
  int64_t repeat_num = align - n % align;
  std::vector<int64_t> times;  // repeat counts of the tail v[n - times.size():]
  if (repeat_num >= n) {
    const int64_t each = repeat_num / n;
    times.assign(static_cast<size_t>(n), each + 1);
    repeat_num -= each * n;
  } else {
    times.assign(static_cast<size_t>(repeat_num), 1);
  }
  for (int64_t i = 0; i < repeat_num; ++i) ++times[times.size() - 1 - static_cast<size_t>(i)];
  const size_t head = v.size() - times.size();
  std::vector<int64_t> out(v.begin(), v.begin() + static_cast<int64_t>(head));
  for (size_t i = 0; i < times.size(); ++i) out.insert(out.end(), static_cast<size_t>(times[i]), v[head + i]);
  return out;
}

std::pair<int, int64_t> IndexV2::locate(int64_t row) const {
  const auto it = std::upper_bound(cum_length.begin(), cum_length.end(), row);
  if (row < 0 || it == cum_length.end())
    throw std::out_of_range(path + ": row " + std::to_string(row) + " is not in its " + std::to_string(rows()) + " rows");
  const auto k = static_cast<int>(it - cum_length.begin());
  return {k, row - (k == 0 ? 0 : cum_length[static_cast<size_t>(k) - 1])};
}

IndexV2 read_index_v2(const std::string& path, int64_t max_entries, int64_t* entries_from_file) {
  nlohmann::json j;
  try {
    j = read_json_file(path, uint64_t{4} << 30);
  } catch (const std::exception& e) {
    throw std::runtime_error(e.what());
  }
  if (!j.is_object()) fail(path, "not a JSON object: not an IndexKits Index V2 JSON");
  IndexV2 idx;
  idx.path = path;
  const nlohmann::json& dt = need(j, path, "data_type");
  if (dt.is_string()) idx.data_type = {dt.get<std::string>()};
  else if (dt.is_array())
    for (const auto& v : dt) idx.data_type.push_back(v.is_string() ? v.get<std::string>() : v.dump());
  const nlohmann::json& files = need(j, path, "arrow_files");
  if (!files.is_array() || files.empty()) fail(path, "key 'arrow_files' is not a non-empty list of paths");
  for (size_t i = 0; i < files.size(); ++i) {
    if (!files[i].is_string()) fail(path, "arrow_files[" + std::to_string(i) + "] is not a path");
    idx.arrow_files.push_back(resolve_arrow(path, files[i].get<std::string>()));
  }
  idx.cum_length = int_list(need(j, path, "cum_length"), path, "cum_length");
  if (idx.cum_length.size() != idx.arrow_files.size())
    fail(path, std::to_string(idx.arrow_files.size()) + " arrow_files but " + std::to_string(idx.cum_length.size()) +
                   " cum_length entries: one per file");
  for (size_t i = 0; i < idx.cum_length.size(); ++i)
    if (idx.cum_length[i] < (i ? idx.cum_length[i - 1] : 0))
      fail(path, "cum_length[" + std::to_string(i) + "] = " + std::to_string(idx.cum_length[i]) + " is less than the one before");

  const nlohmann::json& groups = need(j, path, "group_length");
  const std::string indices_file = j.value("indices_file", std::string());
  std::map<std::string, std::vector<int64_t>> npz;
  if (!indices_file.empty()) {
    const std::string npz_path = (fs::path(path).parent_path() / indices_file).string();
    std::error_code ec;
    if (!fs::exists(npz_path, ec))
      fail(path, "its indices are in indices_file '" + indices_file + "', which is not there (" + npz_path +
                     "): copy the .npz IndexKits wrote beside the JSON");
    npz = read_npz_int_arrays(npz_path, max_entries, kMaxEntriesSetting);
    if (entries_from_file) {
      *entries_from_file = 0;
      for (const auto& [key, v] : npz) *entries_from_file += static_cast<int64_t>(v.size());
    }
  }
  auto check_rows = [&](const std::vector<int64_t>& v, const std::string& what) {
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i] < 0 || v[i] >= idx.rows())
        fail(path, what + "[" + std::to_string(i) + "] = " + std::to_string(v[i]) + " names no row: the Arrow files hold " +
                       std::to_string(idx.rows()) + " (cum_length); was the index built over other files?");
  };
  if (groups.is_object()) {  // multi-resolution
    idx.multireso = true;
    if (indices_file.empty()) fail(path, "a multi-resolution index (group_length by bucket) without its indices_file (.npz)");
    for (const auto& [key, list] : npz) {
      IndexV2::Bucket b;
      // HEIGHTxWIDTH, digits only on both sides ("32x32junk", " 32x32", "+32x32" are not keys IndexKits writes)
      const size_t x = key.find('x');
      auto digits = [](const std::string& t) {
        return !t.empty() && t.size() <= 6 && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
      };
      if (x == std::string::npos || !digits(key.substr(0, x)) || !digits(key.substr(x + 1)) ||
          (b.height = std::stoi(key.substr(0, x))) < 1 || (b.width = std::stoi(key.substr(x + 1))) < 1)
        fail(path, "bucket '" + key + "' in " + indices_file + " is not HEIGHTxWIDTH (two positive whole numbers, e.g. 1024x768)");
      if (!groups.contains(key)) fail(path, "bucket '" + key + "' of " + indices_file + " has no group_length");
      check_rows(list, "indices['" + key + "']");
      b.indices = list;
      if (!b.indices.empty()) idx.buckets.push_back(std::move(b));
    }
    if (idx.buckets.empty()) fail(path, "no bucket holds any row");
    std::stable_sort(idx.buckets.begin(), idx.buckets.end(), [](const IndexV2::Bucket& a, const IndexV2::Bucket& b) {
      return static_cast<double>(a.height) / a.width < static_cast<double>(b.height) / b.width;
    });
  } else {
    if (!groups.is_array() || groups.size() != idx.arrow_files.size())
      fail(path, "group_length is not a list with one entry per Arrow file (" + std::to_string(idx.arrow_files.size()) + ")");
    if (!indices_file.empty()) {
      auto it = npz.find("x");
      if (it == npz.end()) fail(path, indices_file + " has no array 'x' (IndexKits stores a base index's indices there)");
      idx.indices = std::move(it->second);
    } else {
      const nlohmann::json& list = need(j, path, "indices");
      if (list.is_array() && static_cast<uint64_t>(list.size()) > static_cast<uint64_t>(max_entries))
        too_many_indices(path, std::to_string(list.size()), max_entries, kMaxEntriesSetting);
      idx.indices = int_list(list, path, "indices");
    }
    if (idx.indices.empty()) fail(path, "no indices: the index selects no row (were its filters too strict?)");
    check_rows(idx.indices, "indices");
  }
  return idx;
}

}  // namespace flowrun
