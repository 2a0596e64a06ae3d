"""PDLChainingPass: every kernel gets a mark; a mark that reads an activation or a KV
cache before gdc_wait is rejected."""

import pytest

from flintc.passes.base import PassVerifyError
from flintc.passes.canonicalize import CanonicalizationPass
from flintc.passes.fuse_rms_norm import RMSNormFusionPass
from flintc.passes.mark_pdl import PDLChainingPass, check_pdl_marks
from harness import context, run_passes


@pytest.fixture(scope="module")
def marked():
    g, _ = run_passes([CanonicalizationPass, RMSNormFusionPass], "decode", 2)
    p = PDLChainingPass(context(g))
    result = p.run(g.gm)
    return g, result


def test_every_kernel_is_marked(marked):
    g, result = marked
    check_pdl_marks(g.gm)
    assert result.matches > 0
    norm = next(n for n in g.gm.graph.nodes if str(n.target) == "flintc.rms_norm.default")
    mark = norm.meta["pdl"]
    assert any(name.startswith("w_") for name in mark["before_wait"])  # the norm weight
    assert norm.args[0].name in mark["after_wait"]  # the activation


def test_activation_before_wait_is_rejected(marked):
    g, _ = marked
    norm = next(n for n in g.gm.graph.nodes if str(n.target) == "flintc.rms_norm.default")
    saved = dict(norm.meta["pdl"])
    act = norm.args[0].name
    norm.meta["pdl"] = {**saved, "before_wait": saved["before_wait"] + [act],
                        "after_wait": [a for a in saved["after_wait"] if a != act]}
    try:
        with pytest.raises(PassVerifyError, match=f"{act} is read before gdc_wait.*activation"):
            check_pdl_marks(g.gm)
    finally:
        norm.meta["pdl"] = saved


def test_kv_cache_before_wait_is_rejected(marked):
    g, _ = marked
    put = next(n for n in g.gm.graph.nodes if "index_put" in str(n.target))
    saved = dict(put.meta["pdl"])
    put.meta["pdl"] = {**saved, "before_wait": saved["before_wait"] + [put.args[0].name],
                       "after_wait": [a for a in saved["after_wait"] if a != put.args[0].name]}
    try:
        with pytest.raises(PassVerifyError, match="KV cache"):
            check_pdl_marks(g.gm)
    finally:
        put.meta["pdl"] = saved


def test_missing_mark_is_rejected(marked):
    g, _ = marked
    norm = next(n for n in g.gm.graph.nodes if str(n.target) == "flintc.rms_norm.default")
    saved = norm.meta.pop("pdl")
    try:
        with pytest.raises(PassVerifyError, match="no PDL mark"):
            check_pdl_marks(g.gm)
    finally:
        norm.meta["pdl"] = saved
