// The OpenAI <-> specd.v1.Generation translation of specd-http: request parsing and its
// errors, error mapping, response and chunk shapes. Chat templates: http_chat_test.cc.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/http/chat_template.h"
#include "services/http/openai_protocol.h"

namespace specd {
namespace {

using nlohmann::json;

// A ChatML template, as Qwen's and many fine-tunes' templates render a plain conversation.
const ChatTemplate* ChatMl() {
  static const ChatTemplate* t = new ChatTemplate(*ChatTemplate::FromSource(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
      nlohmann::ordered_json::object(), "chatml"));
  return t;
}

ProtocolOptions Options(const ChatTemplate* chat_template = ChatMl()) {
  ProtocolOptions o;
  o.model_name = "target";
  o.model_aliases = {"/models/target"};
  o.chat_template = chat_template;
  return o;
}

// The API error a body gets, or a failure when it parses.
ApiError ErrorFor(Endpoint endpoint, const std::string& body,
                  const ProtocolOptions& options = Options()) {
  absl::StatusOr<ParsedRequest> r = ParseRequest(endpoint, body, options);
  EXPECT_FALSE(r.ok()) << body;
  if (r.ok()) return ApiError();
  return ToApiError(r.status(), endpoint);
}

TEST(HttpProtocolTest, CompletionFieldsMapToGenerateRequest) {
  absl::StatusOr<ParsedRequest> r =
      ParseRequest(Endpoint::kCompletions,
                   R"({"model": "target", "prompt": "def f(", "max_tokens": 40, "temperature": 0.5,
          "top_p": 0.9, "top_k": 7, "seed": 18446744073709551615, "stop": ["\n\n", "END"],
          "stop_token_ids": [3, 4], "ignore_eos": true, "n": 1, "user": "u",
          "specd": {"speculation": "ngram", "draft_depth": 3, "draft_top_k": 2,
                    "draft_max_nodes": 9}})",
                   Options());
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& g = r->generate;
  EXPECT_EQ(g.prompt(), "def f(");
  EXPECT_EQ(g.max_new_tokens(), 40u);
  EXPECT_FLOAT_EQ(g.temperature(), 0.5f);
  EXPECT_FLOAT_EQ(g.top_p(), 0.9f);
  EXPECT_EQ(g.top_k(), 7);
  EXPECT_EQ(g.seed(), 18446744073709551615ull);
  ASSERT_EQ(g.stop_size(), 2);
  EXPECT_EQ(g.stop(0), "\n\n");
  EXPECT_EQ(g.stop(1), "END");
  ASSERT_EQ(g.stop_token_ids_size(), 2);
  EXPECT_EQ(g.stop_token_ids(1), 4);
  EXPECT_TRUE(g.ignore_eos());
  EXPECT_EQ(g.speculation(), v1::SPECULATION_NGRAM);
  EXPECT_EQ(g.draft_depth(), 3u);
  EXPECT_EQ(g.draft_top_k(), 2u);
  EXPECT_EQ(g.draft_max_nodes(), 9u);
  EXPECT_FALSE(r->stream);
}

TEST(HttpProtocolTest, SpecdSpeculationNamesEagle3) {
  absl::StatusOr<ParsedRequest> r = ParseRequest(
      Endpoint::kCompletions,
      R"({"model": "target", "prompt": "x", "specd": {"speculation": "eagle3"}})", Options());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->generate.speculation(), v1::SPECULATION_EAGLE3);
}

TEST(HttpProtocolTest, UnsetSamplingFieldsStayUnset) {
  absl::StatusOr<ParsedRequest> r = ParseRequest(
      Endpoint::kCompletions, R"({"prompt": "x", "temperature": null, "top_k": -1})", Options());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->generate.has_temperature());
  EXPECT_FALSE(r->generate.has_top_p());
  EXPECT_FALSE(r->generate.has_top_k());  // -1: no limit (vLLM's spelling)
  EXPECT_FALSE(r->generate.has_seed());
  EXPECT_EQ(r->generate.max_new_tokens(), 16u);  // OpenAI's default for completions
  EXPECT_EQ(r->generate.speculation(), v1::SPECULATION_AUTO);
}

TEST(HttpProtocolTest, PromptForms) {
  absl::StatusOr<ParsedRequest> ids =
      ParseRequest(Endpoint::kCompletions, R"({"prompt": [5, 6, 7]})", Options());
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_TRUE(ids->generate.has_prompt_ids());
  EXPECT_EQ(ids->generate.prompt_ids().ids_size(), 3);
  EXPECT_EQ(ids->generate.prompt_ids().ids(2), 7);

  absl::StatusOr<ParsedRequest> one =
      ParseRequest(Endpoint::kCompletions, R"({"prompt": ["abc"]})", Options());
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->generate.prompt(), "abc");

  absl::StatusOr<ParsedRequest> one_ids =
      ParseRequest(Endpoint::kCompletions, R"({"prompt": [[1, 2]]})", Options());
  ASSERT_TRUE(one_ids.ok()) << one_ids.status();
  EXPECT_EQ(one_ids->generate.prompt_ids().ids_size(), 2);

  ApiError batch = ErrorFor(Endpoint::kCompletions, R"({"prompt": ["a", "b"]})");
  EXPECT_EQ(batch.http_status, 400);
  EXPECT_EQ(batch.param, "prompt");
  EXPECT_NE(batch.message.find("one request per prompt"), std::string::npos);

  EXPECT_EQ(ErrorFor(Endpoint::kCompletions, R"({"max_tokens": 3})").param, "prompt");
  EXPECT_EQ(ErrorFor(Endpoint::kCompletions, R"({"prompt": 3})").param, "prompt");
  EXPECT_EQ(ErrorFor(Endpoint::kCompletions, R"({"prompt": []})").param, "prompt");
  EXPECT_EQ(ErrorFor(Endpoint::kCompletions, R"({"prompt": [1, 99999999999]})").param, "prompt");
}

TEST(HttpProtocolTest, BadFieldsNameTheParam) {
  struct Case {
    const char* body;
    const char* param;
  };
  for (const Case& c : {
           Case{R"({"prompt": "x", "n": 0})", "n"},
           Case{R"({"prompt": "x", "n": "1"})", "n"},
           Case{R"({"prompt": "x", "best_of": 3})", "best_of"},
           Case{R"({"prompt": "x", "n": 2, "best_of": 3})", "best_of"},
           Case{R"({"prompt": "x", "logprobs": 21})", "logprobs"},
           Case{R"({"prompt": "x", "logprobs": true})", "logprobs"},
           Case{R"({"prompt": "x", "guided_json": {}})", "guided_json"},
           Case{R"({"prompt": "x", "guided_choice": ["a"]})", "guided_choice"},
           Case{R"({"prompt": "x", "frobnicate": 1})", "frobnicate"},
           Case{R"({"prompt": "x", "min_tokens": -1})", "min_tokens"},
           Case{R"({"prompt": "x", "min_p": "low"})", "min_p"},
           Case{R"({"prompt": "x", "echo": true})", "echo"},
           Case{R"({"prompt": "x", "suffix": "y"})", "suffix"},
           Case{R"({"prompt": "x", "presence_penalty": "lots"})", "presence_penalty"},
           Case{R"({"prompt": "x", "logit_bias": {"a": 1}})", "logit_bias[a]"},
           Case{R"({"prompt": "x", "logit_bias": {"5": "up"}})", "logit_bias[5]"},
           Case{R"({"prompt": "x", "logit_bias": [1]})", "logit_bias"},
           Case{R"({"prompt": "x", "temperature": "hot"})", "temperature"},
           Case{R"({"prompt": "x", "top_p": [1]})", "top_p"},
           Case{R"({"prompt": "x", "top_k": 1.5})", "top_k"},
           Case{R"({"prompt": "x", "seed": -4})", "seed"},
           Case{R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
           Case{R"({"prompt": "x", "max_tokens": 16.0})", "max_tokens"},
           Case{R"({"prompt": "x", "stop": 5})", "stop"},
           Case{R"({"prompt": "x", "stop": ["a", 5]})", "stop"},
           Case{R"({"prompt": "x", "stream": "yes"})", "stream"},
           Case{R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options"},
           Case{R"({"prompt": "x", "speculation": "fast"})", "speculation"},
           Case{R"({"prompt": "x", "specd": {"speculation": "fast"}})", "specd.speculation"},
           Case{R"({"prompt": "x", "specd": {"draft_depht": 3}})", "specd.draft_depht"},
           Case{R"({"prompt": "x", "specd": {"draft_depth": -1}})", "specd.draft_depth"},
           Case{R"({"prompt": "x", "specd": 3})", "specd"},
           Case{R"({"prompt": "x", "ignore_eos": 1})", "ignore_eos"},
       }) {
    const ApiError e = ErrorFor(Endpoint::kCompletions, c.body);
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.message;
    EXPECT_EQ(e.code, "invalid_argument") << c.body;
  }
}

TEST(HttpProtocolTest, InvalidJsonIsA400WithoutParam) {
  // 1e99999 overflows a double: nlohmann throws out_of_range, not parse_error, which used to
  // escape ParseRequest (found by tests/fuzz/http_json_fuzzer).
  for (const char* body : {"{\"prompt\": \"x\"", "", "nonsense", "{\"prompt\": \"\xff\"}",
                           "{\"prompt\": [1e99999]}", "74777e3333333333"}) {
    const ApiError e = ErrorFor(Endpoint::kCompletions, body);
    EXPECT_EQ(e.http_status, 400) << body;
    EXPECT_FALSE(e.param.has_value()) << body;
    EXPECT_NE(e.message.find("invalid JSON"), std::string::npos) << e.message;
  }
  const ApiError array = ErrorFor(Endpoint::kCompletions, "[1, 2]");
  EXPECT_EQ(array.http_status, 400);
  EXPECT_NE(array.message.find("JSON object"), std::string::npos) << array.message;
}

TEST(HttpProtocolTest, ModelMustBeTheServedOne) {
  for (const char* ok :
       {R"({"prompt": "x", "model": "target"})", R"({"prompt": "x", "model": "/models/target"})",
        R"({"prompt": "x", "model": ""})"}) {
    EXPECT_TRUE(ParseRequest(Endpoint::kCompletions, ok, Options()).ok()) << ok;
  }
  const ApiError e = ErrorFor(Endpoint::kCompletions, R"({"prompt": "x", "model": "gpt-4"})");
  EXPECT_EQ(e.http_status, 404);
  EXPECT_EQ(e.param, "model");
  EXPECT_EQ(e.code, "model_not_found");
  EXPECT_NE(e.message.find("'target'"), std::string::npos) << e.message;
}

TEST(HttpProtocolTest, StreamOptions) {
  absl::StatusOr<ParsedRequest> r = ParseRequest(
      Endpoint::kCompletions,
      R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}})", Options());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);

  // Nothing in stream_options is dropped silently: vLLM's continuous_usage_stats only at its
  // neutral false, any other key a 400 naming it.
  absl::StatusOr<ParsedRequest> neutral =
      ParseRequest(Endpoint::kChatCompletions,
                   R"({"messages": [{"role": "user", "content": "a"}], "stream": true,
          "stream_options": {"include_usage": false, "continuous_usage_stats": false}})",
                   Options());
  ASSERT_TRUE(neutral.ok()) << neutral.status();
  EXPECT_FALSE(neutral->include_usage);
  const struct {
    const char* options;
    const char* param;
  } cases[] = {{R"({"continuous_usage_stats": true})", "stream_options.continuous_usage_stats"},
               {R"({"include_usage": true, "include_obfuscation": false})",
                "stream_options.include_obfuscation"}};
  for (const auto& c : cases) {
    const std::string tail = std::string(R"("stream": true, "stream_options": )") + c.options + "}";
    EXPECT_EQ(ErrorFor(Endpoint::kCompletions, R"({"prompt": "x", )" + tail).param, c.param);
    EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                       R"({"messages": [{"role": "user", "content": "a"}], )" + tail)
                  .param,
              c.param);
  }
}

// docs/http.md's tables of request parameters name every field either endpoint reads (in
// backquotes, or its keys as `field.key`, on a table row), so no field the edge accepts goes
// undocumented. Tests run from the repository root.
TEST(HttpProtocolTest, DocsListEveryRequestField) {
  std::ifstream in("docs/http.md");
  ASSERT_TRUE(in.good()) << "docs/http.md from " << std::filesystem::current_path();
  std::stringstream text;
  text << in.rdbuf();
  std::string rows;
  std::istringstream lines(text.str());
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| `", 0) == 0) rows += line + "\n";
  }
  for (Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    const std::vector<std::string> fields = RequestFields(endpoint);
    EXPECT_GE(fields.size(), 25u);
    for (const std::string& field : fields) {
      // A nested field's keys count (`stream_options.include_usage`).
      EXPECT_TRUE(rows.find("`" + field + "`") != std::string::npos ||
                  rows.find("`" + field + ".") != std::string::npos)
          << field << " has no row in docs/http.md's parameter tables";
    }
  }
}

TEST(HttpProtocolTest, ChatRequest) {
  absl::StatusOr<ParsedRequest> r =
      ParseRequest(Endpoint::kChatCompletions,
                   R"({"messages": [{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                    {"type": "text", "text": "there"}]}],
          "max_completion_tokens": 9, "max_tokens": 100, "logprobs": false})",
                   Options());
  ASSERT_TRUE(r.ok()) << r.status();
  // The template's text, tokenized by the router without special tokens (vLLM's default).
  EXPECT_EQ(r->generate.prompt(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_TRUE(r->tokenize_prompt);
  EXPECT_FALSE(r->add_special_tokens);
  EXPECT_EQ(r->generate.max_new_tokens(), 9u);

  absl::StatusOr<ParsedRequest> d =
      ParseRequest(Endpoint::kChatCompletions,
                   R"({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": true,
          "add_generation_prompt": false})",
                   Options());
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->generate.max_new_tokens(), 0u);  // the router's default
  EXPECT_TRUE(d->add_special_tokens);
  EXPECT_EQ(d->generate.prompt(), "<|im_start|>user\na<|im_end|>\n");

  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions, R"({"prompt": "x"})").param, "messages");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions, R"({"messages": []})").param, "messages");
  EXPECT_EQ(
      ErrorFor(Endpoint::kChatCompletions, R"({"messages": [{"role": "robot", "content": "a"}]})")
          .param,
      "messages[0].role");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]})")
                .param,
            "messages[1].content");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user",
                                       "content": [{"type": "image_url", "image_url": {}}]}]})")
                .param,
            "messages[0].content[0].type");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})")
                .param,
            "top_logprobs");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true,
                         "top_logprobs": 21})")
                .param,
            "top_logprobs");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user", "content": "a"}],
                         "response_format": {"type": "json_object"}})")
                .param,
            "response_format");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user", "content": "a"}],
                         "tools": [{"type": "function"}]})")
                .param,
            "tools");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user", "content": "a"}], "echo": true})")
                .param,
            "echo");
  EXPECT_EQ(ErrorFor(Endpoint::kChatCompletions,
                     R"({"messages": [{"role": "user", "content": "a"}],
                         "add_special_tokens": "yes"})")
                .param,
            "add_special_tokens");

  // No template: a 400 that says so, with no field at fault.
  const ApiError none =
      ErrorFor(Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "a"}]})",
               Options(/*chat_template=*/nullptr));
  EXPECT_EQ(none.http_status, 400);
  EXPECT_FALSE(none.param.has_value());
  EXPECT_NE(none.message.find("no chat template"), std::string::npos) << none.message;
  // Completions do not need one.
  EXPECT_TRUE(ParseRequest(Endpoint::kCompletions, R"({"prompt": "x"})", Options(nullptr)).ok());
}

TEST(HttpProtocolTest, RouterErrorsMapToHttp) {
  struct Case {
    absl::Status status;
    Endpoint endpoint;
    int http;
    std::optional<std::string> param;
  };
  const Endpoint kC = Endpoint::kCompletions;
  const Endpoint kChat = Endpoint::kChatCompletions;
  for (const Case& c : {
           Case{absl::InvalidArgumentError("temperature: must be a finite number >= 0, got -1"), kC,
                400, "temperature"},
           Case{absl::InvalidArgumentError("max_new_tokens: 9000 exceeds the limit 4096"), kC, 400,
                "max_tokens"},
           Case{absl::InvalidArgumentError("prompt_ids.ids[2]: token id 999 is outside"), kC, 400,
                "prompt"},
           Case{absl::InvalidArgumentError("prompt: the prompt is 5000 tokens"), kChat, 400,
                "messages"},
           Case{absl::InvalidArgumentError("stop[1]: must not be empty"), kC, 400, "stop"},
           Case{absl::InvalidArgumentError("draft_max_nodes: 300 exceeds 256"), kC, 400,
                "specd.draft_max_nodes"},
           Case{absl::InvalidArgumentError("something without a field"), kC, 400, std::nullopt},
           Case{absl::ResourceExhaustedError("queue: 256 requests are waiting"), kC, 429,
                std::nullopt},
           Case{absl::UnavailableError("failed to connect to all addresses"), kC, 503,
                std::nullopt},
           Case{absl::DeadlineExceededError("Deadline Exceeded"), kC, 504, std::nullopt},
           Case{absl::CancelledError("router shutting down"), kC, 503, std::nullopt},
           Case{absl::InternalError("boom: x"), kC, 500, std::nullopt},
       }) {
    const ApiError e = ToApiError(c.status, c.endpoint);
    EXPECT_EQ(e.http_status, c.http) << c.status;
    EXPECT_EQ(e.param, c.param) << c.status;
    EXPECT_EQ(e.message, c.status.message());
  }
  const json j = ErrorJson(ToApiError(absl::ResourceExhaustedError("full"), kC));
  EXPECT_EQ(j["error"]["type"], "rate_limit_error");
  EXPECT_EQ(j["error"]["code"], "resource_exhausted");
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_EQ(j["error"]["message"], "full");
}

v1::GenerateResponse LastChunk() {
  v1::GenerateResponse last;
  last.set_finish_reason(v1::FINISH_REASON_STOP_STRING);
  last.set_matched_stop("\n");
  last.mutable_usage()->set_prompt_tokens(5);
  last.mutable_usage()->set_completion_tokens(7);
  v1::SpeculationStats* s = last.mutable_speculation();
  s->set_steps(4);
  s->set_draft_tokens(16);
  s->set_accepted_tokens(6);
  s->add_accepted_per_position(3);
  s->add_accepted_per_position(2);
  s->set_mode(v1::SPECULATION_DRAFT_MODEL);
  return last;
}

TEST(HttpProtocolTest, CompletionResponse) {
  Completion c;
  c.text = "hello";
  c.token_ids = {1, 2, 3};
  c.last = LastChunk();
  const ResponseIdentity id{"cmpl-1", 1700000000, "target"};
  const json r = CompletionResponseJson(Endpoint::kCompletions, id, c);
  EXPECT_EQ(r["object"], "text_completion");
  EXPECT_EQ(r["id"], "cmpl-1");
  EXPECT_EQ(r["created"], 1700000000);
  EXPECT_EQ(r["model"], "target");
  EXPECT_EQ(r["choices"][0]["text"], "hello");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(r["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(r["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(r["usage"]["completion_tokens"], 7);
  EXPECT_EQ(r["usage"]["total_tokens"], 12);
  EXPECT_EQ(r["specd"]["token_ids"], json::array({1, 2, 3}));
  EXPECT_EQ(r["specd"]["finish_detail"], "stop_string");
  EXPECT_EQ(r["specd"]["matched_stop"], "\n");
  EXPECT_EQ(r["specd"]["speculation"]["mode"], "draft_model");
  EXPECT_DOUBLE_EQ(r["specd"]["speculation"]["acceptance_rate"].get<double>(), 6.0 / 16.0);
  EXPECT_DOUBLE_EQ(r["specd"]["speculation"]["mean_accepted_length"].get<double>(),
                   1.0 + 6.0 / 4.0);
  EXPECT_EQ(r["specd"]["speculation"]["accepted_per_position"], json::array({3, 2}));

  const json chat = CompletionResponseJson(Endpoint::kChatCompletions, id, c);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "hello");
}

TEST(HttpProtocolTest, FinishReasons) {
  EXPECT_STREQ(OpenAiFinishReason(v1::FINISH_REASON_LENGTH), "length");
  EXPECT_STREQ(OpenAiFinishReason(v1::FINISH_REASON_CONTEXT), "length");
  EXPECT_STREQ(OpenAiFinishReason(v1::FINISH_REASON_EOS), "stop");
  EXPECT_STREQ(OpenAiFinishReason(v1::FINISH_REASON_STOP_TOKEN), "stop");
  EXPECT_STREQ(OpenAiFinishReason(v1::FINISH_REASON_STOP_STRING), "stop");
  const json none = SpeculationJson(v1::SpeculationStats());
  EXPECT_TRUE(none["acceptance_rate"].is_null());
  EXPECT_TRUE(none["mean_accepted_length"].is_null());
}

TEST(HttpProtocolTest, StreamChunks) {
  const ResponseIdentity id{"chatcmpl-1", 1, "target"};
  const json first =
      StreamChunkJson(Endpoint::kChatCompletions, id, "He", {1}, /*role=*/true, nullptr, false);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}, {"content", "He"}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(first.contains("usage"));

  const v1::GenerateResponse last = LastChunk();
  const json end =
      StreamChunkJson(Endpoint::kChatCompletions, id, "", {}, /*role=*/false, &last, true);
  EXPECT_EQ(end["choices"][0]["delta"], json::object());
  EXPECT_EQ(end["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(end["usage"].is_null());
  EXPECT_EQ(end["specd"]["speculation"]["steps"], 4);

  const json text =
      StreamChunkJson(Endpoint::kCompletions, id, "x", {9}, /*role=*/false, nullptr, false);
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "x");
  EXPECT_EQ(text["specd"]["token_ids"], json::array({9}));

  const json usage = UsageChunkJson(Endpoint::kCompletions, id, last.usage());
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"]["total_tokens"], 12);

  EXPECT_EQ(SseEvent(json({{"a", "x\ny"}})), "data: {\"a\":\"x\\ny\"}\n\n");
  EXPECT_EQ(kSseDone, "data: [DONE]\n\n");
  // Invalid UTF-8 is replaced, not thrown on.
  EXPECT_EQ(DumpJson(json("a\xff")), "\"a\xEF\xBF\xBD\"");
}

TEST(HttpProtocolTest, SamplingFieldsLogprobsAndNMapToGenerateRequest) {
  absl::StatusOr<ParsedRequest> r =
      ParseRequest(Endpoint::kCompletions,
                   R"({"prompt": "x", "min_p": 0.1, "min_tokens": 5, "repetition_penalty": 1.2,
          "presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"7": -100, "9": 2.5},
          "logprobs": 3, "n": 4, "best_of": 4, "specd": {"logprobs_mode": "processed_logprobs"}})",
                   Options());
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& g = r->generate;
  EXPECT_FLOAT_EQ(g.min_p(), 0.1f);
  EXPECT_EQ(g.min_tokens(), 5u);
  ASSERT_TRUE(g.has_repetition_penalty());
  EXPECT_FLOAT_EQ(g.repetition_penalty(), 1.2f);
  EXPECT_FLOAT_EQ(g.presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(g.frequency_penalty(), -0.25f);
  ASSERT_EQ(g.logit_bias_size(), 2);
  EXPECT_FLOAT_EQ(g.logit_bias().at(7), -100.0f);
  EXPECT_FLOAT_EQ(g.logit_bias().at(9), 2.5f);
  ASSERT_TRUE(g.has_logprobs());
  EXPECT_EQ(g.logprobs(), 3u);
  EXPECT_EQ(r->logprobs, 3);
  EXPECT_EQ(g.logprobs_source(), v1::LOGPROBS_SOURCE_PROCESSED);
  EXPECT_EQ(g.n(), 4u);
  EXPECT_EQ(r->n, 4u);

  // Chat: logprobs: true alone is the chosen token's only; top_logprobs adds alternatives.
  absl::StatusOr<ParsedRequest> chat = ParseRequest(
      Endpoint::kChatCompletions,
      R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true})", Options());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->logprobs, 0);
  EXPECT_EQ(chat->generate.logprobs(), 0u);
  chat = ParseRequest(Endpoint::kChatCompletions,
                      R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true,
                          "top_logprobs": 2})",
                      Options());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->generate.logprobs(), 2u);
  // Not asked: nothing is computed.
  chat = ParseRequest(Endpoint::kChatCompletions,
                      R"({"messages": [{"role": "user", "content": "a"}], "logprobs": false})",
                      Options());
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->logprobs, -1);
  EXPECT_FALSE(chat->generate.has_logprobs());
}

TEST(HttpProtocolTest, LogprobsInOpenAiShapes) {
  std::vector<v1::TokenLogprob> lps(2);
  lps[0].set_token_id(5);
  lps[0].set_token("He");
  lps[0].set_logprob(-0.5f);
  lps[0].set_rank(2);
  v1::TopLogprob* t = lps[0].add_top_logprobs();
  t->set_token_id(6);
  t->set_token("Ha");
  t->set_logprob(-0.25f);
  t = lps[0].add_top_logprobs();
  t->set_token_id(5);
  t->set_token("He");
  t->set_logprob(-0.5f);
  lps[1].set_token_id(7);
  lps[1].set_token("\xC3\xA9");
  lps[1].set_logprob(-1.0f);
  lps[1].set_rank(1);

  size_t offset = 3;
  const json completions = LogprobsJson(Endpoint::kCompletions, 1, lps, &offset);
  EXPECT_EQ(completions["tokens"], json({"He", "\xC3\xA9"}));
  EXPECT_EQ(completions["token_logprobs"], json({-0.5, -1.0}));
  EXPECT_EQ(completions["text_offset"], json({3, 5}));
  EXPECT_EQ(offset, 7u);
  // The top 1 and the chosen token.
  EXPECT_EQ(completions["top_logprobs"][0], json({{"Ha", -0.25}, {"He", -0.5}}));
  EXPECT_EQ(completions["top_logprobs"][1], json({{"\xC3\xA9", -1.0}}));

  offset = 0;
  const json chat = LogprobsJson(Endpoint::kChatCompletions, 2, lps, &offset);
  ASSERT_EQ(chat["content"].size(), 2u);
  EXPECT_EQ(chat["content"][0]["token"], "He");
  EXPECT_EQ(chat["content"][0]["logprob"], -0.5);
  EXPECT_EQ(chat["content"][0]["bytes"], json({72, 101}));
  ASSERT_EQ(chat["content"][0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(chat["content"][0]["top_logprobs"][0]["token"], "Ha");
  EXPECT_EQ(chat["content"][1]["bytes"], json({0xC3, 0xA9}));
  EXPECT_TRUE(chat["content"][1]["top_logprobs"].empty());

  // n choices: indexed, usage counts the prompt once.
  std::vector<Completion> choices(2);
  for (int i = 0; i < 2; ++i) {
    choices[i].text = i == 0 ? "He" : "Ha";
    choices[i].logprobs = {lps[0]};
    choices[i].last.set_finish_reason(v1::FINISH_REASON_LENGTH);
    choices[i].last.mutable_usage()->set_prompt_tokens(4);
    choices[i].last.mutable_usage()->set_completion_tokens(1);
  }
  ResponseIdentity id{"cmpl-1", 1, "m"};
  const json r = CompletionResponseJson(Endpoint::kCompletions, id, choices, 0);
  ASSERT_EQ(r["choices"].size(), 2u);
  EXPECT_EQ(r["choices"][1]["index"], 1);
  EXPECT_EQ(r["choices"][1]["text"], "Ha");
  EXPECT_EQ(r["choices"][1]["logprobs"]["tokens"], json({"He"}));
  EXPECT_EQ(r["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(r["usage"]["completion_tokens"], 2);
  EXPECT_TRUE(r["choices"][0].contains("specd"));
}

}  // namespace
}  // namespace specd
