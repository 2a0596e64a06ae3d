"""The prefill glue cuts: the lean torch launchers of `flintc.kernels.prefill_ops` and the
expert plan of `flintc.kernels.grouped_gemm` (one sort per MoE layer, the tile table
from one Triton launch, the slot offsets computed in the grouped GEMM), each bit for bit
against the code it replaces; and the per-layer aten-op count of one prefill chunk
(`flintc.runtime.opcount`), which must not grow back.
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import pytest
import torch

pytest.importorskip("triton", reason="the prefill kernels need triton")

import flintc.ops  # noqa: F401  (registers torch.ops.flintc.*)
from flintc.kernels import grouped_gemm as GG
from flintc.kernels import prefill_ops as P
from flintc.model import ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F32 = torch.float32


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def rand_bf16(*shape, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Random bf16 values with a spread of magnitudes, some zeros, infinities and NaNs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float()) * scale
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:6]
    flat[idx] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40])
    return x.to(torch.bfloat16).to(DEV)


def test_rms_norm_and_silu_mul_are_bit_identical():
    x = rand_bf16(37, 128, seed=1)
    w = (torch.rand(128, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEV)
    assert same_bits(P.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5, F32))
    assert same_bits(P.rms_norm(x, w.to(torch.bfloat16), 1e-5), ops.rms_norm(x, w.to(torch.bfloat16), 1e-5, F32))
    g, u = rand_bf16(9, 7, 64, seed=3), rand_bf16(9, 7, 64, seed=4)
    assert same_bits(P.silu_mul(g, u), ops.silu_mul(g, u, F32))
    out = torch.zeros(9, 8, 64, dtype=torch.bfloat16, device=DEV)
    P.silu_mul(g[:, 0], u[:, 0], out=out[:, 7])  # a strided slice, as the shared expert's
    assert same_bits(out[:, 7], ops.silu_mul(g[:, 0], u[:, 0], F32))


def test_add_rms_norm_is_bit_identical():
    """`flintc::add_rms_norm`'s CPU launcher against the functions it fuses."""
    x, y = rand_bf16(5, 7, 128, seed=11), rand_bf16(5, 7, 128, seed=12)
    w = (torch.rand(128, generator=torch.Generator().manual_seed(13)) + 0.5).to(DEV)
    h, normed = P.add_rms_norm(x, y, w, 1e-5)
    want = ops.residual_add(x, y, F32)
    assert same_bits(h, want) and same_bits(normed, ops.rms_norm(want, w, 1e-5, F32))
    got = torch.ops.flintc.add_rms_norm(x, y, w, 1e-5)  # the op's reference body
    assert same_bits(got[0], h) and same_bits(got[1], normed)


@pytest.mark.parametrize("rope", [True, False])
def test_qk_norm_rope_is_bit_identical(rope):
    B, T, Hq, Hkv, D = 1, 11, 8, 2, 32
    q, k = rand_bf16(B, T, Hq, D, seed=5, scale=1.0), rand_bf16(B, T, Hkv, D, seed=6, scale=1.0)
    gen = torch.Generator().manual_seed(7)
    qn, kn = (torch.rand(D, generator=gen) + 0.5).to(DEV), (torch.rand(D, generator=gen) + 0.5).to(DEV)
    cos, sin = ops.rope_tables(10000.0, D, 64, F32)
    pos = torch.arange(20, 20 + T)[None]
    cos, sin = cos[pos].to(DEV), sin[pos].to(DEV)
    got = P.qk_norm_rope(q, k, qn, kn, cos, sin, 1e-5, rope)
    want = torch.ops.flintc.qk_norm_rope(q, k, qn, kn, cos, sin, 1e-5, rope)
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@pytest.mark.parametrize("shared", [True, False])
def test_expert_combine_is_bit_identical(shared):
    y = rand_bf16(13, 6, 128, seed=8)
    w = torch.rand(13, 6, generator=torch.Generator().manual_seed(9)).to(DEV) * 2.5
    s = rand_bf16(13, 128, seed=10) if shared else None
    assert same_bits(P.expert_combine(y, w, s), ops.expert_combine(y, w, s, F32))


@pytest.mark.parametrize("E,N,K,block_m", [(16, 7, 6, 16), (16, 64, 6, 64), (256, 37, 6, 32), (5, 3, 2, 16)])
def test_expert_plan_matches_sort_and_tile_table(E, N, K, block_m):
    """The plan's stable order, its ends and the Triton tile table equal `sort_by_expert`
    and `tile_table` (the torch code they replace) entry for entry, with empty experts."""
    g = torch.Generator().manual_seed(E * N + K)
    ids = torch.randint(0, max(1, E - 3), (N, K), generator=g).to(DEV)  # the last experts empty
    plan = GG.ExpertPlan(ids, E)
    order, counts, ends = GG.sort_by_expert(ids, E)
    assert torch.equal(plan.order, order)
    assert torch.equal(plan.ends().to(torch.int64), ends)
    want = GG.tile_table(counts, ends, N * K, block_m)
    got = plan.tiles(block_m)
    for a, b in zip(got, want):
        assert a.dtype == torch.int32 and torch.equal(a, b)
    assert plan.tiles(block_m) is got  # computed once



def skewed_ids(case: str, E: int, N: int, K: int) -> torch.Tensor:
    """int64 [N, K] expert ids routed unevenly: every slot on expert 0 / the last expert /
    one middle expert, or most slots on one expert and the rest on a few (others empty)."""
    g = torch.Generator().manual_seed(N * K + E)
    if case == "first":
        return torch.zeros(N, K, dtype=torch.int64)
    if case == "last":
        return torch.full((N, K), E - 1, dtype=torch.int64)
    if case == "middle":
        return torch.full((N, K), E // 2 + 1, dtype=torch.int64)
    ids = torch.full((N, K), 3, dtype=torch.int64)  # "heavy": 3 holds ~90%, 7 / E-2 the rest
    few = torch.tensor([7, E - 2, 0])[torch.randint(0, 3, (N, K), generator=g)]
    return torch.where(torch.rand(N, K, generator=g) < 0.9, ids, few)


@pytest.mark.parametrize("case,E,N,K,block_m", [
    ("first", 64, 50, 3, 16), ("last", 64, 50, 3, 16), ("middle", 100, 53, 6, 32),
    ("heavy", 256, 201, 6, 16), ("heavy", 60, 111, 3, 16), ("random", 256, 17, 6, 16),
])
def test_expert_tiles_kernel_over_several_programs(case, E, N, K, block_m):
    """`expert_tiles_kernel` with a table of several programs' worth of tiles (NUM_TILES >
    TILES_BLOCK_T) under skewed routing (one expert takes every slot, most experts empty,
    E not a power of two, M not a multiple of block_m, M up to several search steps)
    equals `tile_table` entry for entry."""
    ids = (torch.randint(0, E, (N, K), generator=torch.Generator().manual_seed(E)) if case == "random"
           else skewed_ids(case, E, N, K)).to(DEV)
    M = N * K
    assert M % block_m != 0
    plan = GG.ExpertPlan(ids, E)
    _, counts, ends = GG.sort_by_expert(ids, E)
    want = GG.tile_table(counts, ends, M, block_m)
    assert want[0].numel() > 2 * GG.TILES_BLOCK_T  # at least three programs
    got = plan.tiles(block_m)
    for a, b in zip(got, want):
        assert a.dtype == torch.int32 and torch.equal(a, b)


def test_search_steps_bound():
    """`_search_steps` is enough for the R-ary search: sizes M -> cdiv(M, R) - 1 -> ... 0."""
    assert [GG._search_steps(M, 8) for M in (1, 2, 8, 9, 72, 3072, 3078)] == [1, 1, 1, 2, 2, 4, 4]


def moe_case(N: int, seed: int, H: int = 64, E: int = 8, F: int = 32, K: int = 3) -> dict:
    """A small MoE layer with bf16 weights: x, ids, weights, stacked and shared experts."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return [(torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16).to(DEV)]

    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(DEV)
    return {"x": (torch.randn(N, H, generator=g)).to(torch.bfloat16).to(DEV), "ids": ids,
            "weights": torch.rand(N, K, generator=g).to(DEV), "gate": w(E, F, H), "up": w(E, F, H),
            "down": w(E, H, F), "sg": w(F, H), "su": w(F, H), "sd": w(H, F)}


def test_down_combine_reuses_the_gate_up_plan(monkeypatch):
    """`moe_down_combine(h, ids)` right after `moe_gate_up` returned h for those ids sorts
    nothing; other ids, or another h, get a fresh plan; results equal a fresh plan's."""
    made = []
    real = GG.ExpertPlan.__init__

    def counting(self, ids, E):
        made.append(ids)
        real(self, ids, E)

    monkeypatch.setattr(GG.ExpertPlan, "__init__", counting)
    impl = "triton"
    c = moe_case(9, seed=3)
    x, ids = c["x"], c["ids"]
    h = GG.moe_gate_up(x, ids, c["gate"], c["up"], c["sg"], c["su"], impl=impl)
    y = GG.moe_down_combine(h, ids, c["weights"], c["down"], c["sd"], impl=impl)
    assert len(made) == 1
    h2 = h.clone()  # not the tensor gate_up returned: sorts again
    y2 = GG.moe_down_combine(h2, ids, c["weights"], c["down"], c["sd"], impl=impl)
    assert len(made) == 2 and same_bits(y, y2)
    ids2 = ids.clone()
    GG.moe_down_combine(h, ids2, c["weights"], c["down"], c["sd"], impl=impl)
    assert len(made) == 3


def test_gate_up_plan_is_not_reused_after_ids_change_in_place():
    c = moe_case(9, seed=4)
    x, ids = c["x"], c["ids"].clone()
    h = GG.moe_gate_up(x, ids, c["gate"], c["up"], c["sg"], c["su"], impl="triton")
    plan = GG._LAST_PLAN[0][3]
    ids[0] = ids[1]  # in place, outside inference mode: the version counter moves
    assert GG._expert_plan(ids, plan.E, h) is not plan


# Per-layer aten ops of one prefill chunk (tiny builds, GPU choices; `scripts/prefill_op_count.py`):
# before this change 85 / 67 (dense sliding / full) and 180 / 162 (NVFP4 MoE sliding / full),
# 127 / 109 (BF16 MoE through grouped_mm; 94 / 82 after it; the Triton grouped GEMM that
# "auto" now picks for BF16 too: 79 / 67); 66 / 54 and 79 / 67 before the Triton norms and
# elementwise kernels of `flintc.kernels.prefill_norm` and `fuse_add_rms_norm`: 14 / 14 and
# 24 / 24 (what is left: the GEMMs' casts or NVFP4 scale products, the router's ops).
MAX_ATEN_OPS = {"nvfp4": {0: 14, 1: 14, 2: 24, 3: 24}, "bf16": {0: 14, 1: 14, 2: 24, 3: 24}}
# Triton launches per layer of the norms and elementwise ops (prefill_norm): layer 0 has the
# input norm of the embedding; dense layers a silu_mul, MoE layers the shared expert's
# silu_mul and the combine.
NORM_LAUNCHES = {0: 5, 1: 4, 2: 5, 3: 5}


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_prefill_chunk_aten_op_count_does_not_grow(fmt, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("counts the CPU build's function")
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.runtime.build import BuildOptions, compile_model
    from flintc.runtime.compiled import load_build
    from flintc.runtime.opcount import count_step_ops

    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt=fmt, progress=False)
    compile_model(ckpt, tmp_path / fmt, BuildOptions(max_batch=1, decode_buckets=(1,), max_model_len=48,
                                                     backend="triton", device="cpu", check=False, dump=False),
                  progress=False, log=lambda m: None)
    runner = load_build(tmp_path / fmt, ckpt=ckpt, progress=False)
    counts = count_step_ops(runner, f"prefill_t{runner.prefill_chunk}")
    got = {layer: counts.layer_total(layer) for layer in MAX_ATEN_OPS[fmt]}
    assert all(got[x] <= n for x, n in MAX_ATEN_OPS[fmt].items()), (got, MAX_ATEN_OPS[fmt])
    norm_kernels = {f"triton.{k}" for k in ("rms_norm_kernel", "qk_norm_rope_kernel",
                                            "expert_combine_kernel", "silu_mul_kernel")}
    launches = {layer: sum(n for (_, op), n in counts.by_layer[layer].items() if op in norm_kernels)
                for layer in NORM_LAUNCHES}
    assert launches == NORM_LAUNCHES
    # every residual add runs inside add_rms_norm: the function calls no aten add or cast
    callers = {caller for c in counts.by_layer.values() for caller, _ in c}
    assert not callers & {"aten.add", "aten._to_copy"}, callers
    # one sort per MoE layer for the experts (plus the router's), none in down_combine
    moe = counts.by_layer[2]
    assert moe.get(("K.moe_gate_up", "aten.sort")) == 1 and ("K.moe_down_combine", "aten.sort") not in moe
