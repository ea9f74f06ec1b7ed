"""prefill.main with the start-up's timing gate counted: how many gated series ran, how many gates each queued and
the seconds spent queueing them and waiting (bench/startup/first_start.sh; issue 37's first-start question).

    python bench/startup/gated_main.py --gate-out gate.json [--tries N] -- <prefill.py arguments>
"""

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import prefill  # noqa: E402


def main():
    argv = sys.argv[1:]
    split = argv.index("--")
    own, rest = argv[:split], argv[split + 1:]
    out = own[own.index("--gate-out") + 1]
    if "--tries" in own:
        prefill.GATE_TRIES = int(own[own.index("--tries") + 1])
    series, inner, real_queue, local = [], prefill.gated, prefill.queue_gate, threading.local()

    def queue(device, scale=1):  # the picks run on side threads: each gated series counts its own gates
        getattr(local, "gates", []).append(scale)
        return real_queue(device, scale)

    def counted(device, launch):
        local.gates, t = [], time.perf_counter()
        try:
            return inner(device, launch)
        finally:
            series.append({"gates": local.gates, "s": round(time.perf_counter() - t, 4)})
    prefill.queue_gate = queue
    prefill.gated = counted
    try:
        return prefill.main(rest)
    finally:
        Path(out).write_text(json.dumps({"gate_tries": prefill.GATE_TRIES, "series": len(series),
                                         "retried": sum(len(s["gates"]) > 1 for s in series),
                                         "gated_s": round(sum(s["s"] for s in series), 3), "each": series}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
