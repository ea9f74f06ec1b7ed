"""The fused experts' alignment (prefill.align_experts: count, scan, place) timed over its launch constants, per MoE
shape, on the device (one command, ~2 min on the H200; issue 37): which ALIGN_CHUNK, ALIGN_EXPERTS and ALIGN_BLOCKS
place a slice's (token, slot) entries fastest. Every configuration's ids and block experts must equal the default's
(the placement is defined by the routing alone, not by how the work is cut): a configuration that differs is
recorded as such and never best.

    python bench/align_sweep.py --out $OUT/align.json
    TRITON_INTERPRET=1 python bench/align_sweep.py --device cpu --tokens 300 --repeats 2 --out /tmp/align.json

Timed as the GPU runs them: the calls queued behind a sleep (gpu_timer); the host's launches take longer than the
GPU's work here (~70 us a call on the H200), and a run hides them under the GEMMs queued ahead. Each shape's routing: a random router's softmax top-k over tokens ~ N(0, 1) (prefill.route), as bench/moe_layer.py.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import prefill  # noqa: E402
from bench.moe_layer import timer  # noqa: E402


def gpu_timer(device, repeats):
    """ms(fn): the GPU's time a call, launches queued behind a sleep so that the host's ~25 us a Triton launch is
    not what is timed (in a run the GPU has the layer's GEMMs queued ahead of them); the host clock on the CPU."""
    if device.type != "cuda":
        return timer(device, repeats)

    def ms(fn):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000_000)  # ~50 ms at the H200's clocks: the host queues every call meanwhile
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    return ms

# (name, experts, top-k) of the families' routed experts (their config.json's)
SHAPES = [("qwen3-30b-a3b", 128, 8), ("deepseek-v3", 256, 8), ("moonlight-16b-a3b", 64, 6),
          ("qwen1.5-moe-a2.7b", 60, 4), ("gpt-oss-20b", 32, 4), ("gpt-oss-120b", 128, 4), ("mixtral-8x7b", 8, 2)]
CHUNKS, EXPERTS, BLOCKS = (256, 512, 1024, 2048), (8, 16, 32), (16, 32)


def chosen_of(experts, k, tokens, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    return logits.softmax(-1).topk(k, dim=-1).indices.to(torch.int32)  # [tokens, k], each row's experts


def placed(ids, block_expert, block_m):
    # what the alignment defines: each block's expert, and the ids of the blocks that have one (the others' ids are
    # never written, nor read)
    used = (block_expert >= 0).repeat_interleave(block_m)
    return block_expert.tolist(), ids[used].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens a slice (prefill's expert slices: 16,384)")
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    device = torch.device(args.device)
    ms, default = gpu_timer(device, args.repeats), (prefill.ALIGN_CHUNK, prefill.ALIGN_EXPERTS, prefill.ALIGN_BLOCKS)
    records, start = [], time.perf_counter()
    for name, experts, k in SHAPES:
        chosen = chosen_of(experts, k, args.tokens, device, seed=len(records))
        want = prefill.align_experts(chosen, experts, args.block_m)
        tried = {}
        for chunk, eb, jb in itertools.product(CHUNKS, EXPERTS, BLOCKS):
            prefill.ALIGN_CHUNK, prefill.ALIGN_EXPERTS, prefill.ALIGN_BLOCKS = chunk, eb, jb
            try:  # a launch the GPU cannot run (shared memory) is recorded with its error
                got = prefill.align_experts(chosen, experts, args.block_m)
            except Exception as e:
                tried[f"{chunk} {eb} {jb}"] = f"{type(e).__name__}: {e}"[:200]
                continue
            same = placed(*got, args.block_m) == placed(*want, args.block_m)
            tried[f"{chunk} {eb} {jb}"] = ms(lambda: prefill.align_experts(chosen, experts, args.block_m)) \
                if same else "differs from the default's placement"
        prefill.ALIGN_CHUNK, prefill.ALIGN_EXPERTS, prefill.ALIGN_BLOCKS = default
        timed = {c: t for c, t in tried.items() if not isinstance(t, str)}
        best = min(timed, key=timed.get)
        records.append({"shape": name, "experts": experts, "top_k": k, "tokens": args.tokens,
                        "block_m": args.block_m, "default": " ".join(map(str, default)),
                        "default_us": 1e3 * timed[" ".join(map(str, default))], "best": best,
                        "best_us": 1e3 * timed[best], "tried_us": {c: (1e3 * t if not isinstance(t, str) else t)
                                                                   for c, t in tried.items()}})
        r = records[-1]
        print(f"{name:<20} {experts:>4} experts top-{k}: default {r['default']} {r['default_us']:7.1f} us, "
              f"best {best} {r['best_us']:7.1f} us", flush=True)
    # the configuration best over all shapes: the sum of each shape's time relative to its own best
    score = {c: sum(r["tried_us"][c] / r["best_us"] for r in records) / len(records)
             for c in records[0]["tried_us"] if all(not isinstance(r["tried_us"][c], str) for r in records)}
    overall = min(score, key=score.get)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": prefill.triton.__version__, "wall_s": time.perf_counter() - start,
            "overall_best": overall, "overall_mean_over_best": score[overall],
            "default_mean_over_best": score[" ".join(map(str, default))]}
    Path(args.out).write_text(json.dumps({**meta, "records": records}, indent=1))
    print(f"over all shapes: best {overall} ({score[overall]:.3f}x each shape's best on average), "
          f"default {' '.join(map(str, default))} ({meta['default_mean_over_best']:.3f}x)")
    for r in records:
        print(f"{r['shape']:<20} default {r['default_us']:7.1f} us  overall-best {r['tried_us'][overall]:7.1f} us")


if __name__ == "__main__":
    main()
