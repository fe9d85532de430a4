#include "specd/kernels/embedding.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace specd {

void EmbeddingCpu(const EmbeddingParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int32_t id = p.tokens[t];
    if (id < 0 || id >= p.vocab_size) {
      std::fprintf(stderr, "EmbeddingCpu: token id %d outside [0, %lld)\n", id,
                   static_cast<long long>(p.vocab_size));
      std::abort();
    }
    std::memcpy(p.out + t * p.hidden, p.table + static_cast<int64_t>(id) * p.hidden,
                sizeof(float) * p.hidden);
  }
}

}  // namespace specd
