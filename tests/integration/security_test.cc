// Transport security, bearer tokens and drain of a real cluster: specd-verify, specd-draft and
// specd-router as processes on loopback with certificates openssl makes for the test, spoken to
// through the C++ SDK and raw gRPC. Router to draft and verify is mutual TLS; the public API
// is TLS with bearer tokens. Also the fault suite with all of that on: router SIGTERM with
// streams in flight, verify SIGTERM and restart, draft SIGKILL; and the HTTPS edge's
// certificate rotation under a running stream.
#include <netinet/in.h>
#include <openssl/bn.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "specd/client.h"
#include "specd/v1/verify.grpc.pb.h"
#include "tests/testutil/cpu_cluster.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"
#include "tests/testutil/test_pki.h"

namespace specd {
namespace {

using absl::StatusCode;

const TestPki& Pki() {
  static const TestPki* pki = [] {
    absl::StatusOr<TestPki> p = MakeTestPki("security_test");
    EXPECT_TRUE(p.ok()) << p.status();
    return new TestPki(p.ok() ? *p : TestPki{});
  }();
  return *pki;
}

// Writes `text` to `path` by renaming a sibling file over it, as a rotation should.
void ReplaceFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".new";
  std::ofstream(tmp) << text;
  std::filesystem::rename(tmp, path);
}

std::shared_ptr<grpc::ChannelCredentials> Tls(const std::string& ca, const std::string& cert = "",
                                              const std::string& key = "") {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = Pki().Pem(ca);
  if (!cert.empty()) {
    ssl.pem_cert_chain = Pki().Pem(cert);
    ssl.pem_private_key = Pki().Pem(key);
  }
  return grpc::SslCredentials(ssl);
}

// The cluster's own files live in a folder of the test, so a test can rotate them.
struct SecureCluster {
  std::string dir;
  std::unique_ptr<CpuCluster> cluster;
  std::string Path(const std::string& f) const { return dir + "/" + f; }
};

std::unique_ptr<SecureCluster> StartSecureCluster(std::vector<std::string> extra_router_args = {}) {
  const TestPki& pki = Pki();
  auto s = std::make_unique<SecureCluster>();
  s->dir = MakeTempDir("security_cluster");
  for (const std::string f : {"server.pem", "server.key"}) {
    std::filesystem::copy_file(pki.Path(f), s->Path(f));
  }
  std::ofstream(s->Path("tokens")) << "# API tokens\nfirst-token\n\nsecond-token\n";
  const std::vector<std::string> service_tls = {"--tls_cert=" + pki.Path("server.pem"),
                                                "--tls_key=" + pki.Path("server.key"),
                                                "--tls_client_ca=" + pki.Path("ca.pem")};
  CpuClusterOptions options;
  options.verify_args = service_tls;
  options.draft_args = service_tls;
  options.router_args = {"--tls_cert=" + s->Path("server.pem"),
                         "--tls_key=" + s->Path("server.key"),
                         "--upstream_tls_ca=" + pki.Path("ca.pem"),
                         "--upstream_tls_cert=" + pki.Path("client.pem"),
                         "--upstream_tls_key=" + pki.Path("client.key"),
                         "--token_file=" + s->Path("tokens")};
  options.router_args.insert(options.router_args.end(), extra_router_args.begin(),
                             extra_router_args.end());
  options.router_credentials = Tls("ca.pem");
  options.upstream_credentials = Tls("ca.pem", "client.pem", "client.key");
  absl::StatusOr<std::unique_ptr<CpuCluster>> c = CpuCluster::Start(options);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  s->cluster = *std::move(c);
  return s;
}

std::unique_ptr<Client> Connect(const std::string& address, std::optional<TlsOptions> tls,
                                const std::string& token) {
  ClientOptions options;
  options.target = address;
  options.tls = std::move(tls);
  options.bearer_token = token;
  options.retry.max_attempts = 1;
  options.default_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

TlsOptions Trusting(const std::string& ca) {
  TlsOptions tls;
  tls.root_ca_pem = Pki().Pem(ca);
  return tls;
}

GenerateRequest Greedy(const std::string& prompt, uint32_t tokens, Speculation mode) {
  GenerateRequest r;
  r.prompt = prompt;
  r.max_new_tokens = tokens;
  r.temperature = 0.0f;
  r.ignore_eos = true;
  r.speculation = mode;
  return r;
}

// GetInfo on a verify service over `credentials`: how far an unknown client gets.
grpc::StatusCode VerifyGetInfo(const std::string& address,
                               std::shared_ptr<grpc::ChannelCredentials> credentials) {
  auto stub = v1::Verifier::NewStub(grpc::CreateChannel(address, credentials));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::VerifyInfo info;
  return stub->GetInfo(&context, v1::VerifyInfoRequest(), &info).error_code();
}

// "subject serial" of a PEM certificate.
std::string Identify(X509* cert) {
  if (cert == nullptr) return "";
  char subject[256] = {};
  X509_NAME_oneline(X509_get_subject_name(cert), subject, sizeof(subject));
  BIGNUM* bn = ASN1_INTEGER_to_BN(X509_get_serialNumber(cert), nullptr);
  char* hex = BN_bn2hex(bn);
  std::string out = absl::StrCat(subject, " ", hex);
  OPENSSL_free(hex);
  BN_free(bn);
  return out;
}

std::string CertificateInFile(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return "";
  X509* cert = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  std::string out = Identify(cert);
  X509_free(cert);
  return out;
}

// The certificate that a new TLS connection to 127.0.0.1:port is served ("subject serial"),
// whoever signed it; "" when the handshake fails.
std::string CertificateServed(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
    SSL* ssl = SSL_new(ctx);
    SSL_set_fd(ssl, fd);
    if (SSL_connect(ssl) == 1) {
      X509* cert = SSL_get1_peer_certificate(ssl);
      out = Identify(cert);
      X509_free(cert);
      SSL_shutdown(ssl);
    }
    SSL_free(ssl);
    SSL_CTX_free(ctx);
  }
  close(fd);
  return out;
}

TEST(SecurityTest, TlsClusterWithTokensServesIdenticalOutputsAndRefusesStrangers) {
  std::unique_ptr<SecureCluster> s = StartSecureCluster();
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;

  // The whole cluster works through TLS and mutual TLS, speculation included.
  auto client = Connect(c.router_address, Trusting("ca.pem"), "second-token");
  const absl::StatusOr<Completion> off =
      client->Generate(Greedy("def main():", 96, Speculation::kOff));
  ASSERT_TRUE(off.ok()) << off.status();
  for (Speculation mode : {Speculation::kDraftModel, Speculation::kNgram}) {
    GenerateRequest request = Greedy("def main():", 96, mode);
    if (mode == Speculation::kDraftModel) {
      // An explicit shape is drafted every step; the policy would draft only where it measures
      // a gain, possibly nowhere on a loaded host.
      request.draft_depth = 3;
      request.draft_top_k = 2;
      request.draft_max_nodes = 6;
    }
    const absl::StatusOr<Completion> spec = client->Generate(request);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->token_ids, off->token_ids);
    EXPECT_GT(spec->speculation.steps, 0u);
  }
  EXPECT_GT(CpuCluster::Metric(c.draft_metrics, "specd_step_tokens_total"), 0)
      << "the draft service was used over mutual TLS";

  // Tokens: none, a wrong one, and another scheme are UNAUTHENTICATED with nothing said about
  // the tokens; every RPC of the API is covered.
  for (const std::string token : {"", "first-token-", "first-toke", "wrong"}) {
    auto stranger = Connect(c.router_address, Trusting("ca.pem"), token);
    const absl::StatusOr<Completion> g = stranger->Generate(Greedy("x", 4, Speculation::kOff));
    EXPECT_EQ(g.status().code(), StatusCode::kUnauthenticated) << token << ": " << g.status();
    EXPECT_EQ(g.status().message(), "missing or invalid bearer token");
    EXPECT_EQ(stranger->Tokenize("x").status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(stranger->Detokenize({1}).status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(stranger->GetModelInfo().status().code(), StatusCode::kUnauthenticated);
  }
  {
    ClientOptions basic;
    basic.target = c.router_address;
    basic.tls = Trusting("ca.pem");
    basic.metadata = {{"authorization", "Basic Zmlyc3QtdG9rZW4="}};
    basic.retry.max_attempts = 1;
    auto other_scheme = *Client::Create(basic);
    EXPECT_EQ(other_scheme->GetModelInfo().status().code(), StatusCode::kUnauthenticated);
  }
  EXPECT_TRUE(Connect(c.router_address, Trusting("ca.pem"), "first-token")->Tokenize("x").ok());
  // specd-cli with the CA and a token file; without the token it reports UNAUTHENTICATED.
  std::ofstream(s->Path("cli-token")) << "first-token\n";
  const std::string cli = absl::StrCat(SpecdBinary("specd-cli"), " info --server ",
                                       c.router_address, " --tls-ca ", Pki().Path("ca.pem"));
  EXPECT_EQ(std::system((cli + " --token-file " + s->Path("cli-token") + " > /dev/null").c_str()),
            0);
  FILE* anonymous = popen((cli + " 2>&1").c_str(), "r");
  std::string out(4096, '\0');
  out.resize(fread(out.data(), 1, out.size(), anonymous));
  EXPECT_NE(pclose(anonymous), 0);
  EXPECT_NE(out.find("UNAUTHENTICATED"), std::string::npos) << out;
  // Health needs no token (probes and load balancers have none).
  EXPECT_EQ(*c.router->Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  int http = 0;
  HttpGet("127.0.0.1", c.router_metrics, "/health", &http).IgnoreError();
  EXPECT_EQ(http, 200);

  // The public port refuses plaintext and servers it cannot verify refuse it.
  EXPECT_EQ(Connect(c.router_address, std::nullopt, "first-token")->GetModelInfo().status().code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(Connect(c.router_address, Trusting("other-ca.pem"), "first-token")
                ->GetModelInfo()
                .status()
                .code(),
            StatusCode::kUnavailable);

  // The verify service serves only holders of a client certificate its CA signed.
  const std::string verify = c.verify->address();
  EXPECT_EQ(VerifyGetInfo(verify, grpc::InsecureChannelCredentials()),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(VerifyGetInfo(verify, Tls("ca.pem")), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(VerifyGetInfo(verify, Tls("ca.pem", "other-client.pem", "other-client.key")),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(VerifyGetInfo(verify, Tls("ca.pem", "client.pem", "client.key")), grpc::StatusCode::OK);
  // Reflection is off on the internal services unless asked for.
  EXPECT_FALSE(ListServicesByReflection(c.verify->channel()).ok());
  EXPECT_FALSE(ListServicesByReflection(c.draft->channel()).ok());

  // Token rotation: a new file replaces the old tokens after SIGHUP, no restart.
  ReplaceFile(s->Path("tokens"), "third-token\n");
  ASSERT_EQ(::kill(c.router->pid(), SIGHUP), 0);
  const absl::Time end = absl::Now() + absl::Seconds(10);
  auto third = Connect(c.router_address, Trusting("ca.pem"), "third-token");
  while (!third->GetModelInfo().ok() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(third->GetModelInfo().ok());
  EXPECT_EQ(client->GetModelInfo().status().code(), StatusCode::kUnauthenticated)
      << "the old token still works after rotation";
  // An emptied token file keeps the tokens it had (a half-written file must not lock out).
  ReplaceFile(s->Path("tokens"), "\n");
  ASSERT_EQ(::kill(c.router->pid(), SIGHUP), 0);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(third->GetModelInfo().ok());
  EXPECT_TRUE(c.router->Running());
}

TEST(SecurityTest, RotatedCertificateServesNewConnectionsAndRunningStreamsGoOn) {
  std::unique_ptr<SecureCluster> s = StartSecureCluster();
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;
  auto old_client = Connect(c.router_address, Trusting("ca.pem"), "first-token");
  std::unique_ptr<GenerateStream> stream =
      old_client->Stream(Greedy("class Tree:", 1500, Speculation::kAuto));
  Chunk chunk;
  ASSERT_TRUE(stream->Next(&chunk)) << stream->status();

  // The operator replaces certificate and key (a new CA) and sends SIGHUP.
  ReplaceFile(s->Path("server.key"), Pki().Pem("other-server.key"));
  ReplaceFile(s->Path("server.pem"), Pki().Pem("other-server.pem"));
  ASSERT_EQ(::kill(c.router->pid(), SIGHUP), 0);
  // A fresh client (a new connection) each time: a channel whose handshake failed waits out
  // its reconnect backoff.
  auto new_connection = [&] {
    return Connect(c.router_address, Trusting("other-ca.pem"), "first-token")
        ->GetModelInfo()
        .status();
  };
  const absl::Time end = absl::Now() + absl::Seconds(15);
  absl::Status seen = new_connection();
  while (!seen.ok() && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(200));
    seen = new_connection();
  }
  EXPECT_TRUE(seen.ok()) << "new connections never saw the new certificate: " << seen;
  // A new connection that trusts only the old CA is refused now.
  EXPECT_EQ(
      Connect(c.router_address, Trusting("ca.pem"), "first-token")->GetModelInfo().status().code(),
      StatusCode::kUnavailable);

  // The stream opened before the rotation runs to its end.
  CompletionBuilder builder;
  builder.Add(chunk);
  while (stream->Next(&chunk)) builder.Add(chunk);
  ASSERT_TRUE(stream->status().ok()) << stream->status();
  absl::StatusOr<Completion> done = std::move(builder).Finish();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->token_ids.size(), 1500u);
  EXPECT_TRUE(c.router->Running());
}

TEST(SecurityTest, RouterSigtermDrainsEightStreamsWithoutLoss) {
  std::unique_ptr<SecureCluster> s = StartSecureCluster({"--shutdown_grace_seconds=60"});
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;
  auto client = Connect(c.router_address, Trusting("ca.pem"), "first-token");
  constexpr int kStreams = 8;
  constexpr uint32_t kTokens = 600;
  std::vector<std::unique_ptr<GenerateStream>> streams;
  std::vector<CompletionBuilder> builders(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(
        client->Stream(Greedy(absl::StrCat("def f", i, "(x):"), kTokens,
                              i % 2 == 0 ? Speculation::kDraftModel : Speculation::kNgram)));
  }
  // Every stream is running (its first chunk arrived) when the signal comes.
  for (int i = 0; i < kStreams; ++i) {
    Chunk chunk;
    ASSERT_TRUE(streams[i]->Next(&chunk)) << streams[i]->status();
    builders[i].Add(chunk);
  }
  // All eight are running in the router when the signal comes.
  EXPECT_EQ(CpuCluster::Metric(c.router_metrics, "specd_requests_running"), kStreams);
  ASSERT_EQ(::kill(c.router->pid(), SIGTERM), 0);

  // At once: health NOT_SERVING and new requests UNAVAILABLE (a client retries elsewhere).
  ASSERT_TRUE(
      c.router->WaitForHealth(grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(2))
          .ok());
  const absl::StatusOr<Completion> late = client->Generate(Greedy("late", 4, Speculation::kOff));
  EXPECT_EQ(late.status().code(), StatusCode::kUnavailable) << late.status();

  // Every running stream completes.
  std::vector<std::thread> readers;
  std::atomic<int> completed{0};
  for (int i = 0; i < kStreams; ++i) {
    readers.emplace_back([&, i] {
      Chunk chunk;
      while (streams[i]->Next(&chunk)) builders[i].Add(chunk);
      if (!streams[i]->status().ok()) {
        ADD_FAILURE() << "stream " << i << ": " << streams[i]->status();
        return;
      }
      absl::StatusOr<Completion> done = std::move(builders[i]).Finish();
      if (done.ok() && done->token_ids.size() == kTokens &&
          done->finish_reason == FinishReason::kLength) {
        ++completed;
      }
    });
  }
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(completed.load(), kStreams);
  const absl::StatusOr<int> exit_code = c.router->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

TEST(SecurityTest, RouterSigtermCancelsStreamsLeftAfterTheGracePeriod) {
  std::unique_ptr<SecureCluster> s = StartSecureCluster({"--shutdown_grace_seconds=0"});
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;
  auto client = Connect(c.router_address, Trusting("ca.pem"), "first-token");
  std::unique_ptr<GenerateStream> stream =
      client->Stream(Greedy("while True:", 1900, Speculation::kOff));
  Chunk chunk;
  ASSERT_TRUE(stream->Next(&chunk)) << stream->status();
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(::kill(c.router->pid(), SIGTERM), 0);
  while (stream->Next(&chunk)) {
  }
  EXPECT_EQ(stream->status().code(), StatusCode::kUnavailable) << stream->status();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(10));
  const absl::StatusOr<int> exit_code = c.router->WaitForExit(absl::Seconds(10));
  ASSERT_TRUE(exit_code.ok()) << exit_code.status();
  EXPECT_EQ(*exit_code, 0);
}

// A verify service stopped gracefully (SIGTERM, a rolling restart) with mutual TLS and tokens
// on: the router sees it at once, refuses meanwhile with UNAVAILABLE, and once a new verify
// process is up no request fails (none dies on the stream the old process closed, nor on a
// handshake with the new one).
TEST(SecurityTest, VerifySigtermAndRestartLoseNoRequestOnceItIsBack) {
  std::unique_ptr<SecureCluster> s = StartSecureCluster();
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;
  auto client = Connect(c.router_address, Trusting("ca.pem"), "first-token");
  constexpr int kRequests = 8;
  std::vector<std::vector<int32_t>> reference(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    absl::StatusOr<Completion> r =
        client->Generate(Greedy(absl::StrCat("def g", i, "():"), 48, Speculation::kOff));
    ASSERT_TRUE(r.ok()) << r.status();
    reference[i] = r->token_ids;
  }

  ASSERT_EQ(::kill(c.verify->pid(), SIGTERM), 0);
  const absl::Time stopped = absl::Now();
  const absl::Status down =
      c.router->WaitForHealth(grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(3));
  ASSERT_TRUE(down.ok()) << down << "\n" << c.router->Log();
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(2));
  const absl::StatusOr<int> code = c.verify->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_EQ(client->Generate(Greedy("x", 4, Speculation::kOff)).status().code(),
            StatusCode::kUnavailable);

  c.verify.reset();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> verify = ServiceProcess::Start(c.verify_options);
  ASSERT_TRUE(verify.ok()) << verify.status();
  c.verify = *std::move(verify);
  ASSERT_TRUE(c.router->WaitUntilServing(absl::Seconds(20)).ok()) << c.router->Log();

  // Once it is back: every request succeeds with the outputs of before, concurrent ones
  // (draft model and n-gram speculation) and then one after another.
  std::vector<absl::StatusOr<Completion>> results(kRequests, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      results[i] =
          client->Generate(Greedy(absl::StrCat("def g", i, "():"), 48,
                                  i % 2 == 0 ? Speculation::kDraftModel : Speculation::kNgram));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    EXPECT_EQ(results[i]->token_ids, reference[i]) << "request " << i;
  }
  for (int i = 0; i < kRequests; ++i) {
    const absl::StatusOr<Completion> again =
        client->Generate(Greedy(absl::StrCat("def g", i, "():"), 48, Speculation::kAuto));
    ASSERT_TRUE(again.ok()) << i << ": " << again.status();
    EXPECT_EQ(again->token_ids, reference[i]);
  }
  EXPECT_TRUE(c.router->Running());
}

TEST(SecurityTest, KilledDraftServiceLeavesOutputsIdenticalOverTls) {
  std::unique_ptr<SecureCluster> s = StartSecureCluster();
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;
  auto client = Connect(c.router_address, Trusting("ca.pem"), "first-token");
  constexpr int kStreams = 8;
  constexpr uint32_t kTokens = 400;
  std::vector<std::vector<int32_t>> reference(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    absl::StatusOr<Completion> r =
        client->Generate(Greedy(absl::StrCat("import m", i), kTokens, Speculation::kOff));
    ASSERT_TRUE(r.ok()) << r.status();
    reference[i] = r->token_ids;
  }
  std::vector<std::unique_ptr<GenerateStream>> streams;
  std::vector<CompletionBuilder> builders(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(
        client->Stream(Greedy(absl::StrCat("import m", i), kTokens, Speculation::kDraftModel)));
  }
  for (int i = 0; i < kStreams; ++i) {
    Chunk chunk;
    ASSERT_TRUE(streams[i]->Next(&chunk)) << streams[i]->status();
    builders[i].Add(chunk);
  }
  ASSERT_EQ(::kill(c.draft->pid(), SIGKILL), 0);
  for (int i = 0; i < kStreams; ++i) {
    Chunk chunk;
    while (streams[i]->Next(&chunk)) builders[i].Add(chunk);
    ASSERT_TRUE(streams[i]->status().ok()) << i << ": " << streams[i]->status();
    absl::StatusOr<Completion> done = std::move(builders[i]).Finish();
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->token_ids, reference[i]) << "stream " << i;
  }
  EXPECT_EQ(CpuCluster::Metric(c.router_metrics, "specd_draft_available"), 0);
}

TEST(SecurityTest, HttpEdgeServesHttpsWithApiKeysAndReachesTheRouterOverTls) {
  // OpenSSL writes to sockets the server closed (plaintext and untrusting clients below).
  ::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<SecureCluster> s = StartSecureCluster();
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;
  std::ofstream(s->Path("api-keys")) << "sk-edge\n";
  std::ofstream(s->Path("router-token")) << "second-token\n";
  const int port = PickFreePort();
  const TestPki& pki = Pki();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> edge = ServiceProcess::Spawn(
      {SpecdBinary("specd-http"),
       {absl::StrCat("--address=127.0.0.1:", port), "--router=" + c.router_address,
        "--tls_cert=" + pki.Path("server.pem"), "--tls_key=" + pki.Path("server.key"),
        "--token_file=" + s->Path("api-keys"), "--router_tls_ca=" + pki.Path("ca.pem"),
        "--router_token_file=" + s->Path("router-token"), "--threads=4"},
       absl::StrCat("127.0.0.1:", port)});
  ASSERT_TRUE(edge.ok()) << edge.status();
  httplib::SSLClient https("localhost", port);
  https.set_ca_cert_path(pki.Path("ca.pem").c_str());
  https.enable_server_certificate_verification(true);
  https.set_read_timeout(60, 0);
  // /health is open, and 200 only once the edge reaches the router (TLS + token).
  int health = 0;
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (health != 200 && absl::Now() < end) {
    httplib::Result r = https.Get("/health");
    health = r ? r->status : 0;
    if (health != 200) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(health, 200) << (*edge)->Log();

  const std::string body = R"({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})";
  httplib::Result anonymous = https.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(anonymous);
  EXPECT_EQ(anonymous->status, 401);
  EXPECT_EQ(nlohmann::json::parse(anonymous->body)["error"]["message"],
            "missing or invalid bearer token");
  EXPECT_EQ(
      https
          .Post("/v1/completions", {{"Authorization", "Bearer sk-edge2"}}, body, "application/json")
          ->status,
      401);
  EXPECT_EQ(https.Get("/v1/models")->status, 401);
  httplib::Result ok = https.Post("/v1/completions", {{"Authorization", "Bearer sk-edge"}}, body,
                                  "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(nlohmann::json::parse(ok->body)["usage"]["completion_tokens"], 8);

  // Plaintext HTTP on the HTTPS port gets no answer; a client that does not trust the CA
  // refuses the server.
  httplib::Client plain("127.0.0.1", port);
  plain.set_read_timeout(5, 0);
  httplib::Result p = plain.Get("/health");
  EXPECT_TRUE(!p || p->status != 200);
  httplib::SSLClient untrusting("localhost", port);
  untrusting.set_ca_cert_path(pki.Path("other-ca.pem").c_str());
  untrusting.enable_server_certificate_verification(true);
  EXPECT_FALSE(untrusting.Get("/health"));
}

// The HTTPS edge reads its certificate again on SIGHUP and when the files change: new
// connections get the new one (its subject and serial), while a stream that began under the
// old one runs to its end on its connection.
TEST(SecurityTest, HttpsEdgeRotatesItsCertificateAndARunningStreamGoesOn) {
  ::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<SecureCluster> s = StartSecureCluster();
  ASSERT_NE(s, nullptr);
  CpuCluster& c = *s->cluster;
  const TestPki& pki = Pki();
  std::filesystem::copy_file(pki.Path("server.pem"), s->Path("edge.pem"));
  std::filesystem::copy_file(pki.Path("server.key"), s->Path("edge.key"));
  std::ofstream(s->Path("router-token")) << "first-token\n";
  const int port = PickFreePort();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> edge = ServiceProcess::Spawn(
      {SpecdBinary("specd-http"),
       {absl::StrCat("--address=127.0.0.1:", port), "--router=" + c.router_address,
        "--tls_cert=" + s->Path("edge.pem"), "--tls_key=" + s->Path("edge.key"),
        "--router_tls_ca=" + pki.Path("ca.pem"), "--router_token_file=" + s->Path("router-token")},
       absl::StrCat("127.0.0.1:", port)});
  ASSERT_TRUE(edge.ok()) << edge.status();
  auto health = [&](const std::string& ca) {
    httplib::SSLClient https("localhost", port);
    https.set_ca_cert_path(pki.Path(ca).c_str());
    https.enable_server_certificate_verification(true);
    httplib::Result r = https.Get("/health");
    return r ? r->status : 0;
  };
  const absl::Time up = absl::Now() + absl::Seconds(30);
  while (health("ca.pem") != 200 && absl::Now() < up) absl::SleepFor(absl::Milliseconds(100));
  ASSERT_EQ(health("ca.pem"), 200) << (*edge)->Log();
  const std::string first = CertificateInFile(pki.Path("server.pem"));
  const std::string second = CertificateInFile(pki.Path("other-server.pem"));
  ASSERT_NE(first, second);
  EXPECT_EQ(CertificateServed(port), first);

  // A long stream, read on its own connection while the certificate changes.
  std::atomic<bool> streaming_done{false};
  absl::Notification first_event;
  std::string events;
  int stream_status = 0;
  std::thread reader([&] {
    httplib::SSLClient https("localhost", port);
    https.set_ca_cert_path(pki.Path("ca.pem").c_str());
    https.enable_server_certificate_verification(true);
    https.set_read_timeout(120, 0);
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.headers = {{"Content-Type", "application/json"}};
    req.body =
        R"({"prompt": "while True:", "max_tokens": 1900, "temperature": 0, "stream": true,)"
        R"( "ignore_eos": true, "speculation": "off", "stream_options": {"include_usage": true}})";
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      events.append(data, n);
      if (!first_event.HasBeenNotified()) first_event.Notify();
      return true;
    };
    httplib::Result r = https.send(req);
    stream_status = r ? r->status : 0;
    streaming_done = true;
    if (!first_event.HasBeenNotified()) first_event.Notify();
  });
  ASSERT_TRUE(first_event.WaitForNotificationWithTimeout(absl::Seconds(60)));

  // Rotation with SIGHUP while the stream runs: the very next connection has the new
  // certificate (and only clients of the new CA accept it).
  ReplaceFile(s->Path("edge.key"), pki.Pem("other-server.key"));
  ReplaceFile(s->Path("edge.pem"), pki.Pem("other-server.pem"));
  ASSERT_EQ(::kill((*edge)->pid(), SIGHUP), 0);
  absl::SleepFor(absl::Milliseconds(100));  // the signal is counted on the edge's own thread
  EXPECT_EQ(CertificateServed(port), second) << (*edge)->Log();
  EXPECT_FALSE(streaming_done.load()) << "the stream ended before the rotation";
  EXPECT_EQ(health("other-ca.pem"), 200);
  EXPECT_EQ(health("ca.pem"), 0) << "a client trusting only the old CA was served";

  // A half-done rotation (a key that is not the certificate's) keeps the working pair.
  ReplaceFile(s->Path("edge.key"), pki.Pem("server.key"));
  ASSERT_EQ(::kill((*edge)->pid(), SIGHUP), 0);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(CertificateServed(port), second);
  EXPECT_EQ(health("other-ca.pem"), 200);

  // Rotation by the files alone (as a Kubernetes Secret update does), completing the half-done
  // one: seen by new connections within the polling period.
  ReplaceFile(s->Path("edge.pem"), pki.Pem("server.pem"));
  const absl::Time end = absl::Now() + absl::Seconds(15);
  std::string served = CertificateServed(port);
  while (served != first && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(200));
    served = CertificateServed(port);
  }
  EXPECT_EQ(served, first) << (*edge)->Log();
  EXPECT_EQ(health("ca.pem"), 200);

  // The stream that began before all this ends normally with every token.
  reader.join();
  EXPECT_EQ(stream_status, 200);
  EXPECT_EQ(events.find("\"error\""), std::string::npos) << events.substr(0, 2000);
  EXPECT_NE(events.find("\"completion_tokens\":1900"), std::string::npos)
      << events.substr(events.size() > 2000 ? events.size() - 2000 : 0);
  EXPECT_NE(events.rfind("data: [DONE]"), std::string::npos);
  EXPECT_TRUE((*edge)->Running());
}

}  // namespace
}  // namespace specd
