// gRPC's callback API for moed's services, whose calls block: a layer's turn, a fan-out to
// the workers, a rendezvous key that is not there yet. gRPC's own callback threads must never
// block, so the body of each call runs on a HandlerPool thread and finishes the call's reactor
// from there; streams are read and written through reactors whose Read/Write wait for gRPC's
// answer on that pool thread. (moe-worker stays on the synchronous API: docs/DECISIONS.md.)
//
//   grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
//                                     const ForwardRequest* request,
//                                     ForwardResponse* response) override {
//     return RunUnary(context, &handlers_, [=] { return DoForward(context, request, response); });
//   }
//   grpc::ServerWriteReactor<Chunk>* GetWeights(grpc::CallbackServerContext* context,
//                                               const GetWeightsRequest* request) override {
//     return StreamWriter<Chunk>::Start(&handlers_, [=](StreamWriter<Chunk>* writer) {
//       return DoGetWeights(context, request, writer);
//     }, /*client=*/PeerHost(*context));
//   }
#ifndef MOED_SERVER_CALLBACK_H_
#define MOED_SERVER_CALLBACK_H_

#include <grpcpp/grpcpp.h>

#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace moe {

// Threads for the bodies of calls. It grows on demand up to max_threads (threads are kept
// once started); a call that finds all of them busy is refused (RESOURCE_EXHAUSTED) instead
// of queueing behind calls that may wait for minutes. With max_per_client > 0, one client
// (a key the caller chooses: a token, a peer address) runs at most that many bodies at once;
// its next call is refused (RESOURCE_EXHAUSTED) while other clients still find threads.
class HandlerPool {
 public:
  explicit HandlerPool(int max_threads, int max_per_client = 0);
  ~HandlerPool();  // waits for the running bodies, then joins every thread
  HandlerPool(const HandlerPool&) = delete;
  HandlerPool& operator=(const HandlerPool&) = delete;

  // Runs body on a pool thread, then finish(its status). The thread counts as free from
  // the moment body returns, so a client whose next call follows the answer at once finds it
  // free. False (nothing run) when max_threads bodies are running.
  bool TrySubmit(std::function<grpc::Status()> body,
                 std::function<void(const grpc::Status&)> finish);
  // The same for a call of `client` (empty: no per-client limit): OK when the body was
  // queued; RESOURCE_EXHAUSTED (what the call answers, naming the limit) when max_threads
  // bodies run, or max_per_client of this client's.
  grpc::Status Submit(const std::string& client, std::function<grpc::Status()> body,
                      std::function<void(const grpc::Status&)> finish);
  // Runs body on the calling thread in a slot of the pool: it counts toward max_threads and
  // `client`'s max_per_client while it runs, and is refused exactly as Submit refuses (the
  // same RESOURCE_EXHAUSTED, Close()'s refusal, UNAVAILABLE once stopping), in which case body
  // does not run. For a thread of the caller's own that would otherwise hand the body to the
  // pool and wait (moed's step channels: two thread wake-ups per step saved). Returns body's
  // status.
  grpc::Status RunHere(const std::string& client, absl::FunctionRef<grpc::Status()> body);
  // What a call refused because every thread is busy answers.
  grpc::Status BusyStatus() const;
  // From now on Submit and RunHere refuse every call with `refusal` (moed's graceful stop: no
  // new calls); the bodies queued or running finish, and TrySubmit (the service's own work)
  // still runs.
  void Close(grpc::Status refusal);

 private:
  void Loop();
  // Refusal (not OK) or a slot taken for `client` (*limited: counted in per_client_).
  grpc::Status TakeSlot(const std::string& client, bool* limited)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseClient(const std::string& client) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status Queue(const std::string& client, std::function<grpc::Status()> body,
                     std::function<void(const grpc::Status&)> finish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_threads_;
  const int max_per_client_;
  absl::Mutex mu_;
  struct Work {
    std::string client;
    std::function<grpc::Status()> body;
    std::function<void(const grpc::Status&)> finish;
  };
  std::map<std::string, int> per_client_ ABSL_GUARDED_BY(mu_);  // bodies queued or running
  std::deque<Work> queue_ ABSL_GUARDED_BY(mu_);
  int busy_ ABSL_GUARDED_BY(mu_) = 0;  // bodies queued or running on the pool's threads
  int here_ ABSL_GUARDED_BY(mu_) = 0;  // bodies running in RunHere, on their callers' threads
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status refusal_ ABSL_GUARDED_BY(mu_);  // while closed_
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

// The caller's address without its port ("ipv4:10.0.0.7", "ipv6:[::1]"): a per-client key
// for HandlerPool when calls carry no token.
std::string PeerHost(const grpc::ServerContextBase& context);

// A unary call: body() -> grpc::Status runs on the pool, then the call finishes with it.
// `client`: HandlerPool's per-client key (empty: none).
template <typename Body>
grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* context, HandlerPool* pool,
                                   Body body, const std::string& client = "") {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status queued =
      pool->Submit(client, body, [reactor](const grpc::Status& s) { reactor->Finish(s); });
  if (!queued.ok()) reactor->Finish(queued);
  return reactor;
}

// One stream operation at a time, started on a pool thread and completed by gRPC on its own:
// Run() starts it and waits for Done(ok). After a failed operation (the call is over) Run()
// starts nothing and returns false. With an idle timeout (CancelIfIdle), an operation not
// done within it cancels the call (a client that stopped reading must not hold a handler
// thread and the memory behind the stream forever); gRPC then fails the operation and Run()
// returns false.
class PendingOp {
 public:
  void CancelIfIdle(absl::Duration timeout, grpc::ServerContextBase* context) {
    absl::MutexLock lock(&mu_);
    idle_timeout_ = timeout;
    context_ = context;
  }
  template <typename StartFn>
  bool Run(StartFn start) {
    absl::Duration timeout;
    {
      absl::MutexLock lock(&mu_);
      if (over_) return false;
      pending_ = true;
      timeout = idle_timeout_;
    }
    start();  // not under mu_: gRPC may complete it on another thread at once
    absl::MutexLock lock(&mu_);
    const absl::Condition done(
        +[](bool* pending) { return !*pending; }, &pending_);
    if (!mu_.AwaitWithTimeout(done, timeout)) {
      context_->TryCancel();  // completes the operation (not ok) on gRPC's thread
      mu_.Await(done);
      over_ = true;
    }
    return !over_;
  }
  void Done(bool ok) {
    absl::MutexLock lock(&mu_);
    pending_ = false;
    if (!ok) over_ = true;
  }

 private:
  absl::Mutex mu_;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  bool over_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration idle_timeout_ ABSL_GUARDED_BY(mu_) = absl::InfiniteDuration();
  grpc::ServerContextBase* context_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// Runs body(reactor) -> grpc::Status on the pool and finishes the reactor with it (or with
// the refusal when the pool, or `client`'s share of it, is full).
template <typename Reactor, typename Body>
Reactor* FinishOnPool(HandlerPool* pool, const std::string& client, Reactor* reactor, Body body) {
  grpc::Status queued = pool->Submit(
      client, [reactor, body]() mutable { return body(reactor); },
      [reactor](const grpc::Status& s) { reactor->Finish(s); });
  if (!queued.ok()) reactor->Finish(queued);
  return reactor;
}

// A server-streaming call whose body writes with blocking Write() calls from a pool thread.
template <typename Message>
class StreamWriter final : public grpc::ServerWriteReactor<Message> {
 public:
  // body(StreamWriter*) -> grpc::Status runs on the pool; the call finishes with its status.
  template <typename Body>
  static grpc::ServerWriteReactor<Message>* Start(HandlerPool* pool, Body body,
                                                  const std::string& client = "") {
    return FinishOnPool(pool, client, new StreamWriter(), body);  // deletes itself in OnDone
  }
  // A call refused before any thread is taken (a token without the role): finished at once.
  static grpc::ServerWriteReactor<Message>* Refuse(const grpc::Status& status) {
    auto* reactor = new StreamWriter();
    reactor->Finish(status);
    return reactor;  // deletes itself in OnDone
  }

  // Sends one message and waits until gRPC has taken it (flow control holds a reader that
  // does not read). False once the call is over (the client cancelled or went away).
  bool Write(const Message& message) {
    return write_.Run([&] { this->StartWrite(&message); });
  }
  // From now on, a Write that the client has not taken within `timeout` cancels the call
  // (`context` is the call's) and returns false.
  void CancelIfIdle(absl::Duration timeout, grpc::ServerContextBase* context) {
    write_.CancelIfIdle(timeout, context);
  }

  void OnWriteDone(bool ok) override { write_.Done(ok); }
  void OnDone() override { delete this; }

 private:
  StreamWriter() = default;
  PendingOp write_;
};

// A client-streaming call whose body reads with blocking Read() calls from a pool thread.
template <typename Message>
class StreamReader final : public grpc::ServerReadReactor<Message> {
 public:
  // body(StreamReader*) -> grpc::Status runs on the pool; the call finishes with its status.
  template <typename Body>
  static grpc::ServerReadReactor<Message>* Start(HandlerPool* pool, Body body,
                                                 const std::string& client = "") {
    return FinishOnPool(pool, client, new StreamReader(), body);  // deletes itself in OnDone
  }
  // A call refused before any thread is taken (a token without the role): finished at once.
  static grpc::ServerReadReactor<Message>* Refuse(const grpc::Status& status) {
    auto* reactor = new StreamReader();
    reactor->Finish(status);
    return reactor;  // deletes itself in OnDone
  }

  // The next message of the stream; false at its end (or when the call is over).
  bool Read(Message* message) {
    return read_.Run([&] { this->StartRead(message); });
  }
  // From now on, a Read that the client does not serve within `timeout` cancels the call
  // (`context` is the call's) and returns false.
  void CancelIfIdle(absl::Duration timeout, grpc::ServerContextBase* context) {
    read_.CancelIfIdle(timeout, context);
  }

  void OnReadDone(bool ok) override { read_.Done(ok); }
  void OnDone() override { delete this; }

 private:
  StreamReader() = default;
  PendingOp read_;
};

// A bidirectional stream whose body reads and writes with blocking calls from a pool thread
// (one operation of each kind at a time).
template <typename Request, typename Response>
class StreamReaderWriter final : public grpc::ServerBidiReactor<Request, Response> {
 public:
  // body(StreamReaderWriter*) -> grpc::Status runs on the pool; the call finishes with it.
  template <typename Body>
  static grpc::ServerBidiReactor<Request, Response>* Start(HandlerPool* pool, Body body,
                                                           const std::string& client = "") {
    return FinishOnPool(pool, client, new StreamReaderWriter(), body);  // deletes itself in OnDone
  }
  // A call refused before any thread is taken (a token without the role): finished at once.
  static grpc::ServerBidiReactor<Request, Response>* Refuse(const grpc::Status& status) {
    auto* reactor = new StreamReaderWriter();
    reactor->Finish(status);
    return reactor;  // deletes itself in OnDone
  }

  // The next message; false at the end of the client's half (or when the call is over).
  bool Read(Request* message) {
    return read_.Run([&] { this->StartRead(message); });
  }
  // Sends one message and waits until gRPC has taken it; false once the call is over.
  bool Write(const Response& message) {
    return write_.Run([&] { this->StartWrite(&message); });
  }
  // From now on, a Read or Write the client does not serve within `timeout` cancels the call
  // (`context` is the call's) and returns false.
  void CancelIfIdle(absl::Duration timeout, grpc::ServerContextBase* context) {
    read_.CancelIfIdle(timeout, context);
    write_.CancelIfIdle(timeout, context);
  }

  void OnReadDone(bool ok) override { read_.Done(ok); }
  void OnWriteDone(bool ok) override { write_.Done(ok); }
  void OnDone() override { delete this; }

 private:
  StreamReaderWriter() = default;
  PendingOp read_;
  PendingOp write_;
};

}  // namespace moe

#endif  // MOED_SERVER_CALLBACK_H_
