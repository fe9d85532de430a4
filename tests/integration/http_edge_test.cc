// specd-http against the real cluster: specd-verify, specd-draft, specd-router and specd-http
// started as processes on loopback, spoken to over HTTP (cpp-httplib's client and, for the
// disconnect test, a raw socket) and compared with the router's own gRPC answers.
//
// Each test starts its own cluster, so metric deltas belong to that test alone.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using nlohmann::json;

constexpr int kMaxContext = 4096;

struct Models {
  std::string target;
  std::string draft;
  // A copy of `target` whose tokenizer_config.json makes the router's tokenizer add <|bos|> to
  // text prompts and carries Llama 2's real chat template (which writes {{ bos_token }} itself).
  std::string chat_target;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

constexpr char kLlama2Template[] = "tests/fixtures/chat_templates/llama-2-7b-chat.jinja";
constexpr char kQwen25Template[] = "tests/fixtures/chat_templates/qwen2.5-7b-instruct.jinja";
constexpr int32_t kBos = 257;  // <|bos|> of the random test model's tokenizer

const Models& TestModels() {
  static const Models* models = [] {
    auto* m = new Models();
    const std::string dir = MakeTempDir("http_edge_test");
    m->target = dir + "/target";
    m->draft = dir + "/draft";
    const std::string cmd =
        absl::StrCat(SpecdBinary("specd-make-test-model"), " --target_dir=", m->target,
                     " --draft_dir=", m->draft,
                     " --hidden_size=64 --intermediate_size=128 --num_layers=3 --draft_layers=1"
                     " --max_position_embeddings=",
                     kMaxContext, " > /dev/null");
    if (std::system(cmd.c_str()) != 0) ADD_FAILURE() << "failed: " << cmd;
    m->chat_target = dir + "/chat_target";
    std::filesystem::copy(m->target, m->chat_target, std::filesystem::copy_options::recursive);
    const json config = {{"add_bos_token", true},
                         {"bos_token", "<|bos|>"},
                         {"eos_token", {{"content", "<|eos|>"}, {"special", true}}},
                         {"chat_template", ReadFile(kLlama2Template)}};
    std::ofstream(m->chat_target + "/tokenizer_config.json") << config.dump(2);
    return m;
  }();
  return *models;
}

struct Http {
  std::unique_ptr<ServiceProcess> process;
  int port = 0;
};

struct GrpcResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<v1::TokenLogprob> logprobs;
  v1::GenerateResponse last;
};

class Cluster {
 public:
  // `target` = the target model folder for every service (default: TestModels().target).
  static std::unique_ptr<Cluster> Start(std::string target = "") {
    const Models& models = TestModels();
    if (target.empty()) target = models.target;
    auto c = std::make_unique<Cluster>();
    const std::string verify_address = absl::StrCat("127.0.0.1:", PickFreePort());
    const std::string draft_address = absl::StrCat("127.0.0.1:", PickFreePort());
    c->router_address = absl::StrCat("127.0.0.1:", PickFreePort());
    c->router_metrics = PickFreePort();
    struct Spec {
      std::unique_ptr<ServiceProcess>* out;
      ServiceProcessOptions options;
    };
    for (Spec& s : std::vector<Spec>{
             {&c->verify,
              {SpecdBinary("specd-verify"),
               {"--address=" + verify_address, absl::StrCat("--metrics_port=", PickFreePort()),
                "--model=" + target, "--num_threads=1"},
               verify_address}},
             {&c->draft,
              {SpecdBinary("specd-draft"),
               {"--address=" + draft_address, absl::StrCat("--metrics_port=", PickFreePort()),
                "--model=" + models.draft, "--num_threads=1"},
               draft_address}},
             {&c->router,
              {SpecdBinary("specd-router"),
               {"--address=" + c->router_address,
                absl::StrCat("--metrics_port=", c->router_metrics), "--model=" + target,
                "--verify_address=" + verify_address, "--draft_address=" + draft_address,
                "--max_new_tokens_limit=4000"},
               c->router_address}},
         }) {
      absl::StatusOr<std::unique_ptr<ServiceProcess>> p = ServiceProcess::Spawn(s.options);
      EXPECT_TRUE(p.ok()) << p.status();
      if (!p.ok()) return nullptr;
      *s.out = *std::move(p);
    }
    for (ServiceProcess* p : {c->verify.get(), c->draft.get(), c->router.get()}) {
      const absl::Status s = p->WaitUntilServing(absl::Seconds(60));
      EXPECT_TRUE(s.ok()) << s << "\n" << p->Log();
      if (!s.ok()) return nullptr;
    }
    c->stub = v1::Generation::NewStub(c->router->channel());
    return c;
  }

  // Starts a specd-http in front of the router and waits until its /health says 200.
  Http StartHttp(const std::vector<std::string>& extra_args = {}) {
    Http h;
    h.port = PickFreePort();
    std::vector<std::string> args = {absl::StrCat("--address=127.0.0.1:", h.port),
                                     "--router=" + router_address, "--threads=8"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    absl::StatusOr<std::unique_ptr<ServiceProcess>> p = ServiceProcess::Spawn(
        {SpecdBinary("specd-http"), args, absl::StrCat("127.0.0.1:", h.port)});
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return h;
    h.process = *std::move(p);
    const absl::Time end = absl::Now() + absl::Seconds(30);
    int status = 0;
    while (absl::Now() < end && h.process->Running()) {
      absl::StatusOr<std::string> body = HttpGet("127.0.0.1", h.port, "/health", &status);
      if (body.ok() && status == 200) return h;
      absl::SleepFor(absl::Milliseconds(50));
    }
    ADD_FAILURE() << "specd-http never became healthy (last status " << status << ")\n"
                  << h.process->Log();
    return h;
  }

  GrpcResult Generate(const v1::GenerateRequest& request) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    GrpcResult r;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
        stub->Generate(&ctx, request);
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      r.tokens.insert(r.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      r.text += chunk.text();
      r.logprobs.insert(r.logprobs.end(), chunk.logprobs().begin(), chunk.logprobs().end());
      if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) r.last = chunk;
    }
    r.status = reader->Finish();
    return r;
  }

  std::vector<int32_t> Tokenize(const std::string& text, bool add_special_tokens) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::TokenizeRequest request;
    request.set_text(text);
    request.set_add_special_tokens(add_special_tokens);
    v1::TokenizeResponse response;
    const grpc::Status status = stub->Tokenize(&ctx, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return {response.ids().begin(), response.ids().end()};
  }

  std::string Detokenize(const std::vector<int32_t>& ids) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::DetokenizeRequest request;
    request.mutable_ids()->Assign(ids.begin(), ids.end());
    v1::DetokenizeResponse response;
    const grpc::Status status = stub->Detokenize(&ctx, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.text();
  }

  double RouterMetric(const std::string& name, const std::map<std::string, std::string>& labels) {
    return Metric(router_metrics, name, labels);
  }

  static double Metric(int port, const std::string& name,
                       const std::map<std::string, std::string>& labels = {}) {
    absl::StatusOr<std::string> text = HttpGet("127.0.0.1", port, "/metrics");
    if (!text.ok()) return NAN;
    absl::StatusOr<double> v = MetricValue(*text, name, labels);
    return v.ok() ? *v : NAN;
  }

  // Polls until the metric equals `want` (10 s) and returns its last value. Counters of an HTTP
  // request are updated after its response is written, so a client can get ahead of them.
  static double WaitForMetric(int port, const std::string& name,
                              const std::map<std::string, std::string>& labels, double want) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    double v = Metric(port, name, labels);
    while (v != want && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(20));
      v = Metric(port, name, labels);
    }
    return v;
  }

  std::unique_ptr<ServiceProcess> verify, draft, router;
  std::string router_address;
  int router_metrics = 0;
  std::unique_ptr<v1::Generation::Stub> stub;
};

struct HttpReply {
  int status = 0;
  std::string body;
  std::string content_type;
};

HttpReply Post(int port, const std::string& path, const std::string& body) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(120, 0);
  httplib::Result r = client.Post(path.c_str(), body, "application/json");
  HttpReply out;
  if (!r) {
    ADD_FAILURE() << "POST " << path << ": " << httplib::to_string(r.error());
    return out;
  }
  out.status = r->status;
  out.body = r->body;
  out.content_type = r->get_header_value("Content-Type");
  return out;
}

json ParseJson(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << text;
  return j;
}

// The data of each SSE event in `body`, in order ("[DONE]" included); comments are skipped.
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  for (absl::string_view event : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    if (absl::StartsWith(event, ":")) continue;
    EXPECT_TRUE(absl::StartsWith(event, "data: ")) << event;
    out.emplace_back(event.substr(6));
  }
  return out;
}

struct StreamResult {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<json> chunks;  // without [DONE]
  bool done_last = false;    // the body ended with data: [DONE]
};

StreamResult ReadStream(const HttpReply& reply, bool chat) {
  StreamResult r;
  EXPECT_TRUE(absl::EndsWith(reply.body, "data: [DONE]\n\n")) << reply.body;
  const std::vector<std::string> events = SseData(reply.body);
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i] == "[DONE]") {
      r.done_last = i + 1 == events.size();
      continue;
    }
    json chunk = ParseJson(events[i]);
    if (!chunk["choices"].empty()) {
      const json& choice = chunk["choices"][0];
      if (chat) {
        if (choice["delta"].contains("content")) r.text += choice["delta"]["content"];
      } else {
        r.text += choice["text"].get<std::string>();
      }
    }
    if (chunk.contains("specd")) {
      for (const json& id : chunk["specd"]["token_ids"]) r.tokens.push_back(id.get<int32_t>());
    }
    r.chunks.push_back(std::move(chunk));
  }
  return r;
}

std::vector<int32_t> Ids(const json& array) { return array.get<std::vector<int32_t>>(); }

TEST(HttpEdgeTest, CompletionMatchesGrpcGenerateAndStreamingMatchesNonStreaming) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  Http http = c->StartHttp();
  ASSERT_NE(http.process, nullptr);

  struct Case {
    std::string name;
    json body;  // HTTP request, without stream
    v1::GenerateRequest grpc;
  };
  std::vector<Case> cases;
  {
    Case greedy{"greedy",
                {{"prompt", "def add(a, b):"},
                 {"max_tokens", 24},
                 {"temperature", 0},
                 {"ignore_eos", true}},
                {}};
    greedy.grpc.set_prompt("def add(a, b):");
    greedy.grpc.set_max_new_tokens(24);
    greedy.grpc.set_temperature(0);
    greedy.grpc.set_ignore_eos(true);
    cases.push_back(greedy);
    // Seeded sampling is reproducible, so it must match too; here with n-gram speculation
    // asked for through the extension object and token ids as the prompt.
    Case seeded{"seeded",
                {{"prompt", {104, 101, 108, 108, 111}},
                 {"max_tokens", 20},
                 {"temperature", 0.9},
                 {"top_p", 0.95},
                 {"top_k", 40},
                 {"seed", 1234},
                 {"ignore_eos", true},
                 {"specd", {{"speculation", "ngram"}}}},
                {}};
    for (int id : {104, 101, 108, 108, 111}) seeded.grpc.mutable_prompt_ids()->add_ids(id);
    seeded.grpc.set_max_new_tokens(20);
    seeded.grpc.set_temperature(0.9f);
    seeded.grpc.set_top_p(0.95f);
    seeded.grpc.set_top_k(40);
    seeded.grpc.set_seed(1234);
    seeded.grpc.set_ignore_eos(true);
    seeded.grpc.set_speculation(v1::SPECULATION_NGRAM);
    cases.push_back(seeded);
  }
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const GrpcResult want = c->Generate(k.grpc);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    ASSERT_FALSE(want.tokens.empty());

    const HttpReply reply = Post(http.port, "/v1/completions", k.body.dump());
    ASSERT_EQ(reply.status, 200) << reply.body;
    EXPECT_TRUE(absl::StartsWith(reply.content_type, "application/json"));
    const json r = ParseJson(reply.body);
    EXPECT_EQ(r["object"], "text_completion");
    EXPECT_TRUE(absl::StartsWith(r["id"].get<std::string>(), "cmpl-"));
    EXPECT_EQ(r["model"], "target");
    EXPECT_EQ(r["choices"][0]["text"], want.text);
    EXPECT_EQ(Ids(r["specd"]["token_ids"]), want.tokens);
    EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(r["usage"]["completion_tokens"], want.tokens.size());
    EXPECT_EQ(r["usage"]["prompt_tokens"], want.last.usage().prompt_tokens());
    EXPECT_EQ(r["usage"]["total_tokens"], want.tokens.size() + want.last.usage().prompt_tokens());
    EXPECT_TRUE(r["specd"]["speculation"].contains("steps"));

    json stream_body = k.body;
    stream_body["stream"] = true;
    stream_body["stream_options"] = {{"include_usage", true}};
    const HttpReply sreply = Post(http.port, "/v1/completions", stream_body.dump());
    ASSERT_EQ(sreply.status, 200) << sreply.body;
    EXPECT_TRUE(absl::StartsWith(sreply.content_type, "text/event-stream"));
    const StreamResult s = ReadStream(sreply, /*chat=*/false);
    EXPECT_TRUE(s.done_last);
    EXPECT_EQ(s.text, want.text);
    EXPECT_EQ(s.tokens, want.tokens);
    ASSERT_GE(s.chunks.size(), 2u);
    // The chunk with the finish reason, then the usage chunk with empty choices.
    const json& finish = s.chunks[s.chunks.size() - 2];
    EXPECT_EQ(finish["choices"][0]["finish_reason"], "length");
    EXPECT_TRUE(finish["usage"].is_null());
    const json& usage = s.chunks.back();
    EXPECT_TRUE(usage["choices"].empty());
    EXPECT_EQ(usage["usage"]["completion_tokens"], want.tokens.size());
    for (size_t i = 0; i + 2 < s.chunks.size(); ++i) {
      EXPECT_TRUE(s.chunks[i]["choices"][0]["finish_reason"].is_null()) << i;
      EXPECT_EQ(s.chunks[i]["id"], finish["id"]);
    }
  }

  // A stop string ends the text before it, as the router does it.
  v1::GenerateRequest base;
  base.set_prompt("def add(a, b):");
  base.set_max_new_tokens(24);
  base.set_ignore_eos(true);
  const GrpcResult full = c->Generate(base);
  ASSERT_TRUE(full.status.ok());
  ASSERT_GE(full.text.size(), 4u);
  // Two whole UTF-8 characters from the middle of the text (random models emit any bytes).
  auto is_start = [&](size_t i) {
    return i >= full.text.size() || (static_cast<unsigned char>(full.text[i]) & 0xC0) != 0x80;
  };
  size_t begin = full.text.size() / 2;
  while (!is_start(begin)) --begin;
  size_t end = begin;
  int chars = 0;
  do {
    ++end;
    if (is_start(end)) ++chars;
  } while (chars < 2 && end < full.text.size());
  const std::string stop = full.text.substr(begin, end - begin);
  const HttpReply stopped = Post(
      http.port, "/v1/completions",
      json({{"prompt", "def add(a, b):"}, {"max_tokens", 24}, {"ignore_eos", true}, {"stop", stop}})
          .dump());
  ASSERT_EQ(stopped.status, 200) << stopped.body;
  const json sj = ParseJson(stopped.body);
  EXPECT_EQ(sj["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(sj["choices"][0]["text"], full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(sj["specd"]["matched_stop"], stop);

  // Every request finished normally at the router: two cases of (gRPC, HTTP, HTTP stream), the
  // gRPC reference for the stop string and the HTTP request with it. None was cancelled by the
  // edge closing its call after the last chunk.
  EXPECT_EQ(
      Cluster::WaitForMetric(c->router_metrics, "specd_requests_total", {{"outcome", "ok"}}, 8), 8);
  EXPECT_EQ(c->RouterMetric("specd_requests_total", {{"outcome", "cancelled"}}), 0);
}

TEST(HttpEdgeTest, ChatCompletionsRenderTheChatTemplate) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  Http none = c->StartHttp();
  Http qwen = c->StartHttp({absl::StrCat("--chat_template=", kQwen25Template)});
  ASSERT_NE(none.process, nullptr);
  ASSERT_NE(qwen.process, nullptr);

  const json messages = json::array({{{"role", "system"}, {"content", "You are terse."}},
                                     {{"role", "user"}, {"content", "Hello"}}});
  const json body = {
      {"model", "target"}, {"messages", messages}, {"max_tokens", 16}, {"ignore_eos", true}};

  // The model folder has no template and none was given: refused, as vLLM refuses it.
  const HttpReply refused = Post(none.port, "/v1/chat/completions", body.dump());
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_TRUE(absl::StrContains(ParseJson(refused.body)["error"]["message"].get<std::string>(),
                                "no chat template"))
      << refused.body;

  // Qwen2.5's real template, rendered, then tokenized by the router without special tokens.
  const std::string prompt =
      "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
      "<|im_start|>assistant\n";
  v1::GenerateRequest g;
  for (int32_t id : c->Tokenize(prompt, /*add_special_tokens=*/false)) {
    g.mutable_prompt_ids()->add_ids(id);
  }
  g.set_max_new_tokens(16);
  g.set_ignore_eos(true);
  const GrpcResult want = c->Generate(g);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();

  const HttpReply reply = Post(qwen.port, "/v1/chat/completions", body.dump());
  ASSERT_EQ(reply.status, 200) << reply.body;
  const json r = ParseJson(reply.body);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_TRUE(absl::StartsWith(r["id"].get<std::string>(), "chatcmpl-"));
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["message"]["content"], want.text);
  EXPECT_EQ(Ids(r["specd"]["token_ids"]), want.tokens);
  EXPECT_EQ(r["usage"]["prompt_tokens"], g.prompt_ids().ids_size());

  json stream_body = body;
  stream_body["stream"] = true;
  const HttpReply sreply = Post(qwen.port, "/v1/chat/completions", stream_body.dump());
  ASSERT_EQ(sreply.status, 200) << sreply.body;
  const StreamResult s = ReadStream(sreply, /*chat=*/true);
  EXPECT_TRUE(s.done_last);
  EXPECT_EQ(s.text, want.text);
  ASSERT_FALSE(s.chunks.empty());
  EXPECT_EQ(s.chunks.front()["object"], "chat.completion.chunk");
  EXPECT_EQ(s.chunks.front()["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(s.chunks.back()["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(s.chunks.back().contains("usage"));  // not asked for
}

// A model whose tokenizer adds BOS to text prompts and whose template writes bos_token itself
// (Llama 2's): the prompt carries one BOS, not two, through chat completions and /tokenize; the
// utility endpoints answer as vLLM's do.
TEST(HttpEdgeTest, TemplateBosTokenizeDetokenizeVersionAndModel) {
  const std::string target = TestModels().chat_target;
  std::unique_ptr<Cluster> c = Cluster::Start(target);
  ASSERT_NE(c, nullptr);
  Http http = c->StartHttp({"--model_dir=" + target});
  ASSERT_NE(http.process, nullptr);

  // The hazard is real: the router's text prompts get <|bos|>.
  ASSERT_EQ(c->Tokenize("Hi", true).front(), kBos);

  const json messages = json::array({{{"role", "system"}, {"content", "You are terse."}},
                                     {{"role", "user"}, {"content", "Hello"}}});
  const std::string prompt = "<|bos|>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHello [/INST]";
  const std::vector<int32_t> prompt_ids = c->Tokenize(prompt, /*add_special_tokens=*/false);
  ASSERT_EQ(prompt_ids.front(), kBos);
  ASSERT_NE(prompt_ids[1], kBos);

  const HttpReply tok = Post(http.port, "/tokenize", json({{"messages", messages}}).dump());
  ASSERT_EQ(tok.status, 200) << tok.body;
  const json t = ParseJson(tok.body);
  EXPECT_EQ(Ids(t["tokens"]), prompt_ids);
  EXPECT_EQ(t["count"], prompt_ids.size());
  EXPECT_EQ(t["max_model_len"], kMaxContext);
  EXPECT_TRUE(t["token_strs"].is_null());

  // The same prompt drives the chat completion: same tokens as gRPC Generate from those ids.
  v1::GenerateRequest g;
  for (int32_t id : prompt_ids) g.mutable_prompt_ids()->add_ids(id);
  g.set_max_new_tokens(12);
  g.set_ignore_eos(true);
  const GrpcResult want = c->Generate(g);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  const HttpReply chat =
      Post(http.port, "/v1/chat/completions",
           json({{"messages", messages}, {"max_tokens", 12}, {"ignore_eos", true}}).dump());
  ASSERT_EQ(chat.status, 200) << chat.body;
  const json r = ParseJson(chat.body);
  EXPECT_EQ(r["usage"]["prompt_tokens"], prompt_ids.size());
  EXPECT_EQ(Ids(r["specd"]["token_ids"]), want.tokens);
  EXPECT_EQ(r["choices"][0]["message"]["content"], want.text);

  // Asking for special tokens on top of the template's gives the second BOS, as vLLM does.
  const HttpReply doubled = Post(
      http.port, "/tokenize", json({{"messages", messages}, {"add_special_tokens", true}}).dump());
  ASSERT_EQ(doubled.status, 200) << doubled.body;
  EXPECT_EQ(Ids(ParseJson(doubled.body)["tokens"]), c->Tokenize(prompt, true));

  // continue_final_message leaves the assistant's turn open.
  json open = messages;
  open.push_back({{"role", "assistant"}, {"content", "Sure,"}});
  const HttpReply cont = Post(
      http.port, "/tokenize",
      json({{"messages", open}, {"add_generation_prompt", false}, {"continue_final_message", true}})
          .dump());
  ASSERT_EQ(cont.status, 200) << cont.body;
  EXPECT_EQ(Ids(ParseJson(cont.body)["tokens"]), c->Tokenize(prompt + " Sure,", false));

  // The template's own checks are the request's 400s: Llama 2 wants alternating roles.
  const HttpReply twice =
      Post(http.port, "/v1/chat/completions",
           json({{"messages", json::array({{{"role", "user"}, {"content", "a"}},
                                           {{"role", "user"}, {"content", "b"}}})}})
               .dump());
  EXPECT_EQ(twice.status, 400) << twice.body;
  const json te = ParseJson(twice.body);
  EXPECT_EQ(te["error"]["param"], "messages");
  EXPECT_TRUE(absl::StrContains(te["error"]["message"].get<std::string>(),
                                "Conversation roles must alternate"))
      << twice.body;

  // /tokenize of a prompt: special tokens added unless asked not to.
  for (const bool special : {true, false}) {
    const HttpReply p =
        Post(http.port, "/tokenize",
             json({{"prompt", "Hi there"}, {"add_special_tokens", special}}).dump());
    ASSERT_EQ(p.status, 200) << p.body;
    EXPECT_EQ(Ids(ParseJson(p.body)["tokens"]), c->Tokenize("Hi there", special));
  }
  const HttpReply plain = Post(http.port, "/tokenize", R"({"prompt": "Hi there"})");
  ASSERT_EQ(plain.status, 200);
  EXPECT_EQ(Ids(ParseJson(plain.body)["tokens"]), c->Tokenize("Hi there", true));

  // /detokenize keeps special tokens, as vLLM's does.
  const HttpReply detok = Post(http.port, "/detokenize", json({{"tokens", prompt_ids}}).dump());
  ASSERT_EQ(detok.status, 200) << detok.body;
  EXPECT_EQ(ParseJson(detok.body)["prompt"], c->Detokenize(prompt_ids));
  EXPECT_EQ(ParseJson(detok.body)["prompt"], prompt);

  struct Bad {
    std::string path, body;
    int status;
    json param;
  };
  for (const Bad& b : std::vector<Bad>{
           {"/detokenize", R"({"tokens": [1, 100000]})", 400, "tokens[1]"},
           {"/detokenize", R"({"tokens": "1"})", 400, "tokens"},
           {"/tokenize", R"({"prompt": "a", "return_token_strs": true})", 400, "return_token_strs"},
           {"/tokenize", R"({"prompt": "a", "model": "other"})", 404, "model"},
           {"/tokenize", R"({"messages": [{"role": "user", "content": "a"}],
                             "chat_template": "{{ 1 }}"})",
            400, "chat_template"},
       }) {
    SCOPED_TRACE(b.body);
    const HttpReply reply = Post(http.port, b.path, b.body);
    EXPECT_EQ(reply.status, b.status) << reply.body;
    EXPECT_EQ(ParseJson(reply.body)["error"]["param"], b.param) << reply.body;
  }

  int status = 0;
  absl::StatusOr<std::string> version = HttpGet("127.0.0.1", http.port, "/version", &status);
  ASSERT_TRUE(version.ok());
  EXPECT_EQ(status, 200);
  EXPECT_EQ(ParseJson(*version)["version"], "0.1.0");

  absl::StatusOr<std::string> model =
      HttpGet("127.0.0.1", http.port, "/v1/models/chat_target", &status);
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(status, 200) << *model;
  const json m = ParseJson(*model);
  EXPECT_EQ(m["id"], "chat_target");
  EXPECT_EQ(m["object"], "model");
  EXPECT_EQ(m["max_model_len"], kMaxContext);
  // The CPU verify backend serves logprobs and the logits processors; the router says so.
  EXPECT_EQ(m["specd"]["supports_logprobs"], true);
  EXPECT_EQ(m["specd"]["supports_logits_processors"], true);
  // The template this edge renders, and what the cluster can speculate with (fresh each GET).
  EXPECT_EQ(m["specd"]["chat_template"], "tokenizer_config.json");
  ASSERT_EQ(Cluster::WaitForMetric(c->router_metrics, "specd_draft_available", {}, 1), 1);
  model = HttpGet("127.0.0.1", http.port, "/v1/models/chat_target", &status);
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(ParseJson(*model)["specd"]["speculation_modes"],
            json({"auto", "off", "draft_model", "ngram"}));
  // Ids may hold slashes, as Hugging Face names do.
  absl::StatusOr<std::string> missing =
      HttpGet("127.0.0.1", http.port, "/v1/models/meta-llama/Llama-3", &status);
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(status, 404);
  EXPECT_EQ(ParseJson(*missing)["error"]["code"], "model_not_found");
  EXPECT_EQ(Cluster::WaitForMetric(http.port, "specd_http_requests_total",
                                   {{"endpoint", "/tokenize"}, {"status", "200"}}, 6),
            6);
}

// A template the engine cannot run stops specd-http at startup, naming the construct.
TEST(HttpEdgeTest, UnsupportedTemplateFailsAtStartup) {
  const std::string dir = MakeTempDir("http_edge_template");
  std::ofstream(dir + "/t.jinja") << "{% for m in messages %}\n{{ m.content | truncate(9) }}"
                                     "{% endfor %}";
  const int port = PickFreePort();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> p =
      ServiceProcess::Spawn({SpecdBinary("specd-http"),
                             {absl::StrCat("--address=127.0.0.1:", port), "--router=127.0.0.1:1",
                              "--chat_template=" + dir + "/t.jinja"},
                             absl::StrCat("127.0.0.1:", port)});
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<int> code = (*p)->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  EXPECT_TRUE(absl::StrContains((*p)->Log(),
                                "line 2, column 16: the filter 'truncate' is not "
                                "supported"))
      << (*p)->Log();
}

// OpenAI's logprobs shapes, n choices and the sampling fields, against the router's gRPC answer
// to the same request.
TEST(HttpEdgeTest, LogprobsNAndSamplingFieldsMatchGrpc) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  Http http = c->StartHttp({absl::StrCat("--chat_template=", kQwen25Template)});
  ASSERT_NE(http.process, nullptr);

  v1::GenerateRequest g;
  g.set_prompt("def add(a, b):");
  g.set_max_new_tokens(12);
  g.set_ignore_eos(true);
  g.set_logprobs(2);
  g.set_repetition_penalty(1.2f);
  g.set_presence_penalty(0.3f);
  g.set_min_p(0.05f);
  (*g.mutable_logit_bias())[101] = 2.0f;
  const GrpcResult want = c->Generate(g);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ASSERT_EQ(want.logprobs.size(), want.tokens.size());

  const json body = {{"prompt", "def add(a, b):"},
                     {"max_tokens", 12},
                     {"ignore_eos", true},
                     {"logprobs", 2},
                     {"repetition_penalty", 1.2},
                     {"presence_penalty", 0.3},
                     {"min_p", 0.05},
                     {"logit_bias", {{"101", 2.0}}}};
  const HttpReply reply = Post(http.port, "/v1/completions", body.dump());
  ASSERT_EQ(reply.status, 200) << reply.body;
  const json r = ParseJson(reply.body);
  EXPECT_EQ(Ids(r["specd"]["token_ids"]), want.tokens);
  const json& lp = r["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), want.tokens.size()) << reply.body;
  for (size_t i = 0; i < want.logprobs.size(); ++i) {
    EXPECT_FLOAT_EQ(lp["token_logprobs"][i].get<float>(), want.logprobs[i].logprob());
    EXPECT_EQ(lp["tokens"][i], want.logprobs[i].token());
    EXPECT_LE(lp["top_logprobs"][i].size(), 3u);
  }

  // Chat: logprobs: true with top_logprobs; streamed, the same values arrive chunk by chunk.
  const json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"max_tokens", 8},
                     {"ignore_eos", true},
                     {"logprobs", true},
                     {"top_logprobs", 3}};
  const HttpReply whole = Post(http.port, "/v1/chat/completions", chat.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json wj = ParseJson(whole.body);
  const json& content = wj["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), wj["specd"]["token_ids"].size()) << whole.body;
  for (const json& t : content) {
    ASSERT_EQ(t["top_logprobs"].size(), 3u);
    EXPECT_EQ(t["top_logprobs"][0]["logprob"], t["logprob"]);  // greedy: the top token
    EXPECT_TRUE(t["bytes"].is_array());
  }
  json chat_stream = chat;
  chat_stream["stream"] = true;
  const HttpReply streamed = Post(http.port, "/v1/chat/completions", chat_stream.dump());
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  const StreamResult sr = ReadStream(streamed, /*chat=*/true);
  json streamed_content = json::array();
  for (const json& chunk : sr.chunks) {
    const json& l = chunk["choices"][0]["logprobs"];
    if (l.is_null()) continue;
    for (const json& t : l["content"]) streamed_content.push_back(t);
  }
  EXPECT_EQ(streamed_content, content);

  // n = 3 seeded samples: choice i is the single request with seed + i.
  const json n_body = {{"prompt", "import os"}, {"max_tokens", 10}, {"ignore_eos", true},
                       {"temperature", 1.0},    {"seed", 11},       {"n", 3}};
  const HttpReply n_reply = Post(http.port, "/v1/completions", n_body.dump());
  ASSERT_EQ(n_reply.status, 200) << n_reply.body;
  const json nj = ParseJson(n_reply.body);
  ASSERT_EQ(nj["choices"].size(), 3u);
  EXPECT_EQ(nj["usage"]["completion_tokens"], 30);
  for (int i = 0; i < 3; ++i) {
    v1::GenerateRequest one;
    one.set_prompt("import os");
    one.set_max_new_tokens(10);
    one.set_ignore_eos(true);
    one.set_temperature(1.0f);
    one.set_seed(11 + i);
    const GrpcResult single = c->Generate(one);
    ASSERT_TRUE(single.status.ok());
    EXPECT_EQ(nj["choices"][i]["index"], i);
    EXPECT_EQ(nj["choices"][i]["text"], single.text) << "choice " << i;
  }
  json n_stream = n_body;
  n_stream["stream"] = true;
  const HttpReply ns = Post(http.port, "/v1/completions", n_stream.dump());
  ASSERT_EQ(ns.status, 200) << ns.body;
  std::vector<std::string> texts(3);
  int finishes = 0;
  const std::vector<std::string> events = SseData(ns.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]");
  for (const std::string& e : events) {
    if (e == "[DONE]") continue;
    const json chunk = ParseJson(e);
    const json& choice = chunk["choices"][0];
    texts[choice["index"].get<int>()] += choice["text"].get<std::string>();
    if (!choice["finish_reason"].is_null()) ++finishes;
  }
  EXPECT_EQ(finishes, 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(texts[i], nj["choices"][i]["text"]) << "choice " << i;
}

TEST(HttpEdgeTest, BadInputsAre400WithTheParamAndTheServiceKeepsServing) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  Http http = c->StartHttp();
  ASSERT_NE(http.process, nullptr);

  struct Case {
    std::string path;
    std::string body;
    int status;
    json param;  // null: no param
  };
  const std::string kC = "/v1/completions";
  const std::vector<Case> cases = {
      // Checked by the router, named in its terms and renamed here.
      {kC, R"({"prompt": "x", "temperature": -1})", 400, "temperature"},
      {kC, R"({"prompt": "x", "top_p": 2})", 400, "top_p"},
      {kC, R"({"prompt": "x", "max_tokens": 5000})", 400, "max_tokens"},
      {kC, R"({"prompt": [1, 2, 100000]})", 400, "prompt"},
      {kC, R"({"prompt": "x", "specd": {"draft_max_nodes": 1000}})", 400, "specd.draft_max_nodes"},
      {kC, R"({"prompt": "", "max_tokens": 3})", 400, "prompt"},
      // Checked here.
      {kC, R"({"prompt": "x", "n": 17})", 400, "n"},
      {kC, R"({"prompt": "x", "min_p": 2})", 400, "min_p"},
      {kC, R"({"prompt": "x", "max_tokens": 4, "min_tokens": 9})", 400, "min_tokens"},
      {kC, R"({"prompt": "x", "repetition_penalty": 0})", 400, "repetition_penalty"},
      {kC, R"({"prompt": "x", "logit_bias": {"99999": 1}})", 400, "logit_bias[99999]"},
      {kC, R"({"prompt": "x", "logit_bias": {"5": 500}})", 400, "logit_bias[5]"},
      // Checked here.
      {kC, R"({"prompt": "x", "n": 0})", 400, "n"},
      {kC, R"({"prompt": "x", "logprobs": 21})", 400, "logprobs"},
      {kC, R"({"prompt": "x", "guided_regex": "a+"})", 400, "guided_regex"},
      {kC, R"({"prompt": "x", "not_a_field": 1})", 400, "not_a_field"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "a"}],
           "response_format": {"type": "json_schema", "json_schema": {}}})",
       400, "response_format"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]})", 400,
       "tools"},
      {kC, R"({"max_tokens": 3})", 400, "prompt"},
      {kC, R"({"prompt": "x", "max_tokens": 3)", 400, nullptr},
      {kC, R"(not json at all)", 400, nullptr},
      {kC, R"({"prompt": "x", "model": "gpt-4"})", 404, "model"},
      // A streaming request that fails up front gets a plain JSON error, not a stream.
      {kC, R"({"prompt": "x", "temperature": -1, "stream": true})", 400, "temperature"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user"}]})", 400, "messages[0].content"},
      {"/v1/chat/completions", R"({"messages": "hi"})", 400, "messages"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.body);
    const HttpReply reply = Post(http.port, k.path, k.body);
    EXPECT_EQ(reply.status, k.status) << reply.body;
    EXPECT_TRUE(absl::StartsWith(reply.content_type, "application/json")) << reply.content_type;
    const json e = ParseJson(reply.body);
    ASSERT_TRUE(e.contains("error")) << reply.body;
    EXPECT_EQ(e["error"]["param"], k.param) << reply.body;
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty());
    EXPECT_TRUE(e["error"]["code"].is_string());
  }
  const HttpReply unknown = Post(http.port, "/v1/embeddings", "{}");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(ParseJson(unknown.body)["error"]["code"], "not_found");

  // Still serving.
  const HttpReply ok = Post(http.port, kC, R"({"prompt": "x", "max_tokens": 4})");
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_TRUE(http.process->Running());

  const int http_port = http.port;
  int n400 = 0;
  for (const Case& k : cases) n400 += k.path == kC && k.status == 400;
  EXPECT_EQ(Cluster::WaitForMetric(http_port, "specd_http_requests_total",
                                   {{"endpoint", kC}, {"status", "400"}}, n400),
            n400);
  EXPECT_EQ(Cluster::WaitForMetric(http_port, "specd_http_requests_total",
                                   {{"endpoint", kC}, {"status", "404"}}, 1),
            1);
  EXPECT_EQ(Cluster::WaitForMetric(http_port, "specd_http_requests_total",
                                   {{"endpoint", kC}, {"status", "200"}}, 1),
            1);
  EXPECT_EQ(Cluster::WaitForMetric(http_port, "specd_http_requests_total",
                                   {{"endpoint", "other"}, {"status", "404"}}, 1),
            1);
  EXPECT_EQ(
      Cluster::WaitForMetric(http_port, "specd_http_requests_in_flight", {{"endpoint", kC}}, 0), 0);
  // The thirteen cases above that only the router can judge reached it.
  EXPECT_EQ(Cluster::WaitForMetric(c->router_metrics, "specd_requests_total",
                                   {{"outcome", "invalid_argument"}}, 13),
            13);

  // A deadline shorter than the generation is a 504.
  Http hurried = c->StartHttp({"--request_timeout_ms=300"});
  ASSERT_NE(hurried.process, nullptr);
  const HttpReply late =
      Post(hurried.port, kC, R"({"prompt": "x", "max_tokens": 3000, "ignore_eos": true})");
  EXPECT_EQ(late.status, 504) << late.body;
  EXPECT_EQ(ParseJson(late.body)["error"]["code"], "deadline_exceeded");
}

TEST(HttpEdgeTest, ModelsHealthAndMetrics) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const int metrics_port = PickFreePort();
  Http http = c->StartHttp({absl::StrCat("--metrics_port=", metrics_port)});
  ASSERT_NE(http.process, nullptr);

  int status = 0;
  absl::StatusOr<std::string> models = HttpGet("127.0.0.1", http.port, "/v1/models", &status);
  ASSERT_TRUE(models.ok()) << models.status();
  EXPECT_EQ(status, 200);
  const json m = ParseJson(*models);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "target");
  EXPECT_EQ(m["data"][0]["object"], "model");
  EXPECT_EQ(m["data"][0]["max_model_len"], kMaxContext);

  absl::StatusOr<std::string> health = HttpGet("127.0.0.1", http.port, "/health", &status);
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(status, 200);

  absl::StatusOr<std::string> metrics = HttpGet("127.0.0.1", http.port, "/metrics", &status);
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(status, 200);
  EXPECT_TRUE(absl::StrContains(*metrics, "# TYPE specd_http_requests_total counter"));
  EXPECT_TRUE(absl::StrContains(*metrics, "# TYPE specd_http_request_duration_seconds histogram"));
  EXPECT_EQ(Cluster::WaitForMetric(http.port, "specd_http_requests_total",
                                   {{"endpoint", "/v1/models"}, {"status", "200"}}, 1),
            1);
  EXPECT_GE(Cluster::Metric(http.port, "specd_http_requests_total",
                            {{"endpoint", "/health"}, {"status", "200"}}),
            1);
  // The separate listener serves the same registry.
  absl::StatusOr<std::string> side = HttpGet("127.0.0.1", metrics_port, "/metrics", &status);
  ASSERT_TRUE(side.ok()) << side.status();
  EXPECT_EQ(status, 200);
  EXPECT_TRUE(MetricValue(*side, "specd_http_requests_total",
                          {{"endpoint", "/v1/models"}, {"status", "200"}})
                  .ok());

  // Without its router the edge is unhealthy and says 503, and it does not crash.
  ASSERT_TRUE(c->router->Stop().ok());
  health = HttpGet("127.0.0.1", http.port, "/health", &status);
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(status, 503);
  const HttpReply down = Post(http.port, "/v1/completions", R"({"prompt": "x"})");
  EXPECT_EQ(down.status, 503) << down.body;
  EXPECT_EQ(ParseJson(down.body)["error"]["code"], "unavailable");
  EXPECT_TRUE(http.process->Running());
}

// Sends a raw HTTP request and returns the connected socket, or -1.
int SendRaw(int port, const std::string& path, const std::string& body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  const std::string request = absl::StrCat(
      "POST ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
      "Content-Length: ", body.size(), "\r\n\r\n", body);
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(HttpEdgeTest, ClientDisconnectMidStreamCancelsTheRouterCall) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  Http http = c->StartHttp();
  ASSERT_NE(http.process, nullptr);
  const double cancelled_before =
      c->RouterMetric("specd_requests_total", {{"outcome", "cancelled"}});
  ASSERT_FALSE(std::isnan(cancelled_before));

  const int fd = SendRaw(http.port, "/v1/completions",
                         R"({"prompt": "x", "max_tokens": 3000, "ignore_eos": true,
                             "stream": true})");
  ASSERT_GE(fd, 0);
  // Read until the first streamed tokens have arrived, then hang up.
  std::string received;
  char buf[4096];
  while (received.find("data: {") == std::string::npos) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0) << received;
    received.append(buf, static_cast<size_t>(n));
  }
  EXPECT_NE(received.find("200 OK"), std::string::npos) << received;
  EXPECT_NE(received.find("text/event-stream"), std::string::npos) << received;
  close(fd);

  const absl::Time end = absl::Now() + absl::Seconds(30);
  double cancelled = cancelled_before;
  while (absl::Now() < end && cancelled != cancelled_before + 1) {
    absl::SleepFor(absl::Milliseconds(50));
    cancelled = c->RouterMetric("specd_requests_total", {{"outcome", "cancelled"}});
  }
  EXPECT_EQ(cancelled, cancelled_before + 1);
  EXPECT_EQ(c->RouterMetric("specd_requests_total", {{"outcome", "ok"}}), 0);
  EXPECT_EQ(c->RouterMetric("specd_requests_running", {}), 0);
  EXPECT_EQ(Cluster::WaitForMetric(http.port, "specd_http_stream_disconnects_total", {}, 1), 1);
  EXPECT_EQ(Cluster::WaitForMetric(http.port, "specd_http_requests_in_flight",
                                   {{"endpoint", "/v1/completions"}}, 0),
            0);

  // And the edge keeps serving.
  const HttpReply ok = Post(http.port, "/v1/completions", R"({"prompt": "x", "max_tokens": 2})");
  EXPECT_EQ(ok.status, 200) << ok.body;
}

}  // namespace
}  // namespace specd
