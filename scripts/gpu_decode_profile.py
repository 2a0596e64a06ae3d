"""Per-kernel time of one batch-1 decode step of a prebuilt build (torch.profiler over
CUDA-graph replays, summed per kernel name).

    python3 scripts/gpu_decode_profile.py --build gpu_builds/full-nvfp4-b1 --context 1024
"""

import argparse
import collections

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from flintc.runtime.compiled import load_build

    runner = load_build(args.build, load_format="dummy", device="cuda", progress=False)
    for t in runner.kv:
        t.normal_()
    graph, ids, pos, slots, _ = runner.decode_graph(1)
    ids.fill_(1)
    pos.fill_(args.context)
    slots.fill_(0)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graph.replay()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in per.values()) / args.replays
    lines = [f"build {args.build}, context {args.context}: kernel time per step {total / 1000:.3f} ms (sum of kernel "
             "durations; PDL overlap makes the wall time shorter or longer)", "",
             "| kernel | launches per step | us per step | share |", "|---|---|---|---|"]
    for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name[:60]} | {n // args.replays} | {us / args.replays:.1f} | {us / args.replays / total:.1%} |")
    print("\n".join(lines))
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
