// MD5 (RFC 1321) of bytes, as hex: the `md5` column HunyuanDiT's csv2arrow.py writes
// (hashlib.md5(image_bytes).hexdigest()) and IndexKits filters and de-duplicates by. Not for
// security; a content key.
#pragma once
#include <string>
#include <string_view>

namespace flowrun {

std::string md5_hex(std::string_view bytes);  // 32 lowercase hex digits

}  // namespace flowrun
