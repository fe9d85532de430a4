#include "common/flag_names.h"

#include <cstring>

namespace specd {

void AcceptDashedFlagNames(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* arg = argv[i];
    if (std::strncmp(arg, "--", 2) != 0) continue;
    if (arg[2] == '\0') break;  // "--": everything after it is positional
    for (char* c = arg + 2; *c != '\0' && *c != '='; ++c) {
      if (*c == '-') *c = '_';
    }
  }
}

}  // namespace specd
