#!/usr/bin/env bash
# Copies gpt-fast's Python sources (pytorch-labs/gpt-fast: model.py, generate.py, tp.py and what
# they import) out of a local bare mirror of that repository into an ignored folder, so that
# they can travel to the GPU host beside the working tree. gpt-fast is a peer baseline: its code
# is never committed here (.gitignore ignores /.carry-*/); bench/tools/gpt_fast_bench.py imports
# it from the folder at run time.
#
#   bench/tools/fetch_gpt_fast.sh MIRROR_GIT_DIR [DEST] [REV]
#
#   MIRROR_GIT_DIR  a git directory holding gpt-fast's history (a bare clone of
#                   https://github.com/pytorch-labs/gpt-fast, or a clone's .git)
#   DEST            default .carry-gptfast/gpt-fast (relative to the repository root)
#   REV             default HEAD (the mirror's main)
#
# Writes DEST/{model,generate,tp,quantize,tokenizer}.py, DEST/LICENSE and DEST/COMMIT (the
# commit hash and date, printed by the benchmark). tokenizer.py needs sentencepiece and
# tiktoken, which the GPU host lacks: gpt_fast_bench.py puts a stub in its place when the
# import fails (no tokenizer is used; the weights are random).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
mirror=${1:-}
if [ -z "$mirror" ] || ! git --git-dir="$mirror" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  echo "usage: $0 MIRROR_GIT_DIR [DEST] [REV]: a git directory holding gpt-fast's history" >&2
  exit 2
fi
dest=${2:-.carry-gptfast/gpt-fast}
case "$dest" in /*) ;; *) dest="$root/$dest" ;; esac
rev=${3:-HEAD}
g() { git --git-dir="$mirror" "$@"; }
commit=$(g rev-parse --verify "$rev^{commit}")
mkdir -p "$dest"
for f in model.py generate.py tp.py quantize.py tokenizer.py LICENSE; do
  g show "$commit:$f" > "$dest/$f"
done
echo "$commit $(g show -s --format='%cs %s' "$commit")" > "$dest/COMMIT"
if git -C "$root" ls-files --error-unmatch "$dest" > /dev/null 2>&1; then
  echo "warning: $dest is tracked by git; it must not be committed" >&2
fi
if ! git -C "$root" check-ignore -q "$dest/model.py"; then
  echo "warning: $dest is not ignored by git; add /.carry-*/ to .gitignore before committing" >&2
fi
echo "gpt-fast $(cat "$dest/COMMIT")"
echo "-> $dest ($(du -sk "$(dirname "$dest")" | cut -f1) KiB)"
