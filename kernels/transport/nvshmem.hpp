// The transport of the internode kernels on NVIDIA: NVSHMEM. Every engine call of an internode
// body goes through the functions below and nothing else names the engine, so another transport
// (rocSHMEM or mori-shmem on AMD, NCCL's device API) is another header with the same functions,
// chosen by the renderer on the host (the choice is in the source text, hence in the cache key).
//
// Addresses are symmetric: `dst` is this rank's address of an object in the symmetric heap, and
// the engine writes the same object on rank `pe`. Sources of puts are symmetric too (a transport
// that DMAs from registered memory needs that), so bodies stage plain inputs into the arena first.
#pragma once
#include <cstddef>
#include <cstdint>

#include <nvshmem.h>
#include <nvshmemx.h>

namespace mori::transport {

constexpr const char* kName = "nvshmem";

// Non-blocking put of `bytes` from `src` to `dst` on `pe`, issued by the whole warp (every lane
// calls it with the same arguments). Complete only after quiet(); ordered before later puts and
// signals to the same pe only after fence().
MORI_DEVICE void put_warp(void* dst, const void* src, size_t bytes, int pe) {
  nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
}

// put_warp, then `*sig += value` on `pe` once the data is there (the engine orders the two).
MORI_DEVICE void put_signal_add_warp(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value,
                                     int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, value, NVSHMEM_SIGNAL_ADD, pe);
}

// One 32-bit value stored at `dst` on `pe` (one thread).
MORI_DEVICE void put_int(int* dst, int value, int pe) { nvshmem_int_p(dst, value, pe); }

// `*p += value` on `pe`, returning the old value (one thread; a round trip).
MORI_DEVICE int atomic_fetch_add(int* p, int value, int pe) { return nvshmem_int_atomic_fetch_add(p, value, pe); }

// `*sig += value` on `pe`, ordered after this thread's earlier fenced or quieted puts (one thread).
MORI_DEVICE void signal_add(uint64_t* sig, uint64_t value, int pe) {
  nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_ADD, pe);
}

// Every put, atomic and signal this rank issued is complete (visible at its destination).
MORI_DEVICE void quiet() { nvshmem_quiet(); }

// This rank's puts to each pe are delivered in order with its later ones to that pe.
MORI_DEVICE void fence() { nvshmem_fence(); }

// A plain pointer to `p`'s object on `pe` when loads and stores reach it directly (P2P over
// NVLink or PCIe, or this rank); null when only the engine's puts do.
template <typename P>
MORI_DEVICE P* peer_ptr(P* p, int pe) {
  return static_cast<P*>(nvshmem_ptr(p, pe));
}

// The engine's rank of this process (equal to the op's rank: checked by the host at construction).
MORI_DEVICE int my_pe() { return nvshmem_my_pe(); }

}  // namespace mori::transport
