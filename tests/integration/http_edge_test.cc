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
  std::string chatml_dir;  // only a tokenizer_config.json with a ChatML template
};

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
    m->chatml_dir = dir + "/chatml";
    std::filesystem::create_directories(m->chatml_dir);
    std::ofstream(m->chatml_dir + "/tokenizer_config.json")
        << R"({"chat_template": "{% for message in messages %}{{'<|im_start|>' + message['role'])"
           R"( + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"})";
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
  v1::GenerateResponse last;
};

class Cluster {
 public:
  static std::unique_ptr<Cluster> Start() {
    const Models& models = TestModels();
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
                "--model=" + models.target, "--num_threads=1"},
               verify_address}},
             {&c->draft,
              {SpecdBinary("specd-draft"),
               {"--address=" + draft_address, absl::StrCat("--metrics_port=", PickFreePort()),
                "--model=" + models.draft, "--num_threads=1"},
               draft_address}},
             {&c->router,
              {SpecdBinary("specd-router"),
               {"--address=" + c->router_address,
                absl::StrCat("--metrics_port=", c->router_metrics), "--model=" + models.target,
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
      if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) r.last = chunk;
    }
    r.status = reader->Finish();
    return r;
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

TEST(HttpEdgeTest, ChatCompletionsPlainAndChatMl) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  Http plain = c->StartHttp();
  Http chatml = c->StartHttp({"--model_dir=" + TestModels().chatml_dir});
  ASSERT_NE(plain.process, nullptr);
  ASSERT_NE(chatml.process, nullptr);

  const json messages = json::array({{{"role", "system"}, {"content", "You are terse."}},
                                     {{"role", "user"}, {"content", "Hello"}}});
  struct Case {
    const Http* http;
    std::string prompt;
  };
  for (const Case& k : {Case{&plain, "system: You are terse.\nuser: Hello\nassistant:"},
                        Case{&chatml,
                             "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n"
                             "Hello<|im_end|>\n<|im_start|>assistant\n"}}) {
    SCOPED_TRACE(k.prompt);
    v1::GenerateRequest g;
    g.set_prompt(k.prompt);
    g.set_max_new_tokens(16);
    g.set_ignore_eos(true);
    const GrpcResult want = c->Generate(g);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();

    const json body = {
        {"model", "target"}, {"messages", messages}, {"max_tokens", 16}, {"ignore_eos", true}};
    const HttpReply reply = Post(k.http->port, "/v1/chat/completions", body.dump());
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json r = ParseJson(reply.body);
    EXPECT_EQ(r["object"], "chat.completion");
    EXPECT_TRUE(absl::StartsWith(r["id"].get<std::string>(), "chatcmpl-"));
    EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
    EXPECT_EQ(r["choices"][0]["message"]["content"], want.text);
    EXPECT_EQ(Ids(r["specd"]["token_ids"]), want.tokens);
    EXPECT_EQ(r["usage"]["prompt_tokens"], want.last.usage().prompt_tokens());

    json stream_body = body;
    stream_body["stream"] = true;
    const HttpReply sreply = Post(k.http->port, "/v1/chat/completions", stream_body.dump());
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
      {kC, R"({"prompt": "x", "n": 2})", 400, "n"},
      {kC, R"({"prompt": "x", "logprobs": 2})", 400, "logprobs"},
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
  // The seven cases above that only the router can judge reached it.
  EXPECT_EQ(Cluster::WaitForMetric(c->router_metrics, "specd_requests_total",
                                   {{"outcome", "invalid_argument"}}, 7),
            7);

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
