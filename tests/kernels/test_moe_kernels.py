"""`flintc.kernels.moe` against the reference ops (`torch.ops.flintc.*`, FLINT_SPEC 2-3).

CPU: the Triton interpreter at the tiny config's shapes (H=128, F=64, E=16, top-6) with
N in {1, 3, 8}, BF16 and NVFP4 weights (unit scalar global scales, and non-unit per-expert
ones), fresh random inputs, every kernel output poisoned before the launch (the launchers
allocate with torch.empty, which the tests replace by a NaN / -7 filler), and router
logits crafted to hold exact ties at the top-k boundary (the lower expert index must win).
GPU (`gpu` marker): the same checks at the model's shapes, PDL on and off.

Agreement expected (see the kernel module's doc): ids exactly; routing weights to a few
fp32 ulps (torch's sigmoid and 6-term sum differ from any Triton formula by an ulp); fp32
logits to the dot-product reordering bound; bf16 outputs bit-identical except where a
reordered fp32 sum or an ulp-different sigmoid/rsqrt lands on the other side of a bf16
rounding boundary: at most 2 bf16 ulps there, in a small share of elements. Each check
reports the share of differing elements and the largest difference.
"""

from __future__ import annotations

import os

# The interpreter must be chosen before triton decorates any kernel (no GPU in CI).
if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the MoE kernels need it")

import flintc.ops  # noqa: E402,F401  (registers torch.ops.flintc)
from flintc.kernels import moe as K  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
TOP_K = 6
SCALING = 2.5
EPS = 1e-5
TINY = dict(H=128, F=64, E=16)
FULL = dict(H=2048, F=512, E=256)
FMTS = ["bf16", "nvfp4", "nvfp4_gs"]  # nvfp4: unit global scales; _gs: non-unit ([E] / [])


# ----------------------------------------------------------------------------- inputs
def make_weight(shape, fmt: str, gen: torch.Generator, device=DEV) -> list[torch.Tensor]:
    """Fresh random weights [(E,) R, C]: bf16 N(0, 0.05^2), or NVFP4 with uniformly random
    codes (all 16, -0 included) and E4M3 block scales from 2^-9 (subnormal) to 2.0."""
    if fmt == "bf16":
        return [(torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16).to(device)]
    *lead, R, C = shape
    codes = torch.randint(0, 256, (*lead, R, C // 2), generator=gen, dtype=torch.int32)
    scale_bytes = torch.randint(1, 0x40, (*lead, R, C // 16), generator=gen, dtype=torch.int32)
    scales = scale_bytes.to(torch.uint8).view(torch.float8_e4m3fn)
    if fmt == "nvfp4_gs":
        gs = (0.5 + torch.rand(tuple(lead), generator=gen)) * 0.02  # [E] or [] non-unit
    else:
        gs = torch.ones(tuple(lead))  # unit: what a GGUF without `X.scale` loads as
    return [codes.to(torch.uint8).to(device), scales.contiguous().to(device),
            gs.to(torch.float32).to(device)]


def make_moe(cfg: dict, fmt: str, gen: torch.Generator):
    H, F, E = cfg["H"], cfg["F"], cfg["E"]
    return dict(gate=make_weight((E, F, H), fmt, gen), up=make_weight((E, F, H), fmt, gen),
                down=make_weight((E, H, F), fmt, gen), sg=make_weight((F, H), fmt, gen),
                su=make_weight((F, H), fmt, gen), sd=make_weight((H, F), fmt, gen))


def tied_logits(N: int, E: int, gen: torch.Generator):
    """Random logits [N, E] and bias [E] (bias[e] == bias[e + E/2]) where every token has an
    exact tie in `sigmoid(logit) + bias` on its top-k boundary: a pair (e, e + E/2) outside
    the token's top K-1 gets one common logit whose key lies between the (K-1)-th and the
    K-th key, so the pair takes ranks K and K+1 and only the lower index may be selected.
    Returns (logits, bias, pairs [(lo, hi)])."""
    half = E // 2
    b = torch.randn(half, generator=gen) * 0.05
    bias = torch.cat([b, b])
    logits = torch.randn(N, E, generator=gen)
    pairs = []
    for n in range(N):
        key = torch.sigmoid(logits[n]) + bias
        order = torch.sort(key, descending=True, stable=True).indices.tolist()
        top = set(order[:TOP_K - 1])
        target = 0.5 * (key[order[TOP_K - 2]] + key[order[TOP_K - 1]])
        for lo in range(half):
            q = float(target - bias[lo])
            if lo in top or lo + half in top or not 0.01 < q < 0.99:
                continue
            logits[n, lo] = logits[n, lo + half] = torch.logit(torch.tensor(q))
            pairs.append((lo, lo + half))
            break
        else:
            raise AssertionError(f"token {n}: no pair to tie")
    return logits.to(DEV), bias.to(DEV), pairs


@pytest.fixture
def poison(monkeypatch):
    """Make torch.empty return NaN-filled floats and -7-filled integers inside the kernel
    launchers, so that any output element a kernel fails to write is caught."""
    orig = torch.empty

    def empty(*size, **kw):
        t = orig(*size, **kw)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-7)
        return t

    class Poison:
        def __enter__(self):
            monkeypatch.setattr(torch, "empty", empty)

        def __exit__(self, *exc):
            monkeypatch.setattr(torch, "empty", orig)

    return Poison()


def ref(name):
    return getattr(torch.ops.flintc, name)


# ----------------------------------------------------------------------------- checks
def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of the bf16 grid at |v| (8 significant bits), floored at the smallest normal."""
    _, e = torch.frexp(v.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), e - 8)


def assert_bf16_close(name: str, out: torch.Tensor, expect: torch.Tensor, max_share: float = 0.05,
                      ulps: int = 2):
    """bf16 `out` equals `expect` except in at most `max_share` of the elements, which may
    differ by `ulps` bf16 ulps of the larger magnitude, or (where the sum cancels) by
    `ulps` ulps of the tensor's RMS. Reports share and max difference."""
    assert out.dtype == torch.bfloat16 and out.shape == expect.shape, (out.shape, expect.shape)
    o, r = out.float().cpu(), expect.float().cpu()
    assert torch.isfinite(o).all(), f"{name}: {(~torch.isfinite(o)).sum()} non-finite (unwritten?)"
    diff = (o - r).abs()
    floor = ulps * bf16_ulp(r.pow(2).mean().sqrt())
    tol = torch.maximum(ulps * torch.maximum(bf16_ulp(o), bf16_ulp(r)), floor)
    share = (o != r).float().mean().item()
    msg = (f"{name}: {share:.3%} of {o.numel()} elements differ, max diff {diff.max().item():.3g}, "
           f"max diff / tolerance {(diff / tol).max().item():.2f}")
    print(msg)
    assert bool((diff <= tol).all()), msg
    assert share <= max_share, msg


def assert_fp32_close(name: str, out, expect, rel: float):
    o, r = out.double().cpu(), expect.double().cpu()
    assert torch.isfinite(o).all(), f"{name}: non-finite outputs (unwritten?)"
    diff = (o - r).abs()
    scale = r.abs().max().clamp(min=1e-30)
    share = (out.cpu() != expect.cpu()).float().mean().item()
    msg = (f"{name}: {share:.2%} of {o.numel()} differ, max diff {diff.max().item():.3g} "
           f"(relative to max |ref| {(diff.max() / scale).item():.3g}, allowed {rel:.3g})")
    print(msg)
    assert bool((diff <= rel * scale).all()), msg


def check_routing(ids, wts, ref_ids, ref_wts, pairs=None):
    """ids exact; weights within 8 fp32 ulps (relative 2^-21); crafted ties resolved low."""
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32
    same = (ids.cpu() == ref_ids.cpu())
    assert bool(same.all()), (f"ids differ in {(~same).float().mean().item():.1%}: "
                              f"{ids.cpu().tolist()} vs {ref_ids.cpu().tolist()}")
    w, rw = wts.double().cpu(), ref_wts.double().cpu()
    rel = ((w - rw).abs() / rw.abs()).max().item()
    share = (wts.cpu() != ref_wts.cpu()).float().mean().item()
    print(f"routing weights: {share:.1%} differ, max relative diff {rel:.3g}")
    assert rel <= 2.0**-21, f"routing weights: max relative diff {rel:.3g} > 2^-21"
    if pairs is not None:  # the tie test must have teeth: some tie straddles the boundary
        for n, (lo, hi) in enumerate(pairs):
            row = ref_ids[n].tolist()
            assert lo in row and hi not in row, f"token {n}: the crafted tie {lo}/{hi} is not on the boundary"


# ----------------------------------------------------------------------------- CPU twins
@pytest.mark.parametrize("N", [1, 3, 8])
def test_norm_router(N, poison):
    gen = torch.Generator().manual_seed(100 + N)
    H, E = TINY["H"], TINY["E"]
    x = torch.randn(N, 1, H, generator=gen).to(torch.bfloat16).to(DEV)  # [B, T, H] input
    norm = (1 + 0.1 * torch.randn(H, generator=gen)).to(DEV)
    router = (torch.randn(E, H, generator=gen) * 0.1).to(torch.bfloat16).to(DEV)
    with poison:
        h, logits = K.norm_router(x, norm, router, EPS)
    rh, rl = ref("norm_router")(x, norm, router, EPS)
    assert_bf16_close("normed x", h, rh, max_share=0.02, ulps=1)
    assert logits.dtype == torch.float32 and logits.shape == (N, E)
    assert_fp32_close("logits", logits, rl, rel=H * 2.0**-24)


# Configurations beyond the interpreter's default (one program per expert and row block,
# one K step): several K steps, split-K with the last-arriving combine, the register
# prefetch, the FMA reduction with and without the per-block scale.
CPU_CONFIGS = [
    K.MoeConfig(block_rows=128, block_k=32, split=2, use_dot=True, prefetch=True),
    K.MoeConfig(block_rows=128, block_k=32, split=2, use_dot=False, scale_after=True),
    K.MoeConfig(block_rows=64, block_k=64, split=1, use_dot=False, prefetch=True),
    # one-step (`one_step_configs`): gate/up K = 128 in 2 splits of one 64-wide step; down
    # F = 64 in one step
    K.MoeConfig(block_rows=16, block_k=64, split=2, use_dot=True, num_stages=1, prefetch=True),
    # FMA with the whole-tile accumulator (acc_full), split-K and several K steps
    K.MoeConfig(block_rows=32, block_k=32, split=2, use_dot=False, num_stages=1, prefetch=True,
                acc_full=True),
    # tensor cores over 2-D tiles in K order (flat), split-K and several K steps; prefetch
    # is ignored there
    K.MoeConfig(block_rows=16, block_k=32, split=2, use_dot=True, num_stages=1, prefetch=True,
                flat=True),
    # the swapped dot (weight tile on the left, accumulator [rows, N]): 3-D tiles with the
    # register prefetch, and 2-D tiles with split-K
    K.MoeConfig(block_rows=32, block_k=32, split=1, use_dot=True, prefetch=True, swap=True),
    K.MoeConfig(block_rows=16, block_k=32, split=2, use_dot=True, num_stages=1, flat=True,
                swap=True),
    # a register cap (a GPU compile option; the launcher must accept it and the
    # interpreter ignore it)
    K.MoeConfig(block_rows=16, block_k=32, split=2, use_dot=True, num_stages=1, flat=True,
                maxnreg=128),
    # the down kernel's weight tiles with the row pointers built after the shared / routed
    # branch (STAGE_W) and inside it, whatever the format's default
    K.MoeConfig(block_rows=16, block_k=32, split=2, use_dot=True, num_stages=1, flat=True,
                stage_w=True),
    K.MoeConfig(block_rows=16, block_k=32, split=2, use_dot=True, num_stages=1, flat=True,
                stage_w=False),
]


@pytest.mark.parametrize("fmt,N", [("bf16", 1), ("bf16", 8), ("nvfp4_gs", 3), ("nvfp4_gs", 8),
                                   ("nvfp4", 1)])
def test_moe_topk_gate_up_and_down(fmt, N, poison):
    """Kernels 6 and 7 on the same random layer; kernel 7 is fed the reference's h / ids /
    weights so that each kernel is judged on its own."""
    _check_gate_up_and_down(fmt, N, None, poison, seed=1000 * N + FMTS.index(fmt))


@pytest.mark.parametrize("cfg", range(len(CPU_CONFIGS)))
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
def test_moe_configs(fmt, cfg, poison):
    """The same checks under other launch configurations (N = 2)."""
    _check_gate_up_and_down(fmt, 2, CPU_CONFIGS[cfg], poison, seed=300 + 10 * cfg + FMTS.index(fmt))


# Ragged splits (NVFP4 rows are multiples of 64, so steps of 128): H = 320 and F = 192
# with block_k 128 and 2 splits: gate/up's split 0 makes 2 steps and its split 1 a single
# half-masked one (64 of 128 columns), down's split 1 likewise; the flat loops' next-step
# scale loads run past each split's end. The swapped dot on 2-D tiles (with the scale
# prefetch) and on 3-D tiles with the register prefetch.
TAIL_SHAPES = {"H": 320, "F": 192, "E": 16}
TAIL_CONFIGS = [
    K.MoeConfig(block_rows=64, block_k=128, split=2, use_dot=True, num_stages=1, flat=True,
                swap=True),
    K.MoeConfig(block_rows=64, block_k=128, split=2, use_dot=True, prefetch=True, swap=True),
]


@pytest.mark.parametrize("cfg", range(len(TAIL_CONFIGS)))
def test_swap_nvfp4_split_tails(cfg, poison):
    """NVFP4 (non-unit global scales) gate/up and down at TAIL_SHAPES, N = 2."""
    c = TAIL_CONFIGS[cfg]
    for red in (TAIL_SHAPES["H"], TAIL_SHAPES["F"]):
        split, per = K._effective_split(red, c.block_k, c.split)
        assert split == 2 and 0 < red - per < per and red % c.block_k  # a short, ragged last split
    _check_gate_up_and_down("nvfp4_gs", 2, c, poison, seed=900 + cfg, shapes=TAIL_SHAPES)


def test_counters_left_zero():
    """Split-K / combine counters are zero after the launches (the next launch relies on
    it), and a repeated call gives the same bits (deterministic combine order)."""
    from flintc.kernels.gemv import split_k_counters

    gen = torch.Generator().manual_seed(9)
    w = make_moe(TINY, "bf16", gen)
    N, F = 1, TINY["F"]
    cfg = CPU_CONFIGS[0]
    h = torch.randn(N, TOP_K + 1, F, generator=gen).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(TINY["E"], generator=gen)[:TOP_K] for _ in range(N)]).to(DEV)
    wts = torch.rand(N, TOP_K, generator=gen).to(DEV)
    a = K.moe_down_combine(h, ids, wts, w["down"], w["sd"], config=cfg)
    b = K.moe_down_combine(h, ids, wts, w["down"], w["sd"], config=cfg)
    assert torch.equal(a, b)
    assert_bf16_close("moe_down_combine (random ids)", a,
                      ref("moe_down_combine")(h, ids, wts, w["down"], w["sd"]))
    assert int(split_k_counters(torch.device(DEV), 1).abs().sum()) == 0


def _check_gate_up_and_down(fmt, N, cfg, poison, seed, shapes=TINY):
    gen = torch.Generator().manual_seed(seed)
    H, F, E = shapes["H"], shapes["F"], shapes["E"]
    w = make_moe(shapes, fmt, gen)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(DEV)
    logits, bias, pairs = tied_logits(N, E, gen)
    with poison:
        h, wts, ids = K.moe_topk_gate_up(x, logits, bias, w["gate"], w["up"], w["sg"], w["su"],
                                         TOP_K, SCALING, config=cfg)
    rh, rw, rids = ref("moe_topk_gate_up")(x, logits, bias, w["gate"], w["up"], w["sg"], w["su"],
                                           TOP_K, SCALING)
    check_routing(ids, wts, rids, rw, pairs)
    assert h.shape == (N, TOP_K + 1, F)
    assert_bf16_close(f"h ({fmt}, N={N}, {cfg and cfg.short()})", h, rh)
    if fmt == "nvfp4":
        # A scalar [] global scale for stacked experts (allowed by NVFP4Tensor; the reference's
        # expert gather cannot index it) must give the same bits as ones [E].
        one = torch.tensor(1.0, device=DEV)
        h1, _, _ = K.moe_topk_gate_up(x, logits, bias, w["gate"][:2] + [one], w["up"][:2] + [one],
                                      w["sg"], w["su"], TOP_K, SCALING, config=cfg)
        assert torch.equal(h1, h), "scalar and per-expert unit global scales disagree"

    residual = torch.randn(N, 1, H, generator=gen).to(torch.bfloat16).to(DEV)
    with poison:
        out = K.moe_down_combine_residual(rh, rids, rw, w["down"], w["sd"], residual, config=cfg)
    expect = ref("moe_down_combine_residual")(rh, rids, rw, w["down"], w["sd"], residual)
    assert out.shape == residual.shape
    assert_bf16_close(f"down+combine+residual ({fmt}, N={N}, {cfg and cfg.short()})", out, expect)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
def test_unfused_ops(fmt, poison):
    """moe_route (two launches), moe_gate_up (ids from memory), moe_down_combine."""
    N = 3
    gen = torch.Generator().manual_seed(77 + FMTS.index(fmt))
    H, E = TINY["H"], TINY["E"]
    w = make_moe(TINY, fmt, gen)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(DEV)
    router = (torch.randn(E, H, generator=gen) * 0.1).to(torch.bfloat16).to(DEV)
    bias = (torch.randn(E, generator=gen) * 0.05).to(DEV)
    with poison:
        wts, ids = K.moe_route(x, router, bias, TOP_K, SCALING)
    rw, rids = ref("moe_route")(x, router, bias, TOP_K, SCALING)
    check_routing(ids, wts, rids, rw)
    with poison:
        h = K.moe_gate_up(x, rids, w["gate"], w["up"], w["sg"], w["su"])
    rh = ref("moe_gate_up")(x, rids, w["gate"], w["up"], w["sg"], w["su"])
    assert_bf16_close(f"moe_gate_up ({fmt})", h, rh)
    with poison:
        m = K.moe_down_combine(rh, rids, rw, w["down"], w["sd"])
    rm = ref("moe_down_combine")(rh, rids, rw, w["down"], w["sd"])
    assert_bf16_close(f"moe_down_combine ({fmt})", m, rm)


@pytest.mark.parametrize("N,E", [
    (37, TINY["E"]), (5, 256),
    pytest.param(4096, 256, marks=[pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA")]),
])
def test_route_topk_rows(N, E):
    """`route_topk_rows` (the prefill chunk's selection on CUDA, one launch for any N:
    here 37 tokens over 3 programs of 16, the full model's 256 experts, and on the GPU a
    4,096-token chunk; the CPU cases are its twins) against
    `select_topk`: ids exact with a crafted tie at every token's top-k boundary (the lower
    index wins), weights within 8 fp32 ulps; N = 0; bad arguments named."""
    from flintc.model.ops import select_topk

    gen = torch.Generator().manual_seed(N + E)
    logits, bias, pairs = tied_logits(N, E, gen)
    wts, ids = K.route_topk_rows(logits, bias, TOP_K, SCALING)
    rw, rids = select_topk(logits.cpu(), bias.cpu(), TOP_K, SCALING)
    check_routing(ids, wts, rids, rw, pairs)
    w0, i0 = K.route_topk_rows(logits[:0].contiguous(), bias, TOP_K, SCALING)
    assert w0.shape == (0, TOP_K) and i0.shape == (0, TOP_K)
    for name, call in (("logits", lambda: K.route_topk_rows(logits.double(), bias, TOP_K, 1.0)),
                       ("bias", lambda: K.route_topk_rows(logits, bias[:3], TOP_K, 1.0)),
                       ("top_k", lambda: K.route_topk_rows(logits, bias, E + 1, 1.0))):
        with pytest.raises(ValueError, match=name):
            call()


def test_kernels_table_matches_ops():
    """KERNELS maps each op name to a launcher (the runtime looks them up by name)."""
    assert set(K.KERNELS) == {"norm_router", "moe_topk_gate_up", "moe_down_combine_residual",
                              "moe_route", "moe_gate_up", "moe_down_combine"}
    for name in K.KERNELS:
        assert hasattr(torch.ops.flintc, name), name


def _bad_calls():
    H, F, E = 128, 64, 16
    x = torch.zeros(2, H, dtype=torch.bfloat16)
    g = [torch.zeros(E, F, H, dtype=torch.bfloat16)]
    s = [torch.zeros(F, H, dtype=torch.bfloat16)]
    lg, b = torch.zeros(2, E), torch.zeros(E)
    h = torch.zeros(2, TOP_K + 1, F, dtype=torch.bfloat16)
    ids, wts = torch.zeros(2, TOP_K, dtype=torch.int64), torch.zeros(2, TOP_K)
    d, sd = [torch.zeros(E, H, F, dtype=torch.bfloat16)], [torch.zeros(H, F, dtype=torch.bfloat16)]
    res = torch.zeros(2, H, dtype=torch.bfloat16)
    nv = make_weight((E, F, H), "nvfp4_gs", torch.Generator().manual_seed(0), "cpu")
    gu = K.moe_topk_gate_up
    return [
        ("x", lambda: K.norm_router(x.float(), torch.ones(H), torch.zeros(E, H, dtype=torch.bfloat16), EPS)),
        ("norm", lambda: K.norm_router(x, torch.ones(H + 1), torch.zeros(E, H, dtype=torch.bfloat16), EPS)),
        ("router", lambda: K.norm_router(x, torch.ones(H), torch.zeros(E, H), EPS)),
        ("x", lambda: gu(x.t(), lg, b, g, g, s, s, TOP_K, SCALING)),
        ("logits", lambda: gu(x, lg.double(), b, g, g, s, s, TOP_K, SCALING)),
        ("bias", lambda: gu(x, lg, b[:3], g, g, s, s, TOP_K, SCALING)),
        ("gate", lambda: gu(x, lg, b, g[0], g, s, s, TOP_K, SCALING)),
        (r"up\[0\]", lambda: gu(x, lg, b, g, [g[0][:, :32]], s, s, TOP_K, SCALING)),
        ("up", lambda: gu(x, lg, b, nv, g, s, s, TOP_K, SCALING)),
        (r"gate\[2\]", lambda: gu(x, lg, b, [nv[0], nv[1], nv[2][:3]], nv, s, s, TOP_K, SCALING)),
        (r"shared_gate\[0\]", lambda: gu(x, lg, b, g, g, [s[0][:, :64]], s, TOP_K, SCALING)),
        ("shared_up", lambda: gu(x, lg, b, g, g, s, [], TOP_K, SCALING)),
        ("ids", lambda: K.moe_gate_up(x, ids.int(), g, g, s, s)),
        ("h", lambda: K.moe_down_combine_residual(h[:, :TOP_K], ids, wts, d, sd, res)),
        ("weights", lambda: K.moe_down_combine_residual(h, ids, wts.half(), d, sd, res)),
        (r"down\[0\]", lambda: K.moe_down_combine_residual(h, ids, wts, [d[0][..., :32]], sd, res)),
        ("residual", lambda: K.moe_down_combine_residual(h, ids, wts, d, sd, res.float())),
        ("residual", lambda: K.moe_down_combine_residual(h, ids, wts, d, sd, res[:, :64].contiguous())),
        ("config", lambda: gu(x, lg, b, g, g, s, s, TOP_K, SCALING,
                              config=K.MoeConfig(block_rows=8, use_dot=True))),
        ("config", lambda: K.moe_down_combine(h, ids, wts, d, sd, config=K.MoeConfig(block_k=48))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_launchers_reject_bad_inputs(case):
    name, call = _bad_calls()[case]
    with pytest.raises(ValueError, match=rf": {name}"):
        call()


# ----------------------------------------------------------------------------- GPU, full shapes
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs", "nvfp4"])
@pytest.mark.parametrize("N", [1, 2, 4, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_moe_kernels_full_shapes_gpu(N, fmt, use_pdl, poison):
    """Kernels 5, 6, 7 at H=2048, F=512, E=256, top-6; each fed the reference's inputs."""
    if fmt == "nvfp4" and use_pdl:
        pytest.skip("unit global scales: PDL covered by nvfp4_gs")
    gen = torch.Generator().manual_seed(5000 + 10 * N + FMTS.index(fmt))
    H, E = FULL["H"], FULL["E"]
    w = make_moe(FULL, fmt, gen)
    x = torch.randn(N, 1, H, generator=gen).to(torch.bfloat16).to(DEV)
    norm = (1 + 0.1 * torch.randn(H, generator=gen)).to(DEV)
    router = (torch.randn(E, H, generator=gen) * 0.02).to(torch.bfloat16).to(DEV)
    with poison:
        xn, logits = K.norm_router(x, norm, router, EPS, use_pdl=use_pdl)
    rxn, rlogits = ref("norm_router")(x, norm, router, EPS)
    torch.cuda.synchronize()
    assert_bf16_close("normed x", xn, rxn, max_share=0.02, ulps=1)
    assert_fp32_close("logits", logits, rlogits, rel=64 * 2.0**-24)

    tl_logits, bias, pairs = tied_logits(N, E, gen)
    with poison:
        h, wts, ids = K.moe_topk_gate_up(rxn, tl_logits, bias, w["gate"], w["up"], w["sg"],
                                         w["su"], TOP_K, SCALING, use_pdl=use_pdl)
    rh, rw, rids = ref("moe_topk_gate_up")(rxn, tl_logits, bias, w["gate"], w["up"], w["sg"],
                                           w["su"], TOP_K, SCALING)
    torch.cuda.synchronize()
    check_routing(ids, wts, rids, rw, pairs)
    assert_bf16_close(f"h ({fmt}, N={N})", h, rh)

    with poison:
        out = K.moe_down_combine_residual(rh, rids, rw, w["down"], w["sd"], x,
                                          use_pdl=use_pdl)
    expect = ref("moe_down_combine_residual")(rh, rids, rw, w["down"], w["sd"], x)
    torch.cuda.synchronize()
    assert_bf16_close(f"down+combine+residual ({fmt}, N={N})", out, expect)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.parametrize("families", ["base+swap", "maxnreg", "stage"])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_sweep_configs_full_shapes_gpu(families, N, fmt):
    """Every configuration `benchmarks/bench_moe.py` may pick (`K.sweep_configs`) gives the
    reference's results at the model's shapes, with PDL (CPU twin: test_moe_configs).
    `families` "base+swap": the "all" family at N = 1 (the one-step family only there,
    where its sweeps ran; it keeps the GPU run short) or "classic", then the "swap"
    family's new candidates; "maxnreg" / "stage": that family alone (register caps; the
    down kernel's weight tiles staged or not)."""
    gen = torch.Generator().manual_seed(7000 + 10 * N + FMTS.index(fmt))
    H, F, E = FULL["H"], FULL["F"], FULL["E"]
    w = make_moe(FULL, fmt, gen)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(DEV)
    logits, bias, pairs = tied_logits(N, E, gen)
    rh, rw, rids = ref("moe_topk_gate_up")(x, logits, bias, w["gate"], w["up"], w["sg"], w["su"],
                                           TOP_K, SCALING)
    residual = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(DEV)
    expect = ref("moe_down_combine_residual")(rh, rids, rw, w["down"], w["sd"], residual)
    kind = "nvfp4" if fmt.startswith("nvfp4") else "bf16"
    dev = torch.device(DEV)
    family = "all" if N == 1 else "classic"

    def cands(kernel, rows, red):
        if families in ("maxnreg", "stage"):
            return K.sweep_configs(kernel, kind, N, rows, red, N * TOP_K + 1, dev, family=families)
        out = K.sweep_configs(kernel, kind, N, rows, red, N * TOP_K + 1, dev, family=family)
        more = K.sweep_configs(kernel, kind, N, rows, red, N * TOP_K + 1, dev, family="swap")
        return out + [c for c in more if c not in out]

    for cfg in cands("gate_up", F, H):
        h, wts, ids = K.moe_topk_gate_up(x, logits, bias, w["gate"], w["up"], w["sg"], w["su"],
                                         TOP_K, SCALING, use_pdl=True, config=cfg)
        torch.cuda.synchronize()
        check_routing(ids, wts, rids, rw, pairs)
        assert_bf16_close(f"h ({fmt}, N={N}, {cfg.short()})", h, rh)
    for cfg in cands("down", H, F):
        for _ in range(2):  # the second call checks that the counters were left at zero
            out = K.moe_down_combine_residual(rh, rids, rw, w["down"], w["sd"], residual,
                                              use_pdl=True, config=cfg)
            torch.cuda.synchronize()
            assert_bf16_close(f"down ({fmt}, N={N}, {cfg.short()})", out, expect)


@pytest.mark.parametrize("fmt,N", [("nvfp4", 8), ("bf16", 1), ("nvfp4", 1)])
def test_stage_sweep_family(fmt, N):
    """The "stage" sweep family: the rule's choice, then (down kernel only) its flat twin
    with the weight tiles staged and unstaged (`MoeConfig.stage_w`), no duplicates; the
    launcher's STAGE_W follows stage_w, or the format when it is None."""
    dev = torch.device("cpu")
    H, F = FULL["H"], FULL["F"]
    base_d = K.choose_config("down", fmt, N, H, F, N * TOP_K + 1, dev)
    down = K.sweep_configs("down", fmt, N, H, F, N * TOP_K + 1, dev, family="stage")
    assert down[0] == base_d and len(down) == len(set(down)) == 3
    assert {c.stage_w for c in down[1:]} == {True, False}
    assert all(c.flat and c.use_dot and c.block_rows == base_d.block_rows for c in down[1:])
    assert K.sweep_configs("gate_up", fmt, N, F, H, N * TOP_K + 1, dev, family="stage") == [
        K.choose_config("gate_up", fmt, N, F, H, N * TOP_K + 1, dev)]
    assert "stw" in down[1].short() and "nostw" in down[2].short()
