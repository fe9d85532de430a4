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
#   SPEC_REV        (environment) default 091515a: the revision of generate_spec.py
#
# Writes DEST/{model,generate,tp,quantize,tokenizer}.py, DEST/LICENSE and DEST/COMMIT (the
# commit hash and date, printed by the benchmark), and DEST/generate_spec.py with
# DEST/COMMIT_SPEC: generate.py as of SPEC_REV (default 091515a, 2024-06-25), the last revision
# whose speculative decoding runs. gpt-fast's next commit (61c193d, "Add support for batched
# generation") gave sample() and seq a batch dimension but left speculative_decode and
# generate()'s speculative branch as they were, so with a draft model they fail at any batch
# (a 1-D cur_token concatenated with 2-D draft tokens; seq[a:b] = tokens on a (batch, T) seq;
# gpt-fast issues 209, 213, 214). bench/tools/gpt_fast_spec_bench.py runs generate_spec.py with
# the current model.py (whose only change since is Llama 3.1's RoPE scaling). tokenizer.py
# needs sentencepiece and tiktoken, which the GPU host lacks: gpt_fast_bench.py puts a stub in
# its place when the import fails (no tokenizer is used; the weights are random).
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
spec_commit=$(g rev-parse --verify "${SPEC_REV:-091515a}^{commit}")
g show "$spec_commit:generate.py" > "$dest/generate_spec.py"
echo "$spec_commit $(g show -s --format='%cs %s' "$spec_commit")" > "$dest/COMMIT_SPEC"
if git -C "$root" ls-files --error-unmatch "$dest" > /dev/null 2>&1; then
  echo "warning: $dest is tracked by git; it must not be committed" >&2
fi
if ! git -C "$root" check-ignore -q "$dest/model.py"; then
  echo "warning: $dest is not ignored by git; add /.carry-*/ to .gitignore before committing" >&2
fi
echo "gpt-fast $(cat "$dest/COMMIT")"
echo "gpt-fast generate_spec.py $(cat "$dest/COMMIT_SPEC")"
echo "-> $dest ($(du -sk "$(dirname "$dest")" | cut -f1) KiB)"
