"""`benchmarks/read_floor.py`, the MoE read-floor kernel: its argument checks and chunking
on the CPU, its CUDA source through the pip NVRTC (no GPU needed), and on a GPU
(`-m gpu`) that every launch reads exactly the op's weight bytes (an XOR per item against
numpy's over the same bytes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

import read_floor as RF  # noqa: E402


def _weights(E, R, C, fmt, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    if fmt == "bf16":
        return [torch.randn(E, R, C, generator=g, device=device).to(torch.bfloat16)], []
    codes = torch.randint(0, 256, (E, R, C // 2), generator=g, device=device,
                          dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, (E, R, C // 16), generator=g, device=device,
                           dtype=torch.int32).to(torch.uint8)
    return [codes], [scales]


def _floor(E, R, C, fmt, matrices, device="cpu"):
    routed = [_weights(E, R, C, fmt, device, seed=m) for m in range(matrices)]
    shared = [_weights(1, R, C, fmt, device, seed=10 + m) for m in range(matrices)]
    return RF.ReadFloor([c[0] for c, _ in routed], [s[0] for _, s in routed if s],
                        [c[0][0] for c, _ in shared], [s[0][0] for _, s in shared if s])


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_chunks_cover_an_expert(fmt):
    """chunks x threads x loads words = one item's codes and scales, for the model's gate/up
    (2 matrices of 512 x 2048) and down (1 of 2048 x 512)."""
    for rows, cols, m in ((512, 2048, 2), (2048, 512, 1)):
        rf = _floor(2, rows, cols, fmt, m)
        per = rows * cols // 2 + rows * cols // 16 if fmt == "nvfp4" else rows * cols * 2
        assert rf.item_bytes() == m * per
        for t, ld in ((128, 1), (256, 4), (1024, 4), (512, 8)):
            assert rf.chunks(t, ld) * t * ld * 16 == rf.item_bytes()


def test_expected_xor_is_the_items_bytes():
    """`expected_xor` (what `check` compares the kernel with): item 0 the shared expert,
    then one per id in order, each the XOR of its codes' and scales' 32-bit words; an
    expert repeated gives the same word, and flipping one byte of an expert changes only
    its items."""
    import numpy as np

    rf = _floor(4, 32, 128, "nvfp4", 2)
    ids = torch.tensor([[2, 0, 2]])
    got = rf.expected_xor(ids)
    assert len(got) == 4 and got[1] == got[3]

    def by_hand(ts):
        acc = 0
        for t in ts:
            for w in t.contiguous().view(torch.uint8).reshape(-1).numpy().view(np.uint32):
                acc ^= int(w)
        return acc

    assert got[0] == by_hand(rf.shared)
    assert got[2] == by_hand([rf.codes[0][0], rf.codes[1][0], rf.scales[0][0], rf.scales[1][0]])
    rf.scales[1][2, 5, 3] ^= 0x10
    again = rf.expected_xor(ids)
    assert again[1] != got[1] and again[3] == again[1] and again[:1] + again[2:3] == [got[0], got[2]]


def test_bad_arguments_are_named():
    rf = _floor(2, 512, 2048, "nvfp4", 2)
    with pytest.raises(ValueError, match="threads must be a multiple of 32"):
        rf.chunks(100, 1)
    with pytest.raises(ValueError, match="loads 1..16"):
        rf.chunks(256, 17)
    small = _floor(2, 16, 128, "nvfp4", 1)  # 64 words of codes, 8 of scales per expert
    with pytest.raises(ValueError, match="does not divide"):
        small.chunks(1024, 4)
    c, s = _weights(2, 512, 2048, "nvfp4")
    with pytest.raises(ValueError, match="shared_codes.0. must hold"):
        RF.ReadFloor(c, s, [c[0][0][:256]], [s[0][0]])
    with pytest.raises(ValueError, match="scales and shared_scales"):
        RF.ReadFloor(c, s, [c[0][0]], [])
    with pytest.raises(ValueError, match="matrices must be 1 or 2"):
        RF.kernel_source(3, 4)
    with pytest.raises(ValueError, match="mode must be"):
        rf(torch.zeros(6, dtype=torch.int64), mode="fast")
    with pytest.raises(ValueError, match="trigger must be"):
        rf(torch.zeros(6, dtype=torch.int64), trigger="soon")
    with pytest.raises(ValueError, match="ids must be contiguous int64"):
        rf(torch.zeros(6, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 2\)"):
        rf.check(torch.tensor([0, 2]))
    base = torch.zeros(3 * 16 * 48 + 1, dtype=torch.uint8)
    shifted = base[1:].view(3, 16, 48)  # contiguous, one byte off 16-byte alignment
    with pytest.raises(ValueError, match=r"codes\[0\] must be contiguous, 16-byte aligned"):
        RF.ReadFloor([shifted], [], [base[:768]], [])
    with pytest.raises(ValueError, match="whole number of 16-byte words per expert"):
        RF.ReadFloor([torch.zeros(2, 8, 1, dtype=torch.uint8)], [],
                     [torch.zeros(16, dtype=torch.uint8)], [])


@pytest.mark.skipif(importlib.util.find_spec("nvidia.cuda_nvrtc") is None,
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("matrices,loads", [(1, 1), (2, 4), (2, 8)])
def test_source_compiles_with_nvrtc(matrices, loads):
    """The kernel compiles for sm_90; every weight load is a 16-byte non-coherent load and
    the PDL wait / trigger are in it."""
    from test_nvfp4_mma import _nvrtc_ptx

    ptx = _nvrtc_ptx(RF.kernel_source(matrices, loads))
    assert b".entry read_floor" in ptx
    assert ptx.count(b"ld.global.nc.v4.u32") == loads
    assert b"griddepcontrol.wait" in ptx and b"griddepcontrol.launch_dependents" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("mode", ["dependent", "ids_known"])
def test_reads_exactly_the_op_bytes_gpu(fmt, mode):
    """At the model's shapes (E = 16 here to keep it small), every launch of the floor
    reads each item's bytes once: the XOR per item matches numpy's, with repeated ids."""
    for rows, cols, m in ((512, 2048, 2), (2048, 512, 1)):
        rf = _floor(16, rows, cols, fmt, m, device="cuda")
        ids = torch.tensor([[3, 0, 15, 7, 7, 2], [1, 3, 4, 5, 6, 8]], device="cuda")
        for t, ld in ((128, 1), (256, 4), (1024, 4), (512, 8)):
            out = rf(ids, t, ld, mode)
            torch.cuda.synchronize()
            assert out.shape == (13, rf.chunks(t, ld), t // 32)
            rf.check(ids, t, ld, mode)


def _gemv_weight(F, K, fmt, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    if fmt == "bf16":
        return [torch.randn(F, K, generator=g, device=device).to(torch.bfloat16)]
    codes = torch.randint(0, 256, (F, K // 2), generator=g, device=device,
                          dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 127, (F, K // 16), generator=g, device=device,
                           dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return [codes, scales, torch.ones((), device=device)]


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_weight_floor_reads_the_gemv_bytes(fmt):
    """`weight_floor`: one item (the weights, no routed ids) of exactly the matrices'
    codes and scales; the XOR it must reproduce is numpy's over those bytes; bad groups are
    refused naming the problem."""
    for F, K, m in ((4096, 2048, 1), (2048, 4096, 1), (512, 2048, 2)):
        ws = [_gemv_weight(F, K, fmt, seed=i) for i in range(m)]
        rf = RF.weight_floor(ws)
        per = F * K * 2 if fmt == "bf16" else F * K // 2 + F * K // 16
        assert rf.item_bytes() == m * per
        assert rf.chunks(256, 4) * 256 * 4 * 16 == m * per
        want = RF.weight_floor(ws).expected_xor(RF.NO_IDS)
        import numpy as np

        raw = np.concatenate([t.contiguous().view(torch.uint8).reshape(-1).numpy()
                              for t in [w[0] for w in ws] + [w[1] for w in ws if len(w) == 3]])
        assert want == [int(np.bitwise_xor.reduce(raw.view(np.uint32)))]
    with pytest.raises(ValueError, match="needs 1 or 2 matrices; got 3"):
        RF.weight_floor([_gemv_weight(64, 64, fmt)] * 3)
    with pytest.raises(ValueError, match="must have one size"):
        RF.weight_floor([_gemv_weight(64, 128, fmt), _gemv_weight(128, 128, fmt)])
    with pytest.raises(ValueError, match="all in one format"):
        RF.weight_floor([_gemv_weight(64, 128, "bf16"), _gemv_weight(64, 128, "nvfp4")])
    codes, scales, gs = _gemv_weight(64, 128, "nvfp4")
    for bad in ([codes, scales[:32], gs], [codes, scales.float(), gs], [codes.float(), scales, gs]):
        with pytest.raises(ValueError, match="matrix 0 must be"):
            RF.weight_floor([bad])
    with pytest.raises(ValueError, match="matrix 0 must be"):
        RF.weight_floor([[torch.zeros(64, 128)]])  # fp32, not bf16


def test_weight_floor_takes_the_mma_layout():
    """NVFP4 weights converted to the mma layout (`nvfp4_mma.prepack`: int32 codes, uint8
    scale codes) have the packed layout's byte count; `weight_floor` reads all of them."""
    from flintc.kernels import nvfp4_mma as M
    from flintc.quant.nvfp4 import quantize

    q = quantize((torch.randn(64, 128) * 0.05).to(torch.bfloat16))
    wq, sq = M.pack_mma_layout(q.codes, q.scales)
    rf = RF.weight_floor([[wq, sq, q.global_scale], [wq.clone(), sq.clone(), q.global_scale]])
    assert rf.item_bytes() == 2 * (64 * 64 + 64 * 8)
    assert rf.shared[0].data_ptr() == wq.data_ptr()
    with pytest.raises(ValueError, match="matrix 0 must be"):
        RF.weight_floor([[wq, q.scales, q.global_scale]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_weight_floor_reads_exactly_the_weights_gpu(fmt):
    """On a GPU, `weight_floor` launches read every weight byte once (its CPU twin:
    `test_weight_floor_reads_the_gemv_bytes`)."""
    for F, K, m in ((4096, 2048, 1), (512, 2048, 2)):
        rf = RF.weight_floor([_gemv_weight(F, K, fmt, "cuda", seed=i) for i in range(m)])
        for t, ld in ((128, 1), (256, 4), (1024, 4)):
            rf.check(RF.NO_IDS.cuda(), t, ld)


def test_best_launch_takes_the_fastest_launch_that_splits():
    """`best_launch`: the smallest time among the `LAUNCHES` that split the items into
    whole chunks (the others are never timed); none splitting is a ValueError."""
    rf = _floor(2, 512, 2048, "nvfp4", 2)  # 2 x (64 Ki + 8 Ki) words per item
    timed = []

    def fake(t, ld):
        timed.append((t, ld))
        return abs(t * ld - 2048) + t / 1e4  # fastest: 256 x 8 (then 512 x 4, ...)

    assert RF.best_launch(rf, fake) == (256 / 1e4, 256, 8)
    assert sorted(timed) == sorted(RF.LAUNCHES)  # every launch splits these items
    small = RF.weight_floor([_gemv_weight(16, 64, "bf16")])  # 128 words: only t x ld <= 128
    seen = []
    RF.best_launch(small, lambda t, ld: seen.append((t, ld)) or 1.0)
    assert seen == [(128, 1)]
    tiny = RF.weight_floor([_gemv_weight(16, 16, "bf16")])  # 32 words: no launch splits them
    with pytest.raises(ValueError, match="no launch of LAUNCHES splits"):
        RF.best_launch(tiny, lambda t, ld: 1.0)
