#pragma once
/// \file watchdog.hpp
/// \brief No collective of kfac waits forever: every collective MpiComm makes is started as a
/// nonblocking one and polled until it completes or its deadline passes (MpiComm::with_timeout,
/// default 600 s, or `KFAC_COMM_TIMEOUT=<seconds>` in the environment; 0: no deadline; polled
/// without pause for 10 ms, then with sleeps of 20 us doubling to 0.5 ms). A rank
/// whose peers do not arrive in time throws a kfac::Error that names the call, what kfac was
/// doing (the step and layer, where known: MpiComm::scope) and, for each peer, whether it was
/// waiting in the same collective, in another one (which), or in none. The model is PyTorch's
/// process-group timeout.
///
/// How the peers are asked: while it waits, a rank answers questions on a duplicate of kfac's
/// communicator (tags kQuery / kAnswer); a rank that times out asks every member of the late
/// collective and waits a grace period (a quarter of the timeout, between 0.2 and 2 s) for the
/// answers. A peer that does not answer is not inside a kfac collective on this communicator:
/// computing, blocked elsewhere, or gone.
///
/// A collective that timed out cannot be cancelled (MPI has no such call): the communicator is
/// then unusable, every later collective on it throws at once, and the job should end
/// (MPI_Abort), as PyTorch's watchdog ends it. A late peer may still complete the abandoned
/// collective whenever MPI progresses (in any later MPI call, MPI_Finalize included), so what it
/// needs stays alive until the process ends (impl::Abandoned): its request, the staging buffer
/// of every blocking kfac collective (MpiComm copies small payloads into one), and every kfac
/// communicator (none is freed once something was abandoned). A peer that learns of the
/// timeout (the question the late rank was asked is waiting for it) throws too, at its next
/// kfac collective. And MPI_Finalize cannot hang on a peer that never arrives: once something
/// was abandoned, a process still inside MPI_Finalize a deadline after it began prints why and
/// ends with exit code 1 (mpiexec then ends the job).

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "kfac/error.hpp"

namespace kfac {
namespace impl {

/// The deadline of kfac's collectives when none is set: `KFAC_COMM_TIMEOUT` seconds when the
/// variable is set (0: none), else 600 s.
inline double default_comm_timeout() {
  const char* env = std::getenv("KFAC_COMM_TIMEOUT");
  if (env == nullptr || *env == '\0') return 600.0;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(v >= 0) || !std::isfinite(v))
    throw Error("", "KFAC_COMM_TIMEOUT='" + std::string(env) +
                        "': expected a number of seconds >= 0 (0: collectives wait without a deadline)");
  return v;
}

/// Throws a kfac::Error when an MPI call did not return MPI_SUCCESS.
inline void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) throw Error("", std::string(what) + " failed with code " + std::to_string(rc));
}

/// \brief What timed-out collectives still need, kept until the process ends: a late peer may
/// complete them in any later MPI call. One per process (never destroyed: MPI_Finalize and
/// static destructors may run in any order); thread-safe (background broadcasts time out on
/// their own thread).
class Abandoned {
 public:
  static Abandoned& instance() {
    static Abandoned* one = new Abandoned();  // never destroyed, on purpose
    return *one;
  }
  /// Keeps `what` (requests, buffers, a communicator handle) alive for ever; arms the
  /// MPI_Finalize guard with `grace` seconds (see finalizing) and `why` for its message.
  void keep(std::shared_ptr<void> what, double grace, const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (what) kept_.push_back(std::move(what));
    any_ = true;
    grace_ = std::max(grace_, grace);
    if (why_.empty()) why_ = why;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (armed_ || finalized) return;
    armed_ = true;
    std::atexit([] { instance().exiting_ = true; });
    // MPI_Finalize first frees MPI_COMM_SELF, which calls the delete callbacks of its attributes.
    int key = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &Abandoned::finalizing, &key, nullptr) == MPI_SUCCESS)
      MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
  }
  /// True once some collective was abandoned: communicators are then never freed (a pending
  /// collective on a freed communicator crashes MPI when it completes).
  bool any() const { return any_; }

 private:
  Abandoned() = default;
  /// At the start of MPI_Finalize: a watcher thread ends the process with exit code 1 if it is
  /// still running `grace` seconds later (a peer that never arrives keeps MPI_Finalize waiting).
  static int finalizing(MPI_Comm, int, void*, void*) {
    Abandoned& a = instance();
    const double grace = a.grace_;
    const std::string why = a.why_;
    std::thread([grace, why] {
      std::this_thread::sleep_for(std::chrono::duration<double>(grace));
      if (instance().exiting_) return;
      std::fprintf(stderr,
                   "kfac: MPI_Finalize did not complete within %g s after a kfac collective timed out (%s): ending "
                   "this process with exit code 1\n",
                   grace, why.c_str());
      std::fflush(stderr);
      std::_Exit(1);
    }).detach();
    return MPI_SUCCESS;
  }
  std::mutex mutex_;
  std::vector<std::shared_ptr<void>> kept_;
  std::atomic<bool> any_{false}, exiting_{false};
  bool armed_ = false;
  double grace_ = 0;
  std::string why_;
};

/// How a wait polls: it looks at the clock every `every` polls; after `busy` seconds (polling
/// without pause, as MPI's blocking calls do) it sleeps there, from 20 us doubling up to
/// `max_pause_us`, so that a long wait leaves the core to others.
struct PollPace {
  double busy = 0.010;
  int max_pause_us = 500;
  long every = 64;
};

/// \brief The one polling loop of kfac's MPI waits: tests the `n` requests of `call` until they
/// complete (returns a negative number) or `timeout` seconds (> 0; 0: no deadline) have passed
/// (returns the seconds waited); `between()` runs whenever it looks at the clock (the watchdog
/// answers its peers' questions there).
template <class Between>
double poll_requests(MPI_Request* r, int n, const char* call, double timeout, PollPace pace, Between&& between) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  int pause_us = 0;
  for (long it = 0;; ++it) {
    int done = 0;
    check_mpi(MPI_Testall(n, r, &done, MPI_STATUSES_IGNORE), call);
    if (done) return -1.0;
    if ((it + 1) % pace.every != 0) continue;
    between();
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    if (timeout > 0 && waited > timeout) return waited;
    if (waited > pace.busy) {
      pause_us = std::min(std::max(2 * pause_us, 20), pace.max_pause_us);
      std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
    }
  }
}

/// \brief The deadline and the answers to late peers' questions of one MpiComm (shared by its
/// copies). Used by the calling thread only.
class Watchdog {
 public:
  static constexpr int kQuery = 1, kAnswer = 2;
  double timeout = default_comm_timeout();
  MPI_Comm comm = MPI_COMM_NULL;   ///< kfac's communicator
  MPI_Comm watch = MPI_COMM_NULL;  ///< questions and answers (a duplicate of comm)
  std::string context;             ///< what kfac is doing (MpiComm::scope)

  /// Throws when an earlier collective timed out.
  void check_usable() const {
    if (!broken_.empty()) throw Error("", broken_ + " (an earlier collective timed out; nothing more was sent)");
  }
  /// True once a collective timed out, here or on a peer that asked this rank.
  bool broken() const { return !broken_.empty(); }

  /// Completes the `n` requests of collective `call` on `on` (kfac's communicator or one of its
  /// groups), or throws when the deadline passes, or when a peer gave up on kfac's
  /// communicator (it asked this rank why it was late). `keep`: what the requests write into
  /// or read from, kept alive for ever if they are abandoned (null: the caller's memory).
  void wait(MPI_Request* r, int n, const char* call, MPI_Comm on, std::shared_ptr<void> keep = nullptr) {
    if (n == 0) return;
    if (on == comm) ++seq_;
    if (!(timeout > 0)) {
      check_mpi(MPI_Waitall(n, r, MPI_STATUSES_IGNORE), call);
      return;
    }
    Waiting here(*this, call);
    answer_questions();  // a peer that gave up before this collective began: it cannot complete
    if (!gave_up_.empty()) give_up(r, n, std::move(keep));
    const double late = poll_requests(r, n, call, timeout, PollPace{}, [this] { answer_questions(); });
    if (late >= 0) time_out(on, late, r, n, std::move(keep));
    if (!gave_up_.empty()) give_up(r, n, nullptr);  // completed, but the peer has gone
  }
  /// Keeps `n` requests that will never be waited for, and `keep`, until the process ends
  /// (Abandoned).
  void abandon(const MPI_Request* r, int n, std::shared_ptr<void> keep) {
    auto what = std::make_shared<std::pair<std::vector<MPI_Request>, std::shared_ptr<void>>>(
        std::vector<MPI_Request>(r, r + n), std::move(keep));
    Abandoned::instance().keep(what, std::max(1.0, timeout), broken_);
  }

  /// Answers the questions of peers that timed out (from inside a wait).
  void answer_questions() {
    if (watch == MPI_COMM_NULL) return;
    sent_.remove_if([](Answer& a) {
      int done = 0;
      MPI_Test(&a.request, &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
    for (;;) {
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(MPI_ANY_SOURCE, kQuery, watch, &flag, &st);
      if (!flag) return;
      long question = 0;
      MPI_Recv(&question, 1, MPI_LONG, st.MPI_SOURCE, kQuery, watch, MPI_STATUS_IGNORE);
      // Only a rank whose deadline passed asks: it has given up on kfac's communicator.
      if (gave_up_.empty())
        gave_up_ = "rank " + std::to_string(st.MPI_SOURCE) + " timed out in its kfac collective number " +
                   std::to_string(question) + " on this communicator and gave up on it";
      sent_.emplace_back();
      Answer& a = sent_.back();
      a.report = report();
      MPI_Isend(&a.report, int(sizeof(Report)), MPI_BYTE, st.MPI_SOURCE, kAnswer, watch, &a.request);
    }
  }

 private:
  /// What a rank tells a peer that asks: how many collectives on kfac's communicator it has
  /// waited for, and in which one it waits now.
  struct Report {
    long seq = 0;
    char what[160] = {};
  };
  struct Answer {
    Report report;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  /// Marks the calling rank as waiting in `call` for the duration of a wait.
  struct Waiting {
    Watchdog& d;
    Waiting(Watchdog& dog, const char* call) : d(dog) { d.call_ = call; }
    ~Waiting() { d.call_ = nullptr; }
  };

  long seq_ = 0, question_ = 0;
  const char* call_ = nullptr;
  std::string broken_, gave_up_;
  std::list<Answer> sent_;

  std::string describe() const {
    return std::string(call_ ? call_ : "?") + (context.empty() ? "" : " (" + context + ")");
  }
  Report report() const {
    Report r;
    r.seq = seq_;
    std::snprintf(r.what, sizeof(r.what), "%s", describe().c_str());
    return r;
  }

  int my_rank() const {
    int me = 0;
    MPI_Comm_rank(comm != MPI_COMM_NULL ? comm : MPI_COMM_WORLD, &me);
    return me;
  }
  [[noreturn]] void time_out(MPI_Comm on, double waited, MPI_Request* r, int n, std::shared_ptr<void> keep) {
    const int me = my_rank();
    char secs[64];
    std::snprintf(secs, sizeof(secs), "%.3g s (timeout %g s)", waited, timeout);
    broken_ = "MpiComm: " + describe() + " on rank " + std::to_string(me) + " did not complete within " + secs +
              ": " + ask_peers(on, me) +
              "; kfac's collectives on this communicator cannot be used any more (an MPI collective cannot be "
              "cancelled): end the job, e.g. with MPI_Abort";
    abandon(r, n, std::move(keep));
    throw Error("", broken_);
  }
  /// A peer gave up (gave_up_): this rank's collective is abandoned where it stands.
  [[noreturn]] void give_up(MPI_Request* r, int n, std::shared_ptr<void> keep) {
    broken_ = "MpiComm: " + describe() + " on rank " + std::to_string(my_rank()) + ": " + gave_up_ +
              "; kfac's collectives on this communicator cannot be used any more: end the job, e.g. with MPI_Abort";
    int done = 0;
    MPI_Testall(n, r, &done, MPI_STATUSES_IGNORE);
    if (!done) abandon(r, n, std::move(keep));
    else Abandoned::instance().keep(nullptr, std::max(1.0, timeout), broken_);
    throw Error("", broken_);
  }

  /// Asks every other member of `on` what it is doing; returns who did not arrive.
  std::string ask_peers(MPI_Comm on, int me) {
    if (watch == MPI_COMM_NULL || on == MPI_COMM_NULL)
      return "the peers could not be asked (kfac's communicator was still being made)";
    MPI_Group g_on, g_all;
    MPI_Comm_group(on, &g_on);
    MPI_Comm_group(comm, &g_all);
    int n = 0;
    MPI_Group_size(g_on, &n);
    const std::size_t members = static_cast<std::size_t>(n);
    std::vector<int> local(members), world(members);
    std::iota(local.begin(), local.end(), 0);
    MPI_Group_translate_ranks(g_on, n, local.data(), g_all, world.data());
    MPI_Group_free(&g_on);
    MPI_Group_free(&g_all);
    const Report mine = report();
    std::vector<Report> answers(members);
    std::vector<MPI_Request> asked(members, MPI_REQUEST_NULL), heard(members, MPI_REQUEST_NULL);
    question_ = seq_;
    for (int k = 0; k < n; ++k) {
      if (world[std::size_t(k)] == me) continue;
      MPI_Isend(&question_, 1, MPI_LONG, world[std::size_t(k)], kQuery, watch, &asked[std::size_t(k)]);
      MPI_Irecv(&answers[std::size_t(k)], int(sizeof(Report)), MPI_BYTE, world[std::size_t(k)], kAnswer, watch,
                &heard[std::size_t(k)]);
    }
    const double grace = std::min(2.0, std::max(0.2, timeout / 4));
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace);
    std::vector<int> got(members, 0);
    for (bool all = false; !all && std::chrono::steady_clock::now() < until;) {
      all = true;
      for (int k = 0; k < n; ++k) {
        if (heard[std::size_t(k)] != MPI_REQUEST_NULL && !got[std::size_t(k)])
          MPI_Test(&heard[std::size_t(k)], &got[std::size_t(k)], MPI_STATUS_IGNORE);
        all = all && (world[std::size_t(k)] == me || got[std::size_t(k)]);
      }
      answer_questions();
      if (!all) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::string late, arrived;
    for (int k = 0; k < n; ++k) {
      const int p = world[std::size_t(k)];
      if (p == me) continue;
      if (!got[std::size_t(k)]) {
        MPI_Cancel(&heard[std::size_t(k)]);
        MPI_Wait(&heard[std::size_t(k)], MPI_STATUS_IGNORE);
      }
      int sent = 0;
      MPI_Test(&asked[std::size_t(k)], &sent, MPI_STATUS_IGNORE);
      if (!sent) MPI_Request_free(&asked[std::size_t(k)]);
      const Report& a = answers[std::size_t(k)];
      if (got[std::size_t(k)] && a.seq == mine.seq && std::string(a.what) == mine.what) {
        arrived += (arrived.empty() ? "" : ", ") + std::to_string(p);
        continue;
      }
      late += (late.empty() ? "" : ", ") + std::to_string(p) +
              (got[std::size_t(k)] ? " (waiting in " + std::string(a.what) + " instead)"
                                   : " (no answer: not inside a kfac collective on this communicator)");
    }
    return "rank(s) that did not arrive: " + (late.empty() ? std::string("none") : late) +
           (arrived.empty() ? "" : "; waiting in it too: rank(s) " + arrived);
  }
};

}  // namespace impl
}  // namespace kfac
