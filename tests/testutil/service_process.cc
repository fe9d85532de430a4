#include "tests/testutil/service_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/service/grpc_util.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "tests/testutil/random_checkpoint.h"

#ifndef SPECD_BINARY_DIR
#error "SPECD_BINARY_DIR must name the CMake build tree"
#endif

namespace specd {

std::string SpecdBinary(const std::string& name) {
  return absl::StrCat(SPECD_BINARY_DIR, "/bin/", name);
}

// Claims `port` among the test processes of this machine for the life of this process: an
// exclusive flock on <tmp>/specd-test-ports/<port>, released by the kernel when the process
// ends, however it ends. Without it, two test executables running in parallel (ctest -j) could
// both find a port free and hand it to two services, the second of which fails to listen.
// Returns true when the port is ours, or when the lock directory is unusable (then only the
// bind check below guards the port, as before).
bool ClaimPortAmongTestProcesses(int port) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                       "/specd-test-ports");
  if (mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) return true;
  const std::string path = absl::StrCat(dir, "/", port);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return true;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    close(fd);
    return false;  // another test process holds it
  }
  return true;  // fd stays open (and locked) until this process exits
}

// Ports come from [20000, 32000), below Linux's ephemeral range (32768-60999 by default):
// a port the kernel handed out with bind(0) can be taken again by any outgoing connection
// (gRPC clients of tests running in parallel) before the service binds it. Candidates are
// drawn at random per process, claimed against the other test processes, checked bindable,
// and never handed out twice by one process.
int PickFreePort() {
  static std::mutex mu;
  static std::set<int> given;
  static std::mt19937 rng(static_cast<uint32_t>(getpid()) * 2654435761u ^
                          static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
  std::lock_guard<std::mutex> lock(mu);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = 20000 + static_cast<int>(rng() % 12000);
    if (given.count(port) > 0) continue;
    if (!ClaimPortAmongTestProcesses(port)) continue;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) {
      given.insert(port);
      return port;
    }
  }
  return -1;
}

absl::StatusOr<std::unique_ptr<ServiceProcess>> ServiceProcess::Spawn(
    const ServiceProcessOptions& options) {
  if (access(options.binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(options.binary, ": not an executable"));
  }
  std::unique_ptr<ServiceProcess> p(new ServiceProcess(options));
  const std::string dir = MakeTempDir("specd-service-log");
  const size_t slash = options.binary.rfind('/');
  p->log_path_ = absl::StrCat(dir, "/", options.binary.substr(slash + 1), ".log");
  const int log_fd = open(p->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return absl::InternalError(absl::StrCat(p->log_path_, ": ", std::strerror(errno)));
  }
  // Everything the child needs is built before fork(): after it, in a process with gRPC
  // threads, only async-signal-safe calls are allowed.
  std::vector<std::string> strings = {options.binary};
  strings.insert(strings.end(), options.args.begin(), options.args.end());
  std::vector<char*> argv;
  for (std::string& s : strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(log_fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // A crashed or killed test must not leave services behind.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(log_fd);
  p->pid_ = pid;
  return p;
}

absl::StatusOr<std::unique_ptr<ServiceProcess>> ServiceProcess::Start(
    const ServiceProcessOptions& options, absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<ServiceProcess>> p = Spawn(options);
  if (!p.ok()) return p;
  if (absl::Status s = (*p)->WaitUntilServing(timeout); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "\n--- log of ", options.binary,
                                               " ---\n", (*p)->Log()));
  }
  return p;
}

ServiceProcess::~ServiceProcess() {
  // Whether the child was still alive tells a crash from a clean stop when a test failed.
  const bool was_running = Running();
  if (was_running) (void)Stop(SIGTERM, absl::Seconds(10));
  if (::testing::Test::HasFailure()) {
    std::fprintf(stderr, "--- log of %s (%s, exit code %d) ---\n%s\n", options_.binary.c_str(),
                 was_running ? "stopped by the test" : "had already exited", exit_code_,
                 Log().c_str());
  }
}

std::shared_ptr<grpc::Channel> ServiceProcess::channel() {
  if (channel_ == nullptr) {
    grpc::ChannelArguments args = ServiceChannelArguments();
    // The child is usually not listening yet at the first attempt; retry quickly instead of
    // gRPC's default 1 s backoff.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
    channel_ = grpc::CreateCustomChannel(
        options_.grpc_address,
        options_.credentials ? options_.credentials : grpc::InsecureChannelCredentials(), args);
  }
  return channel_;
}

absl::StatusOr<HealthStatus> ServiceProcess::Health(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  // Wait for the connection (within the deadline) instead of failing fast while the child
  // starts or the channel backs off between connection attempts.
  context.set_wait_for_ready(true);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status();
}

absl::Status ServiceProcess::WaitForHealth(HealthStatus want, absl::Duration timeout) {
  const std::string want_name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(want);
  const absl::Time end = absl::Now() + timeout;
  absl::Status last = absl::UnavailableError("no health check answered yet");
  while (absl::Now() < end) {
    if (!Running()) {
      return absl::FailedPreconditionError(absl::StrCat(
          options_.binary, " exited with code ", exit_code_, " before answering ", want_name));
    }
    absl::StatusOr<HealthStatus> health = Health();
    if (health.ok() && *health == want) return absl::OkStatus();
    last = health.ok() ? absl::UnavailableError(
                             grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*health))
                       : health.status();
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat(options_.binary, " not ", want_name, " after ",
                                                  absl::FormatDuration(timeout), ": ",
                                                  last.message()));
}

absl::Status ServiceProcess::WaitUntilServing(absl::Duration timeout) {
  return WaitForHealth(grpc::health::v1::HealthCheckResponse::SERVING, timeout);
}

bool ServiceProcess::Running() {
  if (pid_ <= 0 || exit_code_ >= 0) return false;
  int wstatus = 0;
  const pid_t r = waitpid(pid_, &wstatus, WNOHANG);
  if (r == 0) return true;
  if (r == pid_) {
    exit_code_ = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
  } else {
    exit_code_ = 255;  // not our child any more; nothing to wait for
  }
  return false;
}

absl::StatusOr<int> ServiceProcess::WaitForExit(absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() >= end) {
      return absl::DeadlineExceededError(
          absl::StrCat(options_.binary, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return exit_code_;
}

absl::StatusOr<int> ServiceProcess::Stop(int sig, absl::Duration timeout) {
  if (!Running()) return exit_code_;
  kill(pid_, sig);
  absl::StatusOr<int> code = WaitForExit(timeout);
  if (code.ok()) return code;
  kill(pid_, SIGKILL);
  (void)WaitForExit(absl::Seconds(10));
  return absl::DeadlineExceededError(absl::StrCat(options_.binary, " ignored signal ", sig, " for ",
                                                  absl::FormatDuration(timeout),
                                                  " and was killed"));
}

std::string ServiceProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::vector<std::string>> ListServicesByReflection(
    std::shared_ptr<grpc::Channel> channel) {
  // Referencing the plugin keeps libgrpc++_reflection, and so its descriptors, linked in.
  (void)&grpc::reflection::InitProtoReflectionServerBuilderPlugin;
  const google::protobuf::DescriptorPool* pool = google::protobuf::DescriptorPool::generated_pool();
  const google::protobuf::Descriptor* request_type =
      pool->FindMessageTypeByName("grpc.reflection.v1alpha.ServerReflectionRequest");
  const google::protobuf::Descriptor* response_type =
      pool->FindMessageTypeByName("grpc.reflection.v1alpha.ServerReflectionResponse");
  if (request_type == nullptr || response_type == nullptr) {
    return absl::FailedPreconditionError("the reflection descriptors are not linked in");
  }
  google::protobuf::MessageFactory* factory = google::protobuf::MessageFactory::generated_factory();
  std::unique_ptr<google::protobuf::Message> request(factory->GetPrototype(request_type)->New());
  request->GetReflection()->SetString(request.get(), request_type->FindFieldByName("list_services"),
                                      "*");
  const std::string bytes = request->SerializeAsString();
  grpc::Slice slice(bytes);
  grpc::ByteBuffer out(&slice, 1);

  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  // The operations run one at a time, so each completion is the one just started.
  auto wait = [&cq]() {
    void* tag = nullptr;
    bool ok = false;
    return cq.Next(&tag, &ok) && ok;
  };
  grpc::ByteBuffer in;
  grpc::Status status;
  call->StartCall(nullptr);
  bool ok = wait();
  if (ok) {
    call->Write(out, nullptr);
    ok = wait();
  }
  if (ok) {
    call->WritesDone(nullptr);
    ok = wait();
  }
  bool read = false;
  if (ok) {
    call->Read(&in, nullptr);
    read = wait();
  }
  call->Finish(&status, nullptr);
  wait();
  cq.Shutdown();
  while (wait()) {
  }
  if (!status.ok()) return FromGrpcStatus(status);
  if (!read) return absl::UnavailableError("reflection: no response");
  std::vector<grpc::Slice> slices;
  if (!in.Dump(&slices).ok()) return absl::InternalError("reflection: unreadable response");
  std::string response_bytes;
  for (const grpc::Slice& s : slices) {
    response_bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  std::unique_ptr<google::protobuf::Message> response(factory->GetPrototype(response_type)->New());
  if (!response->ParseFromString(response_bytes)) {
    return absl::InternalError("reflection: cannot parse the response");
  }
  const google::protobuf::Reflection* r = response->GetReflection();
  const google::protobuf::Message& list =
      r->GetMessage(*response, response_type->FindFieldByName("list_services_response"));
  const google::protobuf::FieldDescriptor* service_field =
      list.GetDescriptor()->FindFieldByName("service");
  std::vector<std::string> names;
  for (int i = 0; i < list.GetReflection()->FieldSize(list, service_field); ++i) {
    const google::protobuf::Message& service =
        list.GetReflection()->GetRepeatedMessage(list, service_field, i);
    names.push_back(service.GetReflection()->GetString(
        service, service.GetDescriptor()->FindFieldByName("name")));
  }
  return names;
}

absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    int* status) {
  httplib::Client client(host, port);
  client.set_connection_timeout(2);
  client.set_read_timeout(5);
  httplib::Result result = client.Get(path.c_str());
  if (!result) {
    return absl::UnavailableError(absl::StrCat("GET http://", host, ":", port, path, ": ",
                                               httplib::to_string(result.error())));
  }
  if (status != nullptr) *status = result->status;
  return result->body;
}

namespace {

// Parses `k="v",...` (Prometheus label syntax with \\, \" and \n escapes) up to the closing
// brace at text[*pos]; returns false on malformed input.
bool ParseLabels(const std::string& text, size_t* pos, std::map<std::string, std::string>* out) {
  size_t i = *pos;
  while (i < text.size() && text[i] != '}') {
    const size_t eq = text.find('=', i);
    if (eq == std::string::npos || eq + 1 >= text.size() || text[eq + 1] != '"') return false;
    std::string key = text.substr(i, eq - i);
    std::string value;
    size_t j = eq + 2;
    for (; j < text.size() && text[j] != '"'; ++j) {
      if (text[j] == '\\' && j + 1 < text.size()) {
        ++j;
        value.push_back(text[j] == 'n' ? '\n' : text[j]);
      } else {
        value.push_back(text[j]);
      }
    }
    if (j >= text.size()) return false;
    (*out)[key] = value;
    i = j + 1;
    if (i < text.size() && text[i] == ',') ++i;
  }
  if (i >= text.size()) return false;
  *pos = i + 1;
  return true;
}

}  // namespace

absl::StatusOr<double> MetricValue(const std::string& text, const std::string& name,
                                   const std::map<std::string, std::string>& labels) {
  for (absl::string_view line_view : absl::StrSplit(text, '\n')) {
    const std::string line(line_view);
    if (line.empty() || line[0] == '#') continue;
    size_t pos = line.find_first_of("{ ");
    if (pos == std::string::npos || line.compare(0, pos, name) != 0 || pos != name.size()) {
      continue;
    }
    std::map<std::string, std::string> got;
    if (line[pos] == '{') {
      ++pos;
      if (!ParseLabels(line, &pos, &got)) {
        return absl::InvalidArgumentError(absl::StrCat("malformed sample: ", line));
      }
    }
    // Every specd_ sample carries the service's `model` label; a query that does not name it
    // matches whatever model.
    if (labels.count("model") == 0) got.erase("model");
    if (got != labels) continue;
    std::vector<std::string> fields = absl::StrSplit(line.substr(pos), ' ', absl::SkipEmpty());
    double value = 0;
    if (fields.empty() || !absl::SimpleAtod(fields[0], &value)) {
      return absl::InvalidArgumentError(absl::StrCat("malformed value: ", line));
    }
    return value;
  }
  return absl::NotFoundError(absl::StrCat("no sample ", name, " with labels {",
                                          absl::StrJoin(labels, ",", absl::PairFormatter("=")),
                                          "}"));
}

}  // namespace specd
