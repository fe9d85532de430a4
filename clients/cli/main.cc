// specd-cli: a command-line client of specd-router's Generation API.
//
//   specd-cli generate --server HOST:PORT --prompt TEXT [--max-new-tokens N] [--temperature T]
//       [--top-p P] [--top-k K] [--seed S] [--speculation auto|off|draft_model|ngram|eagle3]
//       [--stop STR]... [--stop-token-id ID]... [--prompt-ids 1,2,3] [--ignore-eos]
//       [--draft-depth N] [--draft-top-k N] [--draft-max-nodes N] [--timeout-ms MS] [--json]
//       [--min-p P] [--min-tokens N] [--logit-bias ID=BIAS]... [--repetition-penalty R]
//       [--presence-penalty P] [--frequency-penalty F] [--logprobs N] [--processed-logprobs]
//   specd-cli tokenize --server HOST:PORT --text TEXT [--add-special-tokens]
//   specd-cli detokenize --server HOST:PORT --ids 1,2,3 [--skip-special-tokens]
//   specd-cli info --server HOST:PORT
// Every command also takes the connection flags --tls (TLS with gRPC's default roots),
// --tls-ca FILE, --tls-cert FILE --tls-key FILE (mutual TLS), --tls-server-name NAME and
// --token-file FILE (sent as "authorization: Bearer <token>").
//
// It is a thin shell over the C++ SDK (clients/cpp, specd::Client): calls that fail with
// UNAVAILABLE or RESOURCE_EXHAUSTED before any output are retried with backoff.
//
// generate streams the completion to stdout as it arrives. With --json it prints one JSON
// object per streamed chunk ({"token_ids": [...], "text": "...", and with --logprobs N
// "logprobs": [{"token_id", "token", "logprob", "rank", "top": [{"token_id", "token",
// "logprob"}]}]}) and a last line with the
// finish reason, usage, speculation stats and timings. Errors go to stderr as
// "error: CODE_NAME: message" with a non-zero exit status.
//
// Flags are parsed here rather than with absl flags so that they can be spelled with dashes
// and repeated (--stop), as users of other serving CLIs expect.
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "specd/client.h"

namespace specd {
namespace {

using nlohmann::json;

constexpr int kUsageError = 2;
constexpr int kRpcError = 1;

const char* kUsage =
    "usage:\n"
    "  specd-cli generate --server HOST:PORT (--prompt TEXT | --prompt-ids 1,2,3)\n"
    "      [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]\n"
    "      [--speculation auto|off|draft_model|ngram|eagle3] [--stop STR]...\n"
    "      [--stop-token-id ID]...\n"
    "      [--ignore-eos] [--draft-depth N] [--draft-top-k N] [--draft-max-nodes N]\n"
    "      [--timeout-ms MS] [--request-id ID] [--json]\n"
    "  specd-cli tokenize --server HOST:PORT --text TEXT [--add-special-tokens]\n"
    "  specd-cli detokenize --server HOST:PORT --ids 1,2,3 [--skip-special-tokens]\n"
    "  specd-cli info --server HOST:PORT\n"
    "connection flags (every command): [--tls] [--tls-ca FILE] [--tls-cert FILE --tls-key FILE]\n"
    "      [--tls-server-name NAME] [--token-file FILE]\n";

// The status code's name as gRPC and Abseil spell it (they share the numbering).
std::string CodeName(absl::StatusCode code) {
  const std::string name = absl::StatusCodeToString(code);
  return name.empty() ? "UNKNOWN" : name;
}

// As the CLI has always printed it: "stop" for a stop string (OpenAI's word), where the SDK
// says "stop_string".
const char* FinishReasonLabel(FinishReason reason) {
  return reason == FinishReason::kStopString ? "stop" : FinishReasonName(reason);
}

int RpcFailed(const absl::Status& status) {
  std::fflush(stdout);
  std::fprintf(stderr, "error: %s: %s\n", CodeName(status.code()).c_str(),
               std::string(status.message()).c_str());
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
        {"min-p", true},
        {"min-tokens", true},
        {"logit-bias", true},
        {"repetition-penalty", true},
        {"presence-penalty", true},
        {"frequency-penalty", true},
        {"logprobs", true},
        {"processed-logprobs", false},
        {"text", true},
        {"ids", true},
        {"add-special-tokens", false},
        {"skip-special-tokens", false},
        {"tls", false},
        {"tls-ca", true},
        {"tls-cert", true},
        {"tls-key", true},
        {"tls-server-name", true},
        {"token-file", true},
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

// The whole file, or a usage error naming `flag`.
bool ReadFlagFile(const Args& args, const std::string& flag, std::string* out, std::string* error) {
  if (!args.Has(flag)) return true;
  const std::string path = args.Get(flag);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = absl::StrCat("--", flag, ": cannot read ", path, ": ", std::strerror(errno));
    return false;
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  *out = contents.str();
  return true;
}

// A client of --server with the TLS and token flags; nullptr after printing a usage error.
std::unique_ptr<Client> Connect(const Args& args, int* exit_code) {
  ClientOptions options;
  options.target = args.Get("server");
  std::string error;
  if (args.Has("tls") || args.Has("tls-ca") || args.Has("tls-cert") || args.Has("tls-key") ||
      args.Has("tls-server-name")) {
    TlsOptions tls;
    if (!ReadFlagFile(args, "tls-ca", &tls.root_ca_pem, &error) ||
        !ReadFlagFile(args, "tls-cert", &tls.cert_chain_pem, &error) ||
        !ReadFlagFile(args, "tls-key", &tls.private_key_pem, &error)) {
      *exit_code = UsageError(error);
      return nullptr;
    }
    tls.server_name_override = args.Get("tls-server-name");
    options.tls = std::move(tls);
  }
  options.token_file = args.Get("token-file");
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) {
    // The options come from flags: name those.
    static const std::pair<const char*, const char*> kFlagOf[] = {
        {"target:", "--server:"},
        {"token_file:", "--token-file:"},
        {"tls.private_key_pem:", "--tls-key:"}};
    std::string message(client.status().message());
    for (const auto& [field, flag] : kFlagOf) {
      if (absl::StartsWith(message, field)) {
        message = absl::StrCat(flag, message.substr(std::strlen(field)));
      }
    }
    *exit_code = UsageError(message);
    return nullptr;
  }
  return *std::move(client);
}

CallOptions Call(int64_t timeout_ms) {
  CallOptions call;
  if (timeout_ms > 0) call.timeout = absl::Milliseconds(timeout_ms);
  return call;
}

int Generate(const Args& args) {
  std::string error;
  GenerateRequest request;
  if (args.Has("prompt") == args.Has("prompt-ids")) {
    return UsageError("give exactly one of --prompt and --prompt-ids");
  }
  if (args.Has("prompt")) {
    request.prompt = args.Get("prompt");
  } else {
    if (!ParseIds(args.Get("prompt-ids"), "prompt-ids", &request.prompt_ids, &error)) {
      return UsageError(error);
    }
  }
  float temperature = 0, top_p = 1;
  int32_t top_k = 0;
  uint64_t seed = 0;
  int64_t timeout_ms = 0;
  if (!ParseNumber(args, "max-new-tokens", &request.max_new_tokens, &error) ||
      !ParseNumber(args, "temperature", &temperature, &error) ||
      !ParseNumber(args, "top-p", &top_p, &error) || !ParseNumber(args, "top-k", &top_k, &error) ||
      !ParseNumber(args, "seed", &seed, &error) ||
      !ParseNumber(args, "draft-depth", &request.draft_depth, &error) ||
      !ParseNumber(args, "draft-top-k", &request.draft_top_k, &error) ||
      !ParseNumber(args, "draft-max-nodes", &request.draft_max_nodes, &error) ||
      !ParseNumber(args, "timeout-ms", &timeout_ms, &error) ||
      !ParseNumber(args, "min-p", &request.min_p, &error) ||
      !ParseNumber(args, "min-tokens", &request.min_tokens, &error) ||
      !ParseNumber(args, "presence-penalty", &request.presence_penalty, &error) ||
      !ParseNumber(args, "frequency-penalty", &request.frequency_penalty, &error)) {
    return UsageError(error);
  }
  if (args.Has("repetition-penalty")) {
    float r = 1;
    if (!ParseNumber(args, "repetition-penalty", &r, &error)) return UsageError(error);
    request.repetition_penalty = r;
  }
  if (args.Has("logprobs")) {
    uint32_t n = 0;
    if (!ParseNumber(args, "logprobs", &n, &error)) return UsageError(error);
    request.logprobs = n;
  }
  request.processed_logprobs = args.Has("processed-logprobs");
  for (const std::string& b : args.All("logit-bias")) {
    const size_t eq = b.find('=');
    int32_t id = 0;
    float bias = 0;
    if (eq == std::string::npos || !absl::SimpleAtoi(b.substr(0, eq), &id) ||
        !absl::SimpleAtof(b.substr(eq + 1), &bias)) {
      return UsageError(absl::StrCat("--logit-bias: expected ID=BIAS, got '", b, "'"));
    }
    request.logit_bias.emplace_back(id, bias);
  }
  // Only what the user gave is sent; the router validates the values and fills defaults.
  if (args.Has("temperature")) request.temperature = temperature;
  if (args.Has("top-p")) request.top_p = top_p;
  if (args.Has("top-k")) request.top_k = top_k;
  if (args.Has("seed")) request.seed = seed;
  request.ignore_eos = args.Has("ignore-eos");
  request.request_id = args.Get("request-id");
  request.stop = args.All("stop");
  for (const std::string& s : args.All("stop-token-id")) {
    if (!ParseIds(s, "stop-token-id", &request.stop_token_ids, &error)) return UsageError(error);
  }
  if (args.Has("speculation")) {
    const std::optional<Speculation> s = ParseSpeculation(args.Get("speculation"));
    if (!s.has_value()) {
      return UsageError("--speculation: one of auto, off, draft_model, ngram, eagle3");
    }
    request.speculation = *s;
  }
  const bool as_json = args.Has("json");

  int exit_code = 0;
  std::unique_ptr<Client> client = Connect(args, &exit_code);
  if (client == nullptr) return exit_code;
  const auto start = std::chrono::steady_clock::now();
  double ttft = -1;
  bool streamed_text = false;
  const absl::StatusOr<Completion> completion = client->Generate(
      request,
      [&](const Chunk& chunk) {
        const double now =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (ttft < 0 && !chunk.token_ids.empty()) ttft = now;
        if (as_json) {
          if (!chunk.token_ids.empty() || !chunk.text.empty()) {
            json line = {{"token_ids", chunk.token_ids}, {"text", chunk.text}};
            if (request.logprobs.has_value()) {
              json lps = json::array();
              for (const TokenLogprob& lp : chunk.logprobs) {
                json top = json::array();
                for (const TopLogprob& t : lp.top) {
                  top.push_back(
                      {{"token_id", t.token_id}, {"token", t.token}, {"logprob", t.logprob}});
                }
                lps.push_back({{"token_id", lp.token_id},
                               {"token", lp.token},
                               {"logprob", lp.logprob},
                               {"rank", lp.rank},
                               {"top", std::move(top)}});
              }
              line["logprobs"] = std::move(lps);
            }
            std::printf("%s\n", Dump(line).c_str());
          }
        } else {
          std::fwrite(chunk.text.data(), 1, chunk.text.size(), stdout);
          streamed_text = streamed_text || !chunk.text.empty();
        }
        std::fflush(stdout);
        return true;
      },
      Call(timeout_ms));
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!completion.ok()) {
    if (!as_json && streamed_text) std::printf("\n");
    return RpcFailed(completion.status());
  }
  const SpeculationStats& spec = completion->speculation;
  const double acceptance = spec.acceptance_rate().value_or(0.0);
  const double mean_accepted_length = spec.mean_accepted_length().value_or(0.0);
  const uint32_t completion_tokens = completion->usage.completion_tokens;
  const double tokens_per_second = elapsed > 0 ? completion_tokens / elapsed : 0.0;
  if (as_json) {
    json summary = {{"finish_reason", FinishReasonLabel(completion->finish_reason)},
                    {"usage",
                     {{"prompt_tokens", completion->usage.prompt_tokens},
                      {"completion_tokens", completion_tokens}}},
                    {"speculation",
                     {{"mode", SpeculationName(spec.mode)},
                      {"steps", spec.steps},
                      {"draft_tokens", spec.draft_tokens},
                      {"accepted_tokens", spec.accepted_tokens},
                      {"accepted_per_position", spec.accepted_per_position},
                      {"target_only_steps", spec.target_only_steps},
                      {"shape_changes", spec.shape_changes},
                      {"acceptance_rate", acceptance},
                      {"mean_accepted_length", mean_accepted_length}}},
                    {"elapsed_seconds", elapsed},
                    {"time_to_first_token_seconds", ttft < 0 ? json(nullptr) : json(ttft)},
                    {"tokens_per_second", tokens_per_second}};
    if (completion->finish_reason == FinishReason::kStopString) {
      summary["matched_stop"] = completion->matched_stop;
    }
    std::printf("%s\n", Dump(summary).c_str());
  } else {
    std::printf("\n");
    std::fflush(stdout);
    std::fprintf(stderr,
                 "[finish: %s, %u prompt + %u completion tokens, %.2f s, %.1f tokens/s; "
                 "speculation %s: %llu steps, acceptance %.2f, mean accepted length %.2f]\n",
                 FinishReasonLabel(completion->finish_reason), completion->usage.prompt_tokens,
                 completion_tokens, elapsed, tokens_per_second, SpeculationName(spec.mode),
                 static_cast<unsigned long long>(spec.steps), acceptance, mean_accepted_length);
  }
  return 0;
}

int Tokenize(const Args& args) {
  if (!args.Has("text")) return UsageError("tokenize needs --text");
  int exit_code = 0;
  std::unique_ptr<Client> client = Connect(args, &exit_code);
  if (client == nullptr) return exit_code;
  const absl::StatusOr<std::vector<int32_t>> ids =
      client->Tokenize(args.Get("text"), args.Has("add-special-tokens"));
  if (!ids.ok()) return RpcFailed(ids.status());
  std::printf("%s\n", Dump(json(*ids)).c_str());
  return 0;
}

int Detokenize(const Args& args) {
  std::string error;
  std::vector<int32_t> ids;
  if (!args.Has("ids")) return UsageError("detokenize needs --ids");
  if (!ParseIds(args.Get("ids"), "ids", &ids, &error)) return UsageError(error);
  int exit_code = 0;
  std::unique_ptr<Client> client = Connect(args, &exit_code);
  if (client == nullptr) return exit_code;
  const absl::StatusOr<std::string> text = client->Detokenize(ids, args.Has("skip-special-tokens"));
  if (!text.ok()) return RpcFailed(text.status());
  std::printf("%s\n", text->c_str());
  return 0;
}

int Info(const Args& args) {
  int exit_code = 0;
  std::unique_ptr<Client> client = Connect(args, &exit_code);
  if (client == nullptr) return exit_code;
  const absl::StatusOr<ModelInfo> info = client->GetModelInfo();
  if (!info.ok()) return RpcFailed(info.status());
  json j = {{"target_model", info->target_model},
            {"draft_model", info->draft_model},
            {"vocab_size", info->vocab_size},
            {"max_context", info->max_context},
            {"eos_token_ids", info->eos_token_ids},
            {"max_new_tokens_limit", info->max_new_tokens_limit},
            {"draft_available", info->draft_available},
            {"supports_logprobs", info->supports_logprobs},
            {"supports_logits_processors", info->supports_logits_processors},
            {"has_chat_template", info->has_chat_template},
            {"chat_template_source", info->chat_template_source}};
  json modes = json::array();
  for (Speculation mode : info->speculation_modes) modes.push_back(SpeculationName(mode));
  j["speculation_modes"] = std::move(modes);
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
