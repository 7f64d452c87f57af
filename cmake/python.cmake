# The Python of this build: the one whose PyTorch flowrun links (cmake/torch.cmake) and that the
# tests run reference scripts with (tiktoken). FLOWRUN_PYTHON if given (any environment with
# PyTorch >= 2.11, e.g. -DFLOWRUN_PYTHON=$HOME/venv/bin/python), else the checkout's
# .venv/bin/python (scripts/setup.sh makes it from requirements.txt), else python3 on PATH.
# Sets FLOWRUN_PYTHON_EXE (empty when there is none).
set(FLOWRUN_PYTHON "" CACHE FILEPATH "the Python whose torch to build against (empty: .venv/bin/python, else python3)")
set(FLOWRUN_PYTHON_EXE "${FLOWRUN_PYTHON}")
if(NOT FLOWRUN_PYTHON_EXE)
  if(EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python")
    set(FLOWRUN_PYTHON_EXE "${PROJECT_SOURCE_DIR}/.venv/bin/python")
  else()
    find_program(_python_on_path NAMES python3 python)
    set(FLOWRUN_PYTHON_EXE "${_python_on_path}")
  endif()
endif()
