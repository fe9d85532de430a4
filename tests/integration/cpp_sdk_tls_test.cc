// TLS and tokens from the client side, with real certificates made by openssl in the test: the
// SDK and specd-cli against a scripted gRPC server with TLS, which records what the client
// sent (tests/integration/security_test.cc runs the SDK against the real TLS cluster). Trusted
// server, untrusted server, plaintext against TLS, mutual TLS with and without a client
// certificate, a server-name override, and the bearer token arriving with each call.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "gtest/gtest.h"
#include "specd/client.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/scripted_generation_server.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using absl::StatusCode;

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A CA, a second CA nobody trusts, and certificates signed by the first: "server" for
// localhost and 127.0.0.1, "named" for specd.test only, and "client" for mutual TLS.
struct Pki {
  std::string dir;
  std::string Path(const std::string& name) const { return dir + "/" + name; }
  std::string Pem(const std::string& name) const { return Read(Path(name)); }
};

const Pki& Certificates() {
  static const Pki* pki = [] {
    auto* p = new Pki{MakeTempDir("cpp_sdk_tls")};
    const std::string d = p->dir;
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    std::vector<std::string> cmds = {
        absl::StrCat("openssl req -x509 ", key, " -keyout ", d, "/ca.key -out ", d,
                     "/ca.pem -days 2 -subj /CN=specd-test-ca",
                     " -addext basicConstraints=critical,CA:TRUE",
                     " -addext keyUsage=critical,keyCertSign,cRLSign"),
        absl::StrCat("openssl req -x509 ", key, " -keyout ", d, "/other-ca.key -out ", d,
                     "/other-ca.pem -days 2 -subj /CN=other-ca",
                     " -addext basicConstraints=critical,CA:TRUE"),
    };
    const std::vector<std::pair<std::string, std::string>> leaves = {
        {"server", "subjectAltName=DNS:localhost,IP:127.0.0.1"},
        {"named", "subjectAltName=DNS:specd.test"},
        {"client", "extendedKeyUsage=clientAuth"}};
    for (const auto& [name, ext] : leaves) {
      std::ofstream(absl::StrCat(d, "/", name, ".ext")) << ext << "\n";
      cmds.push_back(absl::StrCat("openssl req ", key, " -keyout ", d, "/", name, ".key -out ", d,
                                  "/", name, ".csr -subj /CN=", name));
      cmds.push_back(absl::StrCat("openssl x509 -req -in ", d, "/", name, ".csr -CA ", d,
                                  "/ca.pem -CAkey ", d, "/ca.key -CAcreateserial -days 2 -out ", d,
                                  "/", name, ".pem -extfile ", d, "/", name, ".ext"));
    }
    std::ofstream(d + "/token") << "tls-token\n";
    for (const std::string& cmd : cmds) {
      const std::string quiet = cmd + " > /dev/null 2>&1";
      if (std::system(quiet.c_str()) != 0) ADD_FAILURE() << "failed: " << cmd;
    }
    std::atexit([] { std::system(("rm -rf " + Certificates().dir).c_str()); });
    return p;
  }();
  return *pki;
}

// A TLS server with the certificate `name`; with `require_client_cert`, it requires client
// certificates signed by the CA.
std::unique_ptr<ScriptedGenerationServer> StartTlsServer(const std::string& name,
                                                         bool require_client_cert = false) {
  const Pki& pki = Certificates();
  grpc::SslServerCredentialsOptions ssl(
      require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back({pki.Pem(name + ".key"), pki.Pem(name + ".pem")});
  if (require_client_cert) ssl.pem_root_certs = pki.Pem("ca.pem");
  absl::StatusOr<std::unique_ptr<ScriptedGenerationServer>> s =
      ScriptedGenerationServer::Start(grpc::SslServerCredentials(ssl));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

std::unique_ptr<Client> Connect(const std::string& address, std::optional<TlsOptions> tls,
                                const std::string& token = "") {
  ClientOptions options;
  options.target = address;
  options.tls = std::move(tls);
  options.bearer_token = token;
  options.retry.max_attempts = 1;  // a refused handshake is UNAVAILABLE: no need to repeat it
  options.default_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

TlsOptions TrustingCa(const std::string& ca = "ca.pem") {
  TlsOptions tls;
  tls.root_ca_pem = Certificates().Pem(ca);
  return tls;
}

TEST(CppSdkTlsTest, TrustedServerServesCallsAndGetsTheToken) {
  auto server = StartTlsServer("server");
  auto client = Connect(server->address(), TrustingCa(), "tls-token");
  const absl::StatusOr<ModelInfo> info = client->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->target_model, "scripted-target");
  GenerateRequest request;
  request.prompt = "hi";
  const absl::StatusOr<Completion> c = client->Generate(request);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->text, "1 2 3 ");
  const std::vector<ReceivedCall> calls = server->received();
  ASSERT_EQ(calls.size(), 2u);
  for (const ReceivedCall& r : calls) {
    EXPECT_EQ(r.metadata.find("authorization")->second, "Bearer tls-token");
  }
  // By DNS name too (the certificate names localhost).
  auto by_name = Connect(absl::StrCat("localhost:", server->port()), TrustingCa());
  EXPECT_TRUE(by_name->GetModelInfo().ok());
}

TEST(CppSdkTlsTest, UntrustedServersAndPlaintextAreRefused) {
  auto server = StartTlsServer("server");
  const absl::StatusOr<ModelInfo> untrusted =
      Connect(server->address(), TrustingCa("other-ca.pem"))->GetModelInfo();
  EXPECT_EQ(untrusted.status().code(), StatusCode::kUnavailable) << untrusted.status();
  const absl::StatusOr<ModelInfo> plaintext =
      Connect(server->address(), std::nullopt)->GetModelInfo();
  EXPECT_EQ(plaintext.status().code(), StatusCode::kUnavailable) << plaintext.status();
  EXPECT_EQ(server->received().size(), 0u);
}

TEST(CppSdkTlsTest, MutualTlsNeedsTheClientCertificate) {
  auto server = StartTlsServer("server", /*require_client_cert=*/true);
  const absl::StatusOr<ModelInfo> anonymous =
      Connect(server->address(), TrustingCa())->GetModelInfo();
  EXPECT_EQ(anonymous.status().code(), StatusCode::kUnavailable) << anonymous.status();
  EXPECT_EQ(server->received().size(), 0u);

  const Pki& pki = Certificates();
  absl::StatusOr<TlsOptions> tls =
      TlsOptions::FromFiles(pki.Path("ca.pem"), pki.Path("client.pem"), pki.Path("client.key"));
  ASSERT_TRUE(tls.ok()) << tls.status();
  const absl::StatusOr<ModelInfo> mutual = Connect(server->address(), *tls)->GetModelInfo();
  ASSERT_TRUE(mutual.ok()) << mutual.status();
  EXPECT_EQ(server->received().size(), 1u);
}

TEST(CppSdkTlsTest, ServerNameOverrideChecksTheCertificateAgainstThatName) {
  auto server = StartTlsServer("named");  // a certificate for specd.test only
  const absl::StatusOr<ModelInfo> mismatch =
      Connect(server->address(), TrustingCa())->GetModelInfo();
  EXPECT_EQ(mismatch.status().code(), StatusCode::kUnavailable) << mismatch.status();
  TlsOptions tls = TrustingCa();
  tls.server_name_override = "specd.test";
  const absl::StatusOr<ModelInfo> named = Connect(server->address(), tls)->GetModelInfo();
  EXPECT_TRUE(named.ok()) << named.status();
}

struct CliRun {
  int exit_code = -1;
  std::string out;  // stdout and stderr
};

CliRun RunCli(const std::string& args) {
  const std::string cmd = SpecdBinary("specd-cli") + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  CliRun run;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) run.out.append(buf, n);
  const int status = pclose(p);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

TEST(CppSdkTlsTest, CliSpeaksMutualTlsAndSendsTheTokenFile) {
  auto server = StartTlsServer("server", /*require_client_cert=*/true);
  const Pki& pki = Certificates();
  const std::string tls =
      absl::StrCat(" --server ", server->address(), " --tls-ca ", pki.Path("ca.pem"),
                   " --tls-cert ", pki.Path("client.pem"), " --tls-key ", pki.Path("client.key"),
                   " --token-file ", pki.Path("token"));
  const CliRun info = RunCli("info" + tls);
  EXPECT_EQ(info.exit_code, 0) << info.out;
  EXPECT_TRUE(absl::StrContains(info.out, "\"target_model\":\"scripted-target\"")) << info.out;
  const CliRun gen = RunCli("generate --prompt hi --json" + tls);
  EXPECT_EQ(gen.exit_code, 0) << gen.out;
  EXPECT_TRUE(absl::StrContains(gen.out, "\"finish_reason\":\"length\"")) << gen.out;
  const std::vector<ReceivedCall> calls = server->received();
  ASSERT_EQ(calls.size(), 2u);
  for (const ReceivedCall& r : calls) {
    EXPECT_EQ(r.metadata.find("authorization")->second, "Bearer tls-token");
  }

  // No client certificate: refused, and said so.
  const CliRun anonymous =
      RunCli(absl::StrCat("info --server ", server->address(), " --tls-ca ", pki.Path("ca.pem")));
  EXPECT_EQ(anonymous.exit_code, 1) << anonymous.out;
  EXPECT_TRUE(absl::StrContains(anonymous.out, "error: UNAVAILABLE: ")) << anonymous.out;
  // Bad flags are usage errors naming the flag.
  const CliRun missing =
      RunCli(absl::StrCat("info --server ", server->address(), " --tls-ca /nonexistent/ca.pem"));
  EXPECT_EQ(missing.exit_code, 2) << missing.out;
  EXPECT_TRUE(absl::StrContains(missing.out, "--tls-ca: cannot read /nonexistent/ca.pem"))
      << missing.out;
  const CliRun half = RunCli(
      absl::StrCat("info --server ", server->address(), " --tls-cert ", pki.Path("client.pem")));
  EXPECT_EQ(half.exit_code, 2) << half.out;
  EXPECT_TRUE(absl::StrContains(half.out, "--tls-key:")) << half.out;
  const CliRun no_token =
      RunCli(absl::StrCat("info --server ", server->address(), " --token-file /nonexistent/token"));
  EXPECT_EQ(no_token.exit_code, 2) << no_token.out;
  EXPECT_TRUE(absl::StrContains(no_token.out, "--token-file: cannot read")) << no_token.out;
  EXPECT_EQ(server->received().size(), 2u);
}

}  // namespace
}  // namespace specd
