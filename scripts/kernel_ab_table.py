"""The table of `scripts/gpu_kernel_ab.sh`: flintc's us per call of each benchmark row,
old and new code, every round, from the Markdown tables `bench_gemv.py` / `bench_moe.py`
wrote (`{gemv,moe}-{old,new}-ROUND.md` in one folder).

    python scripts/kernel_ab_table.py DIR [--out table.md]

A row is keyed by its first column (case or op), fmt and N; the columns are old / new of
each round, then new / old of the medians (below 1: the new code is faster). Exits 1 when
DIR holds no such table, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r"^(gemv|moe)-(old|new)-(\d+)\.md$")


def read_rows(path: Path) -> dict:
    """{(first column, fmt, N): flintc us} of every Markdown table in `path` whose header
    names the columns `fmt`, `N` and `flintc us` (rows whose us is not a number skipped)."""
    rows, cols = {}, None
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("|"):
            cols = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "flintc us" in cells and "fmt" in cells and "N" in cells:
            cols = (cells.index("fmt"), cells.index("N"), cells.index("flintc us"))
            continue
        if cols is None or len(cells) <= max(cols) or set(cells[0]) <= set("-: "):
            continue
        try:
            us = float(cells[cols[2]])
        except ValueError:
            continue
        rows[(cells[0], cells[cols[0]], cells[cols[1]])] = us
    return rows


def table(folder: Path) -> str:
    """The A/B table of the benchmark files in `folder` (Markdown). Raises FileNotFoundError
    when there is none."""
    runs: dict = {}  # (bench, version, round) -> rows
    for p in sorted(folder.iterdir()):
        m = NAME.match(p.name)
        if m:
            runs[(m[1], m[2], int(m[3]))] = read_rows(p)
    if not runs:
        raise FileNotFoundError(f"{folder}: no gemv-/moe-{{old,new}}-ROUND.md files")
    rounds = sorted({r for _, _, r in runs})
    lines = ["| bench | row | fmt | N | " + " | ".join(f"old {r} | new {r}" for r in rounds)
             + " | new / old (medians) |",
             "|---|---|---|---|" + "---|---|" * len(rounds) + "---|"]
    for bench in ("gemv", "moe"):
        keys = []
        for (b, _, _), rows in runs.items():
            keys += [k for k in rows if b == bench and k not in keys]
        for key in keys:
            cells, olds, news = [], [], []
            for r in rounds:
                for v, acc in (("old", olds), ("new", news)):
                    us = runs.get((bench, v, r), {}).get(key)
                    cells.append("-" if us is None else f"{us:.2f}")
                    if us is not None:
                        acc.append(us)
            ratio = (f"{statistics.median(news) / statistics.median(olds):.3f}"
                     if olds and news else "-")
            lines.append(f"| {bench} | {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells)
                         + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    try:
        text = table(args.folder)
    except (FileNotFoundError, NotADirectoryError) as e:
        print(f"kernel_ab_table: {e}", file=sys.stderr)
        return 1
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
