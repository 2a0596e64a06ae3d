"""Ahead-of-time compile probe: compiles Triton kernels for sm_90 (H200) on a machine
without a GPU and reports what the compiler made of them.

Why: the engineers write kernels on CPU-only machines (the interpreter checks the
numerics, not the code generation). This compiles the real GPU path with the ptxas
that ships inside the triton wheel (`triton/backends/nvidia/bin`), so one sees before
a GPU run whether a kernel lowers at all, how many registers it takes (occupancy),
whether it spills, how much shared memory its pipelining needs, how wide its global
loads are and whether they were turned into cp.async / TMA copies.

Usage:
    python scripts/triton_aot_probe.py MODULE [--only SUBSTR] [--ptx DIR]

MODULE is an importable kernel module (e.g. `flintc.kernels.decode_attention`) that
defines `aot_probe_specs()`, returning a list of dicts with the keys
    name: a label; fn: the @triton.jit function; signature: {arg: type} for every
    argument in order ("*bf16", "*fp32", "*i32", "i32", "fp32", ... and "constexpr");
    constexprs: {arg: value}; num_warps, num_stages: launch options (optional);
    divisible: argument names known to be multiples of 16 (pointers always are).
--only keeps the specs whose name contains SUBSTR; --ptx DIR also writes each
kernel's .ptx and .ttgir there. From Python: `compile_sm90(...)` and `report(k)`.

Output, one line per spec: REG (registers per thread), STACK (bytes of stack frame:
spills and local arrays), SHARED (static + dynamic shared memory in bytes, which caps
the programs per SM at 228 KiB / SHARED), LOCAL, spill stores/loads (STL/LDL in the
SASS), the SASS instructions of the longest loop (the K loop: per warp and step; times
warps x 32 over the weights of a step gives instructions per weight), the tile loads
left synchronous in the loop (`sync_tile_loads`), the shared-memory wavefronts of each
cp.async tile copy against the ideal (`copy_conflicts`: bank conflicts), and counts of
global load widths (ld.global.v4.b32 = 16 bytes per thread), cp.async copies, TMA
copies and MMA instructions (mma.sync / wgmma) in the PTX.

Limits: compiles with the installed triton; the code can differ a lot between
versions, so compare with the version the GPU runs (3.6 on the H200):
`pip install --no-deps --target /tmp/tri36 triton==3.6.0` and run with
`PYTHONPATH=/tmp/tri36` (session 10: the 32-bit word decode took 20% fewer loop
instructions than the byte decode under triton 3.9 and 22% more under 3.6, which the
H200 measured 65% slower). No timing: it says nothing about latency or bandwidth, only
about the code. Raises whatever triton.compile raises
(e.g. out of shared memory or an unsupported construct), reported per spec.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import math
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4,
                 num_stages: int = 3, divisible=(), maxnreg: int | None = None):
    """Compile `fn` for sm_90; returns triton's CompiledKernel (asm in k.asm: ttgir,
    ptx, cubin). `signature` maps every argument, in order, to its type string
    ("constexpr" for compile-time ones, whose values are in `constexprs`). Pointers
    and the names in `divisible` are declared 16-divisible, as a launch with aligned
    tensors and such integers would specialise them. `maxnreg`: ptxas's register cap per
    thread (Triton's launch option of that name), None for none."""
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or n in divisible}
    src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=SM90, options=options)


def _tool(name: str) -> str:
    path = os.path.join(_BIN, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} not found in {_BIN}")
    return path


def report(k) -> dict:
    """Resource usage and instruction mix of a compiled kernel (see the module doc)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        cubin = f.name
    try:
        res = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin],
                             capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(cubin)
    out = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(key + r":(\d+)", res)
        out[key] = int(m.group(1)) if m else None
    dyn = getattr(k.metadata, "shared", None)
    if dyn is not None:
        out["SHARED"] = max(out["SHARED"] or 0, int(dyn))
    out.update(loop_stats(sass))
    out["sync_tile_loads"] = sync_tile_loads(k.asm.get("ttgir", ""))
    out["copy_conflicts"] = copy_conflicts(k.asm.get("ttgir", ""))
    out["spill_st"] = len(re.findall(r"\bSTL\b", sass))
    out["spill_ld"] = len(re.findall(r"\bLDL\b", sass))
    ptx = k.asm.get("ptx", "")
    loads = collections.Counter(re.findall(r"ld\.global[.\w]*", ptx))
    out["loads"] = dict(sorted(loads.items()))
    out["cp.async"] = len(re.findall(r"cp\.async\.c[ag]\.shared", ptx))
    out["tma"] = len(re.findall(r"cp\.async\.bulk", ptx))
    out["mma"] = len(re.findall(r"\bmma\.sync", ptx))
    out["wgmma"] = len(re.findall(r"wgmma\.mma_async", ptx))
    return out


def loop_stats(sass: str) -> dict:
    """The longest loop of a kernel's SASS (`cuobjdump -sass`): the instructions from a
    backward branch's target to the branch (for the decode kernels, the K loop's body,
    which the pipeliner may unroll). Returns {"loop": instruction count (0: no loop)}."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = []
    for addr, text in ins:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return {"loop": len(best)}


def sync_tile_loads(ttgir: str, min_elems: int = 1024) -> list:
    """Loads of tiles of at least `min_elems` elements left synchronous (`tt.load`, not
    `ttg.async_copy_global_to_local`) inside the kernel's loops, from the TTGIR: weight or
    activation tiles that the pipeliner did not stage, so each K step waits for them
    (session 10: triton 3.6 left the MoE down kernel's weights so). Returns their tile
    types ("64x8x8xi8", ...), each load once per loop body (the ops after `scf.for` up to
    its `scf.yield`); block-scale tiles (BLOCK_F x BLOCK_K/16) stay under `min_elems`."""
    found, depth_indent = [], []
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        if depth_indent and indent <= depth_indent[-1] and "scf.yield" not in line:
            depth_indent.pop()
        if " scf.for " in line:
            depth_indent.append(indent)
            continue
        if depth_indent and " tt.load " in line:
            m = re.search(r"tensor<([0-9x]+)x!tt\.ptr<(\w+)>", line)
            if m and math.prod(int(d) for d in m.group(1).split("x")) >= min_elems:
                found.append(f"{m.group(1)}x{m.group(2)}")
    return found


_ELEM_BYTES = {"i8": 1, "u8": 1, "f8E4M3FN": 1, "f8E5M2": 1, "bf16": 2, "f16": 2, "i16": 2,
               "f32": 4, "i32": 4, "i64": 8, "f64": 8}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def copy_conflicts(ttgir: str) -> list[tuple[str, int, int]]:
    """Shared-memory bank conflicts of the pipeliner's copies into shared memory
    (`ttg.async_copy_global_to_local`, cp.async), estimated from the layouts in the TTGIR:
    for warp 0's first copy instruction of each distinct (tile, layout) pair, the
    shared-memory wavefronts it needs against the ideal (its bytes / 128). Returns
    [(tile type, wavefronts, ideal), ...]; copies into other shared layouts than
    `swizzled_shared` (e.g. `nvmma_shared`) are left out.

    Model: a lane's first vector is sizePerThread elements along the blocked layout's
    fastest dimension (at most 16 bytes); lanes map onto the tile through threadsPerWarp in
    the layout's order; the shared offset follows the shared order, with the XOR swizzle
    of the two fastest dimensions when maxPhase > 1; 8- and 16-byte accesses are served
    16 and 8 lanes at a time; each pass costs as many wavefronts as the most distinct
    4-byte words that fall on one of the 32 banks. Session 10 found this way (and with
    Nsight Compute) that a 3-D NVFP4 code tile put a warp's lanes on 32 rows 64 bytes
    apart: 8x the ideal here, 15x measured (`flintc.kernels.tiles.load_code_tile`)."""
    blocked, shared, seen, out = {}, {}, set(), []
    for m in re.finditer(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
                         r"threadsPerWarp = \[([\d, ]+)\], warpsPerCTA = \[[\d, ]+\], "
                         r"order = \[([\d, ]+)\]", ttgir, re.M):
        blocked[m.group(1)] = (_ints(m.group(2)), _ints(m.group(3)), _ints(m.group(4)))
    for m in re.finditer(r"^(#shared\d*) = #ttg\.swizzled_shared<\{vec = (\d+), perPhase = "
                         r"(\d+), maxPhase = (\d+), order = \[([\d, ]+)\]", ttgir, re.M):
        shared[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)),
                              _ints(m.group(5)))
    for m in re.finditer(r"async_copy_global_to_local .*?: tensor<([\dx]+)x!tt\.ptr<(\w+)>, "
                         r"(#blocked\d*)> -> <[\dx]+x\w+, (#shared\d*),", ttgir):
        key = m.groups()
        if key in seen or key[2] not in blocked or key[3] not in shared:
            continue
        seen.add(key)
        shape = _ints(key[0].replace("x", ","))
        spt, tpw, order = blocked[key[2]]
        vec, per_phase, max_phase, sorder = shared[key[3]]
        eb = _ELEM_BYTES.get(key[1], 4)
        nbytes = min(spt[order[0]] * eb, 16)
        strides, acc = [0] * len(shape), 1
        for d in sorder:
            strides[d], acc = acc, acc * shape[d]
        offsets = []
        for lane in range(32):
            coord, rest = [0] * len(shape), lane
            for d in order:
                coord[d] = (rest % tpw[d]) * spt[d] % shape[d]
                rest //= tpw[d]
            if max_phase > 1 and len(sorder) >= 2:
                inner, outer = sorder[0], sorder[1]
                phase = (coord[outer] // per_phase) % max_phase
                col = coord[inner]
                coord[inner] = ((col // vec) ^ phase) * vec + col % vec
            offsets.append(sum(c * st for c, st in zip(coord, strides)) * eb)
        per_pass = 32 if nbytes <= 4 else 128 // nbytes
        waves = 0
        for start in range(0, 32, per_pass):
            banks: dict[int, set] = {}
            for off in offsets[start:start + per_pass]:
                for word in range(off // 4, (off + max(nbytes, 4) - 1) // 4 + 1):
                    banks.setdefault(word % 32, set()).add(word)
            waves += max(len(w) for w in banks.values())
        ideal = max(1, (32 * nbytes + 127) // 128)
        out.append((f"{key[0]}x{key[1]}", waves, ideal))
    return out


def format_report(name: str, r: dict) -> str:
    loads = ", ".join(f"{k.replace('ld.global', 'ld')} x{v}" for k, v in r["loads"].items())
    return (f"{name}: REG {r['REG']} STACK {r['STACK']} SHARED {r['SHARED']} LOCAL {r['LOCAL']}"
            f" spills st/ld {r['spill_st']}/{r['spill_ld']} | loop {r['loop']} instr,"
            f" sync tile loads [{', '.join(r['sync_tile_loads'])}],"
            f" cp.async wavefronts/ideal [{', '.join(f'{t} {w}/{i}' for t, w, i in r['copy_conflicts'])}]"
            f" | cp.async {r['cp.async']}"
            f" tma {r['tma']} mma {r['mma']} wgmma {r['wgmma']} | {loads or 'no ld.global'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", help="kernel module defining aot_probe_specs()")
    parser.add_argument("--only", default="", help="only specs whose name contains this")
    parser.add_argument("--ptx", default="", help="also write .ptx and .ttgir files here")
    args = parser.parse_args(argv)
    mod = importlib.import_module(args.module)
    if not hasattr(mod, "aot_probe_specs"):
        raise SystemExit(f"{args.module} defines no aot_probe_specs()")
    failed = 0
    for spec in mod.aot_probe_specs():
        if args.only not in spec["name"]:
            continue
        try:
            k = compile_sm90(spec["fn"], spec["signature"], spec["constexprs"],
                             spec.get("num_warps", 4), spec.get("num_stages", 3),
                             spec.get("divisible", ()))
        except Exception as e:  # noqa: BLE001  (reported per spec)
            failed += 1
            print(f"{spec['name']}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(format_report(spec["name"], report(k)), flush=True)
        if args.ptx:
            os.makedirs(args.ptx, exist_ok=True)
            stem = os.path.join(args.ptx, re.sub(r"[^\w.-]+", "_", spec["name"]))
            for ext in ("ptx", "ttgir"):
                with open(f"{stem}.{ext}", "w", encoding="utf-8") as f:
                    f.write(k.asm.get(ext, ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
