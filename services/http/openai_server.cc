#include "services/http/openai_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/guarded_http_server.h"
#include "common/service/metrics.h"
#include "common/service/reloading_ssl_context.h"
#include "httplib.h"
#include "services/http/generate_call.h"
#include "services/http/tokenize_protocol.h"

namespace specd {
namespace {

using nlohmann::json;

constexpr absl::Duration kRouterProbeTimeout = absl::Seconds(1);
constexpr absl::Duration kModelInfoTimeout = absl::Seconds(2);
// Tokenize and Detokenize are quick; a router that does not answer them in this long is stuck.
constexpr absl::Duration kUtilityTimeout = absl::Seconds(30);

// Label values of the per-endpoint metrics: the fixed routes, so a scan of random paths cannot
// grow the label set.
std::string EndpointLabel(const std::string& path) {
  for (const char* known : {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                            "/metrics", "/tokenize", "/detokenize", "/version"}) {
    if (path == known) return known;
  }
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models";
  return "other";
}

std::string RandomId(absl::string_view prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("%s%016x%08x", prefix, rng(), static_cast<uint32_t>(rng()));
}

// When the request being served on this worker thread started; set before routing, read and
// cleared by the logger, which httplib calls on the same thread once the response is written.
thread_local std::optional<absl::Time> request_start;

// Keeps the in-flight gauge up while a request (or its stream) is being served.
class InFlight {
 public:
  explicit InFlight(prometheus::Gauge& gauge) : gauge_(gauge) { gauge_.Increment(); }
  ~InFlight() { gauge_.Decrement(); }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  prometheus::Gauge& gauge_;
};

// A GenerateCall that Stop() can find and cancel while it runs.
class ActiveCall {
 public:
  ActiveCall(absl::Mutex* mu, absl::flat_hash_set<GenerateCall*>* registry,
             std::unique_ptr<GenerateCall> call)
      : mu_(mu), registry_(registry), call_(std::move(call)) {
    absl::MutexLock lock(mu_);
    registry_->insert(call_.get());
  }
  ~ActiveCall() {
    absl::MutexLock lock(mu_);
    registry_->erase(call_.get());
  }
  GenerateCall* operator->() { return call_.get(); }

 private:
  absl::Mutex* mu_;
  absl::flat_hash_set<GenerateCall*>* registry_;
  std::unique_ptr<GenerateCall> call_;
};

// What a streaming response carries between invocations of httplib's content provider.
struct StreamState {
  Endpoint endpoint;
  ResponseIdentity identity;
  bool include_usage = false;
  absl::Duration keepalive;
  std::unique_ptr<ActiveCall> call;
  std::optional<v1::GenerateResponse> pending;  // the first chunk, read before the headers
  int logprobs = -1;                            // ParsedRequest::logprobs
  uint32_t samples = 1;                         // choices; the stream ends when each has finished
  uint32_t finished = 0;                        // choices whose last chunk was written
  v1::Usage usage;                              // of the finished choices
  // Per choice.
  std::vector<bool> role_sent;
  std::vector<size_t> text_offset;
  std::unique_ptr<InFlight> in_flight;
};

// Writes the SSE events for one router chunk. Returns false when the client is gone.
bool WriteChunk(StreamState& s, const v1::GenerateResponse& chunk, httplib::DataSink& sink) {
  const uint32_t index = chunk.index();
  if (index >= s.samples) return true;  // not a choice of this request; the router sends none
  const bool last = chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
  const bool role = s.endpoint == Endpoint::kChatCompletions && !s.role_sent[index];
  // A chunk without text or logprobs (tokens held back while they might begin a stop string)
  // is not worth an event of its own unless it ends the choice or opens the chat turn.
  if (chunk.text().empty() && chunk.logprobs_size() == 0 && !last && !role) return true;
  const std::vector<int32_t> ids(chunk.token_ids().begin(), chunk.token_ids().end());
  const nlohmann::json logprobs =
      s.logprobs >= 0
          ? LogprobsJson(s.endpoint, s.logprobs, {chunk.logprobs().begin(), chunk.logprobs().end()},
                         &s.text_offset[index])
          : nlohmann::json();
  std::string out =
      SseEvent(StreamChunkJson(s.endpoint, s.identity, chunk.text(), ids, role,
                               last ? &chunk : nullptr, s.include_usage, index, logprobs));
  s.role_sent[index] = true;
  if (last) {
    ++s.finished;
    s.usage.set_prompt_tokens(chunk.usage().prompt_tokens());
    s.usage.set_completion_tokens(s.usage.completion_tokens() + chunk.usage().completion_tokens());
    if (s.finished == s.samples) {
      if (s.include_usage) {
        absl::StrAppend(&out, SseEvent(UsageChunkJson(s.endpoint, s.identity, s.usage)));
      }
      absl::StrAppend(&out, kSseDone);
    }
  }
  return sink.write(out.data(), out.size());
}

}  // namespace

OpenAiServer::OpenAiServer(const OpenAiServerOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<OpenAiServer>> OpenAiServer::Start(
    const OpenAiServerOptions& options) {
  if (absl::StatusOr<HostPort> hp = ParseHostPort(options.router_address, "router address");
      !hp.ok()) {
    return hp.status();
  }
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port ", options.port, " is outside [0, 65535]"));
  }
  if (options.threads < 1) return absl::InvalidArgumentError("threads: must be >= 1");
  std::unique_ptr<OpenAiServer> server(new OpenAiServer(options));
  OpenAiServer* self = server.get();
  grpc::ChannelArguments args = ServiceChannelArguments();
  // gRPC's reconnect backoff grows to 120 s; an edge that lost its router should find it again
  // within seconds of its return, or /health and every request keep failing meanwhile.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  std::shared_ptr<grpc::ChannelCredentials> router_credentials =
      options.router_credentials ? options.router_credentials : grpc::InsecureChannelCredentials();
  self->channel_ =
      options.router_token != nullptr
          ? CreateChannelWithToken(options.router_address, router_credentials, args,
                                   options.router_token)
          : grpc::CreateCustomChannel(options.router_address, router_credentials, args);
  self->stub_ = v1::Generation::NewStub(self->channel_);
  self->health_stub_ = grpc::health::v1::Health::NewStub(self->channel_);
  {
    absl::MutexLock lock(&self->model_mu_);
    self->model_name_ = options.model_name;
  }

  self->registry_ = std::make_shared<prometheus::Registry>();
  self->requests_ = &AddCounterFamily(*self->registry_, "specd_http_requests_total",
                                      "HTTP requests answered, by endpoint and status code.");
  self->in_flight_ = &prometheus::BuildGauge()
                          .Name("specd_http_requests_in_flight")
                          .Help("HTTP requests being served (streams until their last event).")
                          .Register(*self->registry_);
  self->duration_ = &prometheus::BuildHistogram()
                         .Name("specd_http_request_duration_seconds")
                         .Help("Request arrival to the end of the response, by endpoint.")
                         .Register(*self->registry_);
  self->stream_disconnects_ =
      &AddCounter(*self->registry_, "specd_http_stream_disconnects_total",
                  "Streams whose client went away before the end; their Generate call was "
                  "cancelled.");

  if (absl::Status s = CheckServerTlsFiles(options.tls, "--tls_"); !s.ok()) return s;
  // Plaintext and HTTPS take one path: the guard's connection cap (503), whole-request read
  // deadline and SOMAXCONN backlog hold for both, and HTTPS certificates rotate without a
  // restart (the context is looked at again for each new connection).
  GuardedHttpOptions guard;
  guard.max_connections = options.threads;
  guard.request_read_deadline = options.request_read_deadline;
  if (options.tls.enabled()) {
    absl::StatusOr<std::unique_ptr<ReloadingSslContext>> tls =
        ReloadingSslContext::Create(options.tls, "--tls_");
    if (!tls.ok()) return tls.status();
    guard.tls = *std::move(tls);
  }
  auto guarded = std::make_unique<GuardedHttpServer>(guard);
  GuardedHttpServer* guarded_server = guarded.get();
  self->http_ = std::move(guarded);
  httplib::Server& http = *self->http_;
  // httplib's default also sets SO_REUSEPORT, which would let a second process share the port;
  // a busy port must be an error.
  http.set_socket_options([](socket_t sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  http.set_payload_max_length(options.max_body_bytes);
  http.set_pre_routing_handler([self](const httplib::Request& req, httplib::Response& res) {
    request_start = absl::Now();
    // Probes and Prometheus carry no token; everything else does when tokens are on.
    if (self->options_.tokens != nullptr && req.path != "/health" && req.path != "/metrics" &&
        !self->options_.tokens->AcceptsAuthorization(req.get_header_value("Authorization"))) {
      ApiError e;
      e.http_status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      e.message = kUnauthenticatedMessage;
      res.set_header("WWW-Authenticate", "Bearer");
      self->SendError(e, res);
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http.set_logger([self](const httplib::Request& req, const httplib::Response& res) {
    self->CountRequest(req, res);
  });
  http.set_exception_handler(
      [self](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        SPECD_LOG(ERROR) << "specd-http: " << req.method << " " << req.path << ": " << what;
        self->SendError(ToApiError(absl::InternalError(absl::StrCat("internal error: ", what)),
                                   Endpoint::kCompletions),
                        res);
      });
  // Unknown routes and httplib's own refusals (413, 400 for a malformed request line) get an
  // OpenAI error object too; handlers that already wrote a body keep it.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [self](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        ApiError e;
        e.http_status = res.status;
        e.type = "invalid_request_error";
        if (res.status == 404) {
          e.message = absl::StrCat("no route for ", req.method, " ", req.path);
          e.code = "not_found";
        } else if (res.status == 413) {
          e.message =
              absl::StrCat("the request body exceeds ", self->options_.max_body_bytes, " bytes");
          e.code = "payload_too_large";
        } else {
          e.message = absl::StrCat("HTTP ", res.status);
          e.code = "http_error";
        }
        self->SendError(e, res);
        return httplib::Server::HandlerResponse::Handled;
      }));

  http.Post("/v1/completions", [self](const httplib::Request& req, httplib::Response& res) {
    self->HandleGenerate(Endpoint::kCompletions, req, res);
  });
  http.Post("/v1/chat/completions", [self](const httplib::Request& req, httplib::Response& res) {
    self->HandleGenerate(Endpoint::kChatCompletions, req, res);
  });
  http.Get("/v1/models",
           [self](const httplib::Request&, httplib::Response& res) { self->HandleModels(res); });
  // Model ids may contain '/' (meta-llama/Llama-3.1-8B-Instruct).
  http.Get(R"(/v1/models/(.+))", [self](const httplib::Request& req, httplib::Response& res) {
    self->HandleModel(req.matches[1], res);
  });
  http.Post("/tokenize", [self](const httplib::Request& req, httplib::Response& res) {
    self->HandleTokenize(req, res);
  });
  http.Post("/detokenize", [self](const httplib::Request& req, httplib::Response& res) {
    self->HandleDetokenize(req, res);
  });
  http.Get("/version",
           [self](const httplib::Request&, httplib::Response& res) { self->HandleVersion(res); });
  http.Get("/health",
           [self](const httplib::Request&, httplib::Response& res) { self->HandleHealth(res); });
  http.Get("/metrics",
           [self](const httplib::Request&, httplib::Response& res) { self->HandleMetrics(res); });

  if (options.port == 0) {
    self->port_ = http.bind_to_any_port(options.host);
  } else if (http.bind_to_port(options.host, options.port)) {
    self->port_ = options.port;
  } else {
    self->port_ = -1;
  }
  if (self->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.host, ":", options.port, " (in use?)"));
  }
  guarded_server->RaiseListenBacklog();
  self->thread_ = std::thread([self] {
    self->http_->listen_after_bind();
    self->listen_returned_ = true;
  });
  // httplib's stop() does nothing until the accept loop runs; wait for it so Stop() right after
  // Start() cannot hang.
  while (!http.is_running() && !self->listen_returned_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!http.is_running()) {
    return absl::UnavailableError(
        absl::StrCat("listener on ", options.host, ":", self->port_, " failed"));
  }
  return server;
}

OpenAiServer::~OpenAiServer() { Stop(); }

void OpenAiServer::Stop() {
  stopping_ = true;
  {
    absl::MutexLock lock(&calls_mu_);
    for (GenerateCall* call : calls_) call->Cancel();
  }
  // Stops accepting, then joins the worker threads; the cancelled calls end their requests.
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

bool OpenAiServer::RouterServing() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRouterProbeTimeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(v1::Generation::service_full_name());
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = health_stub_->Check(&ctx, request, &response);
  return status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::Time OpenAiServer::Deadline() const {
  if (options_.request_timeout <= absl::ZeroDuration()) return absl::InfiniteFuture();
  return absl::Now() + options_.request_timeout;
}

ProtocolOptions OpenAiServer::CurrentProtocolOptions() {
  {
    absl::MutexLock lock(&model_mu_);
    if (!model_name_.empty() && max_context_ > 0) {
      ProtocolOptions p;
      p.model_name = model_name_;
      p.model_aliases = model_aliases_;
      p.chat_template = options_.chat_template.get();
      p.default_completion_max_tokens = options_.default_completion_max_tokens;
      return p;
    }
  }
  // First use (or the router has not answered yet): ask it.
  return RefreshModelInfo();
}

ProtocolOptions OpenAiServer::RefreshModelInfo() {
  // A --model_name set by the operator stays the reported name; the router's own name is
  // accepted as an alias.
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kModelInfoTimeout));
  v1::ModelInfo info;
  const grpc::Status status = stub_->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  absl::MutexLock lock(&model_mu_);
  if (status.ok()) {
    const std::string routers_name = ModelNameFromPath(info.target_model());
    if (model_name_.empty()) model_name_ = routers_name;
    model_aliases_.clear();
    for (const std::string& alias : {routers_name, info.target_model()}) {
      if (alias != model_name_) model_aliases_.push_back(alias);
    }
    max_context_ = info.max_context();
    model_features_.logprobs = info.supports_logprobs();
    model_features_.logits_processors = info.supports_logits_processors();
    model_features_.chat_template =
        options_.chat_template != nullptr ? options_.chat_template->source() : std::string();
    model_features_.speculation_modes.clear();
    for (int mode : info.speculation_modes()) {
      model_features_.speculation_modes.push_back(static_cast<v1::Speculation>(mode));
    }
  } else {
    SPECD_LOG(WARNING) << "specd-http: GetModelInfo on " << options_.router_address << ": "
                       << status.error_message();
  }
  ProtocolOptions p;
  p.model_name = model_name_;
  p.model_aliases = model_aliases_;
  p.chat_template = options_.chat_template.get();
  p.default_completion_max_tokens = options_.default_completion_max_tokens;
  return p;
}

void OpenAiServer::SendError(const ApiError& error, httplib::Response& res) {
  res.status = error.http_status;
  res.set_content(DumpJson(ErrorJson(error)), "application/json");
}

void OpenAiServer::CountRequest(const httplib::Request& req, const httplib::Response& res) {
  const std::string endpoint = EndpointLabel(req.path);
  requests_->Add({{"endpoint", endpoint}, {"status", std::to_string(res.status)}}).Increment();
  if (request_start.has_value()) {
    duration_->Add({{"endpoint", endpoint}}, LatencyBuckets())
        .Observe(absl::ToDoubleSeconds(absl::Now() - *request_start));
    request_start.reset();
  }
}

void OpenAiServer::HandleGenerate(Endpoint endpoint, const httplib::Request& req,
                                  httplib::Response& res) {
  const std::string label = EndpointLabel(req.path);
  auto in_flight = std::make_unique<InFlight>(in_flight_->Add({{"endpoint", label}}));
  if (stopping_) {
    SendError(ToApiError(absl::UnavailableError("the server is shutting down"), endpoint), res);
    return;
  }
  ProtocolOptions protocol = CurrentProtocolOptions();
  if (protocol.model_name.empty()) {
    SendError(
        ToApiError(absl::UnavailableError(absl::StrCat("the router at ", options_.router_address,
                                                       " does not answer GetModelInfo")),
                   endpoint),
        res);
    return;
  }
  absl::StatusOr<ParsedRequest> parsed = ParseRequest(endpoint, req.body, protocol);
  if (!parsed.ok()) {
    SendError(ToApiError(parsed.status(), endpoint), res);
    return;
  }
  if (parsed->tokenize_prompt) {
    absl::StatusOr<std::vector<int32_t>> ids =
        Tokenize(parsed->generate.prompt(), parsed->add_special_tokens);
    if (!ids.ok()) {
      SendError(ToApiError(ids.status(), endpoint), res);
      return;
    }
    parsed->generate.mutable_prompt_ids()->mutable_ids()->Assign(ids->begin(), ids->end());
  }
  ResponseIdentity identity;
  identity.id = RandomId(endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-");
  identity.created = absl::ToUnixSeconds(absl::Now());
  identity.model = protocol.model_name;
  parsed->generate.set_request_id(identity.id);

  auto call = std::make_unique<ActiveCall>(
      &calls_mu_, &calls_,
      std::make_unique<GenerateCall>(stub_.get(), std::move(parsed->generate), Deadline()));

  const uint32_t samples = std::max<uint32_t>(1, parsed->n);
  if (!parsed->stream) {
    std::vector<Completion> completions(samples);
    uint32_t finished_samples = 0;
    v1::GenerateResponse chunk;
    for (;;) {
      const GenerateCall::Event event = (*call)->Next(absl::Seconds(1), &chunk);
      if (event == GenerateCall::Event::kTimeout) continue;
      if (event == GenerateCall::Event::kDone) break;
      if (chunk.index() >= samples) continue;
      Completion& completion = completions[chunk.index()];
      completion.text += chunk.text();
      completion.token_ids.insert(completion.token_ids.end(), chunk.token_ids().begin(),
                                  chunk.token_ids().end());
      completion.logprobs.insert(completion.logprobs.end(), chunk.logprobs().begin(),
                                 chunk.logprobs().end());
      if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        completion.last = std::move(chunk);
        ++finished_samples;
      }
    }
    const bool finished = finished_samples == samples;
    const grpc::Status status = (*call)->status();
    if (!status.ok()) {
      SendError(ToApiError(FromGrpcStatus(status), endpoint), res);
    } else if (!finished) {
      SendError(ToApiError(absl::InternalError("the router ended the stream without a finish "
                                               "reason"),
                           endpoint),
                res);
    } else {
      res.set_content(
          DumpJson(CompletionResponseJson(endpoint, identity, completions, parsed->logprobs)),
          "application/json");
    }
    return;
  }

  // Streaming. Wait for the first chunk before sending headers, so errors the router finds
  // up front (validation, a full queue, no verify service) still get their HTTP status.
  auto state = std::make_shared<StreamState>();
  v1::GenerateResponse first;
  for (;;) {
    const GenerateCall::Event event = (*call)->Next(absl::Seconds(1), &first);
    if (event == GenerateCall::Event::kTimeout) continue;
    if (event == GenerateCall::Event::kDone) {
      const grpc::Status status = (*call)->status();
      SendError(ToApiError(status.ok() ? absl::InternalError("the router sent no chunk")
                                       : FromGrpcStatus(status),
                           endpoint),
                res);
      return;
    }
    break;
  }
  state->endpoint = endpoint;
  state->identity = identity;
  state->include_usage = parsed->include_usage;
  state->logprobs = parsed->logprobs;
  state->samples = samples;
  state->role_sent.assign(samples, false);
  state->text_offset.assign(samples, 0);
  state->keepalive = options_.keepalive_interval;
  state->call = std::move(call);
  state->pending = std::move(first);
  state->in_flight = std::move(in_flight);

  res.set_header("Cache-Control", "no-cache");
  // Reverse proxies (nginx) buffer responses unless told not to; SSE must flow per token.
  res.set_header("X-Accel-Buffering", "no");
  OpenAiServer* self = this;
  res.set_chunked_content_provider(
      "text/event-stream",
      // One router event per invocation; httplib calls again until sink.done().
      [state](size_t /*offset*/, httplib::DataSink& sink) {
        StreamState& s = *state;
        v1::GenerateResponse chunk;
        GenerateCall::Event event;
        if (s.pending.has_value()) {
          chunk = std::move(*s.pending);
          s.pending.reset();
          event = GenerateCall::Event::kChunk;
        } else {
          event = (*s.call)->Next(s.keepalive, &chunk);
        }
        switch (event) {
          case GenerateCall::Event::kTimeout: {
            // An SSE comment: clients ignore it, and writing it finds out whether the client is
            // still there while no tokens come.
            static constexpr absl::string_view kPing = ": keep-alive\n\n";
            return sink.write(kPing.data(), kPing.size());
          }
          case GenerateCall::Event::kChunk: {
            if (!WriteChunk(s, chunk, sink)) return false;
            if (s.finished == s.samples) sink.done();
            return true;
          }
          case GenerateCall::Event::kDone: {
            // Ended without a finish reason: an error after the stream started (the router shut
            // down, the deadline passed). Headers are gone, so the error is an event, then the
            // usual end marker so clients stop reading.
            const grpc::Status status = (*s.call)->status();
            const ApiError error =
                ToApiError(status.ok() ? absl::InternalError("the router ended the stream early")
                                       : FromGrpcStatus(status),
                           s.endpoint);
            std::string out = absl::StrCat(SseEvent(ErrorJson(error)), kSseDone);
            if (!sink.write(out.data(), out.size())) return false;
            sink.done();
            return true;
          }
        }
        return false;
      },
      // Runs when the response is destroyed; success is false when the client went away (a
      // write failed) before sink.done(). Cancelling makes the router free the sequence now
      // rather than generate the rest for nobody.
      [state, self](bool success) {
        if (!success && state->call != nullptr) {
          (*state->call)->Cancel();
          self->stream_disconnects_->Increment();
        }
        // The call (and its in-flight count) ends with the response, not with the lambda copies
        // httplib may keep.
        state->call.reset();
        state->in_flight.reset();
      });
}

bool OpenAiServer::HaveModel(const ProtocolOptions& protocol, httplib::Response& res) {
  if (!protocol.model_name.empty()) return true;
  SendError(
      ToApiError(absl::UnavailableError(absl::StrCat("the router at ", options_.router_address,
                                                     " does not answer GetModelInfo")),
                 Endpoint::kCompletions),
      res);
  return false;
}

void OpenAiServer::HandleModels(httplib::Response& res) {
  const ProtocolOptions protocol = RefreshModelInfo();
  if (!HaveModel(protocol, res)) return;
  absl::MutexLock lock(&model_mu_);
  res.set_content(
      DumpJson(
          {{"object", "list"},
           {"data", json::array({ModelJson(protocol.model_name, max_context_, model_features_)})}}),
      "application/json");
}

void OpenAiServer::HandleModel(const std::string& id, httplib::Response& res) {
  const ProtocolOptions protocol = RefreshModelInfo();
  if (!HaveModel(protocol, res)) return;
  const bool served = id == protocol.model_name ||
                      std::find(protocol.model_aliases.begin(), protocol.model_aliases.end(), id) !=
                          protocol.model_aliases.end();
  if (!served) {
    SendError(ModelNotFound(id), res);
    return;
  }
  absl::MutexLock lock(&model_mu_);
  res.set_content(DumpJson(ModelJson(protocol.model_name, max_context_, model_features_)),
                  "application/json");
}

absl::StatusOr<std::vector<int32_t>> OpenAiServer::Tokenize(const std::string& text,
                                                            bool add_special_tokens) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(std::min(Deadline(), absl::Now() + kUtilityTimeout)));
  v1::TokenizeRequest request;
  request.set_text(text);
  request.set_add_special_tokens(add_special_tokens);
  v1::TokenizeResponse response;
  const grpc::Status status = stub_->Tokenize(&ctx, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::vector<int32_t>(response.ids().begin(), response.ids().end());
}

void OpenAiServer::HandleTokenize(const httplib::Request& req, httplib::Response& res) {
  const ProtocolOptions protocol = CurrentProtocolOptions();
  if (!HaveModel(protocol, res)) return;
  absl::StatusOr<TokenizeCall> call = ParseTokenizeRequest(req.body, protocol);
  if (!call.ok()) {
    SendError(TokenizeApiError(call.status()), res);
    return;
  }
  absl::StatusOr<std::vector<int32_t>> ids = Tokenize(call->text, call->add_special_tokens);
  if (!ids.ok()) {
    SendError(TokenizeApiError(ids.status()), res);
    return;
  }
  absl::MutexLock lock(&model_mu_);
  res.set_content(DumpJson(TokenizeResponseJson(*ids, max_context_)), "application/json");
}

void OpenAiServer::HandleDetokenize(const httplib::Request& req, httplib::Response& res) {
  const ProtocolOptions protocol = CurrentProtocolOptions();
  if (!HaveModel(protocol, res)) return;
  absl::StatusOr<std::vector<int32_t>> ids = ParseDetokenizeRequest(req.body, protocol);
  if (!ids.ok()) {
    SendError(TokenizeApiError(ids.status()), res);
    return;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(std::min(Deadline(), absl::Now() + kUtilityTimeout)));
  v1::DetokenizeRequest request;
  request.mutable_ids()->Assign(ids->begin(), ids->end());
  v1::DetokenizeResponse response;
  const grpc::Status status = stub_->Detokenize(&ctx, request, &response);
  if (!status.ok()) {
    SendError(TokenizeApiError(FromGrpcStatus(status)), res);
    return;
  }
  res.set_content(DumpJson(DetokenizeResponseJson(response.text())), "application/json");
}

void OpenAiServer::HandleVersion(httplib::Response& res) {
  res.set_content(DumpJson({{"version", SPECD_VERSION}}), "application/json");
}

void OpenAiServer::HandleHealth(httplib::Response& res) {
  const bool ok = !stopping_ && RouterServing();
  res.status = ok ? 200 : 503;
  res.set_content(ok ? "ok\n" : "router not serving\n", "text/plain");
}

void OpenAiServer::HandleMetrics(httplib::Response& res) {
  res.set_content(SerializeMetrics(*registry_, MetricLabelsNow()),
                  "text/plain; version=0.0.4; charset=utf-8");
}

}  // namespace specd
