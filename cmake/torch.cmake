# libtorch, from a PyTorch 2.x Python install (pip's torch wheel carries libtorch: its headers,
# libraries and CMake package), on the CPU as on the GPU: one libtorch for the binary, the
# benchmarks' PyTorch peers and the reference-fixture scripts.
#
# Which Python: FLOWRUN_PYTHON_EXE (cmake/python.cmake: -DFLOWRUN_PYTHON=/path/to/python, else the
# checkout's .venv/, else python3), with torch >= FLOWRUN_TORCH_MIN. CMake asks it for
# torch.utils.cmake_prefix_path, the version, the CUDA version and the C++ ABI.
#
# Defines TORCH_LIBRARIES, what every torch-using target links.
#   - FLOWRUN_CUDA=ON: torch's own CMake package (find_package(Torch) through
#     cmake_prefix_path), which needs the CUDA toolkit (nvcc) and links libtorch_cuda.
#   - otherwise: libtorch_cpu and libc10 only, as an imported target. A pip torch is a CUDA
#     build whose CMake package fails without a CUDA toolkit, and whose libtorch.so pulls in
#     libtorch_cuda (0.5 GB) and cuDNN, cuBLAS, ... at every start; the CPU operators are all in
#     libtorch_cpu (which loads only the CUDA runtime and CUPTI, for its profiler), so a CPU
#     flowrun needs no nvcc to build and starts as fast as with a CPU-only libtorch.
set(FLOWRUN_TORCH_MIN 2.11)  # the oldest PyTorch flowrun has been built against (the GPU machines')

set(_how_to "Run scripts/setup.sh (it installs PyTorch into .venv/), or point the build at a Python with "
            "PyTorch >= ${FLOWRUN_TORCH_MIN}: cmake -DFLOWRUN_PYTHON=/path/to/python ...")
if(NOT FLOWRUN_PYTHON_EXE)
  message(FATAL_ERROR "flowrun: no Python found to ask for PyTorch. ${_how_to}")
endif()
execute_process(
  COMMAND "${FLOWRUN_PYTHON_EXE}" -c "import os, torch, torch.utils; print(torch.utils.cmake_prefix_path); print(os.path.dirname(torch.__file__)); print(torch.__version__.split('+')[0]); print(torch.version.cuda or ''); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _rc EQUAL 0)
  string(REGEX REPLACE ".*\n([^\n]+)\n?$" "\\1" _last "${_err}")
  message(FATAL_ERROR "flowrun: ${FLOWRUN_PYTHON_EXE} cannot import torch (${_last}). ${_how_to}")
endif()
string(REPLACE "\n" ";" _out "${_out}")
list(GET _out 0 _torch_cmake_prefix)
list(GET _out 1 FLOWRUN_TORCH_ROOT)
list(GET _out 2 FLOWRUN_TORCH_VERSION)
list(GET _out 3 FLOWRUN_TORCH_CUDA)
list(GET _out 4 _torch_abi)
if(FLOWRUN_TORCH_VERSION VERSION_LESS FLOWRUN_TORCH_MIN)
  message(FATAL_ERROR "flowrun: ${FLOWRUN_PYTHON_EXE} has PyTorch ${FLOWRUN_TORCH_VERSION}; flowrun needs >= ${FLOWRUN_TORCH_MIN}. ${_how_to}")
endif()
if(FLOWRUN_TORCH_CUDA)
  set(_built "CUDA ${FLOWRUN_TORCH_CUDA}")
else()
  set(_built "CPU only")
endif()
message(STATUS "flowrun: PyTorch ${FLOWRUN_TORCH_VERSION} (${_built}) at ${FLOWRUN_TORCH_ROOT}, from ${FLOWRUN_PYTHON_EXE}")

# torch's include folder also holds the headers of the libraries it bundles, fmt among them (v12),
# which would shadow Debian's fmt 9 that spdlog is built against. The build sees a copy of the
# folder made of links to everything in it but fmt/.
set(_torch_include "${PROJECT_BINARY_DIR}/torch_include")
file(REMOVE_RECURSE "${_torch_include}")
file(MAKE_DIRECTORY "${_torch_include}")
file(GLOB _entries RELATIVE "${FLOWRUN_TORCH_ROOT}/include" "${FLOWRUN_TORCH_ROOT}/include/*")
foreach(_entry IN LISTS _entries)
  if(NOT _entry STREQUAL "fmt")
    file(CREATE_LINK "${FLOWRUN_TORCH_ROOT}/include/${_entry}" "${_torch_include}/${_entry}" SYMBOLIC)
  endif()
endforeach()

# In the list variable VAR, torch's include folder becomes that copy (compared as strings: a
# path is no regular expression).
function(flowrun_without_torch_fmt var)
  set(_out)
  foreach(_dir IN LISTS ${var})
    if(_dir STREQUAL "${FLOWRUN_TORCH_ROOT}/include")
      set(_dir "${_torch_include}")
    endif()
    list(APPEND _out "${_dir}")
  endforeach()
  set(${var} "${_out}" PARENT_SCOPE)
endfunction()

if(FLOWRUN_CUDA)
  if(NOT FLOWRUN_TORCH_CUDA)
    message(FATAL_ERROR "flowrun: FLOWRUN_CUDA=ON but the PyTorch at ${FLOWRUN_TORCH_ROOT} was built without CUDA")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${_torch_cmake_prefix}")
  find_package(Torch REQUIRED)
  # The same include folders, the copy without fmt/ in place of torch's own.
  foreach(_target torch torch_cpu torch_cuda c10 c10_cuda headeronly torch_nvshmem)
    if(TARGET ${_target})
      get_target_property(_dirs ${_target} INTERFACE_INCLUDE_DIRECTORIES)
      if(_dirs)
        flowrun_without_torch_fmt(_dirs)
        set_target_properties(${_target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_dirs}")
      endif()
    endif()
  endforeach()
else()
  # The paths themselves, not find_library's cached answers: pointed at another PyTorch, the
  # build must not keep linking the first one's libraries.
  foreach(_lib torch_cpu c10)
    set(FLOWRUN_LIB_${_lib} "${FLOWRUN_TORCH_ROOT}/lib/lib${_lib}.so")
    if(NOT EXISTS "${FLOWRUN_LIB_${_lib}}")
      message(FATAL_ERROR "flowrun: no lib${_lib}.so in ${FLOWRUN_TORCH_ROOT}/lib: not a PyTorch with libtorch. ${_how_to}")
    endif()
  endforeach()
  set(_dirs "${_torch_include}" "${_torch_include}/torch/csrc/api/include")
  add_library(flowrun_torch INTERFACE IMPORTED GLOBAL)
  # SYSTEM include folders: torch's headers warn under our -W flags.
  set_target_properties(flowrun_torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_dirs}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${_dirs}"
    INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${_torch_abi}"
    INTERFACE_LINK_LIBRARIES "${FLOWRUN_LIB_torch_cpu};${FLOWRUN_LIB_c10}")
  set(TORCH_LIBRARIES flowrun_torch)
endif()

# at::parallel_for (ATen/Parallel-inl.h) is a header template: its loop is split over torch's
# intra-op threads only in code compiled with -fopenmp. Without it INTRA_OP_PARALLEL is undefined
# and every at::parallel_for of ours (the fused GELU, the CPU attention's softmax, the optimizers'
# flat updates) runs on the calling thread alone while the other threads wait. A torch built with
# OpenMP (ATen/Config.h: AT_PARALLEL_OPENMP 1, pip's) bundles its libgomp in its lib folder: our
# code joins that same runtime (one thread team, one team size per thread, as torch_setup.cpp
# sets them), compiled with -fopenmp and linked to that libgomp. Test: tests/nodes/
# gelu_tanh_test.cpp's GeluTanh.KernelsSplitOverTorchsThreads.
file(STRINGS "${FLOWRUN_TORCH_ROOT}/include/ATen/Config.h" _torch_openmp REGEX "define AT_PARALLEL_OPENMP 1")
if(_torch_openmp)
  file(GLOB _torch_gomp "${FLOWRUN_TORCH_ROOT}/lib/libgomp*.so*")
  add_library(flowrun_torch_openmp INTERFACE IMPORTED GLOBAL)
  set_target_properties(flowrun_torch_openmp PROPERTIES INTERFACE_COMPILE_OPTIONS "$<$<COMPILE_LANGUAGE:CXX>:-fopenmp>")
  if(_torch_gomp)
    list(GET _torch_gomp 0 _torch_gomp)
    set_target_properties(flowrun_torch_openmp PROPERTIES INTERFACE_LINK_LIBRARIES "${_torch_gomp}")
  else()  # a torch linked against the system's OpenMP runtime
    find_package(OpenMP REQUIRED COMPONENTS CXX)
    set_target_properties(flowrun_torch_openmp PROPERTIES INTERFACE_LINK_LIBRARIES OpenMP::OpenMP_CXX)
  endif()
  list(APPEND TORCH_LIBRARIES flowrun_torch_openmp)
  message(STATUS "flowrun: at::parallel_for in flowrun's code uses torch's OpenMP (${_torch_gomp})")
endif()
