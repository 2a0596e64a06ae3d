"""Token sampling (FLINT_SPEC section 6): temperature, then top-k, then top-p on the
renormalised distribution; temperature 0 is greedy. Runs on the logits' device.

Defaults are Flint's: temperature 1.0, top-p 0.95, top-k 20. Each request may carry
a seed; a seeded request draws from its own `torch.Generator`, so its tokens do
not depend on what else is in the batch.

Ties: tokens with equal logits are kept or dropped together. Top-k keeps every token
whose logit is at least the k-th largest (as vLLM's top-k mask does); top-p drops a
token when the probability mass of the tokens with a strictly larger logit reaches
top_p, so no token is preferred to an equal one for its id. `sampling_probs` is this
definition over the whole vocabulary (with a sort for top-p); `sample` draws from it
without building it when top-k is on (`_top_k_scores`: the k candidates and the k-th
logit's ties as one group, a Gumbel-max draw), which on an H200 cut the default
sampler from ~230 us of device time in 79 kernels per step at batch 1 (~750 us in
204 at batch 8: softmax, sort and cumsum over 151,552 logits, then
`torch.multinomial` per row) to far less (docs/gpu-runs.md, session 18).

On CUDA the default (`FLINTC_SAMPLER` unset or `triton`) draws in one launch instead
(`flintc.kernels.sampler`: the same distribution, Gumbel-max over per-token Philox
uniforms keyed by the request's generator seed and offset), for the rows with
1 <= top_k <= 64 < V (each row decided on its own settings, so a seeded row's tokens
still do not depend on the batch; a batch of only such rows and greedy ones is one
launch); the other rows, the CPU, and `FLINTC_SAMPLER=torch` take the path above.
Written in session 24 without a GPU; session 25's H200 run (`scripts/gpu_sampler_ab.sh`)
made it the default: 0.18 ms per token less at batch 1, 0.13 ms at batch 8.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from flintc.errors import InputError


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
# FLINTC_SAMPLER unset: the one-launch kernel on CUDA (session 25, H200, NVFP4 1K: decode +
# Flint's default sampling + token read 1.984 -> 1.803 ms at batch 1, 3.370 -> 3.237 ms at
# batch 8; docs/gpu-runs.md). On the CPU the torch path runs unless FLINTC_SAMPLER=triton
# is set with Triton's interpreter (tests).
DEFAULT_SAMPLER = "triton"


def sampler_backend() -> str:
    """FLINTC_SAMPLER: "torch" (the torch ops below) or "triton" (one launch,
    `flintc.kernels.sampler`, on CUDA for the batches it takes); unset or empty:
    `DEFAULT_SAMPLER`.

    Raises:
        TuningEnvError (a ValueError): another value, naming the variable.
    """
    from flintc.kernels.tuning import env_choice

    return env_choice("FLINTC_SAMPLER", ("torch", "triton"), DEFAULT_SAMPLER)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature: >= 0; below `GREEDY_TEMPERATURE` (1e-5, vLLM's sampling epsilon) the
        request is greedy (argmax, ties to the lower token id): logits / temperature
        would overflow to inf there.
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    top_p: in (0, 1]; keep the smallest set of most likely tokens whose
        probability (after top-k, renormalised) reaches top_p.
    max_tokens: tokens to generate at most (>= 0); reasoning tokens count.
    seed: seeds this request's generator; None draws from a fresh random seed.
    ignore_eos: keep generating after the end-of-text token.
    """

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 20
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "SamplingParams":
        """Raises InputError naming the field when a value is out of range."""
        t, p, k = self.temperature, self.top_p, self.top_k
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise InputError(f"sampling field 'temperature' must be a finite number >= 0, got {t!r}")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise InputError(f"sampling field 'top_p' must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise InputError(f"sampling field 'top_k' must be an integer >= 1, or 0 / -1 for all, got {k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InputError(f"sampling field 'max_tokens' must be an integer >= 0, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InputError(f"sampling field 'seed' must be an integer in [0, 2**63), got {self.seed!r}")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def make_generator(self, device: torch.device | str) -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def params_per_prompt(params, n: int) -> list["SamplingParams"]:
    """One SamplingParams per prompt: `params` itself repeated n times, or a list / tuple
    of n of them.

    Raises:
        InputError: a list of another length, or an entry that is not a SamplingParams
            (a dict, say), named.
    """
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
    if len(plist) != n:
        raise InputError(f"{len(plist)} SamplingParams for {n} prompts: give one, or one per prompt")
    for i, p in enumerate(plist):
        if not isinstance(p, SamplingParams):
            where = "params" if not isinstance(params, (list, tuple)) else f"params[{i}]"
            raise InputError(f"{where}: expected a flintc.sampling.SamplingParams, got {type(p).__name__}")
    return plist


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from (the definition; `sample` draws from it
    without building it). logits: fp32 (or bf16) [..., V]. Not for greedy.

    x = logits / temperature; top-k keeps every token with x >= the k-th largest x (the
    k-th logit's ties all stay); softmax over the kept tokens; top-p drops a token when
    the mass of the tokens with a strictly larger x reaches top_p (tokens with equal x
    stay or go together; the most likely ones always stay); renormalise. The masses that
    decide top-p are computed and summed in fp64. Cost: softmax, sort and cumsum over V (on an H200 ~0.6 ms of device
    time per call with V = 151,552); `sample` uses it only for top-k off or above
    `MAX_FAST_TOP_K`.

    Returns: fp32 [..., V], zero outside the kept set, summing to 1 per row.
    """
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        # the decision on fp64 masses, as `_top_k_scores` and the sampler kernel take it:
        # fp32 probabilities would move a token whose mass lies within an fp32 ulp of top_p
        sorted_p = torch.softmax(x.double(), dim=-1).gather(-1, order)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass ahead in the sort
        # the mass of the strictly larger x: `before` at the first token of each run of
        # equal x (found by a binary search of the ascending -sorted_x)
        neg = -sorted_x.contiguous()
        # (a NaN logit is found nowhere, i.e. at V: clamped, so a row with NaN gives some
        # token of that row instead of an out-of-bounds gather, a device assert on CUDA)
        first = torch.searchsorted(neg, neg, side="left").clamp_(max=vocab - 1)
        larger = before.gather(-1, first)
        drop = torch.zeros_like(larger, dtype=torch.bool).scatter(-1, order, larger >= params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


MAX_FAST_TOP_K = 256  # `_top_k_scores` does O(k^2) work per row; above this, the sort


def _top_k_scores(x: torch.Tensor, k: int, top_p: float):
    """`sampling_probs`'s distribution for 0 < k < V, without any pass over the vocabulary
    but torch.topk and one comparison with a sum (no softmax, sort or cumsum over V).

    Args:
        x: fp32 [R, V], the logits over the temperature. k: top-k. top_p: in (0, 1].

    Returns (cand, scores, tied):
        cand: int64 [R, k], torch.topk's ids; scores: fp64 [R, k + 1], the log-weights
        (up to a per-row constant) of the k candidates that lie strictly above the k-th
        logit and of the k-th logit's ties as one group (last column; they all share its
        weight), -inf for what top-k or top-p drops; tied: bool [R, V], the k-th logit's
        ties (inside the k or not).

    Every token with a larger logit than the k-th is among the candidates, so the mass
    above a candidate, and the total mass (candidates above the k-th plus n_tied times
    the k-th weight), are sums over k values: O(k^2) work per row.
    """
    vals, cand = torch.topk(x, k, dim=-1)  # [R, k], descending
    vd = vals.double()
    m, kth = vd[:, :1], vd[:, -1:]
    tied = x == vals[:, -1:]  # [R, V]
    n_tied = tied.sum(-1, keepdim=True)  # [R, 1], >= 1
    above = vd > kth  # [R, k]
    e = torch.exp(vd - m) * above  # weights of the candidates above the k-th; 0 for its ties
    e_kth = torch.exp(kth - m)
    mass_above = e.sum(-1, keepdim=True)
    total = mass_above + n_tied * e_kth
    larger = ((vd[:, None, :] > vd[:, :, None]) * e[:, None, :]).sum(-1)  # [R, k] mass of larger x
    keep = above & (larger < top_p * total)
    keep_tied = mass_above < top_p * total  # the ties' larger-x mass is every candidate above
    ninf = float("-inf")  # a Python scalar: a device tensor made from it would be a host-to-device copy
    scores = torch.cat([torch.where(keep, vd - m, ninf),
                        torch.where(keep_tied, torch.log(n_tied.double()) + kth - m, ninf)], dim=-1)
    return cand, scores, tied


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) in fp64 for uniforms u in [0, 1) (u = 0 gives -inf)."""
    return -torch.log(-torch.log(u.double()))


def _draw(x: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """One token per row of x (fp32 [R, V], the logits over the temperature) from
    `sampling_probs`'s distribution, by the Gumbel-max trick (argmax of log-weight plus
    Gumbel noise is a draw from the normalised weights; Gumbel 1954, as in
    Maddison et al. 2014, "A* Sampling"), with uniforms u (fp32 [R, V + k + 1], each row
    from its request's generator). Returns int64 [R]."""
    V = x.shape[-1]
    k = params.top_k
    if 0 < k < V and k <= MAX_FAST_TOP_K:
        cand, scores, tied = _top_k_scores(x, k, params.top_p)
        win = torch.argmax(scores + _gumbel(u[:, :k + 1]), dim=-1)  # [R] in [0, k]
        # the group of ties: each tie equally likely (the largest of independent uniforms)
        tie = torch.argmax(torch.where(tied, u[:, k + 1:k + 1 + V], -1.0), dim=-1)
        pick = cand.gather(-1, win.clamp(max=k - 1)[:, None])[:, 0]
        return torch.where(win == k, tie, pick)
    probs = sampling_probs(x, SamplingParams(temperature=1.0, top_k=k, top_p=params.top_p))
    return torch.argmax(torch.log(probs.double()) + _gumbel(u[:, :V]), dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """Draw one token per row, rows with the same settings batched (one `_draw` per group
    of rows with equal (temperature, top_k, top_p)). Greedy rows take the argmax (ties to
    the lower token id). Each sampled row fills its own V + MAX_FAST_TOP_K + 1 uniforms
    from its own generator (one `uniform_` launch per row, the same count whatever the
    settings), so a seeded request's tokens do not depend on the rest of the batch, at
    any step. A row holding NaN logits gets an unspecified token of that row (no error;
    the other rows are unaffected). No host sync and no host-to-device copy (with
    FLINTC_SAMPLER=triton, the kernel's rows: one asynchronous copy of their settings from
    pinned memory): the launches queue behind the forward pass.

    Args:
        logits: fp32 (or bf16) [B, V].
        params: B `SamplingParams`, one per row.
        generators: B generators on logits' device (None: torch's default generator;
            greedy rows ignore theirs).
    Returns: int64 [B] on logits' device.
    Raises:
        ValueError: logits not [B, V] or lists of another length than B.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError("sample() needs logits [B, V] and one params/generator per row")
    B, V = logits.shape
    if all(p.is_greedy for p in params):
        return torch.argmax(logits, dim=-1)  # first maximum: the lower token id
    # The kernel's rows are chosen row by row (never for the whole batch), so that which
    # way a seeded row goes, and so its tokens, do not depend on the other rows.
    fast = _triton_rows(logits, params, generators) if sampler_backend() == "triton" else []
    if fast and len(fast) == sum(not p.is_greedy for p in params):
        return _sample_triton(logits, params, generators)  # the greedy rows too
    fast_set = set(fast)
    groups: dict[tuple, list[int]] = {}
    for b, p in enumerate(params):
        if b in fast_set:
            continue
        key = ("greedy",) if p.is_greedy else (p.temperature, p.top_k, p.top_p)
        groups.setdefault(key, []).append(b)
    # Every sampled row draws the same number of uniforms whatever its or the other rows'
    # settings, so a seeded request's generator advances alike in any batch.
    u = torch.empty(B, V + MAX_FAST_TOP_K + 1, dtype=torch.float32, device=logits.device)
    out = None if len(groups) == 1 and not fast else torch.empty(B, dtype=torch.long, device=logits.device)
    if fast:
        tok = _sample_triton(_rows(logits, fast), [params[b] for b in fast], [generators[b] for b in fast])
        for j, b in enumerate(fast):
            out[b] = tok[j]
    for key, rows in groups.items():
        x = _rows(logits, rows)
        if key == ("greedy",):
            tok = torch.argmax(x, dim=-1)
        else:
            p = params[rows[0]]
            x = x.float() if p.temperature == 1 else x.float() / p.temperature  # x / 1 == x
            for b in rows:
                u[b].uniform_(generator=generators[b])
            tok = _draw(x, p, _rows(u, rows))
        if out is None:
            return tok
        for j, b in enumerate(rows):
            out[b] = tok[j]
    return out


def _triton_rows(logits: torch.Tensor, params: list[SamplingParams], generators) -> list[int]:
    """The sampled rows `flintc.kernels.sampler` takes, each decided on its own settings
    alone: logits on CUDA (or any device under Triton's interpreter, for tests), the row
    with 1 <= top_k <= its MAX_TOP_K and < V, and a generator whose Philox state can be
    read (CUDA: seed and offset; the CPU's draws an offset). CPU logits only under the
    interpreter with FLINTC_SAMPLER=triton set explicitly (the default keeps the CPU on
    the torch path)."""
    if not (logits.is_cuda or (os.environ.get("TRITON_INTERPRET", "0") == "1"
                               and os.environ.get("FLINTC_SAMPLER", "").strip() == "triton")):
        return []
    try:
        from flintc.kernels import sampler
    except ImportError:  # no triton
        return []
    V = logits.shape[-1]
    if V >= 2**24 or logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(-1) != 1:
        return []
    return [b for b, (p, g) in enumerate(zip(params, generators))
            if not p.is_greedy and sampler.supports([p.top_k], V)
            and (g is None or g.device.type != "cuda" or hasattr(g, "get_offset"))]


def _philox_state(gen: torch.Generator | None, device: torch.device) -> tuple[int, int]:
    """(seed, offset) for one row's draw, advancing the row's generator so that its next
    draw differs: a CUDA generator's Philox seed and offset (offset + 4 after), a CPU
    generator's seed and a 62-bit offset drawn from it. None: the device's default
    generator."""
    if gen is None:
        gen = (torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
               if device.type == "cuda" else torch.default_generator)
    if gen.device.type == "cuda":
        off = gen.get_offset()
        gen.set_offset(off + 4)
        return gen.initial_seed(), off
    return gen.initial_seed(), int(torch.randint(0, 2**62, (1,), generator=gen))


def _sample_triton(logits: torch.Tensor, params: list[SamplingParams], generators) -> torch.Tensor:
    """`sample` in one launch of `flintc.kernels.sampler` (for the rows of `_triton_rows`,
    and greedy rows). The
    per-row settings and Philox state go to the device in one asynchronous copy from
    pinned memory (no host sync)."""
    from flintc.kernels import sampler

    seeds, offsets, ks, temps, tops = [], [], [], [], []
    for p, g in zip(params, generators):
        if p.is_greedy:
            seed, off, k, t = 0, 0, 1, 0.0
        else:
            (seed, off), k, t = _philox_state(g, logits.device), p.top_k, float(p.temperature)
        seeds.append(seed)
        offsets.append(off)
        ks.append(k)
        temps.append(t)
        tops.append(float(p.top_p))
    host = sampler.pack_params(seeds, offsets, ks, temps, tops)
    if logits.is_cuda:
        host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
    dev = host.to(logits.device, non_blocking=True)
    return sampler.launch_sample(logits, dev, max(ks))


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] without an index tensor (whose host-to-device copy would wait for the GPU):
    x itself when rows are all of x in order, else a stack of row views."""
    if rows == list(range(x.shape[0])):
        return x
    return torch.stack([x[b] for b in rows])
