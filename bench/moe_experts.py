"""The MoE feed-forward's pieces on one GPU, at Qwen3-30B-A3B's geometry (one device command, ~1-2 min).

    python bench/moe_experts.py --out bench/results/moe-experts.json                    # the GPU, 30B-A3B
    python bench/moe_experts.py --device cpu --geometry tiny-moe --chunks 64,256 --out /tmp/moe.json   # a CPU try

One MoE layer's router and all its experts, random (bf16, on the device). For each chunk size (tokens a moe_block
slice holds): the start-up check of every expert kernel candidate (prefill.check_experts) and its result; each
passing candidate's two grouped GEMMs (gate_up, down) on the chunk's real routing, in ms and TFLOP/s, against one
dense GEMM of the same rows (what a grouped GEMM could at best reach); routing (router GEMM, softmax, top-k, sort,
row gather), the SwiGLU and the combination (plain, and fused where Triton runs), each alone; moe_block whole per
candidate with the fused kernels a run would pick (prefill.pick_kernels); its peak device memory
against prefill.moe_scratch_per_token; and whether a repeat gives the same bits. Then the plan arithmetic at this
machine's measured rates: pinned host->device GB/s (prefill.h2d_gbps on one layer's bytes) and the best candidate's
rate: copy and compute ms of one streamed layer at a 45k-token wave, and the wave at which compute hides the copy.
Prints a table last and writes it as JSON to --out.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import interact  # noqa: E402
import prefill  # noqa: E402
import prefill_doctor  # noqa: E402
from bench.make_checkpoint import GEOMETRIES  # noqa: E402


def config(geometry):
    return prefill.ModelConfig.from_json(interact.config_json(GEOMETRIES[geometry]))


def ms(fn, device, repeats):
    # mean ms a call after one warm-up call, the device drained before and after
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t) / repeats * 1e3


def layer_weights(cfg, device):
    gen = torch.Generator(device=device).manual_seed(0)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def randn(*shape, std):
        return (torch.randn(shape, generator=gen, device=device) * std).to(prefill.DTYPE)
    return prefill.LayerWeights(mlp_norm=torch.ones(H, device=device, dtype=prefill.DTYPE),
                                router=randn(E, H, std=H ** -0.5), gate_up=randn(E, 2 * I, H, std=H ** -0.5),
                                down=randn(E, H, I, std=I ** -0.5))


def chunk_rows(cfg, w, h):
    weights, chosen = prefill.route(h, w, cfg.router)
    pairs, bounds = prefill.expert_rows(chosen, cfg.num_experts)
    return weights, chosen, pairs, bounds, h[pairs // chosen.shape[1]]


def measure_chunk(cfg, w, tokens, entries, device, repeats, kernels):
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen, device=device).to(prefill.DTYPE)
    h = prefill.rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    weights, chosen, pairs, bounds, rows = chunk_rows(cfg, w, h)
    counts = (bounds[1:] - bounds[:-1]).tolist()
    R, flops = rows.shape[0], 2 * rows.shape[0] * 3 * I * H
    act = prefill.TORCH_KERNELS.gated_act(prefill.grouped_loop(rows, w.gate_up, bounds), "silu")
    out = prefill.grouped_loop(act, w.down, bounds)
    row_of = prefill.pair_rows(pairs)
    dense_gate_up, dense_down = w.gate_up[0], w.down[0]
    row = {
        "tokens": tokens, "rows": R, "rows_per_expert_min_mean_max": [min(counts), R / len(counts), max(counts)],
        "experts_without_rows": sum(c == 0 for c in counts), "expert_gflop": flops / 1e9,
        "route_sort_gather_ms": ms(lambda: chunk_rows(cfg, w, h), device, repeats),
        "silu_mul_ms": ms(lambda: kernels.gated_act(torch.empty(R, 2 * I, device=device, dtype=prefill.DTYPE),
                                                    "silu"), device, repeats),
        "dense_same_rows_ms": ms(lambda: (F.linear(rows, dense_gate_up), F.linear(act, dense_down)), device, repeats),
        "candidates": {},
    }
    row["dense_same_rows_tflops"] = flops / row["dense_same_rows_ms"] / 1e9
    row["combine_ms"] = {name: ms(lambda: fn(x.clone(), out, row_of, weights), device, repeats)
                         for name, fn in combinations(kernels).items()}
    for entry, kind, tile in entries:
        experts = entry["experts"]
        grouped = None if kind == "fused" else prefill.make_grouped(kind, tile)  # the fused experts: no GEMM alone
        gemms = ms(lambda: (grouped(rows, w.gate_up, bounds), grouped(act, w.down, bounds)), device, repeats) \
            if grouped else None
        block_x = x.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        prefill.moe_block(block_x, w, cfg, tokens, kernels, experts)
        peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
        again = x.clone()
        prefill.moe_block(again, w, cfg, tokens, kernels, experts)
        block = ms(lambda: prefill.moe_block(x.clone(), w, cfg, tokens, kernels, experts), device, repeats)
        row["candidates"][entry["name"]] = {
            "grouped_gemms_ms": gemms, "grouped_tflops": flops / gemms / 1e9 if gemms else None, "moe_block_ms": block,
            "moe_block_peak_bytes": peak, "same_bits_twice": torch.equal(block_x, again)}
    row["scratch_bytes_planned"] = tokens * prefill.moe_scratch_per_token(cfg)
    return row


def combinations(kernels):
    # the plain combination (a gather, then one batched GEMM) and, where the fused kernels run, Triton's
    both = {"torch": prefill.combine}
    if kernels.name == "triton":
        both["triton"] = prefill.combine_triton
    return both


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="qwen3-30b-a3b", choices=[g for g in GEOMETRIES if "num_experts" in
                                                                     GEOMETRIES[g]])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunks", default="4096,16384,32768", help="tokens per moe_block slice, comma-separated")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True, help="JSON report")
    ap.add_argument("--commit", help="the commit measured (recorded as given)")
    ap.add_argument("--tiles", default="", help="more Triton grouped GEMM tiles to check and time, comma-separated "
                                                "MxNxKxWARPSxSTAGES (e.g. 128x256x64x8x3)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = config(args.geometry)
    report = {"geometry": args.geometry, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
              "cpu", "torch": torch.__version__, "grouped_mm_native": prefill.grouped_mm_native(device),
              "commit": args.commit}
    # every candidate of this device, the CPU's Triton too (refused there: the check is the judge)
    slice_tokens = prefill.plan_memory(cfg, 0).moe_chunk_tokens  # the default plan's: the fused tiles' shape
    candidates = list(dict.fromkeys(prefill.expert_candidates("auto", device, cfg, slice_tokens)
                                    + prefill.expert_candidates("triton", device, cfg, slice_tokens)))
    for tile in filter(None, args.tiles.split(",")):  # more Triton tiles to try: BLOCK_M x N x K x warps x stages
        m, n, k, warps, stages = map(int, tile.split("x"))
        candidates.append((f"triton {m}x{n}x{k} w{warps} s{stages}", "triton", (m, n, k, warps, stages)))
    t = time.perf_counter()
    checked = prefill.check_experts(candidates, device, cfg)
    report["check_s"] = time.perf_counter() - t
    report["check"] = {e["name"]: e.get("reason") or f"passed, error {e['error']:.2e}" for e in checked}
    passed = [(e, kind, tile) for e, (_, kind, tile) in zip(checked, candidates) if e["experts"] is not None]
    w = layer_weights(cfg, device)
    kernels, report["kernel_errors"] = prefill.pick_kernels("auto", device, cfg)  # as a run picks them
    report["kernels"] = kernels.name
    report["chunks"] = [measure_chunk(cfg, w, int(n), passed, device, args.repeats, kernels)
                        for n in args.chunks.split(",")]
    del w
    if device.type == "cuda":
        torch.cuda.empty_cache()
        gbps, _ = prefill_doctor.h2d_gbps(device, prefill.pin_method(), cfg.layer_bytes)
    else:
        gbps = 55.0  # about the H200's measured pinned host->device rate (55.5 GB/s): the CPU has no such copy
    best = max((c["grouped_tflops"], name) for chunk in report["chunks"] for name, c in chunk["candidates"].items()
               if c["grouped_tflops"])
    copy, compute = prefill.layer_balance(cfg, 45_000, gbps, best[0], attended=225)
    report["plan"] = {"h2d_gbps": gbps, "h2d_measured": device.type == "cuda", "best_grouped_tflops": best[0],
                      "best_candidate": best[1], "layer_bytes": cfg.layer_bytes,
                      "copy_ms_per_layer": copy, "compute_ms_per_layer_at_45k": compute,
                      "hiding_wave_tokens": prefill.hiding_tokens(cfg, gbps, best[0], attended=225)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name, verdict in report["check"].items():
        print(f"check {name:28s} {verdict}")
    for chunk in report["chunks"]:
        print(f"chunk {chunk['tokens']:6d} tokens: rows/expert {chunk['rows_per_expert_min_mean_max']}, route "
              f"{chunk['route_sort_gather_ms']:.3f} ms, silu {chunk['silu_mul_ms']:.3f}, combine "
              + ", ".join(f"{k} {v:.3f}" for k, v in chunk["combine_ms"].items())
              + f", dense same rows {chunk['dense_same_rows_tflops']:.0f} TFLOP/s")
        for name, c in chunk["candidates"].items():
            peak = f"{c['moe_block_peak_bytes'] / 2**20:.0f}" if c["moe_block_peak_bytes"] is not None else "-"
            gemms = f"{c['grouped_gemms_ms']:8.3f} ms {c['grouped_tflops']:7.1f} TFLOP/s" if c["grouped_tflops"] \
                else f"{'(fused: bench/moe_layer.py)':>25}"
            print(f"  {name:26s} grouped {gemms}, "
                  f"moe_block {c['moe_block_ms']:8.3f} ms, peak {peak} MiB "
                  f"(planned {chunk['scratch_bytes_planned'] / 2**20:.0f}), same bits {c['same_bits_twice']}")
    plan = report["plan"]
    print(f"plan: {plan['layer_bytes'] / 1e9:.2f} GB a layer at {plan['h2d_gbps']:.1f} GB/s = "
          f"{plan['copy_ms_per_layer']:.1f} ms; compute at 45k tokens {plan['compute_ms_per_layer_at_45k']:.1f} ms "
          f"({plan['best_candidate']}, {plan['best_grouped_tflops']:.0f} TFLOP/s); compute hides the copy from "
          f"{plan['hiding_wave_tokens']} tokens a wave")
    return 0


if __name__ == "__main__":
    sys.exit(main())
