"""tests/conftest.py starts every test with the TRITON_INTERPRET that collection left,
undoing a change made by a fixture of a wider scope. Session 35 found one on an H100: a
module-scoped `flintc compile` with the default `--device cpu` (tests/cli/test_default_model.py)
set it for the rest of its xdist worker, and a later GPU test's NVFP4 launches took the
interpreter's paths and refused the weights converted for the CUDA kernels."""

from __future__ import annotations

import os

import pytest

_SENTINEL = "leaked-by-a-module-fixture"
_INSIDE = "set-inside-a-test"


@pytest.fixture(scope="module")
def leaky_fixture():
    """Sets TRITON_INTERPRET for the module, as a module-scoped CPU `flintc compile` does;
    at teardown (after the last test of the module and its autouse teardown) checks that
    that test's own setting was undone."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = _SENTINEL
    yield
    seen = os.environ.get("TRITON_INTERPRET")
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before
    assert seen != _INSIDE, "a test's own TRITON_INTERPRET outlived it"


def test_on_a_cpu_machine_a_fixtures_interpreter_is_kept(monkeypatch):
    """Without a GPU the kernels run only interpreted, so a fixture's "1" stays."""
    import interpreter_checks
    import torch

    monkeypatch.setattr(interpreter_checks, "INTERPRET_COLLECTED", [None])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert interpreter_checks.interpret_for_a_test("1") == "1"
    assert interpreter_checks.interpret_for_a_test("0") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert interpreter_checks.interpret_for_a_test("1") is None


def test_a_wider_fixtures_change_is_undone_before_the_test(leaky_fixture):
    import interpreter_checks

    assert os.environ.get("TRITON_INTERPRET") == interpreter_checks.INTERPRET_COLLECTED[0]


def test_a_tests_own_change_is_undone_after_it(leaky_fixture):
    """The module's last test (keep it last): `leaky_fixture`'s teardown, right after this
    test's, checks that this setting did not outlive the test."""
    os.environ["TRITON_INTERPRET"] = _INSIDE
