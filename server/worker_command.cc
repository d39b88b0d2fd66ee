#include "server/worker_command.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "quantd/v1/quantd.grpc.pb.h"
#include "server/compute/device.h"
#include "server/job/job_spec.h"
#include "server/pipeline/prepared_job.h"
#include "server/pipeline/stage.h"
#include "server/scheduler/kill_hook.h"

namespace quantd {
namespace {

namespace v1 = quantd::v1;

constexpr int kOk = 0;
constexpr int kFailed = 1;
constexpr int kUsage = 2;

constexpr auto kCallTimeout = std::chrono::seconds(10);  // every call but Lease's wait
constexpr auto kRetryPause = std::chrono::seconds(1);    // after an unreachable coordinator

std::atomic<bool> g_stop{false};  // SIGINT / SIGTERM

void OnSignal(int) { g_stop.store(true); }

void Log(const std::string& line) { std::cerr << "quantd worker: " << line << std::endl; }

std::chrono::system_clock::time_point Deadline(std::chrono::milliseconds extra) {
  return std::chrono::system_clock::now() + kCallTimeout + extra;
}

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::string ReasonOf(const grpc::ClientContext& ctx) {
  const auto& trailers = ctx.GetServerTrailingMetadata();
  const auto it = trailers.find("quantd-reason");
  return it == trailers.end() ? "" : std::string(it->second.data(), it->second.size());
}

// A job this worker opened, by id.
struct OpenJob {
  int64_t created_ms = 0;
  std::shared_ptr<const pipeline::PreparedJob> job;
  uint64_t last_used = 0;  // Worker::uses_ when a task last used it
};

// Jobs kept open at most (each holds its source's headers and plan).
constexpr size_t kMaxOpenJobs = 8;

// Where a test hook acts (QUANTD_TEST_KILL_AT / QUANTD_TEST_STOP_AT).
struct Hook {
  scheduler::KillHook at;
  int signal = SIGKILL;
};

class Worker {
 public:
  Worker(WorkerArgs args, api::ClientChannel channel,
         std::vector<std::unique_ptr<compute::Device>> devices, std::vector<Hook> hooks)
      : args_(std::move(args)),
        channel_(std::move(channel)),
        stub_(v1::WorkerService::NewStub(channel_.channel())),
        devices_(std::move(devices)),
        hooks_(std::move(hooks)) {}

  int Run() {
    if (int rc = Register(); rc != kOk) return rc;
    last_busy_ = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (size_t i = 0; i < devices_.size(); ++i) {
      threads.emplace_back([this, i] { DeviceLoop(static_cast<int>(i)); });
    }
    for (std::thread& t : threads) t.join();
    return fatal_.load() ? kFailed : kOk;
  }

 private:
  // Registers (again); kFailed when the coordinator refuses the credentials, kOk otherwise (or
  // when stopping). Retries an unreachable coordinator.
  int Register() {
    std::lock_guard<std::mutex> lock(register_mu_);
    v1::RegisterWorkerRequest request;
    request.set_name(args_.name);
    for (const auto& device : devices_) {
      v1::WorkerDevice* d = request.add_devices();
      d->set_name(device->name());
      d->set_gpu(device->kind() == compute::DeviceKind::kCuda);
      d->set_memory_bytes(device->total_memory_bytes());
    }
    while (!g_stop.load()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(std::chrono::milliseconds(0)));
      channel_.Authenticate(&ctx);
      v1::RegisterWorkerResponse response;
      const grpc::Status s = stub_->Register(&ctx, request, &response);
      if (s.ok()) {
        worker_id_ = response.worker_id();
        lease_ms_ = std::max<int64_t>(300, response.lease_ms());
        Log(absl::StrCat("registered as ", args_.name, " with ", devices_.size(),
                         " device(s); lease ", lease_ms_, " ms"));
        return kOk;
      }
      if (Fatal(s)) return kFailed;
      Log(absl::StrCat("cannot register with ", args_.connect.server, ": ", s.error_message(),
                       "; retrying"));
      std::this_thread::sleep_for(kRetryPause);
    }
    return kOk;
  }

  // Credentials or requests the coordinator will never accept: the worker stops.
  bool Fatal(const grpc::Status& s) {
    const grpc::StatusCode c = s.error_code();
    if (c != grpc::StatusCode::UNAUTHENTICATED && c != grpc::StatusCode::PERMISSION_DENIED &&
        c != grpc::StatusCode::INVALID_ARGUMENT && c != grpc::StatusCode::UNIMPLEMENTED) {
      return false;
    }
    Log(absl::StrCat("the coordinator refused: ", s.error_message()));
    fatal_.store(true);
    g_stop.store(true);
    return true;
  }

  std::string worker_id() {
    std::lock_guard<std::mutex> lock(register_mu_);
    return worker_id_;
  }

  bool IdleTooLong() {
    if (args_.exit_when_idle_s <= 0) return false;
    std::lock_guard<std::mutex> lock(idle_mu_);
    return busy_ == 0 && std::chrono::steady_clock::now() - last_busy_ >
                             std::chrono::duration<double>(args_.exit_when_idle_s);
  }

  void SetBusy(bool busy) {
    std::lock_guard<std::mutex> lock(idle_mu_);
    busy_ += busy ? 1 : -1;
    last_busy_ = std::chrono::steady_clock::now();
  }

  void DeviceLoop(int device) {
    while (!g_stop.load()) {
      if (IdleTooLong()) {
        Log(absl::StrCat("idle for ", args_.exit_when_idle_s, " s; exiting"));
        g_stop.store(true);
        return;
      }
      v1::LeaseTaskRequest request;
      request.set_worker_id(worker_id());
      request.set_device(device);
      request.set_wait_ms(static_cast<int32_t>(std::min<int64_t>(10'000, lease_ms_ / 2)));
      {
        std::lock_guard<std::mutex> lock(jobs_mu_);
        for (const auto& [id, job] : jobs_) request.add_open_jobs(id);
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(std::chrono::milliseconds(request.wait_ms())));
      channel_.Authenticate(&ctx);
      v1::LeaseTaskResponse lease;
      const grpc::Status s = stub_->Lease(&ctx, request, &lease);
      if (!s.ok()) {
        if (Fatal(s)) return;
        if (ReasonOf(ctx) == "WORKER_UNKNOWN") {
          if (Register() != kOk) return;
          continue;
        }
        std::this_thread::sleep_for(kRetryPause);
        continue;
      }
      if (!lease.leased()) continue;
      SetBusy(true);
      RunLeased(*devices_[device], lease);
      SetBusy(false);
    }
  }

  // The job of `lease`, opened from its stored spec once (again when its identity changed).
  absl::StatusOr<std::shared_ptr<const pipeline::PreparedJob>> JobOf(
      const v1::LeaseTaskResponse& lease, std::vector<store::TaskRow> tasks) {
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      const auto it = jobs_.find(lease.job_id());
      if (it != jobs_.end() && it->second.created_ms == lease.job_created_ms()) {
        it->second.last_used = ++uses_;
        return it->second.job;
      }
      if (lease.spec_json().empty()) {
        // The job this worker opened under that id was deleted and the id given again: the
        // next lease (without the id in open_jobs) brings the new job's spec.
        if (it != jobs_.end()) jobs_.erase(it);
        return absl::FailedPreconditionError(
            "the coordinator sent no spec for a job not open here");
      }
    }
    absl::StatusOr<job::JobSpec> spec = job::ParseStoredJobSpec(lease.spec_json(), "lease spec");
    if (!spec.ok()) return spec.status();
    pipeline::StoredJob stored;
    stored.identity.job_id = lease.job_id();
    stored.identity.created_ms = lease.job_created_ms();
    stored.identity.store = lease.job_store();
    stored.planned = true;
    stored.tasks = std::move(tasks);
    stored.work_dir = lease.work_dir();
    std::vector<store::AmaxRow> amax;
    for (const v1::AmaxEntry& e : lease.input_amax()) {
      amax.push_back(store::AmaxRow{e.module(), "input", e.amax(), 0});
    }
    absl::StatusOr<std::unique_ptr<pipeline::PreparedJob>> opened =
        pipeline::PreparedJob::OpenForWorker(*spec, std::move(stored), amax);
    if (!opened.ok()) return opened.status();
    std::shared_ptr<const pipeline::PreparedJob> job = *std::move(opened);
    std::lock_guard<std::mutex> lock(jobs_mu_);
    jobs_[lease.job_id()] = OpenJob{lease.job_created_ms(), job, ++uses_};
    if (jobs_.size() > kMaxOpenJobs) {  // the least recently used goes (running tasks keep it)
      jobs_.erase(std::min_element(jobs_.begin(), jobs_.end(), [](const auto& a, const auto& b) {
        return a.second.last_used < b.second.last_used;
      }));
    }
    Log(absl::StrCat("opened job ", lease.job_id(), ": ", spec->source, " -> ", spec->output));
    return job;
  }

  // The hook that acts at `when` of the task just started, or nullptr.
  const Hook* HookAt(scheduler::KillHook::When when, const std::string& stage, int64_t n) const {
    for (const Hook& h : hooks_) {
      if (h.at.when == when && h.at.stage == stage && h.at.n == n) return &h;
    }
    return nullptr;
  }

  void Fire(const Hook* hook) {
    if (hook == nullptr) return;
    if (hook->signal == SIGKILL) scheduler::KillSelf();
    raise(hook->signal);
  }

  void RunLeased(compute::Device& device, const v1::LeaseTaskResponse& lease) {
    std::vector<store::TaskRow> tasks;
    std::optional<store::TaskRow> task;
    for (const v1::WorkerTaskRow& t : lease.tasks()) {
      store::TaskRow row;
      row.id = t.id();
      row.job_id = lease.job_id();
      row.stage_id = t.stage_id();
      row.stage_kind = t.stage_kind();
      row.ordinal = t.ordinal();
      row.name = t.name();
      row.payload_json = t.payload_json();
      row.bytes_total = t.bytes_total();
      row.label = t.label();
      row.requirement.gpu = t.requires_gpu();
      row.requirement.memory_bytes = t.memory_bytes();
      if (t.done()) {
        row.state = store::TaskState::kDone;
        row.output_path = t.output_path();
        row.output_bytes = t.output_bytes();
        row.output_sha256 = t.output_sha256();
      }
      if (t.id() == lease.task_id()) {
        row.state = store::TaskState::kLeased;
        row.attempt = lease.attempt();
        task = row;
      }
      tasks.push_back(std::move(row));
    }
    if (!task.has_value()) {
      Report(lease, absl::InvalidArgumentError("the lease named a task not in the job's plan"));
      return;
    }
    const std::string label = absl::StrCat("job ", lease.job_id(), " ", task->stage_kind, " ",
                                           task->name, " (attempt ", task->attempt, ")");
    absl::StatusOr<std::shared_ptr<const pipeline::PreparedJob>> job = JobOf(lease, tasks);
    if (!job.ok()) {
      // Another worker may see the storage this one does not: the task is retried elsewhere.
      Report(lease, absl::UnavailableError(absl::StrCat(
                        "worker ", args_.name, " cannot open the job: ", job.status().message())));
      return;
    }
    for (const store::TaskRow& t : tasks) (*job)->NoteRecorded(t);
    int64_t n = 0;
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      n = ++started_[task->stage_kind];
    }
    Fire(HookAt(scheduler::KillHook::When::kStart, task->stage_kind, n));
    const Hook* mid = HookAt(scheduler::KillHook::When::kMid, task->stage_kind, n);
    const uint64_t half = static_cast<uint64_t>(std::max<int64_t>(0, task->bytes_total)) / 2;

    std::atomic<bool> cancel{false};
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> reports{0};  // add_progress calls: the heartbeat
    std::mutex done_mu;
    std::condition_variable done_cv;
    bool finished = false;
    std::thread renewer([&] {
      uint64_t renewed_at = 0;
      std::unique_lock<std::mutex> lock(done_mu);
      while (!done_cv.wait_for(lock, std::chrono::milliseconds(lease_ms_ / 3),
                               [&] { return finished; })) {
        const uint64_t seen = reports.load();
        if (seen == renewed_at) continue;  // silent: the lease is not renewed
        renewed_at = seen;
        lock.unlock();
        Renew(lease, bytes.load(), &cancel);
        lock.lock();
      }
    });
    Log(absl::StrCat(label, " on ", device.name()));
    absl::StatusOr<pipeline::TaskOutput> output =
        (*job)->RunTask(*task, device, &cancel, [&](uint64_t processed) {
          const uint64_t total = bytes.fetch_add(processed) + processed;
          reports.fetch_add(1);
          if (mid != nullptr && total >= half) Fire(mid);
        });
    {
      std::lock_guard<std::mutex> lock(done_mu);
      finished = true;
    }
    done_cv.notify_all();
    renewer.join();
    if (output.ok()) Fire(HookAt(scheduler::KillHook::When::kWritten, task->stage_kind, n));
    Report(lease, std::move(output));
    Fire(HookAt(scheduler::KillHook::When::kDone, task->stage_kind, n));
  }

  void Renew(const v1::LeaseTaskResponse& lease, uint64_t bytes, std::atomic<bool>* cancel) {
    v1::RenewLeaseRequest request;
    request.set_worker_id(worker_id());
    request.set_task_id(lease.task_id());
    request.set_attempt(lease.attempt());
    request.set_bytes_done(static_cast<int64_t>(bytes));
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(std::chrono::milliseconds(0)));
    channel_.Authenticate(&ctx);
    v1::RenewLeaseResponse response;
    const grpc::Status s = stub_->Renew(&ctx, request, &response);
    if (s.ok()) {
      if (response.cancel()) cancel->store(true);
      return;
    }
    if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
        s.error_code() == grpc::StatusCode::NOT_FOUND) {
      // The attempt lost its lease (or the coordinator restarted): stop it.
      Log(absl::StrCat("task ", lease.task_id(), " attempt ", lease.attempt(), ": ",
                       s.error_message(), "; stopping it"));
      cancel->store(true);
    }
  }

  // Completes or fails the leased attempt with `result`; retries while the coordinator is
  // unreachable, for at most one lease (after that the lease is gone anyway).
  void Report(const v1::LeaseTaskResponse& lease, absl::StatusOr<pipeline::TaskOutput> result) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(lease_ms_);
    while (true) {
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(std::chrono::milliseconds(0)));
      channel_.Authenticate(&ctx);
      grpc::Status s;
      if (result.ok()) {
        v1::CompleteTaskRequest request;
        request.set_worker_id(worker_id());
        request.set_task_id(lease.task_id());
        request.set_attempt(lease.attempt());
        request.set_output_path(result->path);
        request.set_output_bytes(static_cast<int64_t>(result->bytes));
        request.set_output_sha256(result->sha256);
        for (const store::TensorStatsRow& row : result->stats) {
          v1::TensorStats* stats = request.add_stats();
          stats->set_tensor(row.tensor);
          stats->set_rel_rmse(row.rel_rmse);
          stats->set_sqnr_db(row.sqnr_db);
          stats->set_max_abs_err(row.max_abs_err);
        }
        for (const pipeline::TaskFigure& figure : result->figures) {
          v1::TaskFigureEntry* entry = request.add_figures();
          entry->set_metric(figure.metric);
          entry->set_value(figure.value);
        }
        request.set_summary(result->summary);
        v1::CompleteTaskResponse response;
        s = stub_->Complete(&ctx, request, &response);
      } else {
        v1::FailTaskRequest request;
        request.set_worker_id(worker_id());
        request.set_task_id(lease.task_id());
        request.set_attempt(lease.attempt());
        request.set_code(static_cast<int32_t>(result.status().code()));
        request.set_message(std::string(result.status().message().substr(0, 4096)));
        if (result.status().GetPayload(pipeline::kJobReasonPayload).has_value()) {
          request.set_job_reason(pipeline::JobReasonOf(result.status()));
        }
        v1::FailTaskResponse response;
        s = stub_->Fail(&ctx, request, &response);
      }
      const std::string what = absl::StrCat("task ", lease.task_id(), " attempt ", lease.attempt(),
                                            result.ok() ? " done" : " failed");
      if (s.ok()) {
        Log(result.ok() ? what : absl::StrCat(what, ": ", result.status().message()));
        return;
      }
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
          s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        Log(absl::StrCat(what, "; the coordinator refused it: ", s.error_message()));
        return;
      }
      if (std::chrono::steady_clock::now() > give_up || g_stop.load()) {
        Log(absl::StrCat(what, "; the coordinator is unreachable: ", s.error_message()));
        return;
      }
      std::this_thread::sleep_for(kRetryPause);
    }
  }

  const WorkerArgs args_;
  const api::ClientChannel channel_;
  const std::unique_ptr<v1::WorkerService::Stub> stub_;
  const std::vector<std::unique_ptr<compute::Device>> devices_;  // one thread each
  const std::vector<Hook> hooks_;
  std::atomic<bool> fatal_{false};  // the coordinator refused the credentials

  std::mutex register_mu_;  // guards the registration
  std::string worker_id_;
  int64_t lease_ms_ = 60'000;

  std::mutex idle_mu_;  // guards the idle clock
  int busy_ = 0;        // devices running a task
  std::chrono::steady_clock::time_point last_busy_;

  std::mutex jobs_mu_;                      // guards the members below
  std::map<int64_t, OpenJob> jobs_;         // jobs opened, by id
  uint64_t uses_ = 0;                       // for OpenJob::last_used
  std::map<std::string, int64_t> started_;  // tasks started per stage kind (test hooks)
};

}  // namespace

int WorkerMain(const WorkerArgs& args_in) {
  WorkerArgs args = args_in;
  if (args.name.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    args.name = absl::StrCat(host, "-", getpid());
  }
  if (args.devices.empty()) args.devices = {"cpu"};
  if (args.exit_when_idle_s < 0 || args.cpu_threads < 0) {
    std::cerr << "quantd worker: --exit-when-idle and --cpu-threads must be >= 0\n";
    return kUsage;
  }
  std::vector<Hook> hooks;
  for (const auto& [env, sig] :
       {std::pair{"QUANTD_TEST_KILL_AT", SIGKILL}, std::pair{"QUANTD_TEST_STOP_AT", SIGSTOP}}) {
    absl::StatusOr<std::optional<scheduler::KillHook>> hook = scheduler::ParseKillHook(getenv(env));
    if (!hook.ok()) {
      std::cerr << "quantd worker: " << hook.status().message() << "\n";
      return kUsage;
    }
    if (hook->has_value()) hooks.push_back(Hook{**hook, sig});
  }
  absl::StatusOr<api::ClientChannel> channel = api::ClientChannel::Open(args.connect);
  if (!channel.ok()) {
    std::cerr << "quantd worker: " << channel.status().message() << "\n";
    return kUsage;
  }
  std::vector<std::unique_ptr<compute::Device>> devices;
  for (const std::string& name : args.devices) {
    absl::StatusOr<std::unique_ptr<compute::Device>> device =
        compute::OpenDevice(name, {args.cpu_threads, 0});
    if (!device.ok()) {
      std::cerr << "quantd worker: --devices " << name << ": " << device.status().message() << "\n";
      return kFailed;
    }
    devices.push_back(*std::move(device));
  }
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  Worker worker(std::move(args), *std::move(channel), std::move(devices), std::move(hooks));
  return worker.Run();
}

void AddWorkerCommand(CLI::App& app, int& rc) {
  auto args = std::make_shared<WorkerArgs>();
  auto devices = std::make_shared<std::string>("cpu");
  CLI::App* cmd = app.add_subcommand(
      "worker", "Run tasks of a quantd daemon (the coordinator) on this machine's devices");
  cmd->add_option("--coordinator", args->connect.server,
                  "daemon address: unix:/path/to.sock or HOST:PORT")
      ->required();
  cmd->add_option("--token-file", args->connect.token_file,
                  "file with a bearer token of the worker role");
  cmd->add_option("--tls-ca", args->connect.tls_ca, "PEM CA of the daemon's certificate: TLS");
  cmd->add_option("--tls-cert", args->connect.tls_cert, "PEM client certificate (mTLS)");
  cmd->add_option("--tls-key", args->connect.tls_key, "PEM private key of --tls-cert");
  cmd->add_option("--devices", *devices, "devices to run tasks on: cpu, cuda:N, comma-separated")
      ->capture_default_str();
  cmd->add_option("--name", args->name, "the worker's name (default: HOSTNAME-PID)");
  cmd->add_option("--exit-when-idle", args->exit_when_idle_s,
                  "exit after this many seconds without a task (0: never)")
      ->capture_default_str();
  cmd->add_option("--cpu-threads", args->cpu_threads, "threads per CPU kernel call (0 = all)")
      ->capture_default_str();
  cmd->callback([args, devices, &rc] {
    args->devices = absl::StrSplit(*devices, ',');
    rc = WorkerMain(*args);
  });
}

}  // namespace quantd
