"""Where a warm time to ready goes: prefill's Runner built on a checkpoint, one process per variant, nothing scored
(one device command, ~1.5 min on the H200 with the checkpoint in /dev/shm).

    python bench/load_phases.py --model /dev/shm/prefill-bench/qwen3-32b-L64-s0 [--gpu-memory 46.5] [--out DIR]

Each variant takes some of the start-up's concurrent work away, so that what is left shows its own time:

    fresh     as prefill runs on a new machine (a new picks file: the attention candidates are timed)
    default   as prefill runs again (the picks kept); run first and last, for the spread
    nolock    the streamed layers' pages are not page-locked (the run could not score: a probe of the staging alone)
    sideonly  no weights staged or locked: the start-up checks and picks alone
    torchkern the elementwise kernels in PyTorch (no Triton kernels compiled or checked)
    w8, w12   8 or 12 loading threads instead of 16
    stage64   64 MiB staging buffers instead of 32

For each: seconds since the process started at the Runner's start (imports), at the end of the weights' load, and
when loaded; the side tasks' end (tokenizer, kernel checks, attention pick, BLAS pick), in seconds after the
Runner's start; the warm-up, and the warm-up run again. --gpu-memory
stands for the contest's 48 GiB cap (46.5: what the plan keeps of 48 GiB free). Writes load_phases.json to --out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["fresh", "default", "nolock", "sideonly", "torchkern", "w8", "w12", "stage64", "default"]


def measure(variant, model, gpu_memory, picks):
    sys.path.insert(0, str(ROOT))
    import prefill
    kw = dict(gpu_memory_gib=gpu_memory, picks=picks)
    if variant in ("nolock", "sideonly"):
        prefill.Checkpoint.lock = lambda self, spans, workers=16: True
    if variant == "sideonly":
        prefill.Stager.put = lambda self, ckpt, name, dst: None
    if variant == "torchkern":
        kw["kernels"] = "torch"
    if variant in ("w8", "w12"):
        kw["workers"] = int(variant[1:])
    if variant == "stage64":
        prefill.STAGING_BYTES = 64 * 2**20
    t = time.perf_counter()
    r = prefill.Runner(model, **kw)
    init = time.perf_counter() - t
    warm = []
    for _ in range(2):  # the warm-up as prefill runs it, then again (what is left once everything has loaded)
        t = time.perf_counter()
        r.warm_up()
        warm.append(round(time.perf_counter() - t, 3))
    return dict(variant=variant, runner_s=round(init, 2), since_start_s=r.since_start_s, load_wall_s=r.load_wall_s,
                side_done_s=r.side_done_s, load_seconds=r.load_seconds, resident_layers=len(r.plan.resident_layers),
                warm_up_s=warm[0], warm_up_again_s=warm[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu-memory", type=float, default=46.5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # variant, picks file
    args = ap.parse_args()
    if args.child:
        variant, picks = args.child.split(",")
        print("RESULT " + json.dumps(measure(variant, args.model, args.gpu_memory, picks)), flush=True)
        return
    picks, rows = Path(tempfile.mkdtemp()) / "picks.json", []
    for variant in VARIANTS:  # one picks file: "fresh" times the candidates, the others find its picks kept
        done = subprocess.run([sys.executable, __file__, "--model", args.model, "--gpu-memory", str(args.gpu_memory),
                               "--child", f"{variant},{picks}"], capture_output=True, text=True, timeout=120)
        out = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        rows.append(json.loads(out[0]) if out else {"variant": variant, "error": done.stderr[-800:]})
    import torch
    report = {"command": " ".join(["python", "bench/load_phases.py", *sys.argv[1:]]), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "cpus": os.cpu_count(), "rows": rows}
    Path(args.out, "load_phases.json").write_text(json.dumps(report, indent=1))

    def s(x):
        return "-" if x is None else f"{x:.2f}"
    print(f"{'variant':10s} {'start':>6s} {'weights':>8s} {'loaded':>7s} {'load s':>7s} {'side tasks done (after start)':>44s}"
          f" {'warm-up':>8s} {'again':>6s}  load")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:10s} error: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            continue
        since, side = r["since_start_s"], r["side_done_s"]
        print(f"{r['variant']:10s} {s(since['runner_start']):>6s} {s(since.get('weights')):>8s} {s(since.get('loaded')):>7s}"
              f" {s(r['load_wall_s']['weights']):>7s} {' '.join(f'{k} {v:.2f}' for k, v in side.items()):>44s}"
              f" {r['warm_up_s']:>8.3f} {r['warm_up_again_s']:>6.3f}  {r['load_seconds']}")


if __name__ == "__main__":
    main()
