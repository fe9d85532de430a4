// Multi-word flags spelled with dashes as well as underscores (--tensor-parallel, as vLLM and
// SGLang spell theirs, or --tensor_parallel, Abseil's own spelling), so a command line copied
// from another server's docs works.
#ifndef SPECD_COMMON_FLAG_NAMES_H_
#define SPECD_COMMON_FLAG_NAMES_H_

namespace specd {

// Rewrites, in place, the name part of every "--name[=value]" argument before a bare "--" so
// that dashes inside the name become underscores ("--tensor-parallel=7" ->
// "--tensor_parallel=7"). Values, single-dash arguments and positional arguments are left
// alone. Call before absl::ParseCommandLine.
void AcceptDashedFlagNames(int argc, char** argv);

}  // namespace specd

#endif  // SPECD_COMMON_FLAG_NAMES_H_
