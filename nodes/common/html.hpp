// Text for the HTML pages evaluators write (caption_evaluator's samples, generate's completions).
#pragma once
#include <string>

namespace flowrun {

// `s` with <, >, & and " as entities: safe inside an element or a quoted attribute.
inline std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

}  // namespace flowrun
