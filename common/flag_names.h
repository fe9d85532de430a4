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

// Sets the usage line and makes --help and --helpshort list the program's own flags. Abseil's
// default keeps only flags defined in a file named after the program (specd-router.cc,
// specd-router_main.cc), which matches none of ours (services/router/main.cc), so --help
// printed "No flags matched". Every flag outside Abseil's own sources is shown instead;
// --helpfull still adds Abseil's. Call before absl::ParseCommandLine.
void SetUsageAndHelpFilter(const char* usage);

}  // namespace specd

#endif  // SPECD_COMMON_FLAG_NAMES_H_
