#!/usr/bin/env bash
# Builds kfac's API reference (HTML) from the headers' /// comments with doxygen and fails when
# doxygen prints any warning. Usage: scripts/docs.sh [OUT_DIR [INPUT...]]
#   OUT_DIR  where html/ and warnings.log go (default build/docs)
#   INPUT    files or folders to read instead of docs/Doxyfile's (the test api_docs_refuses
#            passes a header with a wrong comment, to check that a warning fails the build)
# Settings: docs/Doxyfile. Takes about 2 s; run by the ctest api_docs when doxygen is found.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/build/docs}
shift || true
command -v doxygen >/dev/null || { echo "docs.sh: doxygen not found (scripts/install_deps.sh installs it)" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/warnings.log
rm -rf "$out/html" "$log"
cd "$root"
{
  cat docs/Doxyfile
  echo "OUTPUT_DIRECTORY = $out"
  echo "WARN_LOGFILE = $log"
  if [ $# -gt 0 ]; then echo "INPUT = $*"; fi
} | doxygen - && rc=0 || rc=$?
# WARN_AS_ERROR = FAIL_ON_WARNINGS gives a non-zero status; the log is checked too, so a doxygen
# without that setting still fails on a warning.
if [ "$rc" -ne 0 ] || [ -s "$log" ]; then
  echo "docs.sh: doxygen reported problems (status $rc):" >&2
  cat "$log" >&2
  exit 1
fi
echo "docs.sh: API reference in $out/html/index.html, no warnings"
