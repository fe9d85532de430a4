// GetModelInfo through real processes (specd-verify, specd-draft, specd-router and specd-http on
// loopback): the chat template the router's model folder holds, the context length in force (the
// smaller of the router's config and the verify service's, and what the router enforces), and
// the speculation modes of a cluster whose draft service has no model (n-gram only). specd-http's
// /v1/models/{id} reports the template it renders itself, --chat_template over the folder's.
// (A draft model's and an EAGLE head's modes: cpp_sdk_test, http_edge_test, eagle_cluster_test.)
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/testutil/cpu_cluster.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

// A copy of the cluster's random target model in `dst`.
std::string CopyTestModel(const std::string& dst) {
  absl::StatusOr<std::string> base = CpuCluster::TestTargetDir();
  EXPECT_TRUE(base.ok()) << base.status();
  if (!base.ok()) return "";
  std::error_code ec;
  fs::copy(*base, dst, fs::copy_options::recursive, ec);
  EXPECT_FALSE(ec) << ec.message();
  return dst;
}

// A specd-http in front of `router_address`, once its /health says 200 (null on failure).
std::unique_ptr<ServiceProcess> StartHttp(const std::string& router_address, int port,
                                          const std::vector<std::string>& extra_args) {
  std::vector<std::string> args = {absl::StrCat("--address=127.0.0.1:", port),
                                   "--router=" + router_address};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  absl::StatusOr<std::unique_ptr<ServiceProcess>> p =
      ServiceProcess::Spawn({SpecdBinary("specd-http"), args, absl::StrCat("127.0.0.1:", port)});
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return nullptr;
  const absl::Time end = absl::Now() + absl::Seconds(30);
  int status = 0;
  while (absl::Now() < end && (*p)->Running()) {
    absl::StatusOr<std::string> body = HttpGet("127.0.0.1", port, "/health", &status);
    if (body.ok() && status == 200) return *std::move(p);
    absl::SleepFor(absl::Milliseconds(50));
  }
  ADD_FAILURE() << "specd-http never became healthy (last status " << status << ")\n"
                << (*p)->Log();
  return nullptr;
}

// The "specd" object of specd-http's GET /v1/models/{id}.
json ModelExtension(int port, const std::string& id) {
  int status = 0;
  absl::StatusOr<std::string> body = HttpGet("127.0.0.1", port, "/v1/models/" + id, &status);
  EXPECT_TRUE(body.ok()) << body.status();
  if (!body.ok()) return json();
  EXPECT_EQ(status, 200) << *body;
  const json model = json::parse(*body, nullptr, /*allow_exceptions=*/false);
  return model.is_object() && model.contains("specd") ? model["specd"] : json();
}

TEST(ModelInfoTest, TemplateContextAndModesOfAnNgramOnlyCluster) {
  const std::string dir = MakeTempDir("model_info_test");
  // The router's folder: a template in tokenizer_config.json and a chat_template.jinja beside
  // it, which wins as in transformers.
  const std::string router_model = CopyTestModel(dir + "/router_model");
  ASSERT_FALSE(router_model.empty());
  WriteFile(router_model + "/tokenizer_config.json",
            json({{"chat_template", "config {{ messages | length }}"}}).dump());
  WriteFile(router_model + "/chat_template.jinja", "jinja {{ messages | length }}");
  // The verify service's: the same model with a shorter context.
  const std::string verify_model = CopyTestModel(dir + "/verify_model");
  ASSERT_FALSE(verify_model.empty());
  {
    std::ifstream in(verify_model + "/config.json");
    json config = json::parse(in);
    ASSERT_EQ(config["max_position_embeddings"], kCpuClusterMaxContext);
    config["max_position_embeddings"] = 1024;
    WriteFile(verify_model + "/config.json", config.dump(2));
  }
  // A draft service without a model: n-gram lookup over the vocabulary only.
  const std::string ngram_address = absl::StrCat("127.0.0.1:", PickFreePort());
  absl::StatusOr<std::unique_ptr<ServiceProcess>> ngram = ServiceProcess::Spawn(
      {SpecdBinary("specd-draft"),
       {"--address=" + ngram_address, absl::StrCat("--metrics_port=", PickFreePort()),
        absl::StrCat("--vocab_size=", kCpuClusterVocabSize), "--num_threads=1"},
       ngram_address});
  ASSERT_TRUE(ngram.ok()) << ngram.status();
  ASSERT_TRUE((*ngram)->WaitUntilServing(absl::Seconds(60)).ok()) << (*ngram)->Log();

  CpuClusterOptions options;
  options.draft = false;
  options.target_dir = router_model;
  options.verify_args = {"--model=" + verify_model};           // the last --model counts
  options.router_args = {"--draft_address=" + ngram_address};  // the last --draft_address too
  absl::StatusOr<std::unique_ptr<CpuCluster>> c = CpuCluster::Start(options);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(CpuCluster::WaitForMetric((*c)->router_metrics, "specd_draft_available", {}, 1).ok());
  std::unique_ptr<v1::Generation::Stub> stub = v1::Generation::NewStub((*c)->router->channel());

  grpc::ClientContext ctx;
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_TRUE(info.has_chat_template());
  EXPECT_EQ(info.chat_template_source(), "chat_template.jinja");
  EXPECT_EQ(info.max_context(), 1024u);
  EXPECT_TRUE(info.draft_available());
  EXPECT_EQ(std::vector<int>(info.speculation_modes().begin(), info.speculation_modes().end()),
            (std::vector<int>{v1::SPECULATION_AUTO, v1::SPECULATION_OFF, v1::SPECULATION_NGRAM}));

  // The context reported is the one enforced: a prompt that fits the router's config but not
  // the verify service's is refused, naming it.
  {
    grpc::ClientContext gen_ctx;
    v1::GenerateRequest request;
    for (int i = 0; i < 1100; ++i) request.mutable_prompt_ids()->add_ids(i % 200);
    request.set_max_new_tokens(1);
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
        stub->Generate(&gen_ctx, request);
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
    }
    const grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("context holds 1024"), std::string::npos)
        << status.error_message();
  }

  // specd-http reports the template it renders: the folder's, --chat_template's, or none.
  const std::string override_file = dir + "/override.jinja";
  WriteFile(override_file, "override {{ messages | length }}");
  struct Case {
    std::vector<std::string> args;
    json chat_template;
  };
  for (const Case& k : std::vector<Case>{
           {{"--model_dir=" + router_model}, "chat_template.jinja"},
           {{"--model_dir=" + router_model, "--chat_template=" + override_file}, "--chat_template"},
           {{}, nullptr},
       }) {
    SCOPED_TRACE(json(k.args).dump());
    const int port = PickFreePort();
    std::unique_ptr<ServiceProcess> http = StartHttp((*c)->router_address, port, k.args);
    ASSERT_NE(http, nullptr);
    // The router names the model as its verify service does.
    const json ext = ModelExtension(port, "verify_model");
    EXPECT_EQ(ext["chat_template"], k.chat_template) << ext.dump();
    EXPECT_EQ(ext["speculation_modes"], json({"auto", "off", "ngram"})) << ext.dump();
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace specd
