// specd-cli: a command-line client of specd-router's Generation API.
//
//   specd-cli generate --server HOST:PORT --prompt TEXT [--max-new-tokens N] [--temperature T]
//       [--top-p P] [--top-k K] [--seed S] [--speculation auto|off|draft_model|ngram]
//       [--stop STR]... [--stop-token-id ID]... [--prompt-ids 1,2,3] [--ignore-eos]
//       [--draft-depth N] [--draft-top-k N] [--draft-max-nodes N] [--timeout-ms MS] [--json]
//   specd-cli tokenize --server HOST:PORT --text TEXT [--add-special-tokens]
//   specd-cli detokenize --server HOST:PORT --ids 1,2,3 [--skip-special-tokens]
//   specd-cli info --server HOST:PORT
//
// generate streams the completion to stdout as it arrives. With --json it prints one JSON
// object per streamed chunk ({"token_ids": [...], "text": "..."}) and a last line with the
// finish reason, usage, speculation stats and timings. Errors go to stderr as
// "error: CODE_NAME: message" with a non-zero exit status.
//
// Flags are parsed here rather than with absl flags so that they can be spelled with dashes
// and repeated (--stop), as users of other serving CLIs expect.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/service/grpc_util.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "specd/v1/generation.grpc.pb.h"

namespace specd {
namespace {

using nlohmann::json;

constexpr int kUsageError = 2;
constexpr int kRpcError = 1;

const char* kUsage =
    "usage:\n"
    "  specd-cli generate --server HOST:PORT (--prompt TEXT | --prompt-ids 1,2,3)\n"
    "      [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]\n"
    "      [--speculation auto|off|draft_model|ngram] [--stop STR]... [--stop-token-id ID]...\n"
    "      [--ignore-eos] [--draft-depth N] [--draft-top-k N] [--draft-max-nodes N]\n"
    "      [--timeout-ms MS] [--request-id ID] [--json]\n"
    "  specd-cli tokenize --server HOST:PORT --text TEXT [--add-special-tokens]\n"
    "  specd-cli detokenize --server HOST:PORT --ids 1,2,3 [--skip-special-tokens]\n"
    "  specd-cli info --server HOST:PORT\n";

// The status code's name as gRPC and Abseil spell it (they share the numbering).
std::string CodeName(grpc::StatusCode code) {
  const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}

const char* FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_EOS:
      return "eos";
    case v1::FINISH_REASON_STOP_TOKEN:
      return "stop_token";
    case v1::FINISH_REASON_STOP_STRING:
      return "stop";
    case v1::FINISH_REASON_CONTEXT:
      return "context";
    default:
      return "unspecified";
  }
}

int RpcFailed(const grpc::Status& status) {
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s: %s\n", CodeName(status.error_code()).c_str(),
               status.error_message().c_str());
  return kRpcError;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "specd-cli: %s\n%s", message.c_str(), kUsage);
  return kUsageError;
}

// JSON text of `j`; invalid UTF-8 (which the router never sends) is replaced, not fatal.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// --name value / --name=value flags; boolean flags take no value; some may repeat.
class Args {
 public:
  bool Parse(int argc, char** argv, int first, std::string* error) {
    static const std::map<std::string, bool> kFlags = {
        // name -> takes a value
        {"server", true},
        {"prompt", true},
        {"prompt-ids", true},
        {"max-new-tokens", true},
        {"temperature", true},
        {"top-p", true},
        {"top-k", true},
        {"seed", true},
        {"speculation", true},
        {"stop", true},
        {"stop-token-id", true},
        {"ignore-eos", false},
        {"draft-depth", true},
        {"draft-top-k", true},
        {"draft-max-nodes", true},
        {"timeout-ms", true},
        {"request-id", true},
        {"json", false},
        {"text", true},
        {"ids", true},
        {"add-special-tokens", false},
        {"skip-special-tokens", false},
    };
    for (int i = first; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg.rfind("--", 0) != 0) {
        *error = absl::StrCat("unexpected argument '", arg, "'");
        return false;
      }
      arg = arg.substr(2);
      std::string value;
      bool has_value = false;
      if (const size_t eq = arg.find('='); eq != std::string::npos) {
        value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
        has_value = true;
      }
      for (char& c : arg) c = c == '_' ? '-' : c;  // --max_new_tokens works too
      auto it = kFlags.find(arg);
      if (it == kFlags.end()) {
        *error = absl::StrCat("unknown flag --", arg);
        return false;
      }
      if (it->second && !has_value) {
        if (i + 1 >= argc) {
          *error = absl::StrCat("--", arg, " needs a value");
          return false;
        }
        value = argv[++i];
      } else if (!it->second && has_value) {
        *error = absl::StrCat("--", arg, " takes no value");
        return false;
      }
      values_[arg].push_back(value);
    }
    return true;
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? "" : it->second.back();
  }
  std::vector<std::string> All(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? std::vector<std::string>() : it->second;
  }

 private:
  std::map<std::string, std::vector<std::string>> values_;
};

template <typename T>
bool ParseNumber(const Args& args, const std::string& name, T* out, std::string* error) {
  if (!args.Has(name)) return true;
  const std::string v = args.Get(name);
  bool ok;
  if constexpr (std::is_floating_point_v<T>) {
    ok = absl::SimpleAtof(v, out);
  } else {
    ok = absl::SimpleAtoi(v, out);
  }
  if (!ok) *error = absl::StrCat("--", name, ": '", v, "' is not a number");
  return ok;
}

bool ParseIds(const std::string& text, const std::string& name, std::vector<int32_t>* out,
              std::string* error) {
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      *error = absl::StrCat("--", name, ": '", part, "' is not a token id");
      return false;
    }
    out->push_back(id);
  }
  return true;
}

std::unique_ptr<v1::Generation::Stub> Connect(const Args& args) {
  return v1::Generation::NewStub(grpc::CreateCustomChannel(
      args.Get("server"), grpc::InsecureChannelCredentials(), ServiceChannelArguments()));
}

void SetTimeout(int64_t timeout_ms, grpc::ClientContext* ctx) {
  if (timeout_ms > 0) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  }
}

int Generate(const Args& args) {
  std::string error;
  v1::GenerateRequest request;
  if (args.Has("prompt") == args.Has("prompt-ids")) {
    return UsageError("give exactly one of --prompt and --prompt-ids");
  }
  if (args.Has("prompt")) {
    request.set_prompt(args.Get("prompt"));
  } else {
    std::vector<int32_t> ids;
    if (!ParseIds(args.Get("prompt-ids"), "prompt-ids", &ids, &error)) return UsageError(error);
    request.mutable_prompt_ids()->mutable_ids()->Assign(ids.begin(), ids.end());
  }
  uint32_t max_new = 0, depth = 0, top_k_draft = 0, max_nodes = 0;
  float temperature = 0, top_p = 1;
  int32_t top_k = 0;
  uint64_t seed = 0;
  int64_t timeout_ms = 0;
  if (!ParseNumber(args, "max-new-tokens", &max_new, &error) ||
      !ParseNumber(args, "temperature", &temperature, &error) ||
      !ParseNumber(args, "top-p", &top_p, &error) || !ParseNumber(args, "top-k", &top_k, &error) ||
      !ParseNumber(args, "seed", &seed, &error) ||
      !ParseNumber(args, "draft-depth", &depth, &error) ||
      !ParseNumber(args, "draft-top-k", &top_k_draft, &error) ||
      !ParseNumber(args, "draft-max-nodes", &max_nodes, &error) ||
      !ParseNumber(args, "timeout-ms", &timeout_ms, &error)) {
    return UsageError(error);
  }
  request.set_max_new_tokens(max_new);
  // Only what the user gave is sent; the router validates the values and fills defaults.
  if (args.Has("temperature")) request.set_temperature(temperature);
  if (args.Has("top-p")) request.set_top_p(top_p);
  if (args.Has("top-k")) request.set_top_k(top_k);
  if (args.Has("seed")) request.set_seed(seed);
  request.set_draft_depth(depth);
  request.set_draft_top_k(top_k_draft);
  request.set_draft_max_nodes(max_nodes);
  request.set_ignore_eos(args.Has("ignore-eos"));
  request.set_request_id(args.Get("request-id"));
  for (const std::string& s : args.All("stop")) request.add_stop(s);
  for (const std::string& s : args.All("stop-token-id")) {
    std::vector<int32_t> ids;
    if (!ParseIds(s, "stop-token-id", &ids, &error)) return UsageError(error);
    for (int32_t id : ids) request.add_stop_token_ids(id);
  }
  if (args.Has("speculation")) {
    const std::string s = args.Get("speculation");
    if (s == "auto") {
      request.set_speculation(v1::SPECULATION_AUTO);
    } else if (s == "off") {
      request.set_speculation(v1::SPECULATION_OFF);
    } else if (s == "draft_model" || s == "draft-model") {
      request.set_speculation(v1::SPECULATION_DRAFT_MODEL);
    } else if (s == "ngram") {
      request.set_speculation(v1::SPECULATION_NGRAM);
    } else {
      return UsageError("--speculation: one of auto, off, draft_model, ngram");
    }
  }
  const bool as_json = args.Has("json");

  auto stub = Connect(args);
  grpc::ClientContext ctx;
  SetTimeout(timeout_ms, &ctx);
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(&ctx, request);
  v1::GenerateResponse chunk;
  v1::GenerateResponse last;
  double ttft = -1;
  bool got_last = false;
  bool streamed_text = false;
  while (reader->Read(&chunk)) {
    const double now =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (ttft < 0 && chunk.token_ids_size() > 0) ttft = now;
    if (as_json) {
      if (chunk.token_ids_size() > 0 || !chunk.text().empty()) {
        json line = {
            {"token_ids", std::vector<int32_t>(chunk.token_ids().begin(), chunk.token_ids().end())},
            {"text", chunk.text()}};
        std::printf("%s\n", Dump(line).c_str());
      }
    } else {
      std::fwrite(chunk.text().data(), 1, chunk.text().size(), stdout);
      streamed_text = streamed_text || !chunk.text().empty();
    }
    std::fflush(stdout);
    if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      last = chunk;
      got_last = true;
    }
  }
  const grpc::Status status = reader->Finish();
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!status.ok()) {
    if (!as_json && streamed_text) std::printf("\n");
    return RpcFailed(status);
  }
  if (!got_last) {
    return RpcFailed(
        grpc::Status(grpc::StatusCode::INTERNAL, "the stream ended without a finish reason"));
  }
  const v1::SpeculationStats& spec = last.speculation();
  const double acceptance = spec.draft_tokens() > 0
                                ? static_cast<double>(spec.accepted_tokens()) / spec.draft_tokens()
                                : 0.0;
  // Tokens per speculative step, bonus included (docs/metrics.md).
  const double mean_accepted_length =
      spec.steps() > 0 ? 1.0 + static_cast<double>(spec.accepted_tokens()) / spec.steps() : 0.0;
  const uint32_t completion = last.usage().completion_tokens();
  const double tokens_per_second = elapsed > 0 ? completion / elapsed : 0.0;
  if (as_json) {
    json summary = {
        {"finish_reason", FinishReasonName(last.finish_reason())},
        {"usage",
         {{"prompt_tokens", last.usage().prompt_tokens()}, {"completion_tokens", completion}}},
        {"speculation",
         {{"mode", SpeculationName(spec.mode())},
          {"steps", spec.steps()},
          {"draft_tokens", spec.draft_tokens()},
          {"accepted_tokens", spec.accepted_tokens()},
          {"accepted_per_position", std::vector<uint64_t>(spec.accepted_per_position().begin(),
                                                          spec.accepted_per_position().end())},
          {"target_only_steps", spec.target_only_steps()},
          {"acceptance_rate", acceptance},
          {"mean_accepted_length", mean_accepted_length}}},
        {"elapsed_seconds", elapsed},
        {"time_to_first_token_seconds", ttft < 0 ? json(nullptr) : json(ttft)},
        {"tokens_per_second", tokens_per_second}};
    if (last.finish_reason() == v1::FINISH_REASON_STOP_STRING) {
      summary["matched_stop"] = last.matched_stop();
    }
    std::printf("%s\n", Dump(summary).c_str());
  } else {
    std::printf("\n");
    std::fflush(stdout);
    std::fprintf(stderr,
                 "[finish: %s, %u prompt + %u completion tokens, %.2f s, %.1f tokens/s; "
                 "speculation %s: %llu steps, acceptance %.2f, mean accepted length %.2f]\n",
                 FinishReasonName(last.finish_reason()), last.usage().prompt_tokens(), completion,
                 elapsed, tokens_per_second, SpeculationName(spec.mode()),
                 static_cast<unsigned long long>(spec.steps()), acceptance, mean_accepted_length);
  }
  return 0;
}

int Tokenize(const Args& args) {
  if (!args.Has("text")) return UsageError("tokenize needs --text");
  auto stub = Connect(args);
  grpc::ClientContext ctx;
  v1::TokenizeRequest request;
  request.set_text(args.Get("text"));
  request.set_add_special_tokens(args.Has("add-special-tokens"));
  v1::TokenizeResponse response;
  const grpc::Status status = stub->Tokenize(&ctx, request, &response);
  if (!status.ok()) return RpcFailed(status);
  std::printf(
      "%s\n",
      Dump(json(std::vector<int32_t>(response.ids().begin(), response.ids().end()))).c_str());
  return 0;
}

int Detokenize(const Args& args) {
  std::string error;
  std::vector<int32_t> ids;
  if (!args.Has("ids")) return UsageError("detokenize needs --ids");
  if (!ParseIds(args.Get("ids"), "ids", &ids, &error)) return UsageError(error);
  auto stub = Connect(args);
  grpc::ClientContext ctx;
  v1::DetokenizeRequest request;
  request.mutable_ids()->Assign(ids.begin(), ids.end());
  request.set_skip_special_tokens(args.Has("skip-special-tokens"));
  v1::DetokenizeResponse response;
  const grpc::Status status = stub->Detokenize(&ctx, request, &response);
  if (!status.ok()) return RpcFailed(status);
  std::printf("%s\n", response.text().c_str());
  return 0;
}

int Info(const Args& args) {
  auto stub = Connect(args);
  grpc::ClientContext ctx;
  v1::ModelInfo info;
  const grpc::Status status = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (!status.ok()) return RpcFailed(status);
  json j = {{"target_model", info.target_model()},
            {"draft_model", info.draft_model()},
            {"vocab_size", info.vocab_size()},
            {"max_context", info.max_context()},
            {"eos_token_ids",
             std::vector<int32_t>(info.eos_token_ids().begin(), info.eos_token_ids().end())},
            {"max_new_tokens_limit", info.max_new_tokens_limit()},
            {"draft_available", info.draft_available()}};
  std::printf("%s\n", Dump(j).c_str());
  return 0;
}

int Main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? kUsageError : 0;
  }
  const std::string command = argv[1];
  Args args;
  std::string error;
  if (!args.Parse(argc, argv, 2, &error)) return UsageError(error);
  if (!args.Has("server")) return UsageError("--server HOST:PORT is required");
  if (command == "generate") return Generate(args);
  if (command == "tokenize") return Tokenize(args);
  if (command == "detokenize") return Detokenize(args);
  if (command == "info") return Info(args);
  return UsageError(absl::StrCat("unknown command '", command, "'"));
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) { return specd::Main(argc, argv); }
