"""The prefill functions compute the LM head for one row per sequence (`logits_rows`,
vLLM's logits_indices) and return (logits [B, V], final-normed hidden states [B, T, H]);
`CompiledRunner.prefill(..., all_logits=True)` computes the other rows from the hidden
states with the same LM head kernel.

* the final prefill graph runs the LM head on [B, H] rows, not [B*T, H];
* the last-row logits of the compiled prefill agree with the reference's, on the torch
  backend and on the Triton kernels (interpreter);
* all_logits: every row but the last of each chunk is the LM head of the hidden states
  over the whole chunk (what the function computed before), the last row of each chunk
  is the function's own row (bitwise what a prefill without all_logits returns), and
  all rows agree with the reference's;
* a build of the earlier format (build_version 1) is refused with a recompile message.
"""

from __future__ import annotations

import json
import os
import shutil

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import pytest
import torch

from flintc.checkpoint.loader import load_checkpoint
from flintc.errors import InputError
from flintc.model.reference import FlintModel
from flintc.runtime.compiled import CompiledRunner, load_build, read_manifest
from flintc.runtime.runner import ReferenceRunner
from harness import cpu_interpreter_only

ATOL, RTOL = 0.09, 0.02  # fuse_prefill_attention's stated tolerance (tests/runtime/test_compiled.py)
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(21)]  # 16 + 5 (padded to the 8-token tail)


@pytest.fixture(scope="module")
def ckpt(tiny_bf16_dir):
    return load_checkpoint(tiny_bf16_dir, progress=False)


@pytest.fixture(scope="module")
def build(tmp_path_factory, ckpt):
    """A tiny BF16 build, torch backend, prefill chunks of 16 (sizes 16 and 8: W = 9)."""
    from flintc.runtime.build import BuildOptions, compile_model

    out = tmp_path_factory.mktemp("build") / "bf16-c16"
    compile_model(ckpt, out, BuildOptions(max_batch=2, decode_buckets=(2,), max_model_len=64, prefill_chunk=16,
                                          backend="torch", check=False, dump=False),
                  progress=False, log=lambda m: None)
    return out


def runner(build, ckpt, backend="torch"):
    # the generated functions do not depend on the backend, only the kernel table does
    return CompiledRunner(build, dict(read_manifest(build), backend=backend), ckpt, torch.device("cpu"))


def test_prefill_graph_computes_the_lm_head_for_the_selected_rows_only(ckpt):
    """The final prefill graph (B = 2, T = 12): the LM head reads index_select(hidden [B*T,
    H], logits_rows) and returns [B, V]; no other node has a vocabulary-sized dimension;
    the output is (logits [B, V] fp32, hidden [B, T, H] bf16); the checks of every pass
    passed (logits on the drawn rows, hidden states on every token)."""
    from flintc.passes.pipeline import compile_step

    c = ckpt.config
    model = FlintModel(c, ckpt.weights)
    B, T, V, H = 2, 12, c.vocab_size, c.hidden_size
    graph, report = compile_step(model, "prefill", batch=B, tokens=T, cache_len=48, check_model=model,
                                 dump_dir=False)
    assert report.passed
    assert all({o["name"] for o in s["check"]["outputs"]} >= {"logits", "hidden"}
               for s in report.as_dict()["stages"])
    gm = graph.gm
    heads = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.flintc.lm_head.default]
    assert len(heads) == 1
    head = heads[0]
    assert tuple(head.meta["val"].shape) == (B, V) and head.meta["val"].dtype == torch.float32
    picked = head.args[0]
    assert picked.target is torch.ops.aten.index_select.default and picked.args[2].name == "logits_rows"
    assert tuple(picked.args[0].meta["val"].shape) == (B * T, H)
    big = [n.name for n in gm.graph.nodes if n.op == "call_function" and n is not head
           and isinstance(n.meta.get("val"), torch.Tensor) and V in tuple(n.meta["val"].shape)]
    assert big == [], f"nodes of vocabulary size besides the LM head: {big}"
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out[0] is head
    assert tuple(out[1].meta["val"].shape) == (B, T, H) and out[1].meta["val"].dtype == torch.bfloat16
    # the captured graph too: the LM head's matmul is [B, H] @ [H, V]
    from flintc.graph.trace import capture

    captured = capture(model, "prefill", batch=B, tokens=T, cache_len=48, stack_traces=False).gm
    mms = [n for n in captured.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default
           and tuple(n.meta["val"].shape)[-1] == V]
    assert [tuple(n.meta["val"].shape) for n in mms] == [(B, V)]


def test_generated_prefill_function_and_plan(build):
    """runtime.py: the prefill functions take logits_rows and call the LM head on the
    index_select of their rows; plan.json's intermediates hold the logits [1, V] (not [1,
    C, V]); build.json records build_version 2; decode takes no logits_rows."""
    src = (build / "runtime.py").read_text()
    plan = json.loads((build / "plan.json").read_text())["steps"]
    assert "def prefill_t16(K, w, input_ids, positions, slots, logits_rows, kv, device):" in src
    assert "def decode_b2(K, w, input_ids, positions, slots, kv, device):" in src
    assert "aten.index_select.default(" in src and "logits_rows)" in src
    manifest = read_manifest(build)
    assert manifest["build_version"] == 2
    V = manifest["config"]["vocab_size"]
    for name in ("prefill_t16", "prefill_t8"):
        shapes = [i["shape"] for i in plan[name]["intermediates"] if V in i["shape"]]
        assert shapes == [[1, V]], (name, shapes)
    decode = src[src.index("def decode_b2("):]
    assert "logits_rows" not in decode[:decode.index("\ndef ")]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=cpu_interpreter_only(
    "scripts/gpu_prefill_logits_rows.sh (graph against eager prefill, the 4-layer check)"))])
def test_last_row_logits_and_all_logits(build, ckpt, backend):
    """The compiled prefill of a 21-token prompt (16 + 5 padded to 8): its last-row
    logits agree with the reference's (ReferenceRunner, one forward over the prompt)
    within the prefill tolerance; with all_logits every row does, the last row is
    bitwise the one without all_logits, and each chunk's other rows are bitwise the LM
    head over the chunk's hidden states (the reference model's own op,
    `FlintModel.logits_from_hidden`); the KV caches are written alike either way."""
    if backend == "triton":
        pytest.importorskip("triton", reason="the triton backend needs triton")
    r = runner(build, ckpt, backend)
    assert r.prefill_pieces(len(PROMPT)) == [(0, 16, 16), (16, 5, 8)]
    model = FlintModel(ckpt.config, ckpt.weights)
    ref = ReferenceRunner(model, max_batch=2, max_model_len=64, prefill_chunk=64)
    want = ref.prefill(1, PROMPT, all_logits=True)  # [21, V]

    for t in r.kv:
        t.zero_()
    last = r.prefill(1, PROMPT)
    kv_last = [t.clone() for t in r.kv]
    assert last.shape == (ckpt.config.vocab_size,) and last.dtype == torch.float32
    assert torch.allclose(last, want[-1], atol=ATOL, rtol=RTOL), float((last - want[-1]).abs().max())

    for t in r.kv:
        t.zero_()
    got = r.prefill(1, PROMPT, all_logits=True)
    assert got.shape == want.shape
    assert torch.equal(got[-1], last)
    assert torch.allclose(got, want, atol=ATOL, rtol=RTOL), float((got - want).abs().max())
    for a, b in zip(r.kv, kv_last):
        assert torch.equal(a, b)

    # each chunk run directly: its rows are the LM head over its hidden states
    for t in r.kv:
        t.zero_()
    rows = []
    for s, n, C in r.prefill_pieces(len(PROMPT)):
        ids = torch.tensor([PROMPT[s:s + n] + [0] * (C - n)])
        pos = torch.arange(s, s + C)[None]
        keep = [t[1].clone() for t in r.sliding_caches]
        out, hidden = r.forward(f"prefill_t{C}", ids, pos, torch.tensor([1]), torch.tensor([n - 1]))
        assert out.shape == (1, ckpt.config.vocab_size) and hidden.shape == (1, C, ckpt.config.hidden_size)
        full = model.logits_from_hidden(hidden[0])  # [C, V]: every row, as the function computed before
        assert torch.equal(r.logits_from_hidden(hidden[0]), full) or backend == "triton"
        assert torch.allclose(out[0], full[n - 1], atol=1e-4, rtol=1e-5)  # another summation order
        rows.append(torch.cat([full[:n - 1], out]))
        if C > n:  # the padded tail wrote live ring rows: as prefill() does, put them back
            for t, k in zip(r.sliding_caches, keep):
                rows_w = torch.arange(s + n, s + C) % ckpt.config.sliding_window
                t[1, rows_w] = k[rows_w]
    assert torch.equal(torch.cat(rows), got)


def test_build_of_the_earlier_format_is_refused(build, ckpt, tmp_path):
    """A build whose prefill functions return every position's logits (build_version 1)
    cannot run under this runtime: load_build refuses it naming the change and saying to
    recompile (not a crash at the first prefill)."""
    old = tmp_path / "old"
    shutil.copytree(build, old)
    manifest = json.loads((old / "build.json").read_text())
    manifest["build_version"] = 1
    (old / "build.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=r"build_version 1, this flintc reads 2 \(since then: prefill functions "
                                         r"take logits_rows.*\); recompile it with flintc compile"):
        load_build(old, ckpt=ckpt, progress=False)
