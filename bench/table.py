"""The performance tables: one Markdown row per bench/results/*.json report written by bench/run.py, and one per run
of each record bench/moe_run.py wrote (the mixtures of experts: a family's geometry, whole or its first layers).

    python bench/table.py           # print the tables
    python bench/table.py --write   # rewrite docs/performance.md's tables between their markers (or --write FILE)

docs/performance.md keeps the tables between the lines `<!-- bench-table -->` and `<!-- /bench-table -->`, and
`<!-- moe-table -->` and `<!-- /moe-table -->`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PERFORMANCE_DOC = HERE.parent / "docs" / "performance.md"
START, END = "<!-- bench-table -->", "<!-- /bench-table -->"
MOE_START, MOE_END = "<!-- moe-table -->", "<!-- /moe-table -->"

COLUMNS = ("date", "commit", "machine", "workload", "GPUs (speedup)", "texts", "tokens", "T (s)", "compute floor (s)", "T / floor",
           "sustained floor (s)", "T / sustained floor", "transfer floor (s)", "time to ready (s)", "ready / ready floor",
           "peak GPU (GiB)", "max rel err", "repeat max Δ", "baseline T (s)", "W7800 estimate (s)")


def _num(v, fmt: str) -> str:
    return "–" if v is None or v != v else fmt.format(v)  # v != v: NaN, a run without reference texts


def row(r: dict) -> list[str]:
    baseline = _num(r.get("baseline_t_seconds"), "{:.1f}")
    if r.get("baseline_extrapolated"):
        baseline = f"~{baseline} (from {r.get('baseline_texts')})"
    est = r.get("w7800_estimate") or {}
    w7800 = "–"
    if est.get("t_compute_s") is not None:
        # The larger of the two floors (copies hidden under compute), from the W7800's figures in bench/run.py
        # (W7800_GEMM_TFLOPS, W7800_H2D_GBPS): an estimate.
        w7800 = f"≥ {_num(est.get('t_floor_s', est['t_compute_s']), '{:.1f}')} (est.)"
    return [
        r.get("date", "–"), f"`{shown_commit(r)}`", r.get("machine", "–"), r.get("workload", "–"),
        f"{r['gpus']} ({r['speedup_vs_1gpu']:.2f}× 1 GPU)" if r.get("gpus") else "1", _num(r.get("texts"), "{}"),
        _num(r.get("tokens"), "{}"), _num(r.get("t_seconds"), "{:.2f}"), _num(r.get("compute_floor_s"), "{:.2f}"),
        _num(r.get("t_over_compute_floor"), "{:.2f}×"), _num(r.get("compute_floor_sustained_s"), "{:.2f}"),
        _num(r.get("t_over_compute_floor_sustained"), "{:.2f}×"),
        _num(r.get("transfer_floor_s"), "{:.2f}"), _num(r.get("time_to_ready_s"), "{:.1f}"),
        _num(r.get("t_ready_over_floor"), "{:.2f}×"), _num(r.get("peak_gpu_gib"), "{:.1f}"),
        _num(r.get("max_rel_err"), "{:.1e}"), _num(r.get("repeat_max_abs_diff"), "{:.1g}"), baseline, w7800,
    ]


def shown_commit(r) -> str:
    # a commit's 7 characters, and what a variant run changed on top of it ("8f2c05d-bf16-logits": the same commit with
    # one constant edited for the measurement), so that the row does not pass for the commit itself
    commit = str(r.get("commit", "–"))
    return commit[:7] + (commit[commit.index("-", 7):] if "-" in commit[7:] else "")


def commit_order(repo: Path) -> dict[str, int]:
    """7-character commit hash -> its position in the checkout's history (oldest first); {} without git."""
    try:
        log = subprocess.run(["git", "-C", str(repo), "log", "--reverse", "--format=%H"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {h[:7]: i for i, h in enumerate(log.split())}


def read_records(folder: Path) -> list[tuple[Path, dict]]:
    """Every JSON record in folder, (path, record) in the files' order (dated names), read once for both tables."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            records.append((path, json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            print(f"table.py: skipping {path}: {e}", file=sys.stderr)
    return records


def load_reports(records: list[tuple[Path, dict]], folder: Path) -> list[dict]:
    # bench/run.py's reports, not the doctor's (<date>-<machine>-doctor.json: no timed run) nor moe_run's records
    reports = [report for _, report in records if isinstance(report, dict) and "workload" in report]
    # runs of one day in the order of their commits (commits not in this history last, by hash)
    order = commit_order(folder)
    return sorted(reports, key=lambda r: (r.get("date", ""), r.get("machine", ""), r.get("workload", ""),
                                          order.get(str(r.get("commit", ""))[:7], len(order)),
                                          str(r.get("commit", ""))))


def markdown(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


MOE_COLUMNS = ("date", "commit", "model (random weights)", "run", "cap (GiB)", "tokens", "T (s)", "compute floor (s)",
               "transfer floor (s)", "T / larger floor", "max rel err (bf16)", "experts picked", "record")


def moe_rows(records: list[tuple[Path, dict]]) -> list[list[str]]:
    """A row per run of each moe_run record (those with runs and a geometry), in the files' order (dated names)."""
    rows = []
    for path, record in records:
        if not isinstance(record, dict) or "geometry" not in record or "runs" not in record:
            continue
        cut = re.search(r"-L(\d+)\b", path.name)  # the records of a geometry's first N layers say so in their names
        model = (record["geometry"] + (f", first {cut[1]} layers" if cut else "")
                 + (", FP8" if record.get("fp8") else ""))
        extra = f" ({record['runner_args']})" if record.get("runner_args") else ""
        for r in record["runs"]:
            rows.append([path.name[:10], f"`{shown_commit(record)}`", model, r["workload"] + extra, f"{r['cap_gib']:g}",
                         str(r["tokens"]), f"{r['t_seconds']:.2f}", f"{r['compute_floor_s']:.2f}",
                         f"{r['transfer_floor_s']:.2f}", f"{r['t_over_max_floor']:.2f}×",
                         _num(r.get("max_rel_err"), "{:.1e}"), str(r.get("experts") or "–").split(" ")[0],
                         path.name])
    return rows


def replace_section(text: str, table: str, start_marker: str = START, end_marker: str = END) -> str:
    """text with everything between the markers replaced by table; ValueError if the markers are missing."""
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < start:
        raise ValueError(f"no `{start_marker}` ... `{end_marker}` section")
    return text[: start + len(start_marker)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(HERE / "results"), help="folder of reports (default: %(default)s)")
    ap.add_argument("--write", nargs="?", const=str(PERFORMANCE_DOC), metavar="FILE",
                    help="rewrite FILE's table section instead of printing (FILE default: %(const)s)")
    args = ap.parse_args(argv)

    records = read_records(Path(args.results))
    table = markdown(COLUMNS, [row(r) for r in load_reports(records, Path(args.results))])
    moe = markdown(MOE_COLUMNS, moe_rows(records))
    if not args.write:
        print(table + "\n" + moe, end="")
        return 0
    doc = Path(args.write)
    try:
        doc.write_text(replace_section(replace_section(doc.read_text(), table), moe, MOE_START, MOE_END))
    except (OSError, ValueError) as e:
        print(f"table.py: {args.write}: {e}", file=sys.stderr)
        return 1
    print(f"table.py: {args.write}: {len(table.splitlines()) - 2} rows, {len(moe.splitlines()) - 2} MoE runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
