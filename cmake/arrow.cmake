# Apache Arrow's C++ library, for the Arrow files of HunyuanDiT's data (formats/arrow_file.hpp).
# Optional, as SentencePiece: FLOWRUN_ARROW = AUTO (default: on where found), ON (an error when
# not found) or OFF. Looked for, in order:
#   1. an installed Arrow C++ (find_package(Arrow): Apache's apt repository's libarrow-dev, a
#      conda environment, a source build; -DArrow_DIR=... points at one);
#   2. the pyarrow wheel of the build's Python (FLOWRUN_PYTHON_EXE, cmake/python.cmake), which
#      ships libarrow.so.N and Arrow's headers (pyarrow.get_include()): Arrow documents building
#      C++ against it. requirements.txt installs it into .venv/, so scripts/setup.sh finds it.
# Sets FLOWRUN_ARROW_TARGET (an imported target to link; empty when off) and
# FLOWRUN_ARROW_VERSION. Arrow's headers need C++20: only formats/arrow_file.cpp sees them.
set(FLOWRUN_ARROW AUTO CACHE STRING "Arrow files (HunyuanDiT csv2arrow/IndexKits data): AUTO, ON or OFF")
set_property(CACHE FLOWRUN_ARROW PROPERTY STRINGS AUTO ON OFF)
set(FLOWRUN_ARROW_TARGET "")
set(FLOWRUN_ARROW_VERSION "")
if(NOT FLOWRUN_ARROW STREQUAL "OFF")
  find_package(Arrow CONFIG QUIET)
  if(Arrow_FOUND AND TARGET Arrow::arrow_shared)
    set(FLOWRUN_ARROW_TARGET Arrow::arrow_shared)
    set(FLOWRUN_ARROW_VERSION "${Arrow_VERSION} (${Arrow_DIR})")
  elseif(FLOWRUN_PYTHON_EXE)
    execute_process(
      COMMAND "${FLOWRUN_PYTHON_EXE}" -c
              "import glob, os, pyarrow as pa; libs = sorted(glob.glob(os.path.join(os.path.dirname(pa.__file__), 'libarrow.so.*'))); print(pa.get_include()); print(libs[0] if libs else ''); print(pa.__version__)"
      OUTPUT_VARIABLE _pa_out ERROR_QUIET RESULT_VARIABLE _pa_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_pa_rc EQUAL 0)
      string(REPLACE "\n" ";" _pa_out "${_pa_out}")
      list(LENGTH _pa_out _pa_n)
      if(_pa_n EQUAL 3)
        list(GET _pa_out 0 _pa_include)
        list(GET _pa_out 1 _pa_lib)
        list(GET _pa_out 2 _pa_version)
        if(EXISTS "${_pa_lib}" AND EXISTS "${_pa_include}/arrow/api.h")
          add_library(flowrun_pyarrow_libarrow SHARED IMPORTED)
          set_target_properties(flowrun_pyarrow_libarrow PROPERTIES IMPORTED_LOCATION "${_pa_lib}"
                                INTERFACE_INCLUDE_DIRECTORIES "${_pa_include}")
          set(FLOWRUN_ARROW_TARGET flowrun_pyarrow_libarrow)
          set(FLOWRUN_ARROW_VERSION "${_pa_version} (pyarrow, ${_pa_lib})")
        endif()
      endif()
    endif()
  endif()
  if(NOT FLOWRUN_ARROW_TARGET AND FLOWRUN_ARROW STREQUAL "ON")
    message(FATAL_ERROR "FLOWRUN_ARROW=ON but no Arrow C++ library was found: pip install pyarrow into "
                        "${FLOWRUN_PYTHON_EXE} (requirements.txt has it), or install libarrow-dev, and re-run cmake")
  endif()
endif()
if(FLOWRUN_ARROW_TARGET)
  message(STATUS "flowrun: Arrow files on: Arrow ${FLOWRUN_ARROW_VERSION}")
else()
  message(STATUS "flowrun: Arrow files off (FLOWRUN_ARROW=${FLOWRUN_ARROW}; needs pyarrow in ${FLOWRUN_PYTHON_EXE} or libarrow-dev)")
endif()
