import os, sys
_IDS = [l.strip() for l in open("gw8_ids.txt") if l.strip()]
_last = [os.environ.get("TRITON_INTERPRET")]

def pytest_collection_modifyitems(session, config, items):
    by = {it.nodeid: it for it in items}
    missing = [i for i in _IDS if i not in by]
    print("missing ids:", missing[:5], file=sys.stderr)
    items[:] = [by[i] for i in _IDS if i in by]

def _note(item, phase):
    v = os.environ.get("TRITON_INTERPRET")
    if v != _last[0]:
        print(f"ENVCHANGE {phase} {item.nodeid}: {_last[0]!r} -> {v!r}", file=sys.stderr, flush=True)
        _last[0] = v

def pytest_runtest_setup(item): _note(item, "before-setup")
def pytest_runtest_call(item): _note(item, "after-setup")
def pytest_runtest_teardown(item): _note(item, "after-call")
def pytest_runtest_logreport(report):
    v = os.environ.get("TRITON_INTERPRET")
    if v != _last[0]:
        print(f"ENVCHANGE report-{report.when} {report.nodeid}: {_last[0]!r} -> {v!r}", file=sys.stderr, flush=True)
        _last[0] = v
