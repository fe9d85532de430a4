// Token files and TLS file checks of common/service/tls_options.h.
#include "common/service/tls_options.h"

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "common/signals.h"
#include "gtest/gtest.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

void Write(const std::string& path, const std::string& text) {
  std::ofstream(path + ".new") << text;
  std::filesystem::rename(path + ".new", path);
}

TEST(TlsOptionsTest, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secre"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
}

TEST(TlsOptionsTest, TokenFileSkipsCommentsAndBlankLinesAndParsesTheScheme) {
  const std::string dir = MakeTempDir("tls_options_test");
  Write(dir + "/tokens", "# comment\n\n  alpha  \nbeta\r\n");
  absl::StatusOr<std::unique_ptr<BearerTokens>> t = BearerTokens::Load(dir + "/tokens", "--tf");
  ASSERT_TRUE(t.ok()) << t.status();
  BearerTokens& tokens = **t;
  EXPECT_TRUE(tokens.Accepts("alpha"));
  EXPECT_TRUE(tokens.Accepts("beta"));
  EXPECT_FALSE(tokens.Accepts("# comment"));
  EXPECT_FALSE(tokens.Accepts(""));
  EXPECT_EQ(tokens.First(), "alpha");
  EXPECT_TRUE(tokens.AcceptsAuthorization("Bearer alpha"));
  EXPECT_TRUE(tokens.AcceptsAuthorization("bearer beta"));
  EXPECT_TRUE(tokens.AcceptsAuthorization("BEARER   alpha "));
  EXPECT_FALSE(tokens.AcceptsAuthorization("alpha"));
  EXPECT_FALSE(tokens.AcceptsAuthorization("Basic alpha"));
  EXPECT_FALSE(tokens.AcceptsAuthorization("Bearer"));
  EXPECT_FALSE(tokens.AcceptsAuthorization("Bearer "));
  EXPECT_FALSE(tokens.AcceptsAuthorization("Bearer alph"));
  std::filesystem::remove_all(dir);
}

TEST(TlsOptionsTest, TokenFileErrorsNameTheFlag) {
  const std::string dir = MakeTempDir("tls_options_test");
  absl::StatusOr<std::unique_ptr<BearerTokens>> missing =
      BearerTokens::Load(dir + "/none", "--token_file");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message().rfind("--token_file: ", 0), 0u) << missing.status();
  Write(dir + "/empty", "# nothing\n\n");
  absl::StatusOr<std::unique_ptr<BearerTokens>> empty =
      BearerTokens::Load(dir + "/empty", "--token_file");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("holds no token"), absl::string_view::npos);
  std::filesystem::remove_all(dir);
}

TEST(TlsOptionsTest, TokensRotateOnSighupAndAnEmptiedFileKeepsThem) {
  WatchTerminationSignals();  // installs the SIGHUP handler
  const std::string dir = MakeTempDir("tls_options_test");
  Write(dir + "/tokens", "old\n");
  std::unique_ptr<BearerTokens> tokens = *BearerTokens::Load(dir + "/tokens", "--tf");
  EXPECT_TRUE(tokens->Accepts("old"));
  Write(dir + "/tokens", "new\n");
  ASSERT_EQ(::raise(SIGHUP), 0);
  EXPECT_TRUE(tokens->Accepts("new"));
  EXPECT_FALSE(tokens->Accepts("old"));
  Write(dir + "/tokens", "\n");
  ASSERT_EQ(::raise(SIGHUP), 0);
  EXPECT_TRUE(tokens->Accepts("new"));
  // Without a signal, a change is seen within about a second.
  Write(dir + "/tokens", "newer-and-longer\n");
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (!tokens->Accepts("newer-and-longer") && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(tokens->Accepts("newer-and-longer"));
  std::filesystem::remove_all(dir);
}

TEST(TlsOptionsTest, TlsFileChecksNameTheFlag) {
  const std::string dir = MakeTempDir("tls_options_test");
  Write(dir + "/cert.pem", "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n");
  Write(dir + "/key.pem", "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n");
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem";
  EXPECT_TRUE(CheckServerTlsFiles({}, "--tls_").ok());
  EXPECT_TRUE(CheckServerTlsFiles({cert, key, cert}, "--tls_").ok());
  auto message = [](const absl::Status& s) { return std::string(s.message()); };
  EXPECT_EQ(message(CheckServerTlsFiles({cert, "", ""}, "--tls_")).rfind("--tls_cert and", 0), 0u);
  EXPECT_EQ(message(CheckServerTlsFiles({"", "", cert}, "--tls_")).rfind("--tls_cert:", 0), 0u);
  EXPECT_EQ(
      message(CheckServerTlsFiles({cert, dir + "/none", ""}, "--tls_")).rfind("--tls_key:", 0), 0u);
  EXPECT_EQ(message(CheckServerTlsFiles({key, cert, ""}, "--tls_")).rfind("--tls_cert:", 0), 0u)
      << "a key where the certificate belongs";
  EXPECT_EQ(message(CheckChannelTlsFiles({dir + "/none", "", ""}, "--upstream_tls_"))
                .rfind("--upstream_tls_ca:", 0),
            0u);
  EXPECT_TRUE(CheckChannelTlsFiles({cert, cert, key}, "--upstream_tls_").ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace specd
