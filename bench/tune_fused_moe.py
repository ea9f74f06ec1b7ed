"""The fused experts' tiles for this GPU, per shape and slice: each of fused_experts' GEMMs timed alone in every tile
of a search space, the best kept, printed as prefill.FUSED_TILES rows (one device command, < 8 min on the H200; issue
37).

    python bench/tune_fused_moe.py --out $OUT/fused-moe-tiles.json    # bench/moe_layer.py's nine shapes, 4,096 and
                                                                      # 16,384 tokens a slice
    python bench/tune_fused_moe.py --shapes qwen3-30b-a3b --tokens 16384 --out $OUT/tiles.json
    python bench/tune_fused_moe.py --shapes gpt-oss-20b --tokens 16384,65536 --out $OUT/tiles.json
    TRITON_INTERPRET=1 python bench/tune_fused_moe.py --device cpu --shapes tiny,tiny-gpt-oss --tokens 300 \\
        --float16 --out /tmp/tiles.json                               # a CPU try of the steps (no timing worth a look)

Per shape (hidden, experts, top-k, moe_intermediate) and slice of T tokens: bench/moe_layer.py's random layer and
tokens, routed by prefill.route (gpt-oss's shapes: its layer, weights [experts, in, out] read N-contiguous, biases,
clamped SwiGLU and router: the fused kernels' gpt-oss variants timed). For each BLOCK_M, the alignment once
(prefill.align_experts); then every gate+up GEMM tile and every down GEMM tile of SPACE, its weights read by pointers
and by TMA (LOADS), each with GROUP_M 1 and 16 (a runtime integer: no compile of its own), timed alone
(prefill.moe_gate_up, prefill.moe_down: the median of --repeats calls by CUDA events after a warm-up that compiles it);
a tile the GPU cannot run (shared memory, TMA before sm_90) is recorded with its error. A BLOCK_M's fused tile is its
fastest gate+up and fastest down; the two BLOCK_Ms' tiles are ranked by their whole experts' time (alignment, both
GEMMs, sum), checked against torch's grouped_mm experts on the same routing (relative error) and timed against them
(experts after routing).

Vendors ship such tables per GPU (vLLM's fused_moe/configs/E=…,N=…,device_name=….json, keyed by the token count;
DeepGEMM's per-GPU heuristics): prefill keeps its own in prefill.py (FUSED_TILES), keyed by (hidden, moe_intermediate,
rows an expert gets in a slice), the nearest shape's tiles offered to a model and timed at start-up with the other
expert kernels. The last lines printed are that table's entry for this GPU family: paste them over its rows.
--budget-s stops the search where it has run that long (the shapes and slices left are recorded as skipped).
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import prefill  # noqa: E402
from bench.moe_layer import SHAPES, layer_weights, rel_err, shape_config, shared_options, timer  # noqa: E402

# (BLOCK_N, BLOCK_K, warps, stages) of each GEMM per BLOCK_M, within the H200's 227 KiB of shared memory a program
# (a stage: BLOCK_M x BLOCK_K of rows and BLOCK_K x BLOCK_N of weights, twice BLOCK_N for gate+up) and 255 registers a
# thread (the accumulators: BLOCK_M x BLOCK_N floats, twice for gate+up, over 32 x warps threads): around vLLM's H100
# and H200 configs at 1,024-4,096 tokens (BLOCK_SIZE_M 64-128, N 128-256 over gate and up together, K 64-128,
# 4-8 warps, 3-5 stages)
SPACE = {
    64: {"gate_up": [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 4)],
         "down": [(64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 4, 4), (64, 128, 4, 3), (256, 64, 4, 3)]},
    128: {"gate_up": [(64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3), (128, 32, 8, 5)],
          "down": [(128, 64, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3), (256, 32, 8, 5)]},
}
GROUPS = (1, 16)
LOADS = (False, True)  # the weights by pointers, or by TMA (a TensorDescriptor: NVIDIA from sm_90)
CPU_SPACE = {16: {"gate_up": [(32, 32, 4, 1), (16, 64, 4, 1)], "down": [(32, 32, 4, 1), (64, 16, 4, 1)]}}  # --float16


def log(msg):
    print(f"tune_fused_moe: {msg}", file=sys.stderr, flush=True)


def best_gemm(name, fn, tiles, ms):
    """(the fastest (BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA), ms), and {tile: ms or the error} of every one
    tried."""
    tried = {}
    for (n, k, warps, stages), tma in ((tile, tma) for tile in tiles for tma in LOADS):
        for group in GROUPS:
            tile = (n, k, group, warps, stages, tma)
            try:
                tried[tile] = ms(lambda: fn(tile))
            except Exception as e:  # too much shared memory for this GPU, no TMA, a compile error: that tile is out
                tried[tile] = prefill.failure(e)
                log(f"{name} {tile}: {tried[tile]}")
                break  # the other GROUP_M runs the same kernel
    timed = {t: v for t, v in tried.items() if isinstance(v, float)}
    return (min(timed, key=timed.get), min(timed.values())) if timed else (None, math.inf), tried


def tune(name, tokens, w, device, space, ms):
    cfg = shape_config(name)
    H, E, k, I = SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen, device=device).to(prefill.DTYPE)
    h = prefill.rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    weights, chosen = prefill.route(h, w, cfg.router)
    act_fn, up_bias, down_bias = cfg.expert_activation, w.gate_up_bias, w.down_bias
    flops = 6 * tokens * k * H * I
    record = {"shape": name, "tokens": tokens, "rows_per_expert": tokens * k // E, "key": [H, I, tokens * k // E],
              "block_m": {}}
    for block_m, gemms in space.items():
        ids, block_expert = prefill.align_experts(chosen, E, block_m)
        (up, up_ms), up_tried = best_gemm("gate_up", lambda t: prefill.moe_gate_up(
            h, w.gate_up, ids, block_expert, k, block_m, t, up_bias, act_fn), gemms["gate_up"], ms)
        act = prefill.moe_gate_up(h, w.gate_up, ids, block_expert, k, block_m, up, up_bias, act_fn) if up else None
        (down, down_ms), down_tried = best_gemm("down", lambda t: prefill.moe_down(
            act, w.down, ids, block_expert, weights.numel(), block_m, t, down_bias), gemms["down"] if up else [], ms)
        entry = {"gate_up": up, "gate_up_ms": up_ms, "down": down, "down_ms": down_ms,
                 "gate_up_tried": {str(t): v for t, v in up_tried.items()},
                 "down_tried": {str(t): v for t, v in down_tried.items()}}
        if up and down:
            tile = (block_m, up, down)
            entry["experts_ms"] = ms(lambda: prefill.fused_experts(x, h, weights, chosen, w, tile, act_fn))
            entry["alignment_ms"] = ms(lambda: prefill.align_experts(chosen, E, block_m))
            entry["gemm_tflops"] = flops / (up_ms + down_ms) / 1e9
        record["block_m"][block_m] = entry
        log(f"{name} {tokens} BLOCK_M {block_m}: gate_up {up} {up_ms:.3f} ms, down {down} {down_ms:.3f} ms")
    ranked = sorted((e["experts_ms"], m) for m, e in record["block_m"].items() if "experts_ms" in e)
    record["tiles"] = [(m, record["block_m"][m]["gate_up"], record["block_m"][m]["down"]) for _, m in ranked]
    if record["tiles"]:  # the best against torch's grouped_mm experts on the same routing (where it runs here)
        best = prefill.make_experts("fused", record["tiles"][0], act_fn)
        fused_out, grouped_out = x.clone(), x.clone()
        best(fused_out, h, weights, chosen, w, None)
        record["experts_ms"], record["experts_tflops"] = ranked[0][0], flops / ranked[0][0] / 1e9
        try:
            grouped = prefill.make_experts("grouped_mm", None, act_fn)
            kernels = prefill.TRITON_KERNELS if device.type == "cuda" else prefill.TORCH_KERNELS
            grouped(grouped_out, h, weights, chosen, w, kernels)
            record["rel_err_to_grouped_mm"] = rel_err(fused_out.float() - x.float(), grouped_out.float() - x.float())
            record["grouped_mm_experts_ms"] = ms(lambda: grouped(grouped_out, h, weights, chosen, w, kernels))
        except Exception as e:
            record["grouped_mm"] = prefill.failure(e)
    return record


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared_options(ap, "every timing (JSON)")  # --float16 also searches CPU_SPACE, a tiny one
    ap.add_argument("--tokens", default="16384,4096", help="tokens a slice holds, comma-separated")
    ap.add_argument("--budget-s", type=float, default=420, help="no new shape or slice after this many seconds")
    ap.add_argument("--family", help="the FUSED_TILES key printed (default: this device's prefill.gpu_family)")
    args = ap.parse_args(argv)
    if args.float16:
        prefill.DTYPE = torch.float16
    device, t0 = torch.device(args.device), time.perf_counter()
    ms, space = timer(device, args.repeats), CPU_SPACE if args.float16 else SPACE
    records, skipped = [], []
    for name in args.shapes.split(","):
        w = layer_weights(shape_config(name), device)
        for tokens in map(int, args.tokens.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                skipped.append((name, tokens))
                continue
            records.append(tune(name, tokens, w, device, space, ms))
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    family = args.family or prefill.gpu_family(device)
    table = {tuple(r["key"]): r["tiles"][:2] for r in records if r["tiles"]}
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": getattr(prefill.triton, "__version__", None),
              "commit": args.commit, "family": family, "space": {m: g for m, g in space.items()},
              "groups": GROUPS, "loads": LOADS, "skipped": skipped, "wall_s": time.perf_counter() - t0,
              "records": records,
              "fused_tiles": [[list(key), tiles] for key, tiles in table.items()]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'shape':16} {'tokens':>6} {'rows/e':>6}  {'best fused tile':44} {'experts ms':>10} {'TFLOP/s':>7} "
          f"{'GEMMs TFLOP/s':>13} {'grouped_mm ms':>13} {'rel err':>8}")
    for r in records:
        if not r["tiles"]:
            print(f"{r['shape']:16} {r['tokens']:>6} {r['rows_per_expert']:>6}  no tile ran")
            continue
        gemm = r["block_m"][r["tiles"][0][0]]["gemm_tflops"]
        print(f"{r['shape']:16} {r['tokens']:>6} {r['rows_per_expert']:>6}  "
              f"{prefill.tile_name('fused', r['tiles'][0]):44} {r['experts_ms']:>10.3f} {r['experts_tflops']:>7.0f} "
              f"{gemm:>13.0f} {r.get('grouped_mm_experts_ms', math.nan):>13.3f} "
              f"{r.get('rel_err_to_grouped_mm', math.nan):>8.1e}")
    if skipped:
        print(f"skipped (--budget-s {args.budget_s:g}): {skipped}")
    print(f"wall {report['wall_s']:.0f} s -> {args.out}; prefill.FUSED_TILES[{family!r}] =")
    print("{" + ",\n ".join(f"{key}: {tiles}" for key, tiles in table.items()) + "}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
