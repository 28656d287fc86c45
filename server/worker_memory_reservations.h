// The worker memory that admitted calls reserve while they run, for moed's admission control
// (--worker_memory_bytes; server/worker_memory_admission.h). A step (or a CreateLayer until its
// layer is on the books) reserves its estimated per-worker bytes when it is admitted and
// releases them when it ends, on every path: so steps of different layers running at the same
// time are summed, not each checked alone.
//
//   WorkerMemoryReservations reservations;
//   WorkerMemoryReservations::Reservation reserved;
//   int64_t held = 0, in_flight = 0;
//   if (!reservations.TryReserve(need, budget, [&] { return HeldBytes(); }, &reserved, &held,
//                                &in_flight)) {
//     return absl::ResourceExhaustedError(...);  // never waits
//   }
//   ... the step runs; `reserved` gives its bytes back when it is destroyed or Release()d.
//
// Bytes move between the books that `held` reads and a reservation without ever being missed
// by a concurrent TryReserve (which calls `held` under the lock): add them to the reservation
// (Add) before they leave the books, and put them on the books before releasing the
// reservation. Counted twice for a moment is conservative; never counted is not.
#ifndef MOED_SERVER_WORKER_MEMORY_RESERVATIONS_H_
#define MOED_SERVER_WORKER_MEMORY_RESERVATIONS_H_

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace moe {

class WorkerMemoryReservations {
 public:
  // The bytes one admitted call holds; movable, released (once) by Release() or destruction.
  // Must not outlive its WorkerMemoryReservations. An empty one (default-constructed, or
  // admission control off) holds nothing and ignores Add.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept
        : owner_(std::exchange(other.owner_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
    Reservation& operator=(Reservation&& other) noexcept {
      if (this != &other) {
        Release();
        owner_ = std::exchange(other.owner_, nullptr);
        bytes_ = std::exchange(other.bytes_, 0);
      }
      return *this;
    }
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation() { Release(); }

    int64_t bytes() const { return bytes_; }
    // Adds `bytes` without a check: bytes the call keeps on the workers that are about to
    // leave the books `held` reads (a saved step a Backward consumes). Not under a lock that
    // `held` takes.
    void Add(int64_t bytes) {
      if (owner_ == nullptr || bytes <= 0) return;
      absl::MutexLock lock(&owner_->mu_);
      owner_->reserved_ += bytes;
      bytes_ += bytes;
    }
    void Release() {
      if (owner_ == nullptr) return;
      absl::MutexLock lock(&owner_->mu_);
      owner_->reserved_ -= bytes_;
      owner_ = nullptr;
      bytes_ = 0;
    }

   private:
    friend class WorkerMemoryReservations;
    WorkerMemoryReservations* owner_ = nullptr;
    int64_t bytes_ = 0;
  };

  WorkerMemoryReservations() = default;
  WorkerMemoryReservations(const WorkerMemoryReservations&) = delete;
  WorkerMemoryReservations& operator=(const WorkerMemoryReservations&) = delete;

  // Admits `need` bytes when held() + reserved() + need <= budget: *reservation (released
  // first if it held anything) then holds them and true is returned. Otherwise false and
  // nothing is reserved. Either way *held_seen and *reserved_seen are the figures compared.
  // held() runs under this object's lock (which is taken before any lock held() takes), so a
  // check and its reservation are one step for every other TryReserve, Add and Release.
  bool TryReserve(int64_t need, int64_t budget, const std::function<int64_t()>& held,
                  Reservation* reservation, int64_t* held_seen, int64_t* reserved_seen) {
    reservation->Release();
    absl::MutexLock lock(&mu_);
    *held_seen = held();
    *reserved_seen = reserved_;
    // In long double: need saturates at INT64_MAX (server/step_memory.h).
    if (static_cast<long double>(*held_seen) + static_cast<long double>(reserved_) +
            static_cast<long double>(need) >
        static_cast<long double>(budget)) {
      return false;
    }
    reserved_ += need;
    reservation->owner_ = this;
    reservation->bytes_ = need;
    return true;
  }

  // Reserves `bytes` without a check: bytes about to leave the books `held` reads that the
  // workers still hold for a while (a deleted layer until they dropped it).
  Reservation Hold(int64_t bytes) {
    Reservation reservation;
    reservation.owner_ = this;
    reservation.Add(bytes);
    return reservation;
  }

  // The bytes reserved by calls now (moed_worker_memory_reserved_bytes).
  int64_t reserved() const {
    absl::MutexLock lock(&mu_);
    return reserved_;
  }

 private:
  mutable absl::Mutex mu_;
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe

#endif  // MOED_SERVER_WORKER_MEMORY_RESERVATIONS_H_
