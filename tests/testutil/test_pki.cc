#include "tests/testutil/test_pki.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {

std::string TestPki::Pem(const std::string& file) const {
  std::ifstream in(Path(file));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

absl::StatusOr<TestPki> MakeTestPki(const std::string& prefix) {
  TestPki pki{MakeTempDir(prefix)};
  const std::string& d = pki.dir;
  const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  std::vector<std::string> cmds;
  for (const std::string ca : {"ca", "other-ca"}) {
    cmds.push_back(absl::StrCat("openssl req -x509 ", key, " -keyout ", d, "/", ca, ".key -out ", d,
                                "/", ca, ".pem -days 2 -subj /CN=specd-test-", ca,
                                " -addext basicConstraints=critical,CA:TRUE",
                                " -addext keyUsage=critical,keyCertSign,cRLSign"));
  }
  std::ofstream(d + "/server.ext") << "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                   << "extendedKeyUsage=serverAuth\n";
  std::ofstream(d + "/named-server.ext") << "subjectAltName=DNS:localhost\n"
                                         << "extendedKeyUsage=serverAuth\n";
  std::ofstream(d + "/client.ext") << "extendedKeyUsage=clientAuth\n";
  const std::vector<std::pair<std::string, std::string>> leaves = {{"server", "ca"},
                                                                   {"client", "ca"},
                                                                   {"other-server", "other-ca"},
                                                                   {"other-client", "other-ca"},
                                                                   {"named-server", "ca"}};
  for (const auto& [name, ca] : leaves) {
    const std::string ext = name == "named-server"                     ? name
                            : name.find("server") != std::string::npos ? "server"
                                                                       : "client";
    cmds.push_back(absl::StrCat("openssl req ", key, " -keyout ", d, "/", name, ".key -out ", d,
                                "/", name, ".csr -subj /CN=", name));
    cmds.push_back(absl::StrCat("openssl x509 -req -in ", d, "/", name, ".csr -CA ", d, "/", ca,
                                ".pem -CAkey ", d, "/", ca, ".key -CAcreateserial -days 2 -out ", d,
                                "/", name, ".pem -extfile ", d, "/", ext, ".ext"));
  }
  for (const std::string& cmd : cmds) {
    const std::string quiet = cmd + " > /dev/null 2>&1";
    if (std::system(quiet.c_str()) != 0) return absl::InternalError("failed: " + cmd);
  }
  static std::vector<std::string>* dirs = [] {
    auto* v = new std::vector<std::string>();
    std::atexit([] {
      for (const std::string& dir : *dirs) std::system(("rm -rf " + dir).c_str());
    });
    return v;
  }();
  dirs->push_back(d);
  return pki;
}

}  // namespace specd
