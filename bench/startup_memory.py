"""GPU memory the start-up picks hold: prefill's pick_attention and pick_kernels alone, at Qwen3-32B's geometry, with
a fresh picks file (a first run on a machine: every attention candidate checked and timed) and then with the picks
kept, each in a process of its own (one device command, ~1 min).

    python bench/startup_memory.py [--rev REV ...] [--out DIR]

The picks run beside the weights' load, which fills the GPU up to the plan's budget: what they hold at their peak
must fit in the room the plan leaves (Runner._budget). --rev also measures prefill.py as it was at a git revision.
Prints a table last and writes it as JSON to --out.
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


def measure(module_dir, picks_path):
    # in a fresh process: the peak and what the picks leave reserved, in GiB
    import torch
    sys.path[:0] = [str(module_dir), str(ROOT / "bench")]
    import prefill
    from make_checkpoint import QWEN3_32B
    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(json.dumps(dict(QWEN3_32B, model_type="qwen3", torch_dtype="bfloat16")))
    config = getattr(prefill, "ModelConfig", None) or prefill.Qwen3Config  # a --rev before the families' config
    cfg, device = config.from_dir(folder), torch.device("cuda")
    torch.empty(1, device=device)
    free = torch.cuda.mem_get_info()[0]
    picks = prefill.Picks(picks_path, prefill.machine_key(device, cfg))
    t = time.perf_counter()
    picked = prefill.pick_attention("auto", device, cfg, picks)[0]
    prefill.pick_kernels("auto", device, cfg)
    torch.cuda.synchronize()
    gib = 2**30
    row = {"picked": picked, "seconds": round(time.perf_counter() - t, 2),
           "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 3),
           "reserved_gib": round(torch.cuda.memory_reserved() / gib, 3),
           "free_drop_gib": round((free - torch.cuda.mem_get_info()[0]) / gib, 3)}
    torch.cuda.empty_cache()
    row["free_drop_after_empty_cache_gib"] = round((free - torch.cuda.mem_get_info()[0]) / gib, 3)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", action="append", default=[], help="also prefill.py at this git revision")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # module folder, picks file
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    rows = {}
    for rev in ["working tree"] + args.rev:
        folder = ROOT if rev == "working tree" else Path(tempfile.mkdtemp())
        if rev != "working tree":
            source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:prefill.py"], capture_output=True,
                                    text=True, check=True).stdout
            (folder / "prefill.py").write_text(source)
        picks = Path(tempfile.mkdtemp()) / "picks.json"
        for run in ("fresh", "kept"):  # the same picks file: the second run finds what the first kept
            done = subprocess.run([sys.executable, __file__, "--child", str(folder), str(picks)], capture_output=True,
                                  text=True)
            out = done.stdout.strip().splitlines()
            rows[f"{rev} {run}"] = json.loads(out[-1]) if done.returncode == 0 and out else {"error": done.stderr[-500:]}
    import torch
    report = {"command": " ".join(["python", "bench/startup_memory.py", *sys.argv[1:]]), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "rows": rows}
    Path(args.out, "startup_memory.json").write_text(json.dumps(report, indent=1))
    print(f"{'prefill.py':24s} {'peak GiB':>9s} {'reserved':>9s} {'s':>6s}  picked")
    for name, r in rows.items():
        print(f"{name:24s} {r.get('peak_allocated_gib', '-'):>9} {r.get('reserved_gib', '-'):>9} "
              f"{r.get('seconds', '-'):>6}  {r.get('picked', r.get('error'))}")


if __name__ == "__main__":
    main()
