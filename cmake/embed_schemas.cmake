# Writes OUT: a C++ file that holds every schemas/*.yaml as a string, so the flowrun binary
# knows its built-in schemas wherever it is installed. Run as: cmake -DDIR=... -DOUT=... -P
file(GLOB files "${DIR}/*.yaml")
list(SORT files)
set(body "// Generated from schemas/*.yaml by cmake/embed_schemas.cmake. Do not edit.\n#include <map>\n#include <string>\nnamespace flowrun::detail {\nconst std::map<std::string, std::string>& embedded_schemas() {\n  static const std::map<std::string, std::string> m = {\n")
foreach(f ${files})
  get_filename_component(name "${f}" NAME_WE)
  file(READ "${f}" text)
  string(APPEND body "    {\"${name}\", R\"flowrun_schema(${text})flowrun_schema\"},\n")
endforeach()
string(APPEND body "  };\n  return m;\n}\n}  // namespace flowrun::detail\n")
# Only touch the file when it changes, so a rebuild does not recompile it for nothing.
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
  if(old STREQUAL body)
    return()
  endif()
endif()
file(WRITE "${OUT}" "${body}")
