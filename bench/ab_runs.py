"""Two (or more) prefill.py files alternated on one checkpoint, the contest's way (interact.run_runner: T from `ready`
to the last loss), so that a change is measured against the run-to-run spread of one machine, not against a record
of another (one device command; issue 37: the H200's runs spread by +-4%).

    git show 742d573:prefill.py > /tmp/old/prefill.py
    python bench/ab_runs.py --ckpt /dev/shm/prefill-bench/q30-fp8 --gpu-memory 22.5 --rounds 3 \\
        --prefill /tmp/old/prefill.py prefill.py --out $OUT/ab.json

Each round runs every file once, in the order given. The texts: bench/workload.py's contest-like 100 (seed 0), tokenized
by the checkpoint's tokenizer. Prints each run's T and whether its losses equal the first file's first run's, bit for
bit (else their largest relative difference), and whether they equal the same file's first run's (repeatability); the
record holds them all.
"""
import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import interact  # noqa: E402
from bench import workload  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill.py files, alternated in this order")
    ap.add_argument("--gpu-memory", type=float, required=True, help="GiB, passed to every run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--texts", type=int, default=100)
    ap.add_argument("--runner-args", default="", help="more prefill.py options for every run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    texts = workload.make_texts(args.texts, 0, workload.load_tokenizer(args.ckpt))
    runs, first, own = [], None, {}  # own: each file's first run's losses
    for round_ in range(args.rounds):
        for path in args.prefill:
            cmd = [sys.executable, path, "--model", args.ckpt, "--gpu-memory", f"{args.gpu_memory:g}",
                   *shlex.split(args.runner_args)]
            r = interact.run_runner(cmd, texts)
            if r.returncode != 0:
                raise SystemExit(f"ab_runs: {path} failed ({r.returncode}): {r.stderr[-2000:]}")
            first = r.losses if first is None else first
            repeated = r.losses == own.setdefault(path, r.losses)
            diff = max(abs(a - b) / abs(b) for a, b in zip(r.losses, first) if b == b and b != 0)
            runs.append({"prefill": path, "round": round_, "t_seconds": r.t_seconds,
                         "time_to_ready_s": r.time_to_ready_s, "same_losses": r.losses == first,
                         "max_rel_diff": diff, "same_as_own_first": repeated,
                         "stderr": r.stderr.strip().splitlines()[-4:]})
            print(f"round {round_} {path:<30} T {r.t_seconds:.3f} s  same losses {r.losses == first} "
                  f"(max relative difference {diff:.2e}); its own first run's bits {repeated}", flush=True)
    medians = {path: statistics.median(x["t_seconds"] for x in runs if x["prefill"] == path) for path in args.prefill}
    Path(args.out).write_text(json.dumps({"args": vars(args), "medians": medians, "runs": runs},
                                         indent=1))
    for path, t in medians.items():
        print(f"median T {t:.3f} s  {path}")


if __name__ == "__main__":
    main()
