// embserve-server: serve one exported artifact over gRPC from native code.
//
//   embserve-server ARTIFACT [--host H] [--port P] [--max-batch-size N] ...   (the flags of `embserve serve`)
//   embserve-server REPO [--poll-s S] [--version-policy latest:N|versions:1,3] ...   (REPO/<model>/<version>/)
//
// Prints "embserve: serving on port P" once warm; SIGTERM/SIGINT drain (NOT_SERVING, a grace while traffic moves
// away, then new calls refused with UNAVAILABLE and every accepted one answered) and exit 0.
#include <arpa/inet.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#ifdef EMBSERVE_HTTP
#include "http.h"
#endif
#include "metrics.h"
#include "runner.h"
#include "service.h"

namespace es = embserve::server;

namespace {

constexpr const char* kServingLine = "embserve: serving on port";  // server/workers.py SERVING_LINE
constexpr const char* kServiceName = "embserve.v1.InferenceService";
// a REST connection whose last answer kept it alive may carry its client's next request: the process stays until
// no such answer was given for this long (server/app.py _REST_LINGER_S)
constexpr double kRestLingerS = 1.0;

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Flags {
  std::string artifact;
  std::string host = "0.0.0.0";
  int port = 50051;
  int64_t max_batch_size = 4096;
  int64_t max_delay_us = 1000;
  int64_t max_merge_examples = 1024;
  std::string batch_wait = "overlap";
  int64_t max_queue = 1024;
  int forward_threads = 0;
  int intra_op_threads = 0;
  int threads = 0;
  int64_t max_message_mb = 64;
  int64_t max_message_bytes = 0;  // > 0: overrides --max-message-mb (tests use a small cap)
  int metrics_port = -1;  // -1: no /metrics
  int http_port = -1;     // -1: no OIP REST
  std::string http_host;
  std::string metrics_host;
  std::string tls_cert, tls_key, auth_token_file;
  double drain_grace_s = 5.0, drain_quiet_s = 0.25, drain_seconds = 30.0;
  std::string model_name;
  std::string verify = "full";
  int warmup_batches = 3;
  int grpc_threads = 0;  // completion-queue threads; 0: 1 per 2 cores, at least 1
  bool reuse_port = false;
  std::string backend = "torchscript";  // or pt2 (model.pt2, AOTInductor)
  double poll_s = 0;                    // a repository: look for new versions this often (0: on load calls only)
  std::string version_policy = "latest:1";
  std::string hot_rows_file;  // JSON {"table": [row, ...]}: rows kept in a resident cache (one mapped artifact)
  std::string prefetch = "auto";  // read a batch's pages of a mapped artifact ahead: auto (a paged plan), on, off
};

const char* kUsage =
    "usage: embserve-server ARTIFACT [--host H] [--port P] [--max-batch-size N] [--max-delay-us N]\n"
    "  [--max-merge-examples N] [--batch-wait overlap|always] [--max-queue N] [--forward-threads N]\n"
    "  [--intra-op-threads N] [--threads N] [--max-message-mb N | --max-message-bytes N] [--metrics-port P]\n"
    "  [--metrics-host H] [--http-port P] [--http-host H]\n"
    "  [--tls-cert PEM] [--tls-key PEM] [--auth-token-file F] [--drain-grace-s S] [--drain-quiet-s S]\n"
    "  [--drain-seconds S] [--model-name NAME] [--verify full|none] [--warmup-batches N] [--grpc-threads N]\n"
    "  [--reuse-port] [--backend torchscript|pt2] [--poll-s S] [--version-policy latest:N|versions:1,3]\n"
    "  [--hot-rows-file JSON] [--prefetch auto|on|off]\n";

template <typename T>
T number(const std::string& flag, const std::string& text) {
  std::istringstream in(text);
  T value;
  if (!(in >> value) || !in.eof()) throw ConfigError("argument " + flag + ": invalid value '" + text + "'");
  return value;
}

Flags parse_flags(int argc, char** argv) {
  Flags f;
  std::map<std::string, std::function<void(const std::string&)>> with_value = {
      {"--host", [&](auto& v) { f.host = v; }},
      {"--port", [&](auto& v) { f.port = number<int>("--port", v); }},
      {"--max-batch-size", [&](auto& v) { f.max_batch_size = number<int64_t>("--max-batch-size", v); }},
      {"--max-delay-us", [&](auto& v) { f.max_delay_us = number<int64_t>("--max-delay-us", v); }},
      {"--max-merge-examples", [&](auto& v) { f.max_merge_examples = number<int64_t>("--max-merge-examples", v); }},
      {"--batch-wait", [&](auto& v) { f.batch_wait = v; }},
      {"--max-queue", [&](auto& v) { f.max_queue = number<int64_t>("--max-queue", v); }},
      {"--forward-threads", [&](auto& v) { f.forward_threads = number<int>("--forward-threads", v); }},
      {"--intra-op-threads", [&](auto& v) { f.intra_op_threads = number<int>("--intra-op-threads", v); }},
      {"--threads", [&](auto& v) { f.threads = number<int>("--threads", v); }},
      {"--max-message-mb", [&](auto& v) { f.max_message_mb = number<int64_t>("--max-message-mb", v); }},
      {"--max-message-bytes", [&](auto& v) { f.max_message_bytes = number<int64_t>("--max-message-bytes", v); }},
      {"--metrics-port", [&](auto& v) { f.metrics_port = number<int>("--metrics-port", v); }},
      {"--metrics-host", [&](auto& v) { f.metrics_host = v; }},
      {"--http-port", [&](auto& v) { f.http_port = number<int>("--http-port", v); }},
      {"--http-host", [&](auto& v) { f.http_host = v; }},
      {"--tls-cert", [&](auto& v) { f.tls_cert = v; }},
      {"--tls-key", [&](auto& v) { f.tls_key = v; }},
      {"--auth-token-file", [&](auto& v) { f.auth_token_file = v; }},
      {"--drain-grace-s", [&](auto& v) { f.drain_grace_s = number<double>("--drain-grace-s", v); }},
      {"--drain-quiet-s", [&](auto& v) { f.drain_quiet_s = number<double>("--drain-quiet-s", v); }},
      {"--drain-seconds", [&](auto& v) { f.drain_seconds = number<double>("--drain-seconds", v); }},
      {"--model-name", [&](auto& v) { f.model_name = v; }},
      {"--verify", [&](auto& v) { f.verify = v; }},
      {"--warmup-batches", [&](auto& v) { f.warmup_batches = number<int>("--warmup-batches", v); }},
      {"--grpc-threads", [&](auto& v) { f.grpc_threads = number<int>("--grpc-threads", v); }},
      {"--backend", [&](auto& v) { f.backend = v; }},
      {"--poll-s", [&](auto& v) { f.poll_s = number<double>("--poll-s", v); }},
      {"--version-policy", [&](auto& v) { f.version_policy = v; }},
      {"--hot-rows-file", [&](auto& v) { f.hot_rows_file = v; }},
      {"--prefetch", [&](auto& v) { f.prefetch = v; }},
  };
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (arg == "--reuse-port") {
      f.reuse_port = true;
      continue;
    }
    if (arg.rfind("--", 0) == 0) {
      std::string value;
      const size_t eq = arg.find('=');
      if (eq != std::string::npos) {
        value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
      }
      auto it = with_value.find(arg);
      if (it == with_value.end()) throw ConfigError("unrecognized flag " + arg + " (embserve-server --help lists them)");
      if (eq == std::string::npos) {
        if (i + 1 >= argc) throw ConfigError("argument " + arg + ": expected one argument");
        value = argv[++i];
      }
      it->second(value);
      continue;
    }
    if (!f.artifact.empty()) throw ConfigError("unrecognized argument " + arg + "; serve one artifact folder");
    f.artifact = arg;
  }
  if (f.artifact.empty()) throw ConfigError("the artifact folder is missing");
  if (f.batch_wait != "overlap" && f.batch_wait != "always")
    throw ConfigError("batch_wait '" + f.batch_wait + "': use 'overlap' or 'always'");
  if (f.verify != "full" && f.verify != "none") throw ConfigError("--verify " + f.verify + ": use full or none");
  if (f.backend != "torchscript" && f.backend != "pt2")
    throw ConfigError("--backend " + f.backend + ": embserve-server runs torchscript or pt2");
  if (f.prefetch != "auto" && f.prefetch != "on" && f.prefetch != "off")
    throw ConfigError("--prefetch " + f.prefetch + ": use auto, on or off");
  if (f.poll_s < 0) throw ConfigError("--poll-s " + std::to_string(f.poll_s) + ": give seconds >= 0 (0: no polling)");
  if (f.max_batch_size < 1 || f.max_queue < 1 || f.max_merge_examples < 1 || f.max_delay_us < 0 ||
      f.forward_threads < 0)
    throw ConfigError("batcher settings max_batch_size=" + std::to_string(f.max_batch_size) + ", max_queue=" +
                      std::to_string(f.max_queue) + ", max_merge_examples=" + std::to_string(f.max_merge_examples) +
                      ", max_delay_us=" + std::to_string(f.max_delay_us) +
                      ": the first three must be >= 1 and the delay >= 0");
  if (f.tls_cert.empty() != f.tls_key.empty())
    throw ConfigError("TLS needs both --tls-cert and --tls-key (PEM files); give both or neither");
  return f;
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(std::string("cannot read ") + what + " " + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string strip(std::string text) {
  const char* space = " \t\r\n\f\v";
  const size_t b = text.find_first_not_of(space);
  if (b == std::string::npos) return "";
  return text.substr(b, text.find_last_not_of(space) - b + 1);
}

// server/ports.py probe: bind and release (SO_REUSEADDR as a server does, no SO_REUSEPORT)
void probe(const char* role, const std::string& host, int port, const char* flag) {
  if (port == 0) return;
  addrinfo hints{}, *found = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0)
    throw ConfigError(std::string("cannot bind the ") + role + " port " + host + ":" + std::to_string(port) + ": " +
                      gai_strerror(rc) + "; check " + flag);
  const int sock = socket(found->ai_family, found->ai_socktype, found->ai_protocol);
  int one = 1;
  setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const int bound = bind(sock, found->ai_addr, found->ai_addrlen);
  const int err = errno;
  close(sock);
  freeaddrinfo(found);
  if (bound == 0) return;
  if (err == EADDRINUSE)
    throw ConfigError(std::string(role) + " port " + std::to_string(port) + " is in use (host " + host +
                      "); stop the process that holds it or pick another " + flag);
  throw ConfigError(std::string("cannot bind the ") + role + " port " + host + ":" + std::to_string(port) + ": " +
                    std::strerror(err) + "; check " + flag);
}

std::string grpc_address(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int serve(const Flags& flags, const sigset_t& signals) {
  const int metrics_port_flag = flags.metrics_port;
  if (metrics_port_flag >= 0 && flags.port && metrics_port_flag == flags.port)
    throw ConfigError("--port and --metrics-port are both " + std::to_string(flags.port) +
                      "; give each its own port");
  if (flags.http_port >= 0) {  // server/app.py _check_ports
#ifndef EMBSERVE_HTTP
    throw ConfigError("this embserve-server was built without cpp-httplib (libcpp-httplib-dev): no --http-port");
#endif
    if (flags.port && flags.http_port == flags.port)
      throw ConfigError("--port and --http-port are both " + std::to_string(flags.port) + "; give each its own port");
    if (flags.http_port && flags.http_port == metrics_port_flag)
      throw ConfigError("--metrics-port and --http-port are both " + std::to_string(flags.http_port) +
                        "; give each its own port");
  }
  // before loading: a port in use is refused at once, whatever the model's size
  probe("gRPC", flags.host, flags.port, "--port");
  if (flags.http_port >= 0)
    probe("HTTP", flags.http_host.empty() ? flags.host : flags.http_host, flags.http_port, "--http-port");
  if (metrics_port_flag >= 0)
    probe("metrics", flags.metrics_host.empty() ? flags.host : flags.metrics_host, metrics_port_flag,
          "--metrics-port");
  std::string token;
  if (!flags.auth_token_file.empty()) {
    token = strip(read_file(flags.auth_token_file, "the token file"));
    if (token.empty())
      throw ConfigError("token file '" + flags.auth_token_file + "' is empty; write the bearer token into it");
  }

  // thread counts as server/app.py: forwards from the cores and the model's CPU shards, torch and kernels share
  const bool repository = es::is_repository(flags.artifact);
  int cpu_shards = 1;
  if (!repository) {
    try {
      const es::ModelInfo info = es::read_model_info(flags.artifact, flags.model_name);
      bool cpu = true;
      for (const auto& d : info.devices) cpu = cpu && d == "cpu";
      cpu_shards = cpu ? std::max(1, info.world_size) : 1;
    } catch (const std::exception&) {
      // the loader names what is wrong with the artifact below
    }
  }
  es::VersionPolicy policy;
  try {
    policy = es::VersionPolicy::parse(flags.version_policy);
  } catch (const std::invalid_argument& err) {
    throw ConfigError(err.what());
  }
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  const int workers = flags.forward_threads > 0 ? flags.forward_threads : std::max(1, cores / cpu_shards);
  es::RunnerOptions runner_options;
  runner_options.verify_full = flags.verify == "full";
  runner_options.intra_op_threads =
      flags.intra_op_threads > 0 ? flags.intra_op_threads : std::max(1, cores / (workers * cpu_shards));
  runner_options.kernel_threads = flags.threads > 0 ? flags.threads : std::max(1, cores / (workers * cpu_shards));
  runner_options.pt2 = flags.backend == "pt2";
  if (!flags.hot_rows_file.empty()) {
    if (repository)
      throw ConfigError("--hot-rows-file applies to one artifact served whole; " + flags.artifact +
                        " is a repository. Serve one artifact folder with it, or leave the flag out");
    runner_options.hot_rows_file = flags.hot_rows_file;
  }
  runner_options.prefetch = flags.prefetch;

  es::ServiceOptions options;
  options.max_batch_size = flags.max_batch_size;
  options.auth_token = token;
  options.batching.max_batch_size = flags.max_batch_size;
  options.batching.max_merge_examples = flags.max_merge_examples;
  options.batching.max_delay_s = static_cast<double>(flags.max_delay_us) / 1e6;
  options.batching.max_queue = static_cast<size_t>(flags.max_queue);
  options.batching.workers = workers;
  options.batching.always_wait = flags.batch_wait == "always";

  es::Service* service_ptr = nullptr;
  es::Metrics metrics([&] { return service_ptr ? service_ptr->queue_depth() : 0.0; },
                      [&] { return service_ptr ? static_cast<double>(service_ptr->in_flight()) : 0.0; });
  es::Service service(options, &metrics);
  service_ptr = &service;
  // what it serves: one artifact (version "1", warmed once the port is bound), or a repository whose versions are
  // each loaded, verified and warmed before they serve (model_set.h)
  std::unique_ptr<es::ModelSet> models;
  std::string served_version;
  if (repository) {
    es::VersionLoader load_version = [&](const std::string& folder, const std::string& name,
                                         const std::string& version) {
      // the loader first: it names what is wrong with the version (read_model_info assumes a checked manifest)
      std::unique_ptr<es::Runner> runner = es::Runner::load(folder, runner_options);
      auto loaded = service.build_version(std::move(runner), es::read_model_info(folder, name), name, version);
      es::warm_up(*loaded, flags.warmup_batches, flags.max_batch_size);
      return loaded;
    };
    models = std::make_unique<es::ModelSet>(flags.artifact, policy, load_version, &metrics);
    try {
      models->load_all();
    } catch (const es::ModelSetError&) {
      throw;
    } catch (const es::RunnerError&) {
      throw;
    } catch (const std::runtime_error& err) {
      throw ConfigError(err.what());
    }
    served_version = "repository " + policy.describe();
  } else {
    std::unique_ptr<es::Runner> runner = es::Runner::load(flags.artifact, runner_options);
    es::ModelInfo info = es::read_model_info(flags.artifact, flags.model_name);
    served_version = "model " + info.version;
    const std::string name = info.name;
    models = std::make_unique<es::ModelSet>(service.build_version(std::move(runner), std::move(info), name, "1"));
  }
  service.set_models(models.get());
  service.completion_queues = flags.grpc_threads > 0 ? flags.grpc_threads : std::max(1, cores / 2);

  // grpc.health.v1 is the service's own (health.h): grpc's default one would add its callback threads
  grpc::EnableDefaultHealthCheckService(false);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const int64_t cap = flags.max_message_bytes > 0 ? flags.max_message_bytes : flags.max_message_mb * 1024 * 1024;
  const int max_bytes = static_cast<int>(std::min<int64_t>(cap, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  // grpc's default (1) lets a second server share a port that serves: off unless asked
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, flags.reuse_port ? 1 : 0);
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!flags.tls_cert.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back(
        {read_file(flags.tls_key, "the TLS key"), read_file(flags.tls_cert, "the TLS certificate")});
    credentials = grpc::SslServerCredentials(ssl);
  }
  int port = 0;
  builder.AddListeningPort(grpc_address(flags.host, flags.port), credentials, &port);
  service.register_with(builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    probe("gRPC", flags.host, flags.port, "--port");  // "gRPC port P is in use" when that is why
    throw ConfigError("cannot bind the gRPC port " + flags.host + ":" + std::to_string(flags.port) +
                      ": grpc could not bind it (GRPC_VERBOSITY=debug says why); check --port");
  }
  es::Health* health = &service.health();
  health->set_serving("", false);
  health->set_serving(kServiceName, false);
  service.start(server.get());
  int metrics_port = 0;
  if (metrics_port_flag >= 0) {
    const std::string host = flags.metrics_host.empty() ? flags.host : flags.metrics_host;
    try {
      metrics_port = metrics.serve(host, metrics_port_flag);
    } catch (const std::exception& err) {
      probe("metrics", host, metrics_port_flag, "--metrics-port");
      throw ConfigError(std::string("cannot serve /metrics on ") + host + ":" + std::to_string(metrics_port_flag) +
                        ": " + err.what() + "; check --metrics-port");
    }
  }
#ifdef EMBSERVE_HTTP
  // OIP REST, on the same batchers; before the warm-up, as the Python server (model calls are 503 until ready)
  std::unique_ptr<es::HttpServer> http;
  int http_port = 0;
  if (flags.http_port >= 0) {
    es::HttpOptions http_options;
    http_options.host = flags.http_host.empty() ? flags.host : flags.http_host;
    http_options.port = flags.http_port;
    http_options.tls_cert = flags.tls_cert;
    http_options.tls_key = flags.tls_key;
    http_options.auth_token = token;
    http_options.max_body = cap;
    http_options.reuse_port = flags.reuse_port;
    http = std::make_unique<es::HttpServer>(service, metrics, http_options);
    try {
      http_port = http->start();
    } catch (const std::exception& err) {
      probe("HTTP", http_options.host, flags.http_port, "--http-port");
      throw ConfigError(std::string(err.what()) + "; check --http-port");
    }
  }
#else
  const int http_port = 0;
#endif
  std::cerr << "INFO embserve-server: warming up on port " << port << " (" << flags.warmup_batches << " batches)"
            << std::endl;
  if (!repository) es::warm_up(*models->served()[0], flags.warmup_batches, flags.max_batch_size);
  models->start_polling(flags.poll_s);
  service.set_ready(true);
  health->set_serving("", true);
  health->set_serving(kServiceName, true);
  std::cerr << "INFO embserve-server: serving " << flags.artifact << " on port " << port << " (" << served_version
            << ", " << flags.backend << ", max batch " << flags.max_batch_size
            << ", delay " << flags.max_delay_us << " us, " << workers << " forward threads, "
            << service.completion_queues << " gRPC threads)"
            << (metrics_port ? ", metrics on port " + std::to_string(metrics_port) : "")
            << (http_port ? ", HTTP on port " + std::to_string(http_port) : "") << std::endl;
  std::cout << kServingLine << " " << port << std::endl;

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  // the drain (server/app.py RunningServer.drain, exiting): NOT_SERVING; serve on for the grace, or until no call
  // arrived for drain_quiet_s and none is in flight; then refuse new calls, answer every accepted one, leave
  std::cerr << "INFO embserve-server: draining (grace up to " << flags.drain_grace_s << " s, then up to "
            << flags.drain_seconds << " s for accepted calls)" << std::endl;
  health->shutdown();
  service.stop_serving();
  const auto drain_started = std::chrono::steady_clock::now();
  while (since(drain_started) < flags.drain_grace_s &&
         !(service.seconds_since_last_call() >= flags.drain_quiet_s && service.in_flight() == 0))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (since(drain_started) < flags.drain_grace_s)
    std::cerr << "INFO embserve-server: draining: no call for " << service.seconds_since_last_call()
              << " s and none in flight: grace ended early" << std::endl;
  else
    std::cerr << "INFO embserve-server: draining: the grace of " << flags.drain_grace_s << " s is over" << std::endl;
  service.begin_closing();
#ifdef EMBSERVE_HTTP
  if (http) http->stop_accepting();  // the REST port closes; each connection closes after its next answer
  auto http_busy = [&] { return http && (http->in_flight() > 0 || http->seconds_since_kept_alive() < kRestLingerS); };
#else
  auto http_busy = [] { return false; };
#endif
  // every accepted call answered, then leave: gRPC calls that keep arriving are refused (UNAVAILABLE) until the
  // process exits, and waiting for them to stop (clients that retry at once never do) held the stop for the whole
  // --drain-seconds
  const auto closing = std::chrono::steady_clock::now();
  while (since(closing) < flags.drain_seconds && (service.in_flight() > 0 || service.open_calls() > 0 || http_busy()))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (service.in_flight() > 0)
    std::cerr << "WARNING embserve-server: stopping: calls still in flight after the drain's timeout (--drain-seconds)"
              << std::endl;
  std::cerr << "INFO embserve-server: stopped" << std::endl;
  std::cout.flush();
  std::cerr.flush();
  // grpc's own stop would cancel a call that reached the transport and had no handler yet (CANCELLED): the
  // connections close with the process instead, so a call sent in the last instant meets UNAVAILABLE
  _exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  // signals are taken by sigwait in serve(): blocked in every thread, created after this
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  try {
    return serve(parse_flags(argc, argv), signals);
  } catch (const ConfigError& err) {
    std::cerr << "embserve-server: error: " << err.what() << std::endl;
    return 2;
  } catch (const es::RunnerError& err) {
    std::cerr << "embserve-server: error: " << err.what() << std::endl;
    return err.kind == "ConfigError" ? 2 : 1;
  } catch (const std::exception& err) {
    std::cerr << "embserve-server: error: " << err.what() << std::endl;
    return 1;
  }
}
