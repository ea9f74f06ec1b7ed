"""The CPU's loss step against its GEMM rate (issue 38): one loss chunk of the demo model (883 rows of width 256, the
Qwen3 vocabulary's 151,936-word head), each way of computing it timed in interleaved rounds (the median of --rounds),
so that a machine shared with other work slows every way alike.

    python bench/cpu_loss.py [--rounds 7] [--tokens 883] [--hidden 256] [--vocab 151936]

Rows: a plain float32 GEMM of the same shape into a buffer it reuses (the floor), the bf16 GEMM, prefill's float32
head (head_upcast) into a new tensor and into a reused one, the log-softmax as one cross_entropy over the chunk and as
token_nll (blocks of rows), and the whole chunk as it was (new logits, one cross_entropy) and as it is (sequence_nll's
buffer, token_nll). Writes OUT/cpu_loss.json with --out OUT (default: $OUT, where set); the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import prefill  # noqa: E402


def cpu_name():
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=883)  # the loss chunk at Qwen3's vocabulary: 512 MiB of logits
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="a folder for the JSON report (default: $OUT)")
    args = ap.parse_args(argv)
    T, H, V = args.tokens, args.hidden, args.vocab
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(prefill.DTYPE)
    w = (torch.randn(V, H, generator=gen) / H ** 0.5).to(prefill.DTYPE)
    xf, wf = x.float(), w.float()
    targets = torch.randint(V, (T,), generator=gen)
    room = torch.empty(T, V)
    logits = prefill.head_upcast(x, w)

    def as_it_was():  # new logits, one cross_entropy over the chunk
        return F.cross_entropy(prefill.head_upcast(x, w), targets, reduction="none")

    def as_it_is():  # the loss's reused buffer, token_nll's blocks of rows
        return prefill.token_nll(prefill.head_upcast(x, w, room), targets)

    ways = {
        "float32 GEMM, out reused (the floor)": lambda: torch.mm(xf, wf.T, out=room),
        "bf16 GEMM": lambda: torch.mm(x, w.T),
        "head_upcast, new out": lambda: prefill.head_upcast(x, w),
        "head_upcast, out reused": lambda: prefill.head_upcast(x, w, room),
        "cross_entropy over the chunk": lambda: F.cross_entropy(logits, targets, reduction="none"),
        "token_nll (blocks of rows)": lambda: prefill.token_nll(logits, targets),
        "loss chunk as it was": as_it_was,
        "loss chunk as it is": as_it_is,
    }
    assert torch.equal(as_it_was(), as_it_is())  # the same bits
    seconds = {name: [] for name in ways}
    for fn in ways.values():  # warm: allocations, BLAS packing
        fn()
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    floor = statistics.median(seconds["float32 GEMM, out reused (the floor)"])
    flops = 2 * T * H * V
    rows = [{"way": name, "median_s": statistics.median(s), "all_s": s,
             "gflops_equiv": flops / statistics.median(s) / 1e9, "over_floor": statistics.median(s) / floor}
            for name, s in seconds.items()]
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "shape": [T, H, V], "rounds": args.rounds, "load_average": os.getloadavg(), "rows": rows}
    if args.out:
        Path(args.out, "cpu_loss.json").write_text(json.dumps(report, indent=1))
    print(f"{report['cpu']}, {report['threads']} threads, torch {torch.__version__}, load average "
          f"{report['load_average'][0]:.1f}; [{T} x {H}] x [{H} x {V}], median of {args.rounds}")
    for r in rows:
        print(f"  {r['way']:40s} {r['median_s'] * 1e3:8.0f} ms {r['gflops_equiv']:7.1f} GFLOP/s-equiv "
              f"{r['over_floor']:5.2f}x the floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
