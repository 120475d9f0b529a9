#!/usr/bin/env bash
# unit_format: every .cc and .h of the tree is formatted by the root .clang-format
# (clang-format 14, Debian 12's). Skipped (77) without clang-format or outside a git checkout.
# Usage: test_format.sh SOURCE_DIR
set -uo pipefail
src=${1:?usage: test_format.sh SOURCE_DIR}
cd "$src" || exit 1
command -v clang-format >/dev/null || { echo "clang-format not installed: skipped"; exit 77; }
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "not a git checkout: skipped"; exit 77; }
ver=$(clang-format --version | grep -o 'version [0-9]*' | grep -o '[0-9]*$')
[ "$ver" = 14 ] || { echo "clang-format $ver (the style is pinned to 14): skipped"; exit 77; }
mapfile -t files < <(git ls-files '*.cc' '*.h')
if ! out=$(clang-format --dry-run --Werror "${files[@]}" 2>&1); then
  echo "$out" | grep 'error:' | sed 's/:[0-9]*:[0-9]*: error:.*//' | sort -u | sed 's/^/not formatted: /'
  echo "run: git ls-files '*.cc' '*.h' | xargs clang-format -i"
  exit 1
fi
echo "${#files[@]} files formatted"
