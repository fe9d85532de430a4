// Real X.509 certificates for TLS tests, made with the openssl command line in a temporary
// folder: two CAs and leaves signed by each.
#ifndef SPECD_TESTS_TESTUTIL_TEST_PKI_H_
#define SPECD_TESTS_TESTUTIL_TEST_PKI_H_

#include <string>

#include "absl/status/statusor.h"

namespace specd {

// Files in dir(), each NAME.pem with its key NAME.key:
//   ca, other-ca            self-signed CAs
//   server, client          signed by ca: server for localhost and 127.0.0.1, client for
//                           client authentication
//   other-server, other-client  the same, signed by other-ca
//   named-server            signed by ca for the DNS name localhost alone (no address)
struct TestPki {
  std::string dir;
  std::string Path(const std::string& file) const { return dir + "/" + file; }
  std::string Pem(const std::string& file) const;  // the file's contents
};

// Makes the certificates in a new temporary folder (removed at exit). EC P-256 keys, valid two
// days.
absl::StatusOr<TestPki> MakeTestPki(const std::string& prefix);

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_TEST_PKI_H_
