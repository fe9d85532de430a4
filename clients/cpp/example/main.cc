// specd-example: streams one completion from a specd router with the C++ SDK.
//
//   specd-example HOST:PORT [PROMPT] [MAX_NEW_TOKENS]
//
// Prints the served model, the completion as it arrives, then the finish reason, the token
// counts and the speculation statistics. Exits 1 with "error: CODE: message" when a call fails.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "specd/client.h"

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "error: " << absl::StatusCodeToString(status.code()) << ": " << status.message()
            << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 4) {
    std::cerr << "usage: specd-example HOST:PORT [PROMPT] [MAX_NEW_TOKENS]\n";
    return 2;
  }
  specd::ClientOptions options;
  options.target = argv[1];
  options.default_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<specd::Client>> client = specd::Client::Create(options);
  if (!client.ok()) return Fail(client.status());

  absl::StatusOr<specd::ModelInfo> info = (*client)->GetModelInfo();
  if (!info.ok()) return Fail(info.status());
  std::cout << "model: " << info->target_model
            << " (draft: " << (info->draft_available ? info->draft_model : "none") << ", context "
            << info->max_context << " tokens)\n";

  specd::GenerateRequest request;
  request.prompt = argc > 2 ? argv[2] : "def fibonacci(n):";
  request.max_new_tokens = argc > 3 ? std::atoi(argv[3]) : 64;
  request.temperature = 0.0f;  // greedy

  // Chunk by chunk as the router streams them; the last one carries the statistics.
  std::unique_ptr<specd::GenerateStream> stream = (*client)->Stream(request);
  specd::CompletionBuilder completion;
  specd::Chunk chunk;
  while (stream->Next(&chunk)) {
    std::cout << chunk.text << std::flush;
    completion.Add(chunk);
  }
  std::cout << "\n";
  if (!stream->status().ok()) return Fail(stream->status());
  absl::StatusOr<specd::Completion> done = std::move(completion).Finish();
  if (!done.ok()) return Fail(done.status());

  const specd::SpeculationStats& s = done->speculation;
  std::printf("[finish: %s, %u prompt + %u completion tokens; speculation %s: %llu steps",
              specd::FinishReasonName(done->finish_reason), done->usage.prompt_tokens,
              done->usage.completion_tokens, specd::SpeculationName(s.mode),
              static_cast<unsigned long long>(s.steps));
  if (s.acceptance_rate().has_value()) {
    std::printf(", acceptance %.2f, mean accepted length %.2f", *s.acceptance_rate(),
                *s.mean_accepted_length());
  }
  std::printf("]\n");
  return 0;
}
