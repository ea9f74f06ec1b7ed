"""Where the timed pass spends its GPU time: torch.profiler over one request, kernels grouped by kind, and where the
compute stream sits idle between kernels.

    python bench/profile_run.py --model DIR --texts texts.json [--gpu-memory 48] [--json summary.json]

Runs prefill's Runner in-process (load, warm-up, then the profiled request) and prints the share of GPU time
taken by GEMMs, attention, elementwise/normalisation kernels, copies and the loss, plus the top kernels. Then the
compute stream's idle time (the gaps between its kernels), split by cause: "host late" where the kernel after the gap
was launched by the host only after the stream had run dry (Python and launch cost: the GPU waits for the CPU), the
rest where it was launched in time and still started late (a wait on another stream's event: a streamed layer's copy,
or the launch latency itself). The gaps are summed per kernel that ended them, the host-late ones first.
"""
import argparse
import bisect
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import prefill  # noqa: E402

KINDS = [  # first match wins; names as CUDA/ROCm kernels and aten ops show them
    ("copy", ("memcpy", "Memcpy", "copy_")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "varlen")),
    ("gemm", ("gemm", "Gemm", "cutlass", "nvjet", "sm90_xmma", "Cijk", "wgmma", "_moe_gate_up", "_moe_down")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy", "index_add")),
]


def kind_of(name):
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "elementwise/other"


def compute_gaps(trace):
    """trace: a chrome trace (torch.profiler's export_chrome_trace, loaded) -> the compute stream's idle time between
    its first and last kernel: {"stream", "kernels", "busy_s", "span_s", "idle_s", "host_late_s", "other_s",
    "by_next": [[kernel name, host-late s, other s, gaps]]}. The compute stream is the one with the most kernel time;
    a kernel's launch is the runtime or driver call with its correlation id."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    per_stream = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            per_stream[e["args"].get("stream")].append(e)
    stream, kernels = max(per_stream.items(), key=lambda kv: sum(e["dur"] for e in kv[1]))
    host = sorted((e for e in events if e.get("cat") in ("cpu_op", "python_function")), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    by_host = defaultdict(float)
    kernels.sort(key=lambda e: e["ts"])
    by_next = defaultdict(lambda: [0.0, 0.0, 0])
    host_late = other = 0.0
    end = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        gap = k["ts"] - end  # microseconds
        if gap > 0:
            launch = launches.get(k["args"].get("correlation"))
            late = min(gap, max(0.0, launch["ts"] - end)) if launch else 0.0
            host_late, other = host_late + late, other + gap - late
            if late > 0 and launch:  # what the launching thread was in, mid-way through the host's delay
                by_host[innermost(host, starts, launch["tid"], end + late / 2)] += late
            row = by_next[k["name"][:80]]
            row[0], row[1], row[2] = row[0] + late, row[1] + gap - late, row[2] + 1
        end = max(end, k["ts"] + k["dur"])
    busy = sum(k["dur"] for k in kernels)
    span = end - kernels[0]["ts"]
    rows = sorted(by_next.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    return {"stream": stream, "kernels": len(kernels), "busy_s": busy / 1e6, "span_s": span / 1e6,
            "idle_s": (host_late + other) / 1e6, "host_late_s": host_late / 1e6, "other_s": other / 1e6,
            "by_next": [[name, late / 1e6, rest / 1e6, n] for name, (late, rest, n) in rows[:15]],
            "host_late_in": [[name, late / 1e6] for name, late in sorted(by_host.items(), key=lambda kv: -kv[1])[:15]]}


def innermost(host, starts, tid, t):
    # the name of the latest-starting host event (an aten op, or with --stack a Python function) of thread tid that
    # spans time t, with its enclosing Python function where that differs: host events nest, so it is the innermost
    i, found = bisect.bisect_right(starts, t), []
    while i > 0 and len(found) < 2:
        i -= 1
        e = host[i]
        if e["tid"] == tid and e["ts"] + e["dur"] >= t and (not found or e["cat"] == "python_function"):
            found.append(e["name"][:60])
    return " < ".join(found) or "(none)"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--texts", required=True, help="JSON array of strings")
    p.add_argument("--gpu-memory", type=float)
    p.add_argument("--attention", default="auto")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--experts", default="auto")
    p.add_argument("--chunk-tokens", type=int, default=4096)
    p.add_argument("--moe-factor", type=int, help="the MoE slice in attention chunks (prefill.MOE_CHUNK_FACTOR)")
    p.add_argument("--stack", action="store_true", help="record Python functions too (host time inflates more)")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args()

    if args.moe_factor:
        prefill.MOE_CHUNK_FACTOR = args.moe_factor
    runner = prefill.Runner(args.model, gpu_memory_gib=args.gpu_memory, attention=args.attention,
                            kernels=args.kernels, chunk_tokens=args.chunk_tokens, experts=args.experts)
    runner.warm_up()
    texts = json.loads(Path(args.texts).read_text())
    ids = runner.tokenize(texts)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.losses(ids)
    torch.cuda.synchronize()
    plain_s = time.perf_counter() - t0

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], with_stack=args.stack) as prof:
        runner.losses(ids)
        torch.cuda.synchronize()
    per_kind, per_kernel = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kind[kind_of(e.name)] += e.device_time / 1e6
            per_kernel[e.name][0] += e.device_time / 1e6
            per_kernel[e.name][1] += 1
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        gaps = compute_gaps(json.loads(Path(f"{tmp}/trace.json").read_text()))
    total = sum(v for k, v in per_kind.items() if k != "copy")  # copies run on their own stream, overlapped
    print(f"request: {len(texts)} texts, {sum(map(len, ids))} tokens, {plain_s:.3f} s unprofiled; "
          f"{prefill.attention_summary(runner.attention)} attention, {runner.kernels.name} kernels; "
          f"{len(runner.plan.resident_layers)} resident layers; chunks of {args.chunk_tokens} tokens")
    print(f"{'kind':20s} {'GPU s':>8s} {'share':>7s}")
    for kind, secs in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        share = f"{secs / total:6.1%}" if kind != "copy" else "(side)"
        print(f"{kind:20s} {secs:8.3f} {share:>7s}")
    print("top kernels:")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    for name, (secs, n) in top:
        print(f"  {secs:7.3f} s {n:6d}x  {kind_of(name):12s} {name[:90]}")
    print(f"compute stream (profiled): {gaps['kernels']} kernels, busy {gaps['busy_s']:.3f} s of {gaps['span_s']:.3f};"
          f" idle {gaps['idle_s']:.3f} s: host late {gaps['host_late_s']:.3f}, other {gaps['other_s']:.3f}")
    print("idle before (host late s, other s, gaps):")
    for name, late, rest, n in gaps["by_next"]:
        print(f"  {late:7.4f} {rest:7.4f} {n:6d}x  {name}")
    print("host late while the launching thread was in:")
    for name, late in gaps["host_late_in"]:
        print(f"  {late:7.4f}  {name}")
    for what, report in (("attention", runner.attention_report), ("experts", runner.experts_report or [])):
        times = {e["name"]: e.get("time_ms") for e in report if e.get("time_ms")}
        print(f"start-up timing of {what} (ms): {times}; picked {getattr(runner, what)}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "texts": len(texts), "tokens": sum(map(len, ids)), "unprofiled_s": plain_s,
            "chunk_tokens": args.chunk_tokens, "moe_chunk_tokens": runner.plan.moe_chunk_tokens,
            "experts": args.experts,
            "gpu_seconds_by_kind": per_kind, "compute_gpu_seconds": total,
            "top_kernels": [[n, s, c] for n, (s, c) in top], "compute_stream": gaps}, indent=1))


if __name__ == "__main__":
    main()
