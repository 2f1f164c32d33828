"""The in-kernel fp8 block cast (``kernels/ep/ep_quant.hpp``) built for the host with g++ and compared
with ``quant.py`` bit for bit: every e4m3 byte and every scale word, on ordinary, tiny, huge, zero,
power-of-two and tie-rounding blocks, float32 and UE8M0 scales. The device build runs the same
functions (the GPU suite compares the dispatch's rows with the torch backend's)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from mori_jit.jit.paths import kernels_dir
from mori_jit.ops.ep.quant import DISPATCH_QUANT_TYPES, quantize
from jit_helpers import host_harness
from test_ep_quant import hard_rows

SPEC = DISPATCH_QUANT_TYPES["fp8_e4m3_block128"]

# A host stand-in for the platform header (the harness does BlockMax's butterfly itself: a max is
# exact in any order).
_HARNESS = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#define MORI_DEVICE inline
static inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
namespace mori::plat {
struct vec16_t { uint32_t x, y, z, w; };
inline int lane_id() { return 0; }
inline int shfl(int v, int) { return v; }
}  // namespace mori::plat
#include "ep/ep_quant.hpp"
using namespace mori::ep;
using mori::plat::vec16_t;

// One 128-element bf16 block -> 128 e4m3 bytes and its scale word, as the dispatch's lanes do it.
extern "C" void quantize_block(const uint16_t* x, int scale_bytes, uint8_t* q, uint32_t* word) {
  float local[8];
  for (int l = 0; l < 8; ++l) {
    vec16_t lo, hi;
    std::memcpy(&lo, x + 16 * l, 16);
    std::memcpy(&hi, x + 16 * l + 8, 16);
    local[l] = AbsMax16(lo, hi);
  }
  // BlockMax on each lane: a shuffle by lane ^ m reads that lane's running value
  float run[8];
  for (int l = 0; l < 8; ++l) run[l] = local[l];
  for (int m = 1; m < 8; m <<= 1) {
    float next[8];
    for (int l = 0; l < 8; ++l) next[l] = std::fmax(run[l], run[l ^ m]);
    for (int l = 0; l < 8; ++l) run[l] = next[l];
  }
  for (int l = 0; l < 8; ++l) {
    float amax = run[l];
    uint32_t w;
    const float sf = scale_bytes == 1 ? BlockScale<1>(amax, w) : BlockScale<4>(amax, w);
    vec16_t lo, hi;
    std::memcpy(&lo, x + 16 * l, 16);
    std::memcpy(&hi, x + 16 * l + 8, 16);
    vec16_t out = QuantizeVec(lo, hi, 1.0f / sf);
    std::memcpy(q + 16 * l, &out, 16);
    *word = w;
  }
}

extern "C" uint8_t fp8_of(float f) { return Fp8E4m3FromF32(f); }
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = host_harness(tmp_path_factory.mktemp("quant_host"), _HARNESS)
    lib.fp8_of.restype = ctypes.c_uint8
    lib.fp8_of.argtypes = [ctypes.c_float]
    return lib


def _kernel_quantize(lib, x: torch.Tensor, scale_bytes: int):
    n, h = x.shape
    bits = x.contiguous().view(torch.int16).numpy().astype("uint16")
    q = torch.zeros(n, h, dtype=torch.uint8)
    words = torch.zeros(n, h // 128, dtype=torch.int64)
    for r in range(n):
        for b in range(h // 128):
            block = bits[r, 128 * b:128 * (b + 1)].copy()
            out = (ctypes.c_uint8 * 128)()
            word = ctypes.c_uint32()
            lib.quantize_block(block.ctypes.data_as(ctypes.POINTER(ctypes.c_uint16)), scale_bytes, out,
                               ctypes.byref(word))
            q[r, 128 * b:128 * (b + 1)] = torch.tensor(list(out), dtype=torch.uint8)
            words[r, b] = word.value
    return q, words


def _rows(gen) -> torch.Tensor:
    x = hard_rows(gen, 12)
    x[7, :128] = 3.0  # amax 3: amax / 448 and amax * fl32(1/448) differ in the last bit
    x[8] = torch.randn(512, generator=gen) * 1e-3  # values in e4m3's denormal range after scaling
    x[9, :128] = torch.linspace(-448, 448, 128)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("scale_bytes", [4, 1])
def test_the_kernel_cast_is_quant_py_bit_for_bit(lib, scale_bytes):
    gen = torch.Generator().manual_seed(11)
    for x in (_rows(gen), (torch.randn(16, 256, generator=gen) * 50).to(torch.bfloat16)):
        q, words = _kernel_quantize(lib, x, scale_bytes)
        want_q, want_s = quantize(x, SPEC, scale_bytes)
        assert torch.equal(q, want_q.view(torch.uint8)), (q != want_q.view(torch.uint8)).nonzero()[:5]
        if scale_bytes == 4:
            want_words = want_s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        else:
            want_words = want_s.view(torch.uint8).to(torch.int64)
        assert torch.equal(words, want_words)


def test_the_kernel_fp8_conversion_is_torchs_on_every_float_class(lib):
    gen = torch.Generator().manual_seed(3)
    vals = torch.cat([torch.randn(4000, generator=gen) * s for s in (1e-4, 1e-2, 1.0, 50.0, 300.0)])
    vals = torch.cat([vals, torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 463.9, 2.0 ** -9, 2.0 ** -10, 2.0 ** -7 * 1.5,
                                          1.0625, 1.1875, 1e-9])])  # (ties round to even; denormals)
    got = torch.tensor([lib.fp8_of(float(v)) for v in vals], dtype=torch.uint8)
    assert torch.equal(got, vals.to(torch.float8_e4m3fn).view(torch.uint8))


_DEVICE_PROBE = r"""
#include "platform/nvidia.hpp"
#include "ep/ep_quant.hpp"
extern "C" __global__ void probe(const mori::plat::vec16_t* in, mori::plat::vec16_t* out, float inv) {
  out[threadIdx.x] = mori::ep::QuantizeVec(in[2 * threadIdx.x], in[2 * threadIdx.x + 1], inv);
}
"""


@pytest.mark.parametrize("arch, hardware", [("sm_90a", True), ("sm_80", False)])
def test_the_device_cast_uses_the_hardware_conversion_where_the_arch_has_it(tmp_path, arch, hardware):
    """sm_89+ converts a pair per cvt.rn.satfinite.e4m3x2.f32 (8 per 16-byte vector); older archs
    compile the software conversion (the host build above checks its numerics; the GPU suite the
    instruction's, against the torch backend byte for byte)."""
    from mori_jit.jit.toolchain import STANDARD_PLACE

    nvcc = shutil.which("nvcc") or STANDARD_PLACE["nvidia"]
    if not os.path.exists(nvcc):
        pytest.skip("nvcc absent")
    src, ptx = tmp_path / "probe.cu", tmp_path / "probe.ptx"
    src.write_text(_DEVICE_PROBE)
    p = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-std=c++20", "--expt-relaxed-constexpr",
                        f"-I{kernels_dir()}", "-o", str(ptx), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    cvts = ptx.read_text().count("cvt.rn.satfinite.e4m3x2.f32")
    assert cvts == (8 if hardware else 0), cvts
