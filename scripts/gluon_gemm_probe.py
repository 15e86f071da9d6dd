"""Gluon probe (issue 6): does a hand-written Hopper kernel (TMA loads, mbarriers, async wgmma,
a multi-stage ring) compile here for sm_90a and, on an H100/H200, compute C = A @ B right and how fast
against cuBLAS? The first step toward the warp-specialised Lizard kernels the Triton paths could
not reach (docs/results/kernels-h200.md).

    python3 scripts/gluon_gemm_probe.py --out gluon-gemm.json   # on the GPU: right, and how fast
    python3 scripts/gluon_gemm_probe.py --compile-only          # anywhere: compiles for sm_90a

Result on an H200: docs/results/gluon-gemm-probe-h200.json.
"""
import argparse
import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def gemm_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm,
                BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    nbytes: gl.constexpr = (BM * BK + BK * BN) * 2
    nk = gl.cdiv(K, BK)
    for i in gl.static_range(STAGES - 1):  # fill the ring
        ok = i < nk
        mbarrier.expect(bars.index(i), nbytes, pred=ok)
        tma.async_copy_global_to_shared(a_desc, [pid_m * BM, i * BK], bars.index(i), a_s.index(i), pred=ok)
        tma.async_copy_global_to_shared(b_desc, [i * BK, pid_n * BN], bars.index(i), b_s.index(i), pred=ok)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    for k in range(nk):
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(s), b_s.index(s), acc, is_async=True)
        # one product in flight: the one before it is done, so its stage can be refilled
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_s.index(s), b_s.index(s)))
        nxt = k + STAGES - 1
        t = nxt % STAGES
        ok = nxt < nk
        mbarrier.expect(bars.index(t), nbytes, pred=ok)
        tma.async_copy_global_to_shared(a_desc, [pid_m * BM, nxt * BK], bars.index(t), a_s.index(t), pred=ok)
        tma.async_copy_global_to_shared(b_desc, [nxt * BK, pid_n * BN], bars.index(t), b_s.index(t), pred=ok)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    gl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def _ws_producer(a_desc, b_desc, a_s, b_s, ready, empty, off_m, off_n, nk,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One warp: TMA loads into the ring, each stage once the consumers have released it."""
    nbytes: gl.constexpr = (BM * BK + BK * BN) * 2
    for k in range(nk):
        s = k % STAGES
        mbarrier.wait(empty.index(s), ((k // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, k * BK], ready.index(s), a_s.index(s))
        tma.async_copy_global_to_shared(b_desc, [k * BK, off_n], ready.index(s), b_s.index(s))


@gluon.jit
def _ws_consumer(a_s, b_s, ready, empty, nk, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    """The default partition: async wgmma on each stage as it lands, one product in flight; a stage
    is released when the product after it has been issued and the one reading it is done."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    for k in range(nk):
        s = k % STAGES
        mbarrier.wait(ready.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(s), b_s.index(s), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_s.index(s), b_s.index(s)))
        mbarrier.arrive(empty.index((k + STAGES - 1) % STAGES), pred=k > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return (acc,)  # warp_specialize takes the default partition's results as a tuple


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm,
                   BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """gemm_kernel with warp specialisation: a producer warp for the loads beside the consumers."""
    off_m = gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    a_s = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_s = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    nk = gl.cdiv(K, BK)
    acc = gl.warp_specialize([(_ws_consumer, (a_s, b_s, ready, empty, nk, BM, BN, STAGES)),
                              (_ws_producer, (a_desc, b_desc, a_s, b_s, ready, empty, off_m, off_n, nk,
                                              BM, BN, BK, STAGES))], [1], [24])[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BN, 16])
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    gl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(gl.bfloat16), mask=mask)


def descriptors(a, b, BM, BN, BK):
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)
    return TensorDescriptor.from_tensor(a, [BM, BK], la), TensorDescriptor.from_tensor(b, [BK, BN], lb)


def gemm(a, b, BM=128, BN=128, BK=64, stages=4, warps=8, ws=False):
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    da, db = descriptors(a, b, BM, BN, BK)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    kernel = ws_gemm_kernel if ws else gemm_kernel
    kernel[grid](da, db, c, M, N, K, c.stride(0), BM=BM, BN=BN, BK=BK, STAGES=stages, num_warps=warps)
    return c


def compile_only(BM=128, BN=128, BK=64, stages=4, warps=8, ws=False):
    """Compile for sm_90a without a GPU; returns the shared memory one block takes, in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    a = torch.empty(512, 256, dtype=torch.bfloat16)
    b = torch.empty(256, 384, dtype=torch.bfloat16)
    da, db = descriptors(a, b, BM, BN, BK)
    args = {"a_desc": da, "b_desc": db, "c_ptr": a, "M": 512, "N": 384, "K": 256, "stride_cm": 384}
    sig = {k: mangle_type(v) for k, v in args.items()}
    consts = {"BM": BM, "BN": BN, "BK": BK, "STAGES": stages}
    sig.update({k: "constexpr" for k in consts})
    fn = ws_gemm_kernel if ws else gemm_kernel
    names = [q.name for q in fn.params]
    src = GluonASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()})
    k = tcompile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return k.metadata.shared


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.compile_only:
        for kw in ({}, {"ws": True}, {"BN": 256, "stages": 3, "ws": True}):
            print(kw, "compiled for sm_90a,", compile_only(**kw), "bytes of shared memory")
        sys.exit(0)
    rows = []
    dev = "cuda"
    name = torch.cuda.get_device_name()
    for (M, N, K) in [(1000, 1000, 1000), (4096, 4096, 4096), (8192, 8192, 8192)]:
        a = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
        b = torch.randn(K, N, dtype=torch.bfloat16, device=dev)
        ref = (a.float() @ b.float())
        for cfg in [dict(BM=128, BN=128, BK=64, stages=4, warps=8), dict(BM=128, BN=256, BK=64, stages=3, warps=8),
                    dict(BM=64, BN=128, BK=64, stages=4, warps=4),
                    dict(BM=128, BN=128, BK=64, stages=4, warps=8, ws=True),
                    dict(BM=128, BN=256, BK=64, stages=3, warps=8, ws=True)]:
            try:
                c = gemm(a, b, **cfg)
                err = ((c.float() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(lambda: gemm(a, b, **cfg), rep=200)
                row = {"M": M, "N": N, "K": K, **cfg, "rel_err": err, "ms": ms, "tflops": 2 * M * N * K / ms / 1e9}
            except Exception as e:  # noqa: BLE001  (a probe: report and go on)
                row = {"M": M, "N": N, "K": K, **cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
        ms = triton.testing.do_bench(lambda: a @ b, rep=200)
        rows.append({"M": M, "N": N, "K": K, "cublas_ms": ms, "tflops": 2 * M * N * K / ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        json.dump({"gpu": name, "torch": torch.__version__, "triton": triton.__version__, "rows": rows},
                  open(args.out, "w"), indent=1)
