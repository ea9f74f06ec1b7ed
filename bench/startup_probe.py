"""Where prefill's start-up goes, step by step and one step at a time, for one checkout of prefill.py.

    python bench/startup_probe.py --checkout /tmp/new --model DIR --out probe.json

Run in a fresh process: it times `import torch`, `import prefill` (the checkout's), CUDA's first context, the model
config and the safetensors headers, the tokenizer, then each start-up pick in turn, alone (no loading threads beside
them): pick_attention (its candidate checks, per-bucket checks and timings split out by wrapping prefill's own
check_attention / passes_bucket / time_attention), pick_kernels, pick_blas, and pick_experts where the checkout has
it. Every timed step ends with torch.cuda.synchronize(), so that a step's GPU work is its own. The picks file is
wherever prefill's default_picks_path() says (XDG_CACHE_HOME): run once on an empty one, then again, to see the cold
and the kept costs. The runner itself (under the harness, threads overlapping) is bench/run.py's business; this only
says what each piece costs alone.
"""

import argparse
import json
import os
import sys
import time

T_START = time.perf_counter()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    res = {"checkout": args.checkout, "steps_s": {}, "notes": {}}
    steps = res["steps_s"]

    def timed(name, fn, *a, sync=True):
        t = time.perf_counter()
        value = fn(*a)
        if sync and "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            sys.modules["torch"].cuda.synchronize()
        steps[name] = round(time.perf_counter() - t, 4)
        return value

    sys.path.insert(0, args.checkout)
    torch = timed("import_torch", __import__, "torch")
    prefill = timed("import_prefill", __import__, "prefill")
    res["prefill_file"] = prefill.__file__
    device = torch.device(args.device)
    timed("cuda_init", lambda: torch.empty(1, device=device))  # the context, on a GPU
    Config = getattr(prefill, "ModelConfig", None) or prefill.Qwen3Config
    cfg = timed("config", Config.from_dir, args.model)
    prefixes = getattr(cfg, "tensor_prefixes", None)
    timed("checkpoint_headers", lambda: prefill.Checkpoint(args.model, prefixes) if prefixes is not None
          else prefill.Checkpoint(args.model))
    picks = prefill.Picks(prefill.default_picks_path(), prefill.machine_key(device, cfg))
    res["picks_path"] = str(prefill.default_picks_path())
    res["picks_before"] = prefill.default_picks_path().is_file()
    timed("tokenizer", prefill.load_tokenizer, args.model)
    timed("tokenizer_again", prefill.load_tokenizer, args.model)

    # pick_attention's parts, by wrapping the module's own functions (looked up as globals inside prefill)
    parts = {}

    def wrap(name):
        inner = getattr(prefill, name, None)
        if inner is None:
            return

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                p = parts.setdefault(name, [0, 0.0])
                p[0] += 1
                p[1] += time.perf_counter() - t
        setattr(prefill, name, wrapper)
    for name in ("check_attention", "passes_bucket", "time_attention", "attention_reference", "make_attention",
                 "check_inputs", "attention_inputs", "gemm_tflops", "check_kernels", "check_experts"):
        wrap(name)
    res["notes"]["attention_to_time"] = bool(prefill.attention_to_time("auto", device, picks))
    names, _, report = timed("pick_attention", prefill.pick_attention, "auto", device, cfg, picks)
    res["notes"]["attention_picked"] = names
    res["notes"]["attention_checked"] = [e["name"] for e in report]
    res["attention_parts_s"] = {k: {"calls": v[0], "s": round(v[1], 4)} for k, v in parts.items()}
    parts.clear()
    kernels, _ = timed("pick_kernels", prefill.pick_kernels, "auto", device, cfg)
    res["notes"]["kernels"] = kernels.name
    blas, _ = timed("pick_blas", prefill.pick_blas, device, cfg, picks)
    res["notes"]["blas"] = blas
    if getattr(cfg, "num_experts", None) and hasattr(prefill, "pick_experts"):
        timed("pick_experts", prefill.pick_experts, "auto", device, cfg, picks)
    res["other_parts_s"] = {k: {"calls": v[0], "s": round(v[1], 4)} for k, v in parts.items()}
    steps["total_in_process"] = round(time.perf_counter() - T_START, 4)
    res["picks_after"] = json.loads(prefill.default_picks_path().read_text()) if \
        prefill.default_picks_path().is_file() else None
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({"checkout": args.checkout, **steps}))


if __name__ == "__main__":
    main()
