// Writes a random-weight Hugging Face model folder (tests/testutil/random_checkpoint.h) for the
// Python integration tests, which start the real services on it.
//   specd_write_random_model DIR [SEED]
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/testutil/random_checkpoint.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s DIR [SEED]\n", argv[0]);
    return 2;
  }
  specd::RandomCheckpointSpec spec;
  if (argc == 3) {
    char* end = nullptr;
    spec.seed = std::strtoull(argv[2], &end, 10);
    if (*end != '\0') {
      std::fprintf(stderr, "SEED: '%s' is not a number\n", argv[2]);
      return 2;
    }
  }
  // Peakier next-token distributions than the default, so that a copy of the model used as a
  // draft agrees with greedy decoding while sampled decoding still rejects some drafts.
  spec.init_std = 0.3f;
  if (absl::Status st = specd::WriteRandomCheckpoint(argv[1], spec); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}
