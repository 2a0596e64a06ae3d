"""`flintc.kernels.nvfp4_mma`: the NVFP4 mma-fragment layout and its CUDA GEMV.

CPU (CI): the repack is lossless and the kernel's bit formulas (replayed in torch by
`decode_mma_layout`) give back exactly `dequantize_packed` of the original codes and
block scales, for every E4M3 scale (zero and subnormals included) and every code; a
fragment-level replay of the kernel's loop (its `mma.sync.m16n8k16` A / B fragments,
the K order of its x loads, the warp split and the epilogue) matches the fp64
reference GEMV; the launch structs match cuda.h; bad arguments raise ValueError naming
them. GPU (`gpu` marker): the compiled kernel at the model's shapes against the
reference, PDL on and off, inside a CUDA graph, and the `gemv_residual` op on it.
"""

from __future__ import annotations

import ctypes
import re
import struct

import pytest
import torch

from flintc.kernels import nvfp4_mma as M
from flintc.quant.nvfp4 import dequantize_packed, quantize

ON_GPU = torch.cuda.is_available()
E4M3_ALL = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)  # every value >= 0


def random_nvfp4(F: int, K: int, gen: torch.Generator, device="cpu"):
    """Random codes (all 256 bytes) and block scales drawn from every E4M3 value >= 0."""
    codes = torch.randint(0, 256, (F, K // 2), dtype=torch.uint8, generator=gen)
    scales = E4M3_ALL[torch.randint(0, 127, (F, K // 16), generator=gen)]
    return codes.to(device), scales.to(device)


def _spy(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)
    return wrapped


def _nvfp4(lead: tuple, R: int, C: int, gen: torch.Generator, device="cpu") -> list:
    """Random NVFP4 `[codes [*lead, R, C/2], scales, global_scale [*lead]]`: every code,
    block scales 2^-9 (subnormal) .. 2, global scales 0.01 .. 0.03."""
    codes = torch.randint(0, 256, (*lead, R, C // 2), dtype=torch.uint8, generator=gen)
    scales = torch.randint(1, 0x40, (*lead, R, C // 16), dtype=torch.uint8,
                           generator=gen).view(torch.float8_e4m3fn)
    gs = (0.5 + torch.rand(lead, generator=gen)) * 0.02
    return [codes.to(device), scales.to(device), gs.float().to(device)]


def _require_mma() -> None:
    if not M.available(torch.device("cuda")):
        pytest.skip("needs compute capability 9.0 and torch.cuda._compile_kernel")


@pytest.mark.parametrize("F,K", [(16, 64), (48, 192), (32, 256)])
def test_repack_is_lossless(F, K):
    gen = torch.Generator().manual_seed(F * K)
    codes, scales = random_nvfp4(F, K, gen)
    wq, sq = M.pack_mma_layout(codes, scales)
    assert wq.shape == (F // 16, K // 64, 32, 4) and wq.dtype == torch.int32
    assert sq.shape == (F // 16, K // 64, 32, 2) and sq.dtype == torch.uint8
    got = M.decode_mma_layout(wq, sq)
    want = dequantize_packed(codes, scales, None, torch.float32)
    assert torch.equal(got, want)  # -0 and +0 compare equal; every other bit must match


def test_scale_codes_cover_every_e4m3_value():
    code = M.e4m3_to_scale_code(E4M3_ALL)
    bits = M.scale_code_to_bf16_bits(code)
    value = ((bits & 0xFFFF) << 16).view(torch.float32)
    s = E4M3_ALL.float()
    nonzero = s != 0
    assert torch.equal(value[nonzero], s[nonzero] * 2.0**118)  # exact, subnormals included
    assert int(code.max()) <= 255 and len(set(code[nonzero].tolist())) == int(nonzero.sum())


def test_zero_scale_blocks_decode_to_zero():
    codes = torch.full((16, 32), 0x77, dtype=torch.uint8)  # every weight 6.0 ...
    scales = torch.zeros(16, 4).to(torch.float8_e4m3fn)  # ... times a zero scale
    scales[3, 1] = 2.0
    wq, sq = M.pack_mma_layout(codes, scales)
    got = M.decode_mma_layout(wq, sq)
    assert torch.equal(got, dequantize_packed(codes, scales, None, torch.float32))
    assert int((got != 0).sum()) == 16


def _emulate_kernel(x, wq, sq, gscale, warps):
    """The CUDA kernel's loop replayed fragment by fragment (fp64 sums): for every block
    (16-row tile), warp (a K slice of whole chunks), chunk and k16 step, the lane's A
    registers decoded from its word, its B registers read from x at the kernel's K order
    (64 kc + 16 t + 4 s + 2 half + e), and D += A @ B with the PTX m16n8k16 fragment
    maps; the warps' sums added in warp order, times 256 * global scale."""
    N = x.shape[0]
    FT, KC = wq.shape[:2]
    cpw = KC // warps
    w64 = wq.to(torch.int64) & 0xFFFFFFFF
    sval = ((M.scale_code_to_bf16_bits(sq) & 0xFFFF) << 16).view(torch.float32).double()
    xd = x.double()
    out = torch.zeros(N, FT * 16, dtype=torch.float64)
    for ft in range(FT):
        block = torch.zeros(16, 8, dtype=torch.float64)
        for warp in range(warps):
            acc = torch.zeros(16, 8, dtype=torch.float64)
            for kc in range(warp * cpw, (warp + 1) * cpw):
                for s in range(4):
                    A = torch.zeros(16, 16, dtype=torch.float64)
                    B = torch.zeros(16, 8, dtype=torch.float64)
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        for r in range(4):
                            bits = int(M._decode_register(w64[ft, kc, lane, s], r))
                            sc = float(sval[ft, kc, lane, r & 1])
                            for e in range(2):
                                half = (bits >> (16 * e)) & 0xFFFF
                                tiny = struct.unpack("<f", struct.pack("<I", half << 16))[0]
                                row, kappa = g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + e
                                A[row, kappa] = tiny * sc  # exact: <= 6 significant bits
                        n = min(g, N - 1)
                        for h in range(2):
                            for e in range(2):
                                B[2 * t + 8 * h + e, g] = xd[n, 64 * kc + 16 * t + 4 * s + 2 * h + e]
                    acc += A @ B
            block += acc
        out[:, ft * 16:(ft + 1) * 16] = (block * 256.0 * gscale).T[:N]
    return out


@pytest.mark.parametrize("N,warps", [(1, 1), (3, 2), (8, 1)])
def test_fragment_replay_matches_reference(N, warps):
    gen = torch.Generator().manual_seed(7 * N + warps)
    F, K = 32, 128
    codes, scales = random_nvfp4(F, K, gen)
    x = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    wq, sq = M.pack_mma_layout(codes, scales)
    got = _emulate_kernel(x, wq, sq, 0.5, warps)
    ref = x.double() @ dequantize_packed(codes, scales, None, torch.float64).T * 0.5
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_warps_rule_and_source():
    assert M.warps_for(4096) == 16 and M.warps_for(2048) == 16 and M.warps_for(3584) == 14
    assert M.warps_for(10240) == 16 and M.warps_for(192) == 1
    src = M.kernel_source(1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True)
    for needle in ("#define KC 64", "#define CPW 4", "#define WARPS 16", "#define EPI 2",
                   "#define PDL 1", "griddepcontrol.wait", "mma.sync.aligned.m16n8k16"):
        assert needle in src


def test_launch_structs_match_cuda_h():
    assert ctypes.sizeof(M._LaunchAttr) == 72  # id, pad[4], 64-byte value union
    assert M._LaunchAttr.value.offset == 8
    assert ctypes.sizeof(M._LaunchConfig) == 56
    assert (M._LaunchConfig.stream.offset, M._LaunchConfig.attrs.offset,
            M._LaunchConfig.num_attrs.offset) == (32, 40, 48)


def test_bad_arguments_raise_value_errors():
    gen = torch.Generator().manual_seed(1)
    codes, scales = random_nvfp4(32, 128, gen)
    with pytest.raises(ValueError, match="o_proj: the mma layout needs F % 16 == 0"):
        M.pack_mma_layout(codes[:24], scales[:24], name="o_proj")
    with pytest.raises(ValueError, match="scales must be"):
        M.pack_mma_layout(codes, scales[:, :4])
    with pytest.raises(ValueError, match="w.scales: expected float8_e4m3fn"):
        M.pack_mma_layout(codes, scales.float(), name="w")
    bad = scales.clone()
    bad.view(torch.uint8)[0, 0] = 0x7F  # NaN in float8_e4m3fn
    with pytest.raises(ValueError, match="finite and >= 0"):
        M.pack_mma_layout(codes, bad)
    wq, sq = M.pack_mma_layout(codes, scales)
    g = torch.ones(())
    x = torch.randn(2, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="x: expected contiguous, 16-byte aligned bf16"):
        M.mma_gemv(x.float(), wq, sq, g, torch.empty(2, 32))
    with pytest.raises(ValueError, match="out: expected"):
        M.mma_gemv(x, wq, sq, g, torch.empty(2, 16))
    with pytest.raises(ValueError, match="splits: a bf16 out needs splits == 1"):
        M.mma_gemv(x, wq, sq, g, torch.empty(2, 32, dtype=torch.bfloat16), splits=2,
                   warps=1)
    assert not M.available(torch.device("cpu"))


def test_moe_launchers_check_formats_and_splits():
    """The MoE launchers refuse, naming the argument, before any launch or repack (CPU
    tensors: the checks run first): mixed formats, bf16 weights they cannot read in place
    (and say why), K slices that do not divide the expert width, launch sizes out of range
    or over the static shared memory, tensors of the wrong rank, a bias or global scale of
    the wrong length."""
    gen = torch.Generator().manual_seed(2)
    E, H, I, K, N = 32, 128, 128, 2, 1
    bf = [(torch.randn(E, H, I, generator=gen) * 0.02).to(torch.bfloat16)]
    sbf = [(torch.randn(H, I, generator=gen) * 0.02).to(torch.bfloat16)]
    h = torch.randn(N, K + 1, I).to(torch.bfloat16)
    ids = torch.zeros(N, K, dtype=torch.int64)
    wts = torch.ones(N, K)
    res = torch.zeros(N, H, dtype=torch.bfloat16)
    down_cases = [
        ({"shared_down": _nvfp4((), H, I, gen)}, "down must be a stack .* in the same format"),
        ({"shared_down": [sbf[0].t()]}, "shared_down: a bf16 weight .*: not contiguous"),
        ({"down": [bf[0].float()]}, "down: a bf16 weight .*: dtype torch.float32"),
        ({"splits": 4}, "splits 4 must divide I / 64 = 2"),
        ({"splits": 0}, "splits must be an int >= 1, got 0"),
        ({"warps": 64}, "warps must be an int in \\[1, 32\\], got 64"),
        ({"warps": -4}, "warps must be an int in \\[1, 32\\], got -4"),
        ({"prefetch": -1}, "prefetch must be an int in \\[0, 16\\], got -1"),
        ({"h": h[0]}, "h must be a 3-d tensor, got \\(3, 128\\)"),
        ({"ids": ids[0]}, "ids must be a 2-d tensor"),
        ({"ids": torch.zeros(N, K + 1, dtype=torch.int64)}, "h \\[N, K \\+ 1, I\\]"),
        ({"down": _nvfp4((E,), H, I, gen)[:2] + [torch.ones(5)],
          "shared_down": _nvfp4((), H, I, gen)},
         "down: the global scale must be an fp32 tensor of shape \\[32\\] or \\[\\]"),
    ]
    base = {"h": h, "ids": ids, "weights": wts, "down": bf, "shared_down": sbf,
            "residual": res}
    for over, msg in down_cases:
        kw = dict(base, **over)
        extra = {k: kw.pop(k) for k in ("splits", "warps", "prefetch") if k in kw}
        with pytest.raises(ValueError, match=msg):
            M.moe_down(kw["h"], kw["ids"], kw["weights"], kw["down"], kw["shared_down"],
                       kw["residual"], **extra)
    with pytest.raises(ValueError, match="more than 49152"):  # 8 slices x 17 items x 8 x 16
        M.moe_down(torch.randn(N, 17, 512).to(torch.bfloat16), torch.zeros(N, 16,
                   dtype=torch.int64), torch.ones(N, 16),
                   [torch.zeros(E, H, 512, dtype=torch.bfloat16)],
                   [torch.zeros(H, 512, dtype=torch.bfloat16)], res, splits=8)
    with pytest.raises(ValueError, match="down kernel's 3 K slices per item must divide"):
        M.kernel_source(1, 512, 3, 2, 32, M.EPI_RESIDUAL, True, 6)
    with pytest.raises(ValueError, match="needs row_tiles, splits, warps >= 1"):
        M.kernel_source(1, 512, 0, 2, 32, M.EPI_RESIDUAL, True, 6)
    with pytest.raises(ValueError, match="more than 49152 bytes of static shared memory"):
        M.kernel_source(8, 2048, 1, 2, 16, M.EPI_BF16, True, 6, 256)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        M.moe_down(h, ids, wts, bf, sbf, res, warps=1, splits=2)  # fewer warps than slices
    x = torch.randn(N, H).to(torch.bfloat16)
    logits = torch.randn(N, E)
    gate = [(torch.randn(E, I, H, generator=gen) * 0.02).to(torch.bfloat16)]
    sgate = [(torch.randn(I, H, generator=gen) * 0.02).to(torch.bfloat16)]
    args = (x, logits, torch.zeros(E), gate, gate, sgate, sgate, K, 1.0)
    with pytest.raises(ValueError, match="all in one format"):
        M.moe_topk_gate_up(*args[:6], _nvfp4((), I, H, gen), K, 1.0, warps=2)
    with pytest.raises(ValueError, match="gate: expected a list \\[w\\] \\(bf16\\) or"):
        M.moe_topk_gate_up(*args[:3], gate[0], *args[4:])
    with pytest.raises(ValueError, match="bias \\[E\\]; got logits \\(1, 32\\), bias \\(5,\\)"):
        M.moe_topk_gate_up(x, logits, torch.zeros(5), *args[3:], warps=2)
    with pytest.raises(ValueError, match="x must be a 2-d tensor"):
        M.moe_topk_gate_up(x[None], *args[1:])
    with pytest.raises(ValueError, match="row_tiles must be an int >= 1, got -1"):
        M.moe_topk_gate_up(*args, warps=2, row_tiles=-1)
    # 32 warps x 4 row tiles x 4 x 32 fp32 sums + 32 warps x top-k 2 routing keys + s_e
    with pytest.raises(ValueError, match="warps 32 and row_tiles 2 need 66052 bytes"):
        M.moe_topk_gate_up(*args, warps=32, row_tiles=2)
    for warps, mb in ((2, 33), (32, 3), (2, True)):
        with pytest.raises(ValueError, match="min_blocks must be an int in \\[0, 32\\] with"):
            M.moe_topk_gate_up(*args, warps=warps, min_blocks=mb)
    # top_k and scaling checked before anything uses them; bools are not ints here
    for top_k in ("2", None, 2.5, True, 0, 9):
        with pytest.raises(ValueError, match=f"top_k must be an int in \\[1, 8\\], got {top_k!r}"):
            M.moe_topk_gate_up(*args[:7], top_k, 1.0, warps=2)
    for scaling in (None, "a", float("nan"), True):
        with pytest.raises(ValueError, match="scaling must be a finite number"):
            M.moe_topk_gate_up(*args[:8], scaling, warps=2)
    for kw, msg in (({"warps": True}, "warps must be an int in \\[1, 32\\], got True"),
                    ({"prefetch": 17}, "prefetch must be an int in \\[0, 16\\], got 17")):
        with pytest.raises(ValueError, match=msg):
            M.moe_topk_gate_up(*args, **kw)
    # weights that do not match the inputs: the message names the mismatch
    with pytest.raises(ValueError, match="must be \\[E, I, H\\] with E = 64 \\(logits \\(1, 64\\)\\)"):
        M.moe_topk_gate_up(x, torch.randn(N, 64), torch.zeros(64), *args[3:], warps=2)
    with pytest.raises(ValueError, match=f"and H = {2 * H} \\(x \\(1, {2 * H}\\)\\)"):
        M.moe_topk_gate_up(torch.randn(N, 2 * H).to(torch.bfloat16), *args[1:], warps=2)
    # the down weights to prefetch must be the routed down stack [E, H, I] in gate's format
    down = [(torch.randn(E, H, I, generator=gen) * 0.02).to(torch.bfloat16)]
    for bad, got in (([down[0][:, :, :64].contiguous()], f"\\({E}, {H}, 64\\) \\(bf16\\)"),
                     ([down[0][0]], f"\\({H}, {I}\\) \\(bf16\\)"),
                     (_nvfp4((E,), H, I, gen), f"\\({E}, {H}, {I}\\) \\(nvfp4\\)")):
        with pytest.raises(ValueError, match=f"down must be the routed experts' down stack "
                                             f"\\[{E}, {H}, {I}\\] \\(bf16\\); got {got}"):
            M.moe_topk_gate_up(*args, warps=2, down=bad)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        M.moe_topk_gate_up(*args, warps=2)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):  # a fitting down passes
        M.moe_topk_gate_up(*args, warps=2, down=down)


def test_l2_prefetch_env(monkeypatch):
    """`mma_l2_prefetch`: L2_PREFETCH when FLINTC_MMA_L2_PREFETCH is unset, else the kernels
    it lists ("all", "none" / empty); another name is a TuningEnvError naming the variable."""
    from flintc.kernels.tuning import TuningEnvError

    monkeypatch.delenv("FLINTC_MMA_L2_PREFETCH", raising=False)
    for k in M.L2_PREFETCH_KERNELS:
        assert M.mma_l2_prefetch(k) == (k in M.L2_PREFETCH)
    for text, on in (("none", set()), ("", set()), ("all", set(M.L2_PREFETCH_KERNELS)),
                     ("Gate_Up, down_weights", {"gate_up", "down_weights"}),
                     ("all,gemv", set(M.L2_PREFETCH_KERNELS))):
        monkeypatch.setenv("FLINTC_MMA_L2_PREFETCH", text)
        assert {k for k in M.L2_PREFETCH_KERNELS if M.mma_l2_prefetch(k)} == on, text
    for bad in ("qkv", "none,gemv", "gate-up"):
        monkeypatch.setenv("FLINTC_MMA_L2_PREFETCH", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_MMA_L2_PREFETCH must list kernels"):
            M.mma_l2_prefetch("gemv")


def test_moe_launch_rules():
    """The MoE kernels' launch tables: every (warps, K slices) splits the model's expert
    width and fits a block; gate/up row tiles never shrink with N, warps never grow but
    where the registers are capped (NVFP4 N = 8: 4 warps for 6 blocks per SM, measured
    faster in the model); every cap fits 2,048 threads per SM; bf16 MoE on the CUDA
    kernels only where measured faster (`moe.BF16_MMA_N`)."""
    from flintc.kernels import moe

    for fmt in ("nvfp4", "bf16"):
        assert set(M.DOWN_LAUNCH[fmt]) == set(range(1, 9))
        for warps, splits in M.DOWN_LAUNCH[fmt].values():
            assert 32 * warps <= 1024 and (512 // 64) % splits == 0
        ws = [M.GATE_UP_LAUNCH[fmt][n][0] for n in range(1, 9)]
        uncapped = [w for n, w in enumerate(ws, 1) if not M.GATE_UP_MIN_BLOCKS[fmt][n]]
        assert uncapped == sorted(uncapped, reverse=True) and all(2048 % (64 * w) == 0 for w in ws)
        assert all(M.GATE_UP_MIN_BLOCKS[fmt][n] * ws[n - 1] * 32 <= 2048 for n in range(1, 9))
        rows = [M.GATE_UP_LAUNCH[fmt][n][1] for n in range(1, 9)]
        assert rows == sorted(rows) and all(512 % (16 * r) == 0 for r in rows)
        for warps, tiles in M.GATE_UP_LAUNCH[fmt].values():
            assert M.moe_smem_bytes(256, warps, tiles, 6) <= M.STATIC_SMEM
        for warps, splits in M.DOWN_LAUNCH[fmt].values():
            assert M.moe_smem_bytes(0, warps, splits, 6) <= M.STATIC_SMEM
        assert moe.mma_moe_applies("down", fmt, 8) and moe.mma_moe_applies("gate_up", fmt, 1)
    assert moe.mma_moe_applies("gate_up", "nvfp4", 8)
    assert not moe.mma_moe_applies("gate_up", "bf16", 8)  # Triton's flat tiles: 50 vs 57 us


# ----------------------------------------------------------------------------- GPU
SHAPES = [(2048, 4096), (5120, 2048), (4096, 2048), (2048, 10240)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("F,K", SHAPES)
@pytest.mark.parametrize("N", [1, 5, 8])
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("warps,prefetch", [(None, None), (32, 3), (16, 8)])
def test_kernel_model_shapes_gpu(F, K, N, use_pdl, warps, prefetch, monkeypatch):
    """The NVFP4 GEMV kernel (the default launch, and deeper prefetch / 32 warps): fp32
    out within the fp32 reordering bound; bf16 + residual out the epilogue's two roundings
    of the kernel's own sum, also from a CUDA-graph replay; with the L2 prefetch, the
    same fp32 out bit for bit."""
    _require_mma()
    kw = {"warps": warps, "prefetch": prefetch}
    gen = torch.Generator().manual_seed(F + K + N)
    q = quantize(torch.randn(F, K, generator=gen) * 0.05)
    codes, scales, gs = q.codes.cuda(), q.scales.cuda(), q.global_scale.cuda().float()
    x = torch.randn(N, K, generator=gen).to(torch.bfloat16).cuda()
    res = torch.randn(N, F, generator=gen).to(torch.bfloat16).cuda()
    wq, sq = M.pack_mma_layout(codes, scales)
    exact = x.double() @ dequantize_packed(codes, scales, gs, torch.float64).T
    bound = K * 2.0**-24 * (x.double().abs() @ dequantize_packed(
        codes, scales, gs, torch.float64).abs().T)  # fp32 reordering bound
    out = torch.full((N, F), float("nan"), device="cuda")
    M.mma_gemv(x, wq, sq, gs, out, use_pdl=use_pdl, **kw)
    assert bool(((out.double() - exact).abs() <= bound + 1e-30).all())
    monkeypatch.setenv("FLINTC_MMA_L2_PREFETCH", "gemv")
    out_l2 = torch.full((N, F), float("nan"), device="cuda")
    M.mma_gemv(x, wq, sq, gs, out_l2, use_pdl=use_pdl, **kw)
    monkeypatch.delenv("FLINTC_MMA_L2_PREFETCH")
    assert torch.equal(out, out_l2)  # a hint: the same sums in the same order
    # bf16 + residual, captured in a CUDA graph (the decode runtime replays graphs)
    y = torch.full((N, F), float("nan"), device="cuda", dtype=torch.bfloat16)
    M.mma_gemv(x, wq, sq, gs, y, residual=res, use_pdl=use_pdl, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    y2 = torch.empty_like(y)
    with torch.cuda.graph(graph):
        M.mma_gemv(x, wq, sq, gs, y2, residual=res, use_pdl=use_pdl, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y2)
    want = (res.double() + out.to(torch.bfloat16).double()).to(torch.bfloat16)
    assert torch.equal(y, want)  # the epilogue's two roundings on the kernel's own sum


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("F,K", SHAPES + [(256, 2048)])
@pytest.mark.parametrize("N", [1, 5, 8])
@pytest.mark.parametrize("warps,prefetch", [(None, 2), (8, 1)])
def test_bf16_kernel_model_shapes_gpu(F, K, N, warps, prefetch, monkeypatch):
    """The GEMV kernel on row-major bf16 weights (read in place): fp32 out within the fp32
    reordering bound of the exact product; bf16 + residual out = the epilogue's two
    roundings of the kernel's own sum, also from a CUDA-graph replay with PDL (there with
    the L2 prefetch: a hint, the same values)."""
    _require_mma()
    gen = torch.Generator().manual_seed(F + K + N + 1)
    w = (torch.randn(F, K, generator=gen) * 0.05).to(torch.bfloat16).cuda()
    x = torch.randn(N, K, generator=gen).to(torch.bfloat16).cuda()
    res = torch.randn(N, F, generator=gen).to(torch.bfloat16).cuda()
    exact = x.double() @ w.double().T
    bound = K * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    out = torch.full((N, F), float("nan"), device="cuda")
    M.mma_gemv(x, w, None, None, out, warps=warps, prefetch=prefetch)
    assert bool(((out.double() - exact).abs() <= bound + 1e-30).all())
    y = torch.full((N, F), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    monkeypatch.setenv("FLINTC_MMA_L2_PREFETCH", "gemv")
    with torch.cuda.graph(graph):
        M.mma_gemv(x, w, None, None, y, residual=res, warps=warps, prefetch=prefetch,
                   use_pdl=True)
    monkeypatch.delenv("FLINTC_MMA_L2_PREFETCH")
    graph.replay()
    torch.cuda.synchronize()
    want = (res.double() + out.to(torch.bfloat16).double()).to(torch.bfloat16)
    assert torch.equal(y, want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_bf16_gemv_ops_use_mma_gpu(monkeypatch):
    """`gemv_residual` and `gemv` with bf16 weights run the CUDA kernel (no config) and
    agree with the reference within 2 bf16 ulps and with the Triton kernel
    (FLINTC_NVFP4_MMA=0) but for the fp32 summation order."""
    from flintc.kernels import fused_gemv as FG
    from flintc.ops import grouped

    _require_mma()
    gen = torch.Generator().manual_seed(5)
    w = [(torch.randn(2048, 4096, generator=gen) * 0.05).to(torch.bfloat16).cuda()]
    x = torch.randn(4, 4096, generator=gen).to(torch.bfloat16).cuda()
    res = torch.randn(4, 2048, generator=gen).to(torch.bfloat16).cuda()
    calls = []
    monkeypatch.setattr(M, "mma_gemv", _spy(M.mma_gemv, calls))
    out = FG.gemv_residual(x, w, res)
    plain = FG.gemv(x, w)
    assert len(calls) == 2  # the CUDA path ran
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "0")
    tri = FG.gemv_residual(x, w, res)
    ref = grouped.gemv_residual(x, w, res)
    assert len(calls) == 2
    for got in (out, tri):
        diff = (got.double() - ref.double()).abs()
        ulp = ref.double().abs().clamp_min(2.0**-126) * 2.0**-7
        assert bool((diff <= 2 * ulp).all()), float(diff.max())
    exact = x.double() @ w[0].double().T
    assert bool(((plain.double() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-6).all())
    share = float((out != tri).float().mean())
    print(f"bf16 mma vs triton: {share:.2%} of elements differ (fp32 summation order)")
    assert share < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("launch", [None, (16, 4, 8, 1), (32, 2, 8, 2), (16, 1, 4, 1)])
@pytest.mark.parametrize("N", [1, 3, 8])
def test_norm_router_gpu(N, launch, monkeypatch):
    """`flintc::norm_router` on the CUDA kernel (`mma_norm_router`, through the op without
    a launch given): the normed x within one bf16 ulp of the reference in <= 2% of the
    elements, the logits within the fp32 reordering bound of the exact product of the
    kernel's own normed x; bf16 norm weights; a CUDA-graph replay with PDL gives the same
    bits. E = 256, H = 2048. CPU twin: test_moe_kernels.py::test_norm_router (the Triton
    kernel) and the NVRTC compile of the router variant."""
    from flintc.kernels import moe
    from flintc.ops import grouped

    _require_mma()
    gen = torch.Generator().manual_seed(40 + N)
    H, E = 2048, 256
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).cuda()
    norm = (1 + 0.1 * torch.randn(H, generator=gen)).cuda()
    router = (torch.randn(E, H, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    if launch is None:
        calls = []
        monkeypatch.setattr(M, "mma_norm_router", _spy(M.mma_norm_router, calls))
        h, logits = moe.norm_router(x, norm, router, 1e-5)
        assert len(calls) == 1
    else:
        h, logits = M.mma_norm_router(x, norm, router, 1e-5, launch=launch)
    rh, _ = grouped.norm_router(x, norm, router, 1e-5)
    ulp = rh.double().abs().clamp_min(2.0**-126) * 2.0**-7
    assert bool(((h.double() - rh.double()).abs() <= ulp).all())
    assert float((h != rh).float().mean()) <= 0.02
    exact = h.double() @ router.double().T
    bound = H * 2.0**-24 * (h.double().abs() @ router.double().abs().T)
    assert bool(((logits.double() - exact).abs() <= bound + 1e-30).all())
    hb, lb = M.mma_norm_router(x, norm.to(torch.bfloat16), router, 1e-5, launch=launch)
    rhb, _ = grouped.norm_router(x, norm.to(torch.bfloat16).float(), router, 1e-5)
    assert float((hb != rhb).float().mean()) <= 0.02
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.mma_norm_router(x, norm, router, 1e-5, launch=launch, use_pdl=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], h) and torch.equal(out[1], logits)


def test_router_launch_rules():
    """`router_launch_config` picks a split that divides H / 64 and E; None where the
    kernel does not apply; the router variant of the source refuses NVFP4 / KV heads."""
    assert M.router_launch_config(2048, 256) == (16, 8, 4, 1)
    for h, e in ((64, 16), (128, 32), (192, 48), (2048, 128), (4096, 256)):
        d, c, w, r = M.router_launch_config(h, e)
        assert e % d == 0 and (h // 64) % (c * (w // r)) == 0
    assert M.router_launch_config(100, 256) is None and M.router_launch_config(2048, 8) is None
    src = M.qkv_source(2048, 16, 16, 0, 8, 4, rope=False, bf16=True, router=True)
    assert _eval_define(src, "SMEM_BYTES") == M.qkv_smem_bytes(2048, 16, 8, 4)
    x = torch.zeros(2, 2048, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"launch \(32, 1, 4, 1\) does not split"):
        M.mma_norm_router(x, torch.ones(2048), torch.zeros(48, 2048, dtype=torch.bfloat16), 1e-5,
                          launch=(32, 1, 4, 1))  # 32 rows per block do not divide E = 48
    with pytest.raises(ValueError, match="x must be a bf16 tensor"):
        M.mma_norm_router(x[None], torch.ones(2048), torch.zeros(256, 2048, dtype=torch.bfloat16),
                          1e-5)
    with pytest.raises(ValueError, match="router variant"):
        M.qkv_source(2048, 16, 16, 0, 8, 4, router=True)
    with pytest.raises(ValueError, match="mma_norm_router"):
        M.mma_norm_router(torch.zeros(2, 2048, dtype=torch.bfloat16), torch.ones(2048),
                          torch.zeros(8, 2048, dtype=torch.bfloat16), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gemv_residual_op_uses_mma_gpu(monkeypatch):
    from flintc.kernels import fused_gemv as FG
    from flintc.ops import grouped

    _require_mma()
    gen = torch.Generator().manual_seed(3)
    q = quantize(torch.randn(2048, 4096, generator=gen) * 0.05)
    w = [q.codes.cuda(), q.scales.cuda(), q.global_scale.cuda()]
    x = torch.randn(4, 4096, generator=gen).to(torch.bfloat16).cuda()
    res = torch.randn(4, 2048, generator=gen).to(torch.bfloat16).cuda()
    calls = []
    monkeypatch.setattr(M, "mma_gemv", _spy(M.mma_gemv, calls))
    out = FG.gemv_residual(x, w, res)
    assert len(calls) == 1  # the CUDA path ran
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "0")
    tri = FG.gemv_residual(x, w, res)
    ref = grouped.gemv_residual(x, w, res)
    for got in (out, tri):
        diff = (got.double() - ref.double()).abs()
        ulp = ref.double().abs().clamp_min(2.0**-126) * 2.0**-7
        assert bool((diff <= 2 * ulp).all()), float(diff.max())
    share = float((out != tri).float().mean())
    print(f"mma vs triton: {share:.2%} of elements differ (fp32 summation order)")
    assert share < 0.05


def test_stacked_experts_pack_as_rows():
    """A stack [E, H, I/2] packs as its E * H rows: expert e's row tiles at e * H / 16 (the
    MoE down kernel's addressing)."""
    gen = torch.Generator().manual_seed(11)
    codes, scales, _ = _nvfp4((3,), 32, 128, gen)
    wq, sq = M.packed_weight(codes, scales)
    dense = M.decode_mma_layout(wq, sq)
    for e in range(3):
        assert torch.equal(dense[32 * e:32 * (e + 1)],
                           dequantize_packed(codes[e], scales[e], None, torch.float32))


def _experts(fmt: str, lead: tuple, R: int, C: int, gen: torch.Generator) -> list:
    """Random expert weights on the GPU: NVFP4 (`_nvfp4`) or `[w]` bf16 (std 0.02)."""
    if fmt == "bf16":
        return [(torch.randn(*lead, R, C, generator=gen) * 0.02).to(torch.bfloat16).cuda()]
    return _nvfp4(lead, R, C, gen, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_moe_down_matches_reference_and_triton_gpu(fmt, N, use_pdl, monkeypatch):
    """The CUDA down kernel (the op's default launch, and launches with K slices per
    item, fewer warps than slices among them) against the reference op and the Triton
    kernel: within 2 bf16 ulps, the share
    of differing elements printed and below 5%."""
    from flintc.kernels import moe
    from flintc.ops import grouped

    _require_mma()
    gen = torch.Generator().manual_seed(100 + N)
    E, H, I, K = 256, 2048, 512, 6
    down, sd = _experts(fmt, (E,), H, I, gen), _experts(fmt, (), H, I, gen)
    h = torch.randn(N, K + 1, I, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)]).cuda()
    wts = torch.rand(N, K, generator=gen).cuda() * 0.5
    res = torch.randn(N, H, generator=gen).to(torch.bfloat16).cuda()
    calls = []
    monkeypatch.setattr(M, "moe_down", _spy(M.moe_down, calls))
    out = moe.moe_down_combine_residual(h, ids, wts, down, sd, res, use_pdl=use_pdl)
    assert len(calls) == int(moe.mma_moe_applies("down", fmt, N))  # the CUDA kernel ran
    ref = grouped.moe_down_combine_residual(h, ids, wts, down, sd, res)
    got = {"op": out}
    # column slices of ids and weights (the reference's top-k returns such views) run on
    # the CUDA kernel too, as contiguous copies (at N = 1 such a slice counts as contiguous)
    ids_s, wts_s = (torch.cat([t, t], 1)[:, :K] for t in (ids, wts))
    assert ids_s.is_contiguous() == wts_s.is_contiguous() == (N == 1)
    got["op, strided ids"] = moe.moe_down_combine_residual(h, ids_s, wts_s, down, sd, res,
                                                           use_pdl=use_pdl)
    assert len(calls) == 2 * int(moe.mma_moe_applies("down", fmt, N))
    for warps, splits, pf in ((32, 4, 2), (16, 8, 1), (8, 2, 3), (2, 4, 2)):
        got[f"cuda w{warps} s{splits} pf{pf}"] = M.moe_down(
            h, ids, wts, down, sd, res, warps=warps, splits=splits, prefetch=pf,
            use_pdl=use_pdl)
    monkeypatch.setenv("FLINTC_MMA_L2_PREFETCH", "down")  # one K slice: 6 chunks past 2
    got["cuda w32 s1 pf2, L2 prefetch"] = M.moe_down(h, ids, wts, down, sd, res, warps=32,
                                                     splits=1, prefetch=2, use_pdl=use_pdl)
    monkeypatch.delenv("FLINTC_MMA_L2_PREFETCH")
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "0")
    got["triton"] = moe.moe_down_combine_residual(h, ids, wts, down, sd, res, use_pdl=use_pdl)
    torch.cuda.synchronize()
    ulp = ref.double().abs().clamp_min(2.0**-126) * 2.0**-7
    for name, y in got.items():
        diff = (y.double() - ref.double()).abs()
        assert bool((diff <= 2 * ulp).all()), (name, float(diff.max()))
        share = float((y != ref).float().mean())
        print(f"moe down {fmt} {name} N={N}: {share:.2%} of elements differ from the reference")
        assert share < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_moe_topk_gate_up_matches_reference_and_triton_gpu(fmt, N, use_pdl, ties, monkeypatch):
    """The CUDA gate/up kernel (the op's default launch, other warp counts and row tiles
    per block) against the reference op and the Triton kernel: the same ids and weights,
    h within 2 bf16 ulps plus a floor near zero, the share of differing elements printed
    and below 5%. `ties`: logits and biases on coarse grids, so many experts share a
    routing key and the top-k must take the lower index (the block's warps each hold a
    share of the experts, so equal keys meet across warps too)."""
    from flintc.kernels import moe
    from flintc.ops import grouped

    _require_mma()
    gen = torch.Generator().manual_seed(200 + N)
    E, H, I, K = 256, 2048, 512, 6
    gate, up = _experts(fmt, (E,), I, H, gen), _experts(fmt, (E,), I, H, gen)
    sg, su = _experts(fmt, (), I, H, gen), _experts(fmt, (), I, H, gen)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).cuda()
    logits = torch.randn(N, E, generator=gen).cuda()
    bias = (torch.randn(E, generator=gen) * 0.05).cuda()
    if ties:  # 5 logit values x 2 bias values: about 25 experts per key
        logits = (torch.randint(-2, 3, (N, E), generator=gen) * 0.5).cuda()
        bias = (torch.randint(0, 2, (E,), generator=gen) * 0.25).cuda()
    calls = []
    monkeypatch.setattr(M, "moe_topk_gate_up", _spy(M.moe_topk_gate_up, calls))
    got = {"op": moe.moe_topk_gate_up(x, logits, bias, gate, up, sg, su, K, 2.5,
                                      use_pdl=use_pdl)}
    assert len(calls) == int(moe.mma_moe_applies("gate_up", fmt, N))  # the CUDA kernel ran
    # the 5th to 7th with registers capped for 12 / 3 / 6 blocks per SM (the first spills);
    # the last one warp, which routes all E experts alone
    for warps, pf, rows, mb in ((8, 3, 1, 0), (4, 2, 2, 0), (32, 1, 1, 0), (2, 2, 4, 0),
                                (2, 2, 1, 12), (8, 4, 1, 3), (4, 2, 1, 6), (1, 2, 1, 0)):
        got[f"cuda w{warps} pf{pf} rt{rows} mb{mb}"] = M.moe_topk_gate_up(
            x, logits, bias, gate, up, sg, su, K, 2.5, warps=warps, row_tiles=rows,
            prefetch=pf, min_blocks=mb, use_pdl=use_pdl)
    monkeypatch.setenv("FLINTC_MMA_GATE_UP_ROUTE", "warp")  # warp 0 routing alone
    got["cuda warp route"] = M.moe_topk_gate_up(x, logits, bias, gate, up, sg, su, K, 2.5,
                                                use_pdl=use_pdl)
    monkeypatch.delenv("FLINTC_MMA_GATE_UP_ROUTE")
    # every L2 prefetch on (the gate/up slices, and the selected experts' down weights
    # through the op's down_prefetch argument): hints, the same outputs; 1 and 8 warps
    down = _experts(fmt, (E,), H, I, gen)
    monkeypatch.setenv("FLINTC_MMA_L2_PREFETCH", "all")
    got["op, L2 prefetch"] = moe.moe_topk_gate_up(x, logits, bias, gate, up, sg, su, K, 2.5,
                                                  down, use_pdl=use_pdl)
    for warps in (1, 8):
        got[f"cuda w{warps}, L2 prefetch"] = M.moe_topk_gate_up(
            x, logits, bias, gate, up, sg, su, K, 2.5, warps=warps, use_pdl=use_pdl, down=down)
    monkeypatch.delenv("FLINTC_MMA_L2_PREFETCH")
    rh, rw, rids = grouped.moe_topk_gate_up(x, logits, bias, gate, up, sg, su, K, 2.5)
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "0")
    got["triton"] = moe.moe_topk_gate_up(x, logits, bias, gate, up, sg, su, K, 2.5,
                                         use_pdl=use_pdl)
    torch.cuda.synchronize()
    # 2 bf16 ulps, plus a floor for values near zero: h = silu(g) * u after g and u were
    # rounded to bf16, so one ulp of g or u moves a small h by more than its own ulp
    tol = 2 * rh.double().abs() * 2.0**-7 + 2.0**-10 * rh.double().abs().max()
    for name, (h, w, ids) in got.items():
        assert torch.equal(ids, rids), name
        torch.testing.assert_close(w, rw, rtol=4 * 2.0**-24, atol=0)
        assert torch.equal(w, got["triton"][1])  # the Triton kernel's formulas and sum order
        diff = (h.double() - rh.double()).abs()
        assert bool((diff <= tol).all()), (name, float(diff.max()))
        share = float((h != rh).float().mean())
        print(f"moe gate/up {fmt} {name} N={N}: {share:.2%} of elements differ from the "
              "reference")
        assert share < 0.05


def _moe_config(**over):
    """The tiny config with the MoE shapes the CUDA MoE kernels take (E 32, H 1024)."""
    import dataclasses

    from flintc.config import FlintConfig

    base = FlintConfig.preset("tiny")
    return dataclasses.replace(base, **{"hidden_size": 1024, "n_routed_experts": 32, **over})


@pytest.mark.parametrize("moe_applies", [False, True])
def test_prepack_converts_in_place(monkeypatch, moe_applies):
    """`prepack` converts exactly the NVFP4 weights named in PREPACK_SUFFIXES (the MoE ones
    only when the config's MoE kernels run on CUDA; here on the CPU, with `available`
    forced) to the mma layout, in place: same decoded values, same fingerprint, no cache
    entry, and a second call does nothing."""
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.runtime.build import weight_fingerprint

    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="nvfp4",
                           progress=False)
    # the MoE kernels: decided by the config (H 2048: they take it; the weights stay tiny);
    # the dense gate/up: by each weight's own [F, K], which the default launches do not
    # split at tiny's K = 128, and 1-warp launches do
    config = _moe_config(hidden_size=2048) if moe_applies else ckpt.config
    assert M._moe_kernels_apply(config) == moe_applies
    if moe_applies:
        monkeypatch.setenv("FLINTC_MMA_NORM_GATE_UP_LAUNCH",
                           "/".join(f"nvfp4:{n}=1,1,1,0" for n in range(1, 9)))
    dense = M.norm_gate_up_applies(128, 256)
    assert dense == moe_applies
    monkeypatch.setattr(M, "available", lambda device: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # prepack: no CUDA kernels under it
    monkeypatch.setattr(M, "_PACKED", {})
    before = {n: w.dequantize() for n, w in ckpt.weights.items() if hasattr(w, "codes")}
    sha = weight_fingerprint(ckpt.weights, "nvfp4", "file.gguf")
    want = [n for n in before if n.endswith(M.PREPACK_SUFFIXES)
            and (moe_applies or "experts." not in n)
            and (dense or not n.endswith(M.DENSE_GATE_UP_SUFFIXES))]
    want_bytes = sum(ckpt.weights[n].codes.numel() + ckpt.weights[n].scales.numel() for n in want)
    assert M.prepack(ckpt.weights, config) == want_bytes > 0
    for n, w in ckpt.weights.items():
        if n in before:
            assert w.layout == ("mma" if n in want else "packed"), n
            assert torch.equal(w.dequantize(), before[n]), n
    assert any("experts." in n for n in want) == moe_applies
    assert any(n.endswith(M.DENSE_GATE_UP_SUFFIXES) for n in want) == dense
    assert not M._PACKED
    assert weight_fingerprint(ckpt.weights, "nvfp4", "file.gguf") == sha
    assert M.prepack(ckpt.weights, config) == 0  # already converted


def test_reference_model_runs_on_converted_weights(monkeypatch):
    """The reference model (bench's eager baseline, the ops' N > 8 fallbacks) reads the
    mma layout through `NVFP4Tensor.dequantize`: the same logits as on packed weights."""
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.model.reference import FlintModel

    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="nvfp4",
                           progress=False)
    ids = torch.randint(0, ckpt.config.vocab_size, (2, 5))
    pos = torch.arange(5).expand(2, 5)

    def logits():
        model = FlintModel(ckpt.config, ckpt.weights, max_positions=16)
        kv = model.new_kv_cache(2, 16, torch.device("cpu"))
        return model(ids, pos, torch.arange(2), kv)

    ref = logits()
    monkeypatch.setattr(M, "available", lambda device: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # prepack: no CUDA kernels under it
    assert M.prepack(ckpt.weights, _moe_config()) > 0
    assert torch.equal(logits(), ref)


def test_unpack_inverts_pack_and_layout_checks():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    codes, scales = random_nvfp4(48, 192, gen)
    scales[3, 2] = 0.0  # a zero block: its codes' magnitudes are cleared in the mma layout
    wq, sq = M.pack_mma_layout(codes, scales)
    c2, s2 = M.unpack_mma_layout(wq, sq)
    assert torch.equal(dequantize_packed(c2, s2, None), dequantize_packed(codes, scales, None))
    from flintc.quant.nvfp4 import NVFP4FormatError, NVFP4Tensor

    w = NVFP4Tensor(wq, sq, torch.tensor(0.5))
    assert w.layout == "mma" and w.shape == (48, 192) and w.nbytes == codes.numel() + scales.numel() + 4
    assert torch.equal(w.dequantize(), dequantize_packed(codes, scales, torch.tensor(0.5)))
    assert M.weight_dims(wq) == ((), 48, 192) and M.weight_dims(codes) == ((), 48, 192)
    with pytest.raises(NVFP4FormatError, match=r"scales in the mma layout must be uint8 \[3, 3, 32, 2\]"):
        NVFP4Tensor(wq, sq[:, :2], torch.tensor(0.5))
    with pytest.raises(ValueError, match="unpack_mma_layout: expected wq int32"):
        M.unpack_mma_layout(wq.view(torch.float32), sq)
    with pytest.raises(ValueError, match="shared_up: mma-layout codes must be contiguous"):
        M.mma_operands(wq, sq[..., :1], "shared_up")


def test_refusal_reason_names_what_keeps_the_cuda_kernels_off(monkeypatch):
    """The launchers' errors for mma-layout weights say why the CUDA kernels do not run
    here: the device, its capability, or NVRTC's probe (its error quoted); never the
    interpreter, under which converted weights run on the CUDA kernels too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert M.refusal_reason(torch.device("cpu")) == "the tensors are on cpu, not a CUDA device"
    monkeypatch.setattr(M, "_COMPILES", {0: False})
    monkeypatch.setattr(M, "_COMPILE_ERRORS", {0: "OSError: CUDA_HOME is not set"})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a: None, raising=False)
    assert M.refusal_reason(torch.device("cuda", 0)) == (
        "NVRTC cannot compile the CUDA kernels on cuda:0 (OSError: CUDA_HOME is not set)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    assert M.refusal_reason(torch.device("cuda", 0)) == "cuda:0 is sm_80, below sm_90"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(M, "_COMPILES", {0: True})
    assert M.refusal_reason(torch.device("cuda", 0)) == ""


def test_converted_weights_take_the_cuda_kernel_under_the_interpreter(monkeypatch):
    """Weights in the mma layout have no Triton path, so the GEMV launcher sends them to
    the CUDA kernel even with TRITON_INTERPRET=1 set (an earlier CPU run in the process
    sets it); packed weights then take Triton's. The CUDA kernel is a spy here."""
    from flintc.kernels import gemv

    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(M, "supported", lambda device: True)
    monkeypatch.setattr(M, "available", lambda device: True)
    monkeypatch.setattr(M, "mma_gemv", lambda *a, **k: calls.append("mma"))
    gen = torch.Generator().manual_seed(0)
    codes, scales, gs = _nvfp4((), 64, 128, gen)
    wq, sq = M.pack_mma_layout(codes, scales)
    x = torch.randn(2, 128).to(torch.bfloat16)
    out = torch.empty(2, 64, dtype=torch.bfloat16)
    assert gemv._mma_gemv(x, (wq, sq, gs.reshape(())), 64, out, None, False)
    assert not gemv._mma_gemv(x, (codes, scales, gs.reshape(())), 64, out, None, False)
    assert calls == ["mma"]


def test_decode_ops_refuse_converted_weights_off_the_cuda_path():
    """Converted weights on a device without the CUDA kernels (here the CPU): a clear
    ValueError from every decode op that takes them, and from the ops that never read the
    mma layout; never a silent wrong result."""
    from flintc.kernels import fused_gemv, gemv, moe

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    codes, scales, gs = _nvfp4((), 64, 128, gen)
    wq, sq = M.pack_mma_layout(codes, scales)
    w = [wq, sq, gs.reshape(())]
    x = torch.randn(2, 128).to(torch.bfloat16)
    here = r"; here: the tensors are on cpu, not a CUDA device"
    with pytest.raises(ValueError, match="gemv: w must be in the packed NVFP4 layout here.*" + here):
        gemv.gemv(x, w)
    with pytest.raises(ValueError, match="gemv_residual: w must be in the packed NVFP4 layout"):
        fused_gemv.gemv_residual(x, w, torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="norm_gate_up_silu: gate must be in the packed NVFP4 "
                                         "layout here"):
        fused_gemv.norm_gate_up_silu(x, torch.ones(128), w, w, 1e-6)
    # the fused QKV: 4 / 2 heads of dim 16 over H = 128
    wk = [*M.pack_mma_layout(*_nvfp4((), 32, 128, gen)[:2]), gs.reshape(())]
    cos = torch.zeros(16, 8)
    cache = torch.zeros(2, 16, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm_qkv_rope_kv: wq must be in the packed NVFP4 "
                                         "layout here.*" + here):
        fused_gemv.norm_qkv_rope_kv(x.view(2, 1, 128), torch.ones(128), w, wk, wk,
                                    torch.ones(16), torch.ones(16), cos, cos, cache,
                                    cache.clone(), torch.arange(2), torch.zeros(2, 1,
                                    dtype=torch.int64), 1e-6, 4, 2, True, 0)
    E, I, H = 32, 64, 1024
    st = [_nvfp4((E,), I, H, gen), _nvfp4((E,), I, H, gen), _nvfp4((), I, H, gen),
          _nvfp4((), I, H, gen)]
    conv = [[*M.pack_mma_stack(c, s), g.reshape(c.shape[:-2])] for c, s, g in st]
    xh = torch.randn(2, H).to(torch.bfloat16)
    logits = torch.randn(2, E)
    with pytest.raises(ValueError, match="moe_topk_gate_up: gate must be in the packed NVFP4 "
                                         "layout here"):
        moe.moe_topk_gate_up(xh, logits, torch.zeros(E), *conv, 6, 2.5)
    bad = [conv[0][0][:, :2], conv[0][1], conv[0][2]]
    with pytest.raises(ValueError, match=r"up\[0\] \(NVFP4 codes, mma layout\) must be an int32 "
                                         r"tensor \[32, 4, 16, 32, 4\]"):
        moe.moe_topk_gate_up(xh, logits, torch.zeros(E), conv[0], bad, conv[2], conv[3], 6, 2.5)


def test_flintc_nvfp4_mma_variable(monkeypatch):
    from flintc.kernels.tuning import TuningEnvError, check_environment

    monkeypatch.setenv("FLINTC_NVFP4_MMA", "0")
    assert not M.enabled_from_env()
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "1")
    assert M.enabled_from_env()
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "yes")
    with pytest.raises(TuningEnvError, match="FLINTC_NVFP4_MMA must be 0 or 1, got 'yes'"):
        check_environment()


def test_prepack_off_with_the_variable(monkeypatch):
    """FLINTC_NVFP4_MMA=0, or TRITON_INTERPRET=1 in the process: nothing is converted
    (every kernel stays on Triton, which reads only the packed layout)."""
    from flintc.checkpoint.loader import load_checkpoint

    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="nvfp4",
                           progress=False)
    monkeypatch.setattr(M, "supported", lambda device: True)
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "0")
    assert M.prepack(ckpt.weights, ckpt.config) == 0
    assert all(w.layout == "packed" for w in ckpt.weights.values() if hasattr(w, "codes"))
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the launchers would run Triton's kernels
    assert M.prepack(ckpt.weights, ckpt.config) == 0
    monkeypatch.delenv("TRITON_INTERPRET")
    assert M.prepack(ckpt.weights, ckpt.config) > 0


def test_compile_failure_turns_the_path_off(monkeypatch):
    """NVRTC failing (e.g. no CUDA headers) is probed once: a warning, then False."""
    monkeypatch.setattr(M, "_COMPILES", {})

    def broken(src, name):
        raise OSError("CUDA_HOME environment variable is not set")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken)
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    with pytest.warns(UserWarning, match="NVRTC cannot compile the CUDA kernels"):
        assert not M._compiles(0)
    assert M._COMPILES == {0: False} and not M._compiles(0)


def test_cuda_source_pastes_the_replayed_expressions():
    """The expressions the CPU replay evaluates are the ones in the CUDA source, and every
    kernel's rendered source (GEMV, MoE gate/up and down, QKV, router) has no `__NAME__`
    placeholder left."""
    src = M.kernel_source(1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True)
    for expr in M._DECODE_EXPR:
        assert f"({expr})" in src
    assert f"0x{M._SEL_G:04X}u" in src and f"0x{M._SEL_G8:04X}u" in src
    assert f"0x{M._SCALE_ADD:08X}u" in src
    import re

    for source in (src, M.kernel_source(2, 2048, 1, 2, 4, M.EPI_BF16, True, 6, 256),
                   M.kernel_source(1, 512, 4, 2, 32, M.EPI_RESIDUAL, True, 6, 0, True),
                   M.qkv_source(2048, 128, 32, 4, 4, 8),
                   M.qkv_source(2048, 16, 16, 0, 8, 4, bf16=True, rope=False, router=True)):
        assert re.findall(r"__[A-Z][A-Z0-9_]*__", source) == []  # no placeholder left


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("variant", [
    ("gemv", (1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True)),
    ("gemv", (2, 2048, 1, 2, 8, M.EPI_FP32, False)),
    ("gemv", (1, 10240, 1, 2, 16, M.EPI_BF16, True)),
    ("gemv", (1, 10240, 1, 8, 16, M.EPI_RESIDUAL, True)),  # deeper prefetch
    ("gemv", (1, 4096, 1, 3, 32, M.EPI_RESIDUAL, True)),  # 32 warps: all of a slice ahead
    ("moe_gate_up", (2, 2048, 1, 2, 16, M.EPI_BF16, True, 6, 256)),
    ("moe_down", (1, 512, 1, 2, 32, M.EPI_RESIDUAL, True, 6)),
    ("gemv", (1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True, 0, 0, True)),  # bf16 weights
    ("gemv", (2, 2048, 1, 1, 8, M.EPI_FP32, False, 0, 0, True)),
    ("moe_gate_up", (2, 2048, 1, 2, 4, M.EPI_BF16, True, 6, 256, True)),  # bf16 experts
    ("moe_gate_up", (2, 2048, 1, 2, 2, M.EPI_BF16, False, 8, 128, False)),
    ("moe_gate_up", (4, 2048, 1, 2, 4, M.EPI_BF16, True, 6, 256, False)),  # 2 row tiles
    ("moe_gate_up", (8, 2048, 1, 1, 2, M.EPI_BF16, True, 6, 256, True)),
    ("moe_down", (1, 512, 4, 2, 32, M.EPI_RESIDUAL, True, 6, 0, True)),  # 4 K slices
    ("moe_down", (1, 512, 2, 2, 32, M.EPI_RESIDUAL, False, 6)),
    ("moe_down", (1, 512, 4, 2, 2, M.EPI_RESIDUAL, True, 6, 0, True)),  # warps < slices
])
def test_cuda_sources_compile_with_nvrtc(variant):
    """The CUDA sources compile for sm_90 with NVRTC on the CPU machine (the pip wheel,
    no GPU): C++ errors in a variant show here, not first on the H200."""
    kind, args = variant
    ptx = _nvrtc_ptx(M.kernel_source(*args))
    assert f".entry nvfp4_mma_{kind}".encode() in ptx
    assert b"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("args", [
    (2, 2048, 1, 2, 8, M.EPI_BF16, True, 6, 256),   # gate/up, NVFP4
    (2, 2048, 1, 2, 4, M.EPI_BF16, True, 6, 256, True),  # gate/up, bf16
    (1, 512, 4, 2, 32, M.EPI_RESIDUAL, True, 6),    # down, 4 K slices
    (1, 512, 4, 2, 2, M.EPI_RESIDUAL, True, 6),     # down, warps < slices
    (1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True),      # GEMV
    (1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True, 0, 0, True),  # GEMV, bf16 weights
])
def test_trigger_early_moves_launch_dependents(args):
    """`trigger_early` puts the kernels' `griddepcontrol.launch_dependents` before their
    first tensor-core mma (once the first loads are issued); without it every trigger comes
    after the last mma. Without PDL there is none."""
    def positions(ptx, what):
        return [m.start() for m in re.finditer(re.escape(what), ptx)]

    mma = b"mma.sync.aligned.m16n8k16"
    late = _nvrtc_ptx(M.kernel_source(*args))
    early = _nvrtc_ptx(M.kernel_source(*args, trigger_early=True))
    trig = b"griddepcontrol.launch_dependents"
    assert positions(late, trig) and min(positions(late, trig)) > max(positions(late, mma))
    assert positions(early, trig) and min(positions(early, trig)) < min(positions(early, mma))
    off = list(args)
    off[6] = False
    assert trig not in _nvrtc_ptx(M.kernel_source(*off, trigger_early=True))


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
def test_qkv_trigger_early_moves_launch_dependents():
    """The fused QKV and router variants: with `trigger_early` the trigger comes before the
    first mma (once x is normed into shared memory), otherwise after the last."""
    mma = b"mma.sync.aligned.m16n8k16"
    trig = b"griddepcontrol.launch_dependents"
    for kw in ({}, {"bf16": True, "row_groups": 2}):
        for early in (False, True):
            ptx = _nvrtc_ptx(M.qkv_source(2048, 128, 32, 4, 4, 8, pdl=True, trigger_early=early,
                                          **kw))
            t = [m.start() for m in re.finditer(trig, ptx)]
            m = [x.start() for x in re.finditer(mma, ptx)]
            assert t and (min(t) < min(m) if early else min(t) > max(m))
    ptx = _nvrtc_ptx(M.qkv_source(2048, 16, 16, 0, 8, 4, pdl=True, bf16=True, rope=False,
                                  router=True, trigger_early=True))
    assert ptx.find(trig) < ptx.find(mma)


def test_kernel_source_refuses_other_kernels_parameters():
    """`kernel_source` refuses a parameter that the chosen kernel does not have (so no two
    argument sets compile and cache the same kernel twice): experts without moe_top_k, a
    gate/up split, the warp route outside the gate/up kernel."""
    for args, kw in (((1, 2048, 1, 2, 16, M.EPI_FP32, True, 0, 256), {}),
                     ((2, 2048, 2, 2, 4, M.EPI_BF16, True, 6, 256), {}),
                     ((1, 2048, 1, 2, 16, M.EPI_FP32, True), {"block_route": False}),
                     ((1, 512, 4, 2, 32, M.EPI_RESIDUAL, True, 6), {"block_route": False})):
        with pytest.raises(ValueError, match="experts and block_route are for the MoE gate/up"):
            M.kernel_source(*args, **kw)
    assert "nvfp4_mma_moe_gate_up" in M.kernel_source(2, 2048, 1, 2, 4, M.EPI_BF16, True, 6, 256,
                                                      block_route=False)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
def test_gate_up_min_blocks_in_the_ptx():
    """`min_blocks` becomes the gate/up kernel's `__launch_bounds__` minimum (PTX
    `.minnctapersm`); 0 leaves it out; other kernels refuse it."""
    args = (2, 2048, 1, 2, 2, M.EPI_BF16, True, 6, 256)
    assert b".minnctapersm 12" in _nvrtc_ptx(M.kernel_source(*args, min_blocks=12))
    assert b".minnctapersm" not in _nvrtc_ptx(M.kernel_source(*args))
    with pytest.raises(ValueError, match="min_blocks is for the MoE gate/up kernel"):
        M.kernel_source(1, 512, 1, 2, 32, M.EPI_RESIDUAL, True, 6, min_blocks=4)
    with pytest.raises(ValueError, match="min_blocks x warps x 32 <= 2048"):
        M.kernel_source(2, 2048, 1, 2, 16, M.EPI_BF16, True, 6, 256, min_blocks=5)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("warps, experts, top_k", [(4, 256, 6), (2, 128, 8), (32, 32, 8),
                                                    (1, 1024, 1), (8, 96, 6)])
def test_gate_up_block_route_in_the_ptx(warps, experts, top_k):
    """`block_route` compiles for every share of experts per warp (fewer experts than
    lanes x warps too) and loads the routing biases before `griddepcontrol.wait` (a
    weight), with one barrier more than warp 0 routing alone, which reads them after."""
    args = (2, 2048, 1, 2, warps, M.EPI_BF16, True, top_k, experts)
    block = _nvrtc_ptx(M.kernel_source(*args)).decode()
    alone = _nvrtc_ptx(M.kernel_source(*args, block_route=False)).decode()
    assert block == _nvrtc_ptx(M.kernel_source(*args, block_route=True)).decode()  # default
    assert "ld.global.nc.f32" in block[:block.index("griddepcontrol.wait")]
    assert "ld.global.nc.f32" not in alone[:alone.index("griddepcontrol.wait")]
    assert block.count("bar.sync") == alone.count("bar.sync") + 1


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("bf16", [False, True])
def test_l2_prefetch_in_the_ptx(bf16):
    """`l2_prefetch` adds `cp.async.bulk.prefetch.L2` requests where a warp's slice has
    chunks past the first `prefetch`: before `griddepcontrol.wait` for weights that do not
    depend on the previous kernel (the GEMV, the dense gate/up, the shared experts; the
    down kernel with one K slice per item: 8 chunks), and none where the slice is all in
    registers. The MoE gate/up kernel always has the
    (runtime-switched) prefetch of the selected experts' down weights."""
    pf = b"cp.async.bulk.prefetch.L2.global"
    wait = b"griddepcontrol.wait"
    b = (0, 0, True) if bf16 else ()
    for args, before_wait in (((1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True, *b), True),  # 4 chunks
                              ((1, 512, 1, 2, 32, M.EPI_RESIDUAL, True, 6, 0, bf16), None)):
        on, off = (_nvrtc_ptx(M.kernel_source(*args, l2_prefetch=v)) for v in (True, False))
        assert pf in on and pf not in off, args
        if before_wait:  # (the down kernel's branches come in no fixed order in the PTX)
            assert on.find(pf) < on.find(wait), args
    # 16 warps x 2 chunks = K 2048: every chunk is in registers, nothing to prefetch
    ptx = _nvrtc_ptx(M.kernel_source(1, 2048, 1, 2, 16, M.EPI_RESIDUAL, True, *b,
                                     l2_prefetch=True))
    assert pf not in ptx
    gate_up = (2, 2048, 1, 2, 4, M.EPI_BF16, True, 6, 256, bf16)
    on, off = (_nvrtc_ptx(M.kernel_source(*gate_up, l2_prefetch=v)) for v in (True, False))
    assert on.count(pf) > off.count(pf) >= 1
    assert pf not in off[:off.find(wait)] and pf in on[:on.find(wait)]  # the shared expert's
    on, off = (_nvrtc_ptx(M.norm_gate_up_source(2048, 4, 2, 2, True, bf16, l2_prefetch=v))
               for v in (True, False))
    assert pf in on[:on.find(wait)] and pf not in off


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("bf16", [False, True])
def test_early_epilogue_in_the_ptx(bf16):
    """`early_epilogue` (`mma_early_epilogue`, session 40) loads the epilogues' inputs from
    earlier kernels before the work they would wait behind: the GEMV's residual right
    after `griddepcontrol.wait`, before the first mma (else between the warps' reduction
    and each store); the MoE down kernel's residual and routing weights before the
    block's barrier (else after it, in the combine). In the PTX: the GEMV's coherent
    16-bit loads (the residual; x is read 16 bytes at a time) come before its first
    `mma.sync` with the switch and after it without; the down kernel's coherent 16- and
    32-bit loads (residual, routing weights) before its `bar.sync` with the switch and
    after it without. Other kernels and epilogues refuse the switch."""
    b = (0, 0, True) if bf16 else ()
    for args in ((1, 4096, 1, 2, 16, M.EPI_RESIDUAL, True, *b),
                 (1, 4096, 1, 2, 32, M.EPI_RESIDUAL, False, *b),
                 (4, 2048, 1, 2, 2, M.EPI_RESIDUAL, True, *b)):  # 2 row tiles per warp
        for early in (True, False):
            ptx = _nvrtc_ptx(M.kernel_source(*args, early_epilogue=early)).decode()
            loads = [m.start() for m in re.finditer(r"ld\.global\.u16", ptx)]
            assert loads, args
            if early:
                assert max(loads) < ptx.find("mma.sync"), args
                assert not args[6] or ptx.find("griddepcontrol.wait") < min(loads), args
            else:
                assert min(loads) > ptx.find("mma.sync"), args
    for args in ((1, 512, 4, 2, 32, M.EPI_RESIDUAL, True, 6, 0, bf16),
                 (1, 512, 1, 2, 2, M.EPI_RESIDUAL, True, 6, 0, bf16)):  # 2 warps: loops
        for early in (True, False):
            ptx = _nvrtc_ptx(M.kernel_source(*args, early_epilogue=early)).decode()
            loads = [m.start() for m in re.finditer(r"ld\.global\.(u16|f32)", ptx)]
            assert len(loads) >= 2, args
            if early:
                assert max(loads) < ptx.find("bar.sync"), args
            else:
                assert min(loads) > ptx.find("bar.sync"), args
    for args in ((1, 4096, 1, 2, 16, M.EPI_BF16, True, *b),
                 (2, 2048, 1, 2, 16, M.EPI_BF16, True, 6, 256, bf16),  # gate/up
                 (1, 512, 4, 2, 32, M.EPI_BF16, True, 6, 0, bf16)):  # down: residual only
        with pytest.raises(ValueError, match="early_epilogue is for"):
            M.kernel_source(*args, early_epilogue=True)


def test_early_epilogue_env(monkeypatch):
    """`mma_early_epilogue`: unset FLINTC_MMA_EARLY_EPILOGUE, the measured per-shape
    default (session 42, H200: bf16 always; NVFP4 the O projection's K 4096 but not the
    dense down's 10240, the MoE down kernel at N <= 2 but not 8); set, the kernels it lists
    at every shape ("all", "none" / empty); anything else is a TuningEnvError naming the
    variable."""
    from flintc.kernels.tuning import TuningEnvError

    monkeypatch.delenv("FLINTC_MMA_EARLY_EPILOGUE", raising=False)
    cases = [("gemv", "bf16", 4096, 1, True), ("gemv", "bf16", 10240, 8, True),
             ("gemv", "nvfp4", 4096, 1, True), ("gemv", "nvfp4", 4096, 8, True),
             ("gemv", "nvfp4", 10240, 1, False), ("down", "bf16", 768, 8, True),
             ("down", "nvfp4", 768, 1, True), ("down", "nvfp4", 768, 2, True),
             ("down", "nvfp4", 768, 8, False)]
    for kernel, fmt, K, N, want in cases:
        assert M.mma_early_epilogue(kernel, fmt, K, N) is want, (kernel, fmt, K, N)
        assert M.early_epilogue_default(kernel, fmt, K, N) is want
    assert not any(M.mma_early_epilogue(k) for k in M.EARLY_EPILOGUE_KERNELS)  # no format: off
    for text, on in (("all", {"gemv", "down"}), ("none", set()), ("", set()), ("down", {"down"}),
                     (" GEMV , down ", {"gemv", "down"})):
        monkeypatch.setenv("FLINTC_MMA_EARLY_EPILOGUE", text)
        assert {k for k in M.EARLY_EPILOGUE_KERNELS if M.mma_early_epilogue(k)} == on, text
        for kernel, fmt, K, N, _ in cases:  # the variable wins at every shape
            assert M.mma_early_epilogue(kernel, fmt, K, N) is (kernel in on)
    for bad in ("qkv", "gemv,none"):
        monkeypatch.setenv("FLINTC_MMA_EARLY_EPILOGUE", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_MMA_EARLY_EPILOGUE must list kernels"):
            M.mma_early_epilogue("gemv")


def test_gate_up_route_env(monkeypatch):
    """`gate_up_route`: GATE_UP_ROUTE (variable unset or empty), or FLINTC_MMA_GATE_UP_ROUTE
    ("block" / "warp", case and spaces ignored); another value is a TuningEnvError naming
    the variable, also from `tuning.check_environment`."""
    from flintc.kernels.tuning import TuningEnvError, check_environment

    monkeypatch.delenv("FLINTC_MMA_GATE_UP_ROUTE", raising=False)
    assert M.gate_up_route() == M.GATE_UP_ROUTE == "block"
    for text, value in (("warp", "warp"), (" Block ", "block"), ("WARP", "warp")):
        monkeypatch.setenv("FLINTC_MMA_GATE_UP_ROUTE", text)
        assert M.gate_up_route() == value
    for empty in ("", "  "):  # empty: unset, as every other tuning variable
        monkeypatch.setenv("FLINTC_MMA_GATE_UP_ROUTE", empty)
        assert M.gate_up_route() == M.GATE_UP_ROUTE
    for bad in ("blocks", "0", "warp,block"):
        monkeypatch.setenv("FLINTC_MMA_GATE_UP_ROUTE", bad)
        with pytest.raises(TuningEnvError, match=f"FLINTC_MMA_GATE_UP_ROUTE must be 'block' or "
                                                 f"'warp', got '{bad}'"):
            M.gate_up_route()
        with pytest.raises(TuningEnvError, match="FLINTC_MMA_GATE_UP_ROUTE"):
            check_environment()


def test_gate_up_launch_env(monkeypatch):
    """`gate_up_launch` is (GATE_UP_LAUNCH's warps and row tiles, GATE_UP_MIN_BLOCKS,
    GATE_UP_PREFETCH); FLINTC_MMA_GATE_UP_LAUNCH replaces entries (prefetch optional); bad
    entries are a TuningEnvError naming the variable and the entry."""
    from flintc.kernels.tuning import TuningEnvError

    monkeypatch.delenv("FLINTC_MMA_GATE_UP_LAUNCH", raising=False)
    for fmt in ("nvfp4", "bf16"):
        for n in range(1, 9):
            assert M.gate_up_launch(fmt, n) == (*M.GATE_UP_LAUNCH[fmt][n],
                                                M.GATE_UP_MIN_BLOCKS[fmt][n],
                                                M.GATE_UP_PREFETCH[fmt][n])
    monkeypatch.setenv("FLINTC_MMA_GATE_UP_LAUNCH", "nvfp4:8=4,1,6 / bf16:2=2,2,0,3")
    assert M.gate_up_launch("nvfp4", 8) == (4, 1, 6, 2) != (*M.GATE_UP_LAUNCH["nvfp4"][8],
                                                             M.GATE_UP_MIN_BLOCKS["nvfp4"][8],
                                                             M.GATE_UP_PREFETCH["nvfp4"][8])
    assert M.gate_up_launch("bf16", 2) == (2, 2, 0, 3)  # the optional prefetch field
    assert M.gate_up_launch("nvfp4", 4) == (*M.GATE_UP_LAUNCH["nvfp4"][4],
                                            M.GATE_UP_MIN_BLOCKS["nvfp4"][4],
                                            M.GATE_UP_PREFETCH["nvfp4"][4])
    for bad in ("nvfp4:9=4,1,6", "fp8:1=4,1,6", "nvfp4:1=4,1,40", "nvfp4:1=4,1", "nvfp4:1=0,1,0",
                "nvfp4=4,1,6", "nvfp4:1=32,1,3", "nvfp4:1=4,1,0,9", "nvfp4:1=4,1,0,2,1",
                "nvfp4:1=32,1000,0", "nvfp4:1=32,2,0"):  # the last two: shared memory
        monkeypatch.setenv("FLINTC_MMA_GATE_UP_LAUNCH", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_MMA_GATE_UP_LAUNCH.*" + bad[:5]):
            M.gate_up_launch("nvfp4", 1)
    monkeypatch.delenv("FLINTC_MMA_GATE_UP_LAUNCH")
    for fmt, n in (("fp8", 1), ("NVFP4", 8), ("nvfp4", 0), ("nvfp4", 9), ("bf16", 8.0)):
        with pytest.raises(ValueError, match="gate_up_launch: fmt must be"):
            M.gate_up_launch(fmt, n)


def test_down_launch_env(monkeypatch):
    """`down_launch` is (DOWN_LAUNCH's warps and K slices, DOWN_PREFETCH);
    FLINTC_MMA_DOWN_LAUNCH replaces entries (prefetch optional) and `moe_down` takes them;
    bad entries are a TuningEnvError naming the variable and the entry."""
    from flintc.kernels.tuning import TuningEnvError

    monkeypatch.delenv("FLINTC_MMA_DOWN_LAUNCH", raising=False)
    for fmt in ("nvfp4", "bf16"):
        for n in range(1, 9):
            assert M.down_launch(fmt, n) == (*M.DOWN_LAUNCH[fmt][n], M.DOWN_PREFETCH[fmt])
    monkeypatch.setenv("FLINTC_MMA_DOWN_LAUNCH", "nvfp4:2=16,8 / bf16:1=8,2,5")
    assert M.down_launch("nvfp4", 2) == (16, 8, M.DOWN_PREFETCH["nvfp4"])
    assert M.down_launch("nvfp4", 2) != (*M.DOWN_LAUNCH["nvfp4"][2], M.DOWN_PREFETCH["nvfp4"])
    assert M.down_launch("bf16", 1) == (8, 2, 5)  # the optional prefetch field
    assert M.down_launch("nvfp4", 1) == (*M.DOWN_LAUNCH["nvfp4"][1], M.DOWN_PREFETCH["nvfp4"])
    for bad in ("nvfp4:9=32,2", "fp8:1=32,2", "nvfp4:1=32", "nvfp4:1=0,2", "nvfp4:1=33,2",
                "nvfp4:1=32,0", "nvfp4:1=32,2,17", "nvfp4:1=32,2,2,1", "nvfp4=32,2",
                "nvfp4:1=32,64"):  # the last: shared memory
        monkeypatch.setenv("FLINTC_MMA_DOWN_LAUNCH", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_MMA_DOWN_LAUNCH.*" + bad[:5]):
            M.down_launch("nvfp4", 1)
    monkeypatch.delenv("FLINTC_MMA_DOWN_LAUNCH")
    for fmt, n in (("fp8", 1), ("NVFP4", 8), ("nvfp4", 0), ("nvfp4", 9), ("bf16", 8.0)):
        with pytest.raises(ValueError, match="down_launch: fmt must be"):
            M.down_launch(fmt, n)
    # the launcher's defaults are down_launch's (its checks run before any launch, on CPU)
    E, H, I, K, N = 4, 32, 128, 2, 1
    seen = []

    def launch(fmt, n):
        seen.append((fmt, n))
        return (0, 1, 2)  # 0 warps: refused by moe_down's own check

    monkeypatch.setattr(M, "down_launch", launch)
    with pytest.raises(ValueError, match="warps must be an int in \\[1, 32\\], got 0"):
        M.moe_down(torch.zeros(N, K + 1, I, dtype=torch.bfloat16),
                   torch.zeros(N, K, dtype=torch.int64), torch.ones(N, K),
                   [torch.zeros(E, H, I, dtype=torch.bfloat16)],
                   [torch.zeros(H, I, dtype=torch.bfloat16)],
                   torch.zeros(N, H, dtype=torch.bfloat16))
    assert seen == [("bf16", N)]


def test_gemv_launch_env(monkeypatch):
    """`gemv_launch`: `GEMV_LAUNCH`'s entry or (`warps_for(K)`, 2); FLINTC_MMA_GEMV_LAUNCH
    entries take precedence for their format and shape; bad entries are a TuningEnvError
    naming the variable and the entry; `mma_gemv` refuses a bad prefetch."""
    from flintc.kernels.tuning import TuningEnvError

    monkeypatch.delenv("FLINTC_MMA_GEMV_LAUNCH", raising=False)
    for fmt, F, K in (("nvfp4", 2048, 4096), ("bf16", 2048, 10240), ("nvfp4", 4096, 2048)):
        assert M.gemv_launch(fmt, F, K) == M.GEMV_LAUNCH.get((fmt, F, K), (M.warps_for(K), 2))
    monkeypatch.setenv("FLINTC_MMA_GEMV_LAUNCH", "nvfp4:2048x10240=32,5 / bf16:2048X4096=8,4")
    assert M.gemv_launch("nvfp4", 2048, 10240) == (32, 5)
    assert M.gemv_launch("bf16", 2048, 4096) == (8, 4)
    assert M.gemv_launch("nvfp4", 2048, 4096) == M.GEMV_LAUNCH.get(("nvfp4", 2048, 4096),
                                                                   (16, 2))
    for bad in ("nvfp4:2048x10240=3,2", "fp8:64x64=1,1", "nvfp4:2048x100=1,1", "nvfp4:2048=1,1",
                "nvfp4:2048x4096=16,17", "nvfp4:2048x4096=16"):
        monkeypatch.setenv("FLINTC_MMA_GEMV_LAUNCH", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_MMA_GEMV_LAUNCH.*" + bad[:5]):
            M.gemv_launch("nvfp4", 2048, 4096)
    monkeypatch.delenv("FLINTC_MMA_GEMV_LAUNCH")
    gen = torch.Generator().manual_seed(1)
    q = quantize(torch.randn(32, 128, generator=gen))
    wq, sq = M.pack_mma_layout(q.codes, q.scales)
    with pytest.raises(ValueError, match="prefetch: expected an int in \\[0, 16\\], got 17"):
        M.mma_gemv(torch.zeros(1, 128).to(torch.bfloat16), wq, sq, q.global_scale.float(),
                   torch.empty(1, 32), prefetch=17)
    for warps in (-1, 64, True):
        with pytest.raises(ValueError, match="warps: expected an int in \\[1, 32\\]"):
            M.mma_gemv(torch.zeros(1, 128).to(torch.bfloat16), wq, sq, q.global_scale.float(),
                       torch.empty(1, 32), warps=warps)
    with pytest.raises(ValueError, match="fmt must be 'nvfp4' or 'bf16'; got 'NVFP4'"):
        M.gemv_launch("NVFP4", 2048, 4096)


def test_mma_trigger_env(monkeypatch):
    """FLINTC_MMA_TRIGGER lists the CUDA kernels that trigger early ("all" / "none" too);
    unset, `EARLY_TRIGGER` decides; anything else is a TuningEnvError naming the variable."""
    from flintc.kernels.tuning import TuningEnvError

    monkeypatch.delenv("FLINTC_MMA_TRIGGER", raising=False)
    assert [M.mma_trigger_early(k) for k in M.MMA_KERNELS] == \
        [k in M.EARLY_TRIGGER for k in M.MMA_KERNELS]
    monkeypatch.setenv("FLINTC_MMA_TRIGGER", "down")
    assert [M.mma_trigger_early(k) for k in M.MMA_KERNELS] == [k == "down" for k in M.MMA_KERNELS]
    monkeypatch.setenv("FLINTC_MMA_TRIGGER", " gate_up , down ")
    assert M.mma_trigger_early("gate_up") and M.mma_trigger_early("down")
    assert not M.mma_trigger_early("gemv")
    monkeypatch.setenv("FLINTC_MMA_TRIGGER", "all")
    assert all(M.mma_trigger_early(k) for k in M.MMA_KERNELS)
    monkeypatch.setenv("FLINTC_MMA_TRIGGER", "none")
    assert not any(M.mma_trigger_early(k) for k in M.MMA_KERNELS)
    monkeypatch.setenv("FLINTC_MMA_TRIGGER", "none,down")  # contradictory
    with pytest.raises(TuningEnvError, match="none / empty alone"):
        M.mma_trigger_early("down")
    monkeypatch.setenv("FLINTC_MMA_TRIGGER", "attention")
    with pytest.raises(TuningEnvError, match="FLINTC_MMA_TRIGGER"):
        M.mma_trigger_early("down")


@pytest.mark.skipif(not __import__("importlib").util.find_spec("nvidia.cuda_nvrtc"),
                    reason="needs the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("args", [
    (2048, 128, 32, 4, 4, 8, 1, True, True, 0, True),   # the model's default launch
    (2048, 128, 32, 4, 1, 16, 1, True, False, 0, True),  # no cluster, NoPE (full layer)
    (2048, 128, 32, 4, 8, 4, 2, False, True, 7, False),  # bf16 norms, int32 slots
    (128, 32, 8, 2, 1, 2, 1, False, True, 0, True),  # the tiny config
    (2048, 128, 32, 4, 8, 16, 1, True, True, 0, True, True, 4),  # bf16 weights, row groups
    (2048, 128, 32, 4, 2, 8, 2, True, False, 6, False, True, 2),
    (2048, 16, 16, 0, 8, 4, 1, True, False, 0, True, True, 1, True),  # norm_router
    (2048, 32, 8, 0, 2, 8, 1, False, False, 1, True, True, 2, True),
])
def test_qkv_source_compiles_with_nvrtc(args):
    """The fused QKV kernel's variants compile for sm_90 (CPU twin of the GPU tests'
    compile step); in a cluster launch the blocks push their sums to rank 0 with `mapa` /
    `st.shared::cluster`, a launch without one has no cluster instructions."""
    ptx = _nvrtc_ptx(M.qkv_source(*args))
    assert b".entry nvfp4_mma_qkv" in ptx
    assert ptx.count(b"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= 4
    assert (b"st.shared::cluster.f32" in ptx) == (args[4] > 1)
    assert (b"griddepcontrol.wait" in ptx) == args[7]
    assert (b"st.global.f32" in ptx) == (len(args) == 14)  # only the router stores fp32 (logits)


def test_qkv_launch_rules():
    """`qkv_launch_config` divides the K chunks and the head's rows exactly; `qkv_source`
    rejects splits that do not; `qkv_smem_bytes` is the larger of the x slice and the
    warps' sums plus the head's outputs and the other cluster blocks' sums; `qkv_applies`
    states the kernel's shape limits."""
    assert M.qkv_launch_config(2048) == (4, 8, 1)
    assert M.qkv_launch_config(2048, 128, "bf16") == (4, 8, 4)
    for fmt in ("nvfp4", "bf16"):
        for h in (64, 128, 192, 320, 2048, 4096, 7168):
            for d in (16, 32, 64, 128):
                cl, w, r = M.qkv_launch_config(h, d, fmt)
                assert (h // 64) % (cl * (w // r)) == 0 and 1 <= cl <= 8 and d % (16 * r) == 0
                src = M.qkv_source(h, d, 4, 1, cl, w, row_groups=r, bf16=fmt == "bf16")
                # the kernel's own shared-memory layout (its #defines) = what is launched
                assert _eval_define(src, "SMEM_BYTES") == M.qkv_smem_bytes(h, d, cl, w, r)
                assert M.qkv_applies(h, d, fmt) == (d <= 256 and M.qkv_smem_bytes(
                    h, d, cl, w, r) <= M.MAX_SMEM)
    with pytest.raises(ValueError, match="multiple of 64"):
        M.qkv_launch_config(100)
    with pytest.raises(ValueError, match="h % \\(64 \\* cluster \\* warps / row_groups\\)"):
        M.qkv_source(2048, 128, 32, 4, 4, 16)
    with pytest.raises(ValueError, match="d % \\(16 \\* row_groups\\)"):
        M.qkv_source(2048, 32, 32, 4, 1, 8, row_groups=4)
    assert M.qkv_applies(2048, 128) and M.qkv_applies(128, 32) and M.qkv_applies(2048, 128, "bf16")
    assert not M.qkv_applies(2048, 8) and not M.qkv_applies(2048, 512) and not M.qkv_applies(96, 32)
    assert not M.qkv_applies(14400, 128)  # H / 64 = 225: one block per head, 235 KB of x slice


def _eval_define(src: str, name: str) -> int:
    """The integer value of the C macro `name` in the rendered CUDA source `src` (its
    #defines expanded recursively; `a > b ? a : b` evaluated as Python)."""
    import re

    defs = {}
    for line in src.splitlines():
        m = re.match(r"#define (\w+) (.*?)(\s*//.*)?$", line)
        if m:
            defs[m.group(1)] = m.group(2)

    def expand(expr: str, depth: int = 0) -> str:
        assert depth < 20
        return re.sub(r"[A-Za-z_]\w*", lambda t: f"({expand(defs[t.group(0)], depth + 1)})"
                      if t.group(0) in defs else t.group(0), expr)

    ternary = r"\(([^()?]*) \? ([^():]*) : ([^()]*)\)"  # one level, as the macros write it
    defs = {k: re.sub(ternary, r"(\2 if \1 else \3)", v) for k, v in defs.items()}
    expr = expand(defs[name])
    assert "?" not in expr, expr
    return int(eval(expr, {}))  # noqa: S307  (our own source's integer constants)


def _nvrtc_ptx(source: str) -> bytes:
    """PTX of `source` compiled for compute_90 by the pip NVRTC; fails with its log."""
    import glob
    import os

    import nvidia.cuda_nvrtc as pkg

    root = next(iter(pkg.__path__))
    lib = ctypes.CDLL(min(glob.glob(os.path.join(root, "lib", "libnvrtc.so*"))))
    src = source.encode()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"k.cu", 0, None, None) == 0
    opts = (ctypes.c_char_p * 2)(b"--gpu-architecture=compute_90", b"-default-device")
    rc = lib.nvrtcCompileProgram(prog, 2, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def _convert(w: list) -> list:
    """An NVFP4 weight list `[codes, scales, gs]` in the mma layout, as `prepack` makes it."""
    return [*M.pack_mma_stack(w[0], w[1]), w[2]]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("N", [1, 8])
def test_converted_weights_match_packed_gpu(N):
    """Every op of both schedules that takes a converted weight (`prepack`) gives the
    same result as with the packed weight: bit for bit the decode ops on the CUDA kernels
    (the packed weight through the repack cache) and the prefill GEMM (the same bf16
    matrix into cuBLAS); the prefill grouped GEMMs through the mma tile loader within the
    bound of harness.assert_same (another compiled program: 37 of 1.57M
    gate/up outputs differed in session 13). Model shapes; CPU twins: the tests above and
    test_prefill_mma_layout."""
    from harness import assert_same

    from flintc.kernels import fused_gemv as FG
    from flintc.kernels import gemm as G
    from flintc.kernels import grouped_gemm as GG
    from flintc.kernels import moe

    _require_mma()
    gen = torch.Generator().manual_seed(300 + N)
    E, H, I, K, A = 256, 2048, 512, 6, 4096
    o = _nvfp4((), H, A, gen, "cuda")
    o[2] = o[2].reshape(())
    gate, up = _nvfp4((E,), I, H, gen, "cuda"), _nvfp4((E,), I, H, gen, "cuda")
    sg, su = _nvfp4((), I, H, gen, "cuda"), _nvfp4((), I, H, gen, "cuda")
    down, sd = _nvfp4((E,), H, I, gen, "cuda"), _nvfp4((), H, I, gen, "cuda")
    for w in (sg, su, sd):
        w[2] = w[2].reshape(())
    conv = {k: _convert(v) for k, v in {"o": o, "gate": gate, "up": up, "sg": sg, "su": su,
                                        "down": down, "sd": sd}.items()}
    xa = torch.randn(N, A, generator=gen).to(torch.bfloat16).cuda()
    res = torch.randn(N, H, generator=gen).to(torch.bfloat16).cuda()
    assert torch.equal(FG.gemv_residual(xa, o, res), FG.gemv_residual(xa, conv["o"], res))
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).cuda()
    logits = torch.randn(N, E, generator=gen).cuda()
    bias = (torch.randn(E, generator=gen) * 0.05).cuda()
    got = moe.moe_topk_gate_up(x, logits, bias, conv["gate"], conv["up"], conv["sg"], conv["su"],
                               K, 2.5)
    want = moe.moe_topk_gate_up(x, logits, bias, gate, up, sg, su, K, 2.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    h, wts, ids = want
    assert torch.equal(moe.moe_down_combine_residual(h, ids, wts, conv["down"], conv["sd"], res),
                       moe.moe_down_combine_residual(h, ids, wts, down, sd, res))
    T = 64 * N  # a prefill chunk
    xt = torch.randn(T, A, generator=gen).to(torch.bfloat16).cuda()
    assert torch.equal(G.gemm(xt, conv["o"]), G.gemm(xt, o))
    xh = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    tids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
    hp = GG.moe_gate_up(xh, tids, gate, up, sg, su)
    assert_same("moe_gate_up", GG.moe_gate_up(xh, tids, conv["gate"], conv["up"], conv["sg"],
                                              conv["su"]), hp, dots=True)
    tw = torch.rand(T, K, generator=gen).cuda()
    assert_same("moe_down_combine", GG.moe_down_combine(hp, tids, tw, conv["down"], conv["sd"]),
                GG.moe_down_combine(hp, tids, tw, down, sd), dots=True)


def test_layout_checks_found_by_review(monkeypatch):
    """Inputs a review fed the mma-layout functions: each gets a ValueError that names the
    problem (never a silent result or a bare IndexError / AttributeError), `prepack`
    converts nothing when a scale is bad, and moving a converted weight keeps its
    fingerprint."""
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.kernels import moe
    from flintc.quant.nvfp4 import NVFP4Tensor
    from flintc.runtime.build import weight_fingerprint

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    codes, scales = random_nvfp4(32, 128, gen)
    wq, sq = M.pack_mma_layout(codes, scales)
    bad = sq.clone()
    bad[0, 0, 0, 0] = M.MAX_SCALE_CODE + 1
    for fn in (M.decode_mma_layout, M.unpack_mma_layout):
        with pytest.raises(ValueError, match="above 142"):
            fn(wq, bad)
        with pytest.raises(ValueError, match="expected wq int32"):
            fn(wq, sq[:1])
    with pytest.raises(ValueError, match="both > 0"):
        M.pack_mma_layout(codes[:, :0], scales[:, :0])
    # prepack: a NaN scale in a later weight leaves every weight packed
    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="nvfp4", progress=False)
    monkeypatch.setattr(M, "available", lambda device: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # prepack: no CUDA kernels under it
    names = [n for n, w in ckpt.weights.items() if n.endswith("o_proj.weight")]
    w = ckpt.weights[names[-1]]
    s = w.scales.clone()
    s.view(torch.uint8)[0, 0] = 0x7F  # NaN in E4M3
    ckpt.weights[names[-1]] = NVFP4Tensor(w.codes, s, w.global_scale)
    with pytest.raises(ValueError, match=f"{names[-1]}: block scales must be finite"):
        M.prepack(ckpt.weights, ckpt.config)
    assert all(ckpt.weights[n].layout == "packed" for n in names)
    ckpt.weights[names[-1]] = w
    sha = weight_fingerprint(ckpt.weights, "nvfp4", "x.gguf")
    assert M.prepack(ckpt.weights, ckpt.config) > 0
    moved = {k: v.to("cpu") for k, v in ckpt.weights.items()}
    assert weight_fingerprint(moved, "nvfp4", "x.gguf") == sha
    # MoE decode ops: a missing tensor or shared expert is named, not an AttributeError
    E, I, H = 32, 64, 1024
    stack = _convert(_nvfp4((E,), I, H, gen))
    x, logits = torch.randn(1, H).to(torch.bfloat16), torch.randn(1, E)
    with pytest.raises(ValueError, match="gate must be a stacked NVFP4 weight in the mma layout"):
        moe.moe_topk_gate_up(x, logits, torch.zeros(E), [None, stack[1], stack[2]], stack, [], [],
                             6, 2.5)
    with pytest.raises(ValueError, match="shared_gate must be given"):
        moe.moe_topk_gate_up(x, logits, torch.zeros(E), stack, stack, [], [], 6, 2.5)
    wrong = [stack[0], torch.zeros(E, I, H // 16, dtype=torch.float8_e4m3fn), stack[2]]
    with pytest.raises(ValueError, match=r"up\[1\] \(NVFP4 scale codes, mma layout\)"):
        moe.moe_topk_gate_up(x, logits, torch.zeros(E), stack, wrong, [], [], 6, 2.5)


# -- the dense gate/up kernel (flintc::norm_gate_up_silu) ----------------------------------

_NVRTC = __import__("importlib").util.find_spec("nvidia.cuda_nvrtc")


@pytest.mark.skipif(not _NVRTC, reason="needs the nvidia-cuda-nvrtc wheel "
                                       "(pip install nvidia-cuda-nvrtc-cu12)")
@pytest.mark.parametrize("args", [
    (2048, 8, 1, 2, True),                      # the default launch, NVFP4
    (2048, 4, 2, 3, True, False, True, True),   # 2 row tiles, bf16 norm, early trigger
    (2048, 16, 1, 1, False),                    # no PDL, 2 chunks per warp
    (2048, 8, 1, 2, True, True),                # bf16 weights
    (1024, 4, 1, 0, True, True, False, False),  # no prefetch
])
def test_norm_gate_up_source_compiles_with_nvrtc(args):
    """The dense gate/up kernel compiles for sm_90 with NVRTC on the CPU machine. With PDL
    the first weight loads come before `griddepcontrol.wait` and x's after it; the trigger
    sits after the last mma (early: before the first); without PDL neither instruction."""
    ptx = _nvrtc_ptx(M.norm_gate_up_source(*args)).decode()
    assert ".entry nvfp4_mma_norm_gate_up" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    pdl = args[4]
    early = len(args) > 7 and args[7]
    if not pdl:
        assert "griddepcontrol" not in ptx
        return
    wait = ptx.index("griddepcontrol.wait")
    weights = ptx.index("ld.global.nc.v4.u32")
    act = ptx.index("ld.global.v4.u32")  # x: coherent loads, never .nc
    mmas = [m.start() for m in re.finditer("mma.sync.aligned", ptx)]
    trig = [m.start() for m in re.finditer("griddepcontrol.launch_dependents", ptx)]
    assert (weights < wait) == (args[3] > 0) and wait < act
    assert trig and (max(trig) < min(mmas) if early else min(trig) > max(mmas))


def test_norm_gate_up_source_and_launch_refuse_bad_splits():
    """`norm_gate_up_source` and `mma_norm_gate_up` refuse splits the kernel cannot take,
    naming them, before anything runs (x on the CPU: the checks come first)."""
    for bad in ((2048, 32, 1, 0), (2048, 8, 1, 4), (2048, 3, 1, 1), (2000, 4, 1, 1),
                (2048, 8, 0, 1), (2048, 8, 1, -1)):
        with pytest.raises(ValueError, match="norm_gate_up_source: needs"):
            M.norm_gate_up_source(*bad)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
    gate = _nvfp4((), 64, 256, gen)
    norm = torch.ones(256)
    with pytest.raises(ValueError, match=r"does not fit H = 256, F = 64, N = 2: warps 8 must"):
        M.mma_norm_gate_up(x, norm, gate, gate, 1e-5, launch=(8, 1, 1, 0))
    with pytest.raises(ValueError, match=r"row_tiles 8 must be in 1..8 with F = 64"):
        M.mma_norm_gate_up(x, norm, gate, gate, 1e-5, launch=(2, 8, 1, 0))
    with pytest.raises(ValueError, match=r"launch must be 4 ints"):
        M.mma_norm_gate_up(x, norm, gate, gate, 1e-5, launch=(2, 1, 1))
    big = torch.zeros(8, 16384, dtype=torch.bfloat16)  # 8 normed rows of 16384: > 227 KiB
    wide = _nvfp4((), 64, 16384, gen)
    with pytest.raises(ValueError, match=r"bytes of shared memory at N = 8"):
        M.mma_norm_gate_up(big, torch.ones(16384), wide, wide, 1e-5, launch=(4, 1, 1, 0))
    assert not M.norm_gate_up_applies(16384, 10240)  # so prepack leaves such weights packed
    assert M.norm_gate_up_fits(16384, 10240, 1, (4, 1, 1, 0)) == ""
    with pytest.raises(ValueError, match="gate and up must be"):
        M.mma_norm_gate_up(x, norm, gate, _nvfp4((), 32, 256, gen), 1e-5, launch=(2, 1, 1, 0))
    with pytest.raises(ValueError, match="gate and up must be"):
        M.mma_norm_gate_up(x, norm, gate, [torch.zeros(64, 256, dtype=torch.bfloat16)], 1e-5)
    with pytest.raises(ValueError, match=r"norm must be a contiguous fp32 or bf16 tensor \[256\]"):
        M.mma_norm_gate_up(x, torch.ones(128), gate, gate, 1e-5, launch=(2, 1, 1, 0))
    with pytest.raises(ValueError, match=r"x must be a contiguous, 16-byte aligned bf16"):
        M.mma_norm_gate_up(torch.zeros(9, 256, dtype=torch.bfloat16), norm, gate, gate, 1e-5)
    with pytest.raises(ValueError, match="prefetch -1 must be in 0..1"):
        M.mma_norm_gate_up(x, norm, gate, gate, 1e-5, launch=(2, 1, -1, 0))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        M.mma_norm_gate_up(x, norm, gate, gate, 1e-5, launch=(2, 1, 1, 0))


def test_norm_gate_up_launch_env_and_applies(monkeypatch):
    """`norm_gate_up_launch` is NORM_GATE_UP_LAUNCH's entry; FLINTC_MMA_NORM_GATE_UP_LAUNCH
    replaces entries; bad entries are a TuningEnvError naming the variable and the entry.
    `norm_gate_up_applies` (which decides `prepack`) follows the launch: the full model's
    H 2048 / F 10240 yes, the tiny model's H 128 no."""
    from flintc.kernels.tuning import TuningEnvError

    monkeypatch.delenv("FLINTC_MMA_NORM_GATE_UP_LAUNCH", raising=False)
    for fmt in ("nvfp4", "bf16"):
        for n in range(1, 9):
            assert M.norm_gate_up_launch(fmt, n) == M.NORM_GATE_UP_LAUNCH[fmt][n]
    assert M.norm_gate_up_applies(2048, 10240) and not M.norm_gate_up_applies(128, 256)
    monkeypatch.setenv("FLINTC_MMA_NORM_GATE_UP_LAUNCH", "nvfp4:8=4,2,3,2 / bf16:1=16,1,1,0")
    assert M.norm_gate_up_launch("nvfp4", 8) == (4, 2, 3, 2)
    assert M.norm_gate_up_launch("bf16", 1) == (16, 1, 1, 0)
    assert M.norm_gate_up_launch("nvfp4", 1) == M.NORM_GATE_UP_LAUNCH["nvfp4"][1]
    monkeypatch.setenv("FLINTC_MMA_NORM_GATE_UP_LAUNCH", "nvfp4:3=32,1,1,0")
    assert not M.norm_gate_up_applies(2048, 10240)  # 32 warps: 1 chunk each
    monkeypatch.delenv("FLINTC_MMA_NORM_GATE_UP_LAUNCH")
    for text, want in (("none", set()), ("", set()), ("bf16", {"bf16"}),
                       ("NVFP4, bf16", {"nvfp4", "bf16"})):
        monkeypatch.setenv("FLINTC_MMA_NORM_GATE_UP_FORMATS", text)
        assert M.norm_gate_up_formats() == want
        assert M.norm_gate_up_applies(2048, 10240) == ("nvfp4" in want)
    for bad in ("fp8", "none,nvfp4"):
        monkeypatch.setenv("FLINTC_MMA_NORM_GATE_UP_FORMATS", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_MMA_NORM_GATE_UP_FORMATS"):
            M.norm_gate_up_formats()
    monkeypatch.delenv("FLINTC_MMA_NORM_GATE_UP_FORMATS")
    assert M.norm_gate_up_formats() == M.NORM_GATE_UP_FORMATS
    for bad in ("nvfp4:9=4,1,2,0", "fp8:1=4,1,2,0", "nvfp4:1=4,1,2", "nvfp4:1=0,1,2,0",
                "nvfp4:1=4,0,2,0", "nvfp4:1=4,1,17,0", "nvfp4:1=4,1,2,33", "nvfp4=4,1,2,0",
                "nvfp4:1=4,9,2,0"):
        monkeypatch.setenv("FLINTC_MMA_NORM_GATE_UP_LAUNCH", bad)
        with pytest.raises(TuningEnvError,
                           match="FLINTC_MMA_NORM_GATE_UP_LAUNCH.*" + re.escape(repr(bad))):
            M.norm_gate_up_launch("nvfp4", 1)
    monkeypatch.delenv("FLINTC_MMA_NORM_GATE_UP_LAUNCH")
    for fmt, n in (("fp8", 1), ("nvfp4", 0), ("bf16", 9), ("nvfp4", 2.0)):
        with pytest.raises(ValueError, match="norm_gate_up_launch: fmt must be"):
            M.norm_gate_up_launch(fmt, n)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_norm_gate_up_matches_reference_and_triton_gpu(fmt, N, use_pdl, monkeypatch):
    """The CUDA dense gate/up kernel (the op's default path, converted weights, and other
    launches: warps, row tiles, prefetch, blocks looping over row groups) against the
    reference op and the Triton kernel at the model's shapes (H 2048, F 10240): h within
    2 bf16 ulps plus a floor near zero, the share of differing elements printed and below
    5%. The op takes the CUDA kernel for NVFP4, and bf16 at `NORM_GATE_UP_BF16_N`."""
    from flintc.kernels import fused_gemv
    from flintc.ops import grouped

    _require_mma()
    gen = torch.Generator().manual_seed(300 + N)
    H, F = 2048, 10240
    gate, up = _experts(fmt, (), F, H, gen), _experts(fmt, (), F, H, gen)
    x = (torch.randn(N, H, generator=gen) * 3).to(torch.bfloat16).cuda()
    norm = (torch.rand(H, generator=gen) + 0.5).cuda()
    calls = []
    monkeypatch.setattr(M, "mma_norm_gate_up", _spy(M.mma_norm_gate_up, calls))
    got = {"op": fused_gemv.norm_gate_up_silu(x, norm, gate, up, 1e-5, use_pdl=use_pdl)}
    assert len(calls) == int(fmt == "nvfp4" or N in M.NORM_GATE_UP_BF16_N)
    if fmt == "nvfp4":
        got["op converted"] = fused_gemv.norm_gate_up_silu(x, norm, _convert(gate),
                                                           _convert(up), 1e-5, use_pdl=use_pdl)
        assert len(calls) == 2
    for launch in ((8, 1, 2, 0), (4, 1, 3, 0), (16, 1, 1, 0), (8, 2, 2, 0), (4, 1, 0, 0),
                   (8, 1, 2, 1), (4, 2, 3, 3), (2, 1, 6, 0)):
        got[f"cuda {launch}"] = M.mma_norm_gate_up(x, norm, gate, up, 1e-5, launch=launch,
                                                   use_pdl=use_pdl)
    got["bf16 norm"] = M.mma_norm_gate_up(x, norm.to(torch.bfloat16), gate, up, 1e-5,
                                          use_pdl=use_pdl)
    monkeypatch.setenv("FLINTC_MMA_L2_PREFETCH", "norm_gate_up")  # blocks looping too
    for launch in ((4, 2, 2, 0), (4, 1, 2, 2)):
        got[f"cuda {launch}, L2 prefetch"] = M.mma_norm_gate_up(x, norm, gate, up, 1e-5,
                                                                launch=launch, use_pdl=use_pdl)
    monkeypatch.delenv("FLINTC_MMA_L2_PREFETCH")
    ref = grouped.norm_gate_up_silu(x, norm, gate, up, 1e-5)
    ref_bf16_norm = grouped.norm_gate_up_silu(x, norm.to(torch.bfloat16), gate, up, 1e-5)
    monkeypatch.setenv("FLINTC_NVFP4_MMA", "0")
    got["triton"] = fused_gemv.norm_gate_up_silu(x, norm, gate, up, 1e-5, use_pdl=use_pdl)
    torch.cuda.synchronize()
    assert ref.shape == (N, F)
    for name, h in got.items():
        r = ref_bf16_norm if name == "bf16 norm" else ref
        tol = 2 * r.double().abs() * 2.0**-7 + 2.0**-10 * r.double().abs().max()
        diff = (h.double() - r.double()).abs()
        assert bool((diff <= tol).all()), (name, float(diff.max()))
        share = float((h != r).float().mean())
        print(f"dense gate/up {fmt} {name} N={N}: {share:.2%} of elements differ from the "
              "reference")
        assert share < 0.05


def test_norm_gate_up_epilogue_replay():
    """The dense gate/up epilogue's index math, as pasted in the CUDA source (checked to be
    there), replayed: thread i of the loop finds the accumulator of the m16n8k16 C fragment
    (lane 4 g + t, register j: row g + 8 (j >> 1), column 2 t + (j & 1); PTX ISA) that holds
    output (row tile r, row, column < N), gate and up alike, and every output is written
    exactly once. Integer partial sums make the warp-order sums exact."""
    src = M.norm_gate_up_source(2048, 4, 2, 2)
    for line in ("const int r = i / (16 * N), rem = i - r * 16 * N;",
                 "const int col = rem >> 4, row16 = rem & 15;",
                 "const int j = 2 * (row16 >> 3) + (col & 1), ln = 4 * (row16 & 7) + (col >> 1);",
                 "vg += red[((w * RT + r) * 4 + j) * 32 + ln];",
                 "vu += red[((w * RT + RTB + r) * 4 + j) * 32 + ln];",
                 "out[(size_t)col * F + (grp * RTB + r) * 16 + row16] = to_bf16(hv);"):
        assert line in src, line
    gen = torch.Generator().manual_seed(11)
    for warps, rtb in ((1, 1), (4, 2), (3, 1)):
        rt = 2 * rtb
        # C[w, tile, row, col]: warp w's partial sums of 16-row tile `tile` (gate tiles
        # 0..rtb-1, up tiles rtb..), 8 columns
        C = torch.randint(-1000, 1000, (warps, rt, 16, 8), generator=gen)
        red = torch.zeros(warps * rt * 4 * 32, dtype=torch.int64)
        for w in range(warps):
            for tile in range(rt):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for j in range(4):
                        red[((w * rt + tile) * 4 + j) * 32 + lane] = \
                            C[w, tile, g + 8 * (j >> 1), 2 * t + (j & 1)]
        for N in range(1, 9):
            seen = {}
            for i in range(rtb * 16 * N):
                r = i // (16 * N)
                rem = i - r * 16 * N
                col, row16 = rem >> 4, rem & 15
                j, ln = 2 * (row16 >> 3) + (col & 1), 4 * (row16 & 7) + (col >> 1)
                vg = sum(int(red[((w * rt + r) * 4 + j) * 32 + ln]) for w in range(warps))
                vu = sum(int(red[((w * rt + rtb + r) * 4 + j) * 32 + ln]) for w in range(warps))
                assert (r, row16, col) not in seen
                seen[(r, row16, col)] = (vg, vu)
            assert len(seen) == rtb * 16 * N
            for (r, row16, col), (vg, vu) in seen.items():
                assert vg == int(C[:, r, row16, col].sum())
                assert vu == int(C[:, rtb + r, row16, col].sum())


def test_dense_gate_up_reference_reads_converted_weights():
    """Past N = 8 (prefill chunks) `norm_gate_up_silu` takes the reference op, which must
    read the dense gate and up weights that `prepack` converted to the mma layout: the
    same bits as from the packed weights (here on the CPU)."""
    from flintc.kernels import fused_gemv

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    gate, up = _nvfp4((), 64, 256, gen), _nvfp4((), 64, 256, gen)
    x = (torch.randn(12, 256, generator=gen) * 2).to(torch.bfloat16)
    norm = torch.rand(256, generator=gen) + 0.5
    want = fused_gemv.norm_gate_up_silu(x, norm, gate, up, 1e-5)
    conv = [[*M.pack_mma_layout(w[0], w[1]), w[2]] for w in (gate, up)]
    got = fused_gemv.norm_gate_up_silu(x, norm, conv[0], conv[1], 1e-5)
    assert got.shape == (12, 64) and torch.equal(got, want)
