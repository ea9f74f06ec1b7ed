"""Where the timed pass spends its GPU time: torch.profiler over one request, kernels grouped by kind.

    python bench/profile_run.py --model DIR --texts texts.json [--gpu-memory 48] [--out trace_dir]

Runs prefill's Runner in-process (load, warm-up, then the profiled request) and prints the share of GPU time
taken by GEMMs, attention, elementwise/normalisation kernels, copies and the loss, plus the top kernels.
"""
import argparse
import json
import sys
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--texts", required=True, help="JSON array of strings")
    p.add_argument("--gpu-memory", type=float)
    p.add_argument("--attention", default="auto")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--chunk-tokens", type=int, default=4096)
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args()

    runner = prefill.Runner(args.model, gpu_memory_gib=args.gpu_memory, attention=args.attention,
                            kernels=args.kernels, chunk_tokens=args.chunk_tokens)
    runner.warm_up()
    texts = json.loads(Path(args.texts).read_text())
    ids = runner.tokenize(texts)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.losses(ids)
    torch.cuda.synchronize()
    plain_s = time.perf_counter() - t0

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.losses(ids)
        torch.cuda.synchronize()
    per_kind, per_kernel = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kind[kind_of(e.name)] += e.device_time / 1e6
            per_kernel[e.name][0] += e.device_time / 1e6
            per_kernel[e.name][1] += 1
    total = sum(v for k, v in per_kind.items() if k != "copy")  # copies run on their own stream, overlapped
    print(f"request: {len(texts)} texts, {sum(map(len, ids))} tokens, {plain_s:.3f} s unprofiled; "
          f"{prefill.attention_summary(runner.attention)} attention, {runner.kernels.name} kernels; {len(runner.plan.resident_layers)} resident layers")
    print(f"{'kind':20s} {'GPU s':>8s} {'share':>7s}")
    for kind, secs in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        share = f"{secs / total:6.1%}" if kind != "copy" else "(side)"
        print(f"{kind:20s} {secs:8.3f} {share:>7s}")
    print("top kernels:")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    for name, (secs, n) in top:
        print(f"  {secs:7.3f} s {n:6d}x  {kind_of(name):12s} {name[:90]}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "texts": len(texts), "tokens": sum(map(len, ids)), "unprofiled_s": plain_s,
            "gpu_seconds_by_kind": per_kind, "compute_gpu_seconds": total,
            "top_kernels": [[n, s, c] for n, (s, c) in top]}, indent=1))


if __name__ == "__main__":
    main()
