"""Summarises device.sh's /tmp/res into one JSON: per version the runner's phases (three runs), the probes' steps,
importtime's top entries. python3 summarize.py RES_DIR OUT_JSON"""
import json
import re
import statistics
import sys
from pathlib import Path

R, OUT = Path(sys.argv[1]), Path(sys.argv[2])


def load(p):
    try:
        return json.loads(Path(p).read_text())
    except (OSError, ValueError):
        return None


def phases(stats, inter):
    if not stats:
        return None
    s = stats.get("since_start_s") or {}
    out = {"time_to_ready_s": (inter or {}).get("time_to_ready_s"), "t_seconds": (inter or {}).get("t_seconds"),
           "since_start_s": s, "side_done_s": stats.get("side_done_s"), "load_wall_s": stats.get("load_wall_s"),
           "warm_up_s": stats.get("warm_up_s"), "load_seconds": stats.get("load_seconds"),
           "attention": stats.get("attention"), "kernels": stats.get("kernels"), "blas": stats.get("blas")}
    keys = ["runner_start", "weights", "loaded", "ready"]
    if all(s.get(k) is not None for k in keys):
        out["phase_s"] = {"start_and_imports": s["runner_start"], "setup_and_load": s["weights"] - s["runner_start"],
                          "side_waits_and_slots": s["loaded"] - s["weights"], "warm_up_and_ready": s["ready"] - s["loaded"]}
    lines = [ln for ln in ((inter or {}).get("stderr") or "").splitlines() if "prefill:" in ln][:6]
    out["stderr_head"] = lines
    return out


def importtime(path):
    rows = []
    for ln in Path(path).read_text(errors="replace").splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", ln)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)) // 2, m.group(4)))
    top = sorted(rows, key=lambda r: -r[1])
    roots = [r for r in rows if r[2] == 0]
    return {"total_s": round(sum(r[1] for r in roots) / 1e6, 3),
            "prefill_cumulative_s": next((r[1] / 1e6 for r in rows if r[3] == "prefill"), None),
            "prefill_self_s": next((r[0] / 1e6 for r in rows if r[3] == "prefill"), None),
            "top_level": [{"module": r[3], "cumulative_s": r[1] / 1e6, "self_s": r[0] / 1e6}
                          for r in sorted(roots, key=lambda r: -r[1])[:15]],
            "top_cumulative": [{"module": r[3], "depth": r[2], "cumulative_s": r[1] / 1e6} for r in top[:30]],
            "top_self": [{"module": r[3], "self_s": r[0] / 1e6} for r in sorted(rows, key=lambda r: -r[0])[:20]],
            "modules": len(rows)}


def floats(p):
    try:
        return [float(x) for x in Path(p).read_text().split()]
    except (OSError, ValueError):
        return None


res = {"versions": load(R / "versions.json"), "nvidia_smi": (R / "nvidia-smi.txt").read_text()
       if (R / "nvidia-smi.txt").is_file() else None}
for v in ("new", "old"):
    d = R / f"run-{v}"
    runs = [phases(load(d / f"{p}runner_stats.json"), load(d / f"{p}interact.json"))
            for p in ("", "repeat1-", "repeat2-")]
    reports = sorted(d.glob("*-h200-*.json")) if d.is_dir() else []
    rep = load(reports[0]) if reports else None
    res[v] = {"runs": runs, "run_notes": ["first: empty picks file and Triton cache", "warm", "warm"],
              "report_errors": (rep or {}).get("errors"), "report_commit": (rep or {}).get("commit"),
              "report_command": (rep or {}).get("command"),
              "importtime": {f"run{i}": importtime(R / f"importtime-{v}-{i}.txt")
                             for i in (1, 2) if (R / f"importtime-{v}-{i}.txt").is_file()},
              "compile_prefill_py_s": floats(R / f"compile-{v}.txt"),
              "wall_python_c_import_torch_s": floats(R / f"import-torch-{v}.txt"),
              "wall_python_c_import_prefill_s": floats(R / f"import-prefill-{v}.txt"),
              "probe": {k: load(R / f"probe-{v}-{k}.json") for k in ("cold", "warm1", "warm2")}}
    warm = [r for r in runs[1:] if r and r.get("phase_s")]
    if warm:
        res[v]["warm_median_phase_s"] = {k: statistics.median(r["phase_s"][k] for r in warm)
                                         for k in warm[0]["phase_s"]}
        res[v]["warm_time_to_ready_s"] = [r["time_to_ready_s"] for r in warm]
OUT.write_text(json.dumps(res, indent=1))
for v in ("new", "old"):
    print(v, "ttr", [r and r["time_to_ready_s"] for r in res[v]["runs"]],
          "phases", [r and r.get("phase_s") and {k: round(x, 2) for k, x in r["phase_s"].items()} for r in res[v]["runs"]])
    print(v, "side_done", [r and r.get("side_done_s") and {k: round(x, 2) for k, x in r["side_done_s"].items()}
                           for r in res[v]["runs"]])
    for k, p in res[v]["probe"].items():
        print(v, "probe", k, p and p["steps_s"], p and p.get("attention_parts_s"))
    it = res[v]["importtime"].get("run2")
    print(v, "importtime", it and it["total_s"], it and it["prefill_self_s"], it and it["top_level"][:6])
