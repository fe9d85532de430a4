#!/usr/bin/env bash
# The repository stands on its own and its front page stays a front page: no tracked file
# refers to a folder outside the repository (../shared, /work) or to a design document that is
# not in it (docs/architecture.md is the one), and README.md stays under 200 lines.
#   tests/tools/repo_hygiene_test.sh        (from the repository root)
set -uo pipefail
fails=0
lines=$(wc -l < README.md)
if [ "$lines" -ge 200 ]; then
  echo "FAIL: README.md has $lines lines; keep it under 200 (details go to docs/)"
  fails=1
fi
# git grep covers tracked and staged files; this script names the patterns, so it is skipped.
pattern='\.\./shared|/work/|DESIGN\.md'
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  hits=$(git grep -n -I -E "$pattern" -- . ':!tests/tools/repo_hygiene_test.sh')
else  # a source tree without git: every file but build folders
  hits=$(grep -rn -I -E "$pattern" --exclude-dir=.git --exclude-dir='build*' \
    --exclude=repo_hygiene_test.sh .)
fi
if [ -n "$hits" ]; then
  echo "FAIL: files refer to something outside the repository (../shared, /work, DESIGN.md):"
  echo "$hits"
  fails=1
fi
[ $fails -eq 0 ] && echo "README.md: $lines lines; no reference outside the repository"
exit $fails
