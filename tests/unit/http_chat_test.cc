// specd-http's chat templates (services/http/chat_template.h): where a model's template is found,
// how messages are normalized and rendered with it, continue_final_message; and the /tokenize,
// /detokenize, /v1/models/{id} translations (services/http/tokenize_protocol.h).
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/http/chat_template.h"
#include "services/http/tokenize_protocol.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ojson = nlohmann::ordered_json;

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

ChatTemplate::Request Messages(const std::string& json, bool add_generation_prompt = true) {
  absl::StatusOr<ojson> m = NormalizeMessages(ojson::parse(json));
  EXPECT_TRUE(m.ok()) << m.status();
  ChatTemplate::Request r;
  r.messages = m.ok() ? *m : ojson::array();
  r.add_generation_prompt = add_generation_prompt;
  return r;
}

TEST(HttpChatTest, LoadFindsTheTemplateAndTheSpecialTokens) {
  const std::string dir = MakeTempDir("http_chat_test");
  absl::StatusOr<std::optional<ChatTemplate>> none = ChatTemplate::Load(dir, "");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  EXPECT_FALSE(ChatTemplate::Load("", "")->has_value());

  // tokenizer_config.json's string, with special tokens as strings or {"content": ...}.
  WriteFile(dir + "/tokenizer_config.json",
            R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
                "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"})");
  absl::StatusOr<std::optional<ChatTemplate>> t = ChatTemplate::Load(dir, "");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(t->has_value());
  EXPECT_EQ((*t)->origin(), dir + "/tokenizer_config.json");
  EXPECT_EQ((*t)->source(), "tokenizer_config.json");
  EXPECT_EQ(*(*t)->Render(Messages(R"([{"role": "user", "content": "hi"}])")), "<s>[user]hi</s>");

  // The list of named templates: "default" is used; without one, loading fails.
  WriteFile(dir + "/tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D{{ messages | length }}"}]})");
  EXPECT_EQ(
      *(*ChatTemplate::Load(dir, ""))->Render(Messages(R"([{"role": "user", "content": "x"}])")),
      "D1");
  WriteFile(dir + "/tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  absl::StatusOr<std::optional<ChatTemplate>> no_default = ChatTemplate::Load(dir, "");
  ASSERT_FALSE(no_default.ok());
  EXPECT_NE(no_default.status().message().find("no template named \"default\" (it has tool_use)"),
            std::string::npos)
      << no_default.status();

  // chat_template.jinja beside the config wins over it, --chat_template over both.
  WriteFile(dir + "/tokenizer_config.json", R"({"eos_token": "E", "chat_template": "config"})");
  WriteFile(dir + "/chat_template.jinja", "jinja file {{ eos_token }}");
  t = ChatTemplate::Load(dir, "");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*(*t)->Render(Messages(R"([{"role": "user", "content": "x"}])")), "jinja file E");
  EXPECT_EQ((*t)->source(), "chat_template.jinja");
  WriteFile(dir + "/override.jinja", "override {{ eos_token }}");
  t = ChatTemplate::Load(dir, dir + "/override.jinja");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->origin(), dir + "/override.jinja");
  EXPECT_EQ((*t)->source(), "--chat_template");
  EXPECT_EQ(*(*t)->Render(Messages(R"([{"role": "user", "content": "x"}])")), "override E");
  // --chat_template alone (no model folder): no special tokens, so bos_token is undefined.
  t = ChatTemplate::Load("", dir + "/override.jinja");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*(*t)->Render(Messages(R"([{"role": "user", "content": "x"}])")), "override ");

  // Errors name the file, and a construct the engine lacks is named.
  WriteFile(dir + "/broken.jinja", "{% for m in messages %}{{ m | groupby('x') }}{% endfor %}");
  absl::StatusOr<std::optional<ChatTemplate>> broken =
      ChatTemplate::Load("", dir + "/broken.jinja");
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("the filter 'groupby' is not supported"),
            std::string::npos)
      << broken.status();
  EXPECT_NE(broken.status().message().find("broken.jinja"), std::string::npos);
  EXPECT_FALSE(ChatTemplate::Load("", dir + "/missing.jinja").ok());
  EXPECT_FALSE(ChatTemplate::Load(dir + "/missing", "").ok());
  WriteFile(dir + "/chat_template.jinja", "fine");
  WriteFile(dir + "/tokenizer_config.json", "{not json");
  absl::StatusOr<std::optional<ChatTemplate>> bad = ChatTemplate::Load(dir, "");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tokenizer_config.json"), std::string::npos);
}

TEST(HttpChatTest, NormalizeMessages) {
  absl::StatusOr<ojson> m = NormalizeMessages(ojson::parse(
      R"([{"content": "S", "role": "developer"},
          {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"},
                                                     {"type": "text", "text": "b"}],
           "refusal": null, "tool_calls": []},
          {"role": "assistant", "content": "<think>r</think>x", "reasoning_content": "r"}])"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->dump(),
            R"([{"role":"system","content":"S"},)"
            R"({"role":"user","content":"a\nb","name":"ann"},)"
            R"({"role":"assistant","content":"<think>r</think>x","reasoning_content":"r"}])");
  struct Case {
    std::string messages;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"role": "user"})", "messages: must be an array"},
           {R"([])", "messages: must not be empty"},
           {R"([{"role": "tool", "content": "x"}])", "messages[0].role: 'tool' is not one of"},
           {R"([{"content": "x"}])", "messages[0].role: required"},
           {R"([{"role": "user", "content": 5}])", "messages[0].content: must be a string or"},
           {R"([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}])",
            "messages[0].tool_calls: tool calls are not supported"},
           {R"([{"role": "user", "content": "x", "tool_call_id": "1"}])",
            "messages[0].tool_call_id: tool messages are not supported"},
           {R"([{"role": "user", "content": "x", "mood": "happy"}])",
            "messages[0].mood: unknown field"},
           {R"([{"role": "user", "content": [{"type": "text"}]}])",
            "messages[0].content[0].text: must be a string"},
       }) {
    absl::StatusOr<ojson> r = NormalizeMessages(ojson::parse(c.messages));
    ASSERT_FALSE(r.ok()) << c.messages;
    EXPECT_EQ(r.status().message().substr(0, c.message.size()), c.message) << r.status();
  }
}

TEST(HttpChatTest, RequestFields) {
  absl::StatusOr<ChatTemplate::Request> r = ParseChatTemplateFields(ojson::parse(
      R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false,
          "continue_final_message": true, "chat_template_kwargs": {"enable_thinking": false}})"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->add_generation_prompt);
  EXPECT_TRUE(r->continue_final_message);
  EXPECT_EQ(r->kwargs.dump(), R"({"enable_thinking":false})");
  for (const auto& [body, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true})",
            "continue_final_message"},
           {R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"})",
            "chat_template"},
           {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]})",
            "chat_template_kwargs"},
           {R"({"messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"messages": []}})",
            "chat_template_kwargs.messages"},
           {R"({"messages": [{"role": "user", "content": "x"}], "documents": [{"t": 1}]})",
            "documents"},
           {R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1})",
            "add_generation_prompt"},
           {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": )" +
                std::string(40, '[') + std::string(40, ']') + "}}",
            "chat_template_kwargs"},
       }) {
    absl::StatusOr<ChatTemplate::Request> bad = ParseChatTemplateFields(ojson::parse(body));
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_EQ(bad.status().message().substr(0, field.size() + 1), field + ":") << bad.status();
  }
}

// Real templates through the HTTP edge's path: Qwen3's enable_thinking through
// chat_template_kwargs, and continue_final_message cutting the prompt as transformers does
// (keeping the message's trailing space where the template keeps it, not where it trims).
TEST(HttpChatTest, RealTemplatesKwargsAndContinueFinalMessage) {
  const std::string fixtures = "tests/fixtures/chat_templates/";
  absl::StatusOr<ChatTemplate> qwen3 = ChatTemplate::FromSource(
      ReadFile(fixtures + "qwen3.jinja"), ojson{{"eos_token", "<|im_end|>"}}, "qwen3");
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  ChatTemplate::Request r = Messages(R"([{"role": "user", "content": "2+2?"}])");
  EXPECT_EQ(*qwen3->Render(r), "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
  r.kwargs = {{"enable_thinking", false}};
  EXPECT_EQ(*qwen3->Render(r),
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");

  absl::StatusOr<ChatTemplate> qwen25 = ChatTemplate::FromSource(
      ReadFile(fixtures + "qwen2.5-7b-instruct.jinja"), ojson::object(), "qwen2.5");
  ASSERT_TRUE(qwen25.ok());
  r = Messages(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}])",
               /*add_generation_prompt=*/false);
  r.continue_final_message = true;
  EXPECT_EQ(*qwen25->Render(r),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, ");

  absl::StatusOr<ChatTemplate> mistral =
      ChatTemplate::FromSource(ReadFile(fixtures + "mistral-7b-instruct-v0.3.jinja"),
                               ojson{{"bos_token", "<s>"}, {"eos_token", "</s>"}}, "mistral");
  ASSERT_TRUE(mistral.ok());
  // Mistral trims assistant turns: the trailing space is not in the prompt, so it is not kept.
  EXPECT_EQ(*mistral->Render(r), "<s>[INST] Hi[/INST] Sure,");

  // The template raising (roles that do not alternate) is the request's fault: a 400 on
  // messages carrying the template's own words.
  ChatTemplate::Request twice =
      Messages(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])");
  absl::StatusOr<std::string> raised = mistral->Render(twice);
  ASSERT_FALSE(raised.ok());
  EXPECT_EQ(raised.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(raised.status().message().substr(0, 10), "messages: ");
  EXPECT_NE(raised.status().message().find("conversation roles must alternate"), std::string::npos)
      << raised.status();

  // A final message the template does not reproduce cannot be continued.
  absl::StatusOr<ChatTemplate> drops = ChatTemplate::FromSource(
      "{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}", ojson::object(),
      "drops");
  ASSERT_TRUE(drops.ok());
  absl::StatusOr<std::string> lost = drops->Render(r);
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().message().substr(0, 23), "continue_final_message:");
}

ProtocolOptions Protocol(const ChatTemplate* t) {
  ProtocolOptions o;
  o.model_name = "target";
  o.model_aliases = {"/models/target"};
  o.chat_template = t;
  return o;
}

TEST(HttpChatTest, TokenizeAndDetokenizeRequests) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromSource(
      "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
      "{% if add_generation_prompt %}assistant:{% endif %}",
      ojson{{"bos_token", "<B>"}}, "t");
  ASSERT_TRUE(t.ok());
  const ProtocolOptions o = Protocol(&*t);

  absl::StatusOr<TokenizeCall> p = ParseTokenizeRequest(R"({"prompt": "hi"})", o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->text, "hi");
  EXPECT_TRUE(p->add_special_tokens);
  p = ParseTokenizeRequest(R"({"prompt": "hi", "add_special_tokens": false, "model": "target"})",
                           o);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->add_special_tokens);

  absl::StatusOr<TokenizeCall> m = ParseTokenizeRequest(
      R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false})", o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->text, "<B>user:x;");
  EXPECT_FALSE(m->add_special_tokens);
  m = ParseTokenizeRequest(R"({"messages": [{"role": "user", "content": "x"}]})", o);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->text, "<B>user:x;assistant:");

  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "a", "messages": []})", "prompt"},
           {R"({})", "prompt"},
           {R"({"prompt": 5})", "prompt"},
           {R"({"prompt": "a", "return_token_strs": true})", "return_token_strs"},
           {R"({"prompt": "a", "add_generation_prompt": true})", "add_generation_prompt"},
           {R"({"prompt": "a", "colour": "red"})", "colour"},
           {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{}]})", "tools"},
           {R"({"messages": [{"role": "nobody", "content": "x"}]})", "messages[0].role"},
       }) {
    absl::StatusOr<TokenizeCall> bad = ParseTokenizeRequest(body, o);
    ASSERT_FALSE(bad.ok()) << body;
    const ApiError e = TokenizeApiError(bad.status());
    EXPECT_EQ(e.http_status, 400) << body;
    EXPECT_EQ(e.param, param) << body << ": " << e.message;
  }
  const ApiError other =
      TokenizeApiError(ParseTokenizeRequest(R"({"prompt": "a", "model": "gpt"})", o).status());
  EXPECT_EQ(other.http_status, 404);
  EXPECT_EQ(other.code, "model_not_found");
  const ApiError no_template = TokenizeApiError(
      ParseTokenizeRequest(R"({"messages": [{"role": "user", "content": "x"}]})", Protocol(nullptr))
          .status());
  EXPECT_EQ(no_template.http_status, 400);
  EXPECT_FALSE(no_template.param.has_value());

  EXPECT_EQ(TokenizeResponseJson({5, 6}, 4096).dump(),
            R"({"count":2,"max_model_len":4096,"token_strs":null,"tokens":[5,6]})");

  absl::StatusOr<std::vector<int32_t>> ids = ParseDetokenizeRequest(R"({"tokens": [1, 2, 3]})", o);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{1, 2, 3}));
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({})", "tokens"},
           {R"({"tokens": "1 2"})", "tokens"},
           {R"({"tokens": [1, -2]})", "tokens[1]"},
           {R"({"tokens": [1.5]})", "tokens[0]"},
           {R"({"tokens": [1], "skip_special_tokens": true})", "skip_special_tokens"},
       }) {
    absl::StatusOr<std::vector<int32_t>> bad = ParseDetokenizeRequest(body, o);
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_EQ(TokenizeApiError(bad.status()).param, param) << body;
  }
  // The router's vocabulary check names ids[i]; the HTTP API calls them tokens.
  EXPECT_EQ(TokenizeApiError(absl::InvalidArgumentError("ids[2]: token id 9 is outside")).param,
            "tokens[2]");
  EXPECT_EQ(DetokenizeResponseJson("x").dump(), R"({"prompt":"x"})");
}

TEST(HttpChatTest, ModelObjects) {
  EXPECT_EQ(
      ModelJson("target", 4096, ModelFeatures{true, false}).dump(),
      R"({"created":0,"id":"target","max_model_len":4096,"object":"model","owned_by":"specd",)"
      R"("specd":{"chat_template":null,"speculation_modes":[],)"
      R"("supports_logits_processors":false,"supports_logprobs":true}})");
  ModelFeatures features{
      false,
      true,
      "chat_template.jinja",
      {v1::SPECULATION_AUTO, v1::SPECULATION_OFF, v1::SPECULATION_NGRAM, v1::SPECULATION_EAGLE3}};
  EXPECT_EQ(ModelJson("target", 0, features).dump(),
            R"({"created":0,"id":"target","object":"model","owned_by":"specd",)"
            R"("specd":{"chat_template":"chat_template.jinja",)"
            R"("speculation_modes":["auto","off","ngram","eagle3"],)"
            R"("supports_logits_processors":true,"supports_logprobs":false}})");
  const ApiError e = ModelNotFound("nope/x");
  EXPECT_EQ(e.http_status, 404);
  EXPECT_EQ(e.code, "model_not_found");
  EXPECT_EQ(e.param, "model");
  EXPECT_EQ(ErrorJson(e)["error"]["type"], "invalid_request_error");
}

}  // namespace
}  // namespace specd
