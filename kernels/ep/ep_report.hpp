// What the intranode and internode EP kernels share to report a failure and to wait for a peer: the
// error words' first-failure claim, a timeout's detail word, the bounded spin-wait, and a block's
// share of a done count. Each family wraps them for its own args struct.
#pragma once
#include "common/types.hpp"

namespace mori::ep_report {

// Record a device error for the host (host-mapped words a.errWord: code, detail, extra). The first
// thread of this rank to fail claims the words (`claim`: a word that counts the failures since the
// last reset) and the others return, so the host reads one thread's report whole (a dead peer
// times out many waits at once) and it is the first error, until op.reset().
template <typename Args>
MORI_DEVICE void RecordErrorWords(const Args& a, uint64_t* claim, uint64_t code, uint64_t detail, uint64_t extra) {
  if (plat::atomic_add_device(reinterpret_cast<unsigned*>(claim), 1u) != 0) return;
  volatile uint64_t* err = a.errWord;
  err[1] = detail;
  err[2] = extra;
  plat::fence_system();
  err[0] = code;
}

// The detail word of a timed-out wait, as the host decodes it: which wait, for which peer, on which rank.
MORI_DEVICE constexpr uint64_t TimeoutDetail(uint64_t wait, uint64_t peer, uint64_t rank) {
  return (wait << 48) | (peer << 32) | (rank << 16);
}

// Spin until *flag >= target; returns the value seen, which is below target only after timeoutNs
// (then `onTimeout(target)` has recorded the timeout).
template <typename OnTimeout>
MORI_DEVICE uint64_t SpinAtLeast(const uint64_t* flag, uint64_t target, int64_t timeoutNs, OnTimeout onTimeout) {
  uint64_t v = plat::load_acquire_system(flag);
  if (v >= target) return v;
  const uint64_t t0 = plat::now_ns();
  while ((v = plat::load_acquire_system(flag)) < target) {
    if (plat::now_ns() - t0 > uint64_t(timeoutNs)) {
      onTimeout(target);
      return v;
    }
  }
  return v;
}

// This block's share of a done count's `unit`: a rank's blocks add the unit in all per epoch,
// whatever its grid, so no block waits for the others to count (a launch's partial sum stays below
// a unit, so count / unit is the epochs done even while a launch is adding).
MORI_DEVICE uint64_t BlockShare(uint64_t unit) { return blockIdx.x == 0 ? unit - (gridDim.x - 1) : 1; }

}  // namespace mori::ep_report
