"""Block-wise FP8 on a GPU, in one command: a tiny FP8 Qwen3 (tests/test_fp8.py's writer) scored on the GPU with the
dequantization picked at start-up (Triton where its check passes) and with plain PyTorch, resident and every layer
streamed, against prefill's own CPU run of the same checkpoint. Prints one JSON line; nothing here is a speed figure.

    python bench/fp8_smoke.py --tokenizer .cache/tokenizer --out /tmp/fp8
"""
import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

import prefill  # noqa: E402
from test_fp8 import write_fp8_checkpoint  # noqa: E402
from test_prefill import TEXTS, max_rel_err  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    path = write_fp8_checkpoint(Path(args.out), args.tokenizer)
    cpu = prefill.Runner(path, device="cpu", attention="sdpa")
    ids = cpu.tokenize(TEXTS)
    want = cpu.losses(ids)
    report = {"cpu_losses": want}
    for kernels in ("auto", "torch"):
        for budget in (None, 0):
            r = prefill.Runner(path, device="cuda", kernels=kernels, gpu_memory_gib=budget)
            got = r.losses(ids)
            report[f"{kernels} {'streamed' if budget == 0 else 'resident'}"] = {
                "kernels": r.kernels.name, "dequantize": r.kernels.dequantize_layer.__name__,
                "kernel_errors": r.kernel_errors, "streamed_layers": len(r.plan.streamed_layers),
                "max_rel_err_vs_cpu": max_rel_err(got, want), "losses": got}
    runs = [v for k, v in report.items() if k != "cpu_losses"]
    report["streamed_equals_resident"] = [runs[0]["losses"] == runs[1]["losses"], runs[2]["losses"] == runs[3]["losses"]]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
