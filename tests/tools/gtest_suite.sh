#!/usr/bin/env bash
# One gtest suite as one ctest test (tests/tools/gtest_suites.cmake): runs BIN --gtest_filter=SUITE.*
# and exits with its code, but 77 (ctest: skipped) when no case passed because every one skipped
# (a test that needs scripts/data.sh's data/ and finds none: FLOWRUN_NEEDS_DATA). A suite whose
# cases partly skipped passes, and its output lists them.
#   gtest_suite.sh BIN --gtest_filter=SUITE.* [ARGS...]
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
if [ "$rc" = 0 ] && grep -q '^\[  SKIPPED \]' "$out" && grep -q '^\[  PASSED  \] 0 tests' "$out"; then
  exit 77
fi
exit "$rc"
