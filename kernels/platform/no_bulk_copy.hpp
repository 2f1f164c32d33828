// The bulk-copy stubs of a platform without a bulk-copy unit (AMD; NVIDIA before sm_90). Kernels
// refuse a Cfg that asks for bulk copies there (plat::kHasBulkCopy is false) and never call these;
// they exist so that the bulk paths, discarded by `if constexpr`, still name declared functions.
#pragma once
#include <cstdint>

namespace mori::plat {

constexpr bool kHasBulkCopy = false;
MORI_DEVICE void bulk_barrier_init(uint64_t*) { __builtin_trap(); }
MORI_DEVICE void bulk_load(void*, const void*, uint32_t, uint64_t*) { __builtin_trap(); }
MORI_DEVICE void bulk_wait_load(uint64_t*, uint32_t) { __builtin_trap(); }
MORI_DEVICE void bulk_store(void*, const void*, uint32_t) { __builtin_trap(); }
MORI_DEVICE void bulk_commit() { __builtin_trap(); }
template <int Pending>
MORI_DEVICE void bulk_wait_smem_read() { __builtin_trap(); }
MORI_DEVICE void bulk_wait_stores() { __builtin_trap(); }
MORI_DEVICE void bulk_after_generic() { __builtin_trap(); }

}  // namespace mori::plat
