"""prefill --doctor: every start-up decision on this machine and why, in one screen (and JSON with --stats), for the first
run on a new machine (a W7800 nobody here could run) to answer what was decided blind.
Imported by prefill.py's command line for --doctor.
"""
import json
import math
import os
import time
from pathlib import Path

import torch

from prefill import (ATTENTION_BUCKETS, BLAS_LIBRARIES, BUCKET_LABELS, CHECK_LENGTHS, DTYPE, PIN_METHODS, WAVE_STEP, GiB,
                     attention_candidates, attention_summary, check_attention, check_experts,
                     check_writable, expert_candidates, expert_timing_inputs, experts_ms, gemm_shapes, gemm_tflops,
                     gpu_arch, gpu_family, host_memory_spare, layer_flops, package_version, pinned_empty, runner_of,
                     time_attention, triton, unoffered_attention, unpin, warmed_up)

CONTEST_TOKENS = 45_244  # contest-100's tokens in bench/results: 100 NuminaMath chats of < 2048 characters


def h2d_gbps(device, method, nbytes=GiB):
    # host->device copy rate out of pinned memory, and the seconds that page-locking nbytes took
    t = time.perf_counter()
    host, registered = pinned_empty(nbytes // DTYPE.itemsize, method, lambda buf: buf.fill_(1))
    lock_s = time.perf_counter() - t
    dst = torch.empty_like(host, device=device)
    dst.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    rate = 3 * nbytes / (time.perf_counter() - t) / 1e9
    if registered:
        unpin(host)
    return rate, lock_s


def unavailable_here(kind, device):
    """Why attention `kind` cannot run on this machine by design (the doctor shows it as expected, not as a
    failure), or None where it should run."""
    if kind == "triton" and triton is None:
        return "triton is not installed"
    if kind == "flash" and package_version("flash_attn") is None:
        return "flash_attn is not installed"
    if device.type == "cpu" and kind != "sdpa" and not (kind == "triton" and os.environ.get("TRITON_INTERPRET") == "1"):
        return "a GPU kernel, not on the CPU"
    return None


def same_bits_caveats(hip, environ):
    """What can give other bits for the same input on another start, beside the picks (kept per machine), that the
    repeat probe within one process cannot see."""
    caveats = []
    if hip:  # torch sets each rocBLAS handle's atomics mode from the flag (aten/src/ATen/cuda/CublasHandlePool.cpp)
        caveats.append("rocBLAS may sum with atomics (torch allows them unless torch.use_deterministic_algorithms is "
                       "on), so a GEMM can differ in its last bits from run to run")
    if environ.get("PYTORCH_TUNABLEOP_ENABLED") == "1":
        caveats.append("PYTORCH_TUNABLEOP_ENABLED=1: torch picks each GEMM's kernel by timing, so another start "
                       "can pick others unless PYTORCH_TUNABLEOP_FILENAME keeps the results and tuning is off")
    return caveats


def doctor(runner):
    """(report lines, figures, problems) for a loaded, warmed-up Runner."""
    cfg, plan, dev = runner.cfg, runner.plan, runner.device
    cuda = dev.type == "cuda"
    fig = {"torch": torch.__version__, "hip": torch.version.hip, "cuda": torch.version.cuda,
           "triton": triton.__version__ if triton is not None else None, "flash_attn": package_version("flash_attn"),
           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "gpu_family": gpu_family(dev)}
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        fig["arch"] = gpu_arch(props)
        fig["gpu_free_bytes"], fig["gpu_total_bytes"] = torch.cuda.mem_get_info(dev)
    fig["host_spare_bytes"] = host_memory_spare()
    fig.update(load_mode=runner.load_mode, pin_method=runner.pin_method, locked_bytes=runner.pinned_host_bytes,
               lock_s=runner.lock_s, load_wall_s=runner.load_wall_s)
    if cuda:  # both ways of page-locking 1 GiB, and the copy rate out of the one in use
        measured = {m: h2d_gbps(dev, m) for m in PIN_METHODS}
        fig["lock_s_per_gb"] = {m: lock_s / (GiB / 1e9) for m, (_, lock_s) in measured.items()}
        fig["h2d_gbps"] = measured[runner.pin_method][0]
    # every candidate offered here, checked and timed per bucket (the start-up checks only the kept ones where known)
    report = check_attention(attention_candidates("auto", fig["gpu_family"], cfg), dev, cfg)
    for label in BUCKET_LABELS if cuda else ():
        time_attention([e for e in report if e["attend"] is not None], label, dev, cfg)
    for e in report:
        if "reason" in e:
            e["expected"] = unavailable_here(e["name"].split()[0], dev)
    fig["attention_not_offered"] = unoffered_attention(fig["gpu_family"], cfg)
    failed = [e["name"] for e in report if "reason" in e and not e["expected"]]
    fig["attention"] = runner.attention
    fig["attention_candidates"] = [{k: v for k, v in e.items() if k != "attend"} for e in report]
    fig.update(kernels=runner.kernels.name, kernel_errors=runner.kernel_errors, blas=runner.blas)
    if cfg.num_experts:  # every expert kernel offered here, checked, and timed on a chunk's shapes
        experts = check_experts(expert_candidates("auto", dev, cfg, plan.moe_chunk_tokens), dev, cfg)
        inputs = expert_timing_inputs(dev, cfg, plan.moe_chunk_tokens, runner.kernels) if cuda else None
        rows = inputs[3].numel() if cuda else 0  # the slice's (token, slot) rows
        for e in experts:
            if cuda and e["experts"] is not None:
                e["time_ms"] = experts_ms(e["experts"], inputs)
                e["tflops"] = 6 * rows * cfg.moe_intermediate_size * cfg.hidden_size / (e["time_ms"] / 1e3) / 1e12
        fig["experts"] = runner.experts
        fig["expert_candidates"] = [{k: v for k, v in e.items() if k != "experts"} for e in experts]
    if cuda:
        # a layer's weights on the device (a resident one's, else a slot's); a dense one where the model has any,
        # whose MLP's GEMMs are timed too
        kind = "mlp" if "mlp" in cfg.layouts else cfg.largest_kind
        w = runner.streamer.scratch_views[kind] if cfg.quantized else \
            next((w for i, w in runner.streamer.resident.items() if cfg.layer_kinds[i] == kind), None) \
            or runner.streamer.slot_views[0][kind]  # an FP8 or MXFP4 model's: the bf16 scratch its layers become
        shapes = gemm_shapes(cfg, plan.chunk_tokens)[:-1] + [("lm_head", plan.loss_chunk_tokens, cfg.vocab_size,
                                                              cfg.hidden_size)]
        own = {name: getattr(w, name) for name, _, _, _ in shapes[:-1]} | {"lm_head": runner.lm_head}
        fig["gemm_tflops"] = {}
        for library in BLAS_LIBRARIES:
            torch.backends.cuda.preferred_blas_library(library)
            fig["gemm_tflops"][library] = gemm_tflops(dev, shapes, own)
        torch.backends.cuda.preferred_blas_library(runner.blas)
        # contest-100 projected: each token's GEMM FLOPs at the rates measured for the library in use
        rate = fig["gemm_tflops"][runner.blas]

        def token_s(kind):  # in a layer of kind; a MoE layer's router and k experts at the picked kernel's rate
            gemms = [(name, N, K) for name, _, N, K in shapes[:-1] if kind == "mlp" or name not in ("gate_up", "down")]
            dense_s = sum(2 * N * K / (rate[name] * 1e12) for name, N, K in gemms)
            return dense_s if kind == "mlp" else dense_s + (layer_flops(cfg, kind, 1) - 2 * sum(
                N * K for _, N, K in gemms)) / (next(e["tflops"] for e in fig["expert_candidates"]
                                                     if e["name"] == runner.experts) * 1e12)
        per_token = sum(token_s(kind) * cfg.layer_kinds.count(kind) for kind in cfg.layouts)
        fig["contest100_compute_s"] = CONTEST_TOKENS * (per_token + 2 * cfg.vocab_size * cfg.hidden_size
                                                        / (rate["lm_head"] * 1e12))
        fig["contest100_transfer_s"] = sum(cfg.layer_nbytes[i] for i in plan.streamed_layers) / (fig["h2d_gbps"] * 1e9)
    fig["plan"] = f"{plan.describe()}; {runner.host_plan.describe()}"
    # required paths: the warm-up ran every kernel; the same request twice gives the same bits
    gen = torch.Generator().manual_seed(2)
    probe = [torch.randint(cfg.vocab_size, (n,), generator=gen).tolist() for n in (300, 650, 41)]
    first, second = runner.losses(probe), runner.losses(probe)
    fig["repeat_identical"] = first == second
    fig["same_bits_caveats"] = same_bits_caveats(torch.version.hip, os.environ)
    problems = [] if fig["repeat_identical"] else ["the same request twice gave different losses"]
    problems += [f"loss is not finite: {x}" for x in first if not math.isfinite(x)]

    def gb(n):
        return "?" if n is None else f"{n / 1e9:.1f} GB"
    lines = [f"machine    {fig['device']} ({fig.get('arch', '-')}, {fig['gpu_family']}); torch {fig['torch']}, "
             f"{'HIP ' + fig['hip'] if fig['hip'] else 'CUDA ' + str(fig['cuda'])}, triton {fig['triton']}, "
             f"flash_attn {fig['flash_attn']}",
             "memory     " + (f"GPU {gb(fig['gpu_free_bytes'])} free of {gb(fig['gpu_total_bytes'])}; " if cuda else "")
             + f"host {gb(fig['host_spare_bytes'])} can be page-locked (available less a margin)",
             f"load       {runner.load_mode}, pinned by {runner.pin_method}: {gb(runner.pinned_host_bytes)} locked in "
             f"{runner.lock_s:.1f} s" + (f"; 1 GiB locks in {fig['lock_s_per_gb']['register']:.2f} s/GB by "
                                         f"register, {fig['lock_s_per_gb']['alloc']:.2f} s/GB by alloc; "
                                         f"host->device {fig['h2d_gbps']:.1f} GB/s" if cuda else "")]
    sinks = any(how.sinks for how in cfg.attention)
    if cfg.kv_lora_rank:  # DeepSeek's: what the kernels below run on
        lines.append(f"attention  multi-head latent (MLA): {cfg.num_attention_heads} heads, q/k head dim "
                     f"{cfg.head_dim} ({cfg.qk_nope_head_dim} + RoPE {cfg.rope_dim}"
                     + (", interleaved" if cfg.rope_interleave else "") + f"), v {cfg.v_head_dim}; latents "
                     + (f"q {cfg.q_lora_rank}, " if cfg.q_lora_rank else "q none (q_proj), ")
                     + f"kv {cfg.kv_lora_rank}, expanded per token; softmax scale {cfg.attention[0].scale:.4g}"
                     + (f", {cfg.ropes[0].kind} RoPE" if cfg.ropes[0].kind != "default" else ""))
    lines.append(f"attention  by the longest text in a chunk: {attention_summary(runner.attention)} (each checked "
                 f"against float32 attention on texts of {CHECK_LENGTHS}, then each bucket's own"
                 + (", with sinks: a logit a head in each row's softmax denominator, from -2 to 10 across the heads"
                    if sinks else "") + "; rel. error: the worst row's largest difference over that row's largest "
                 "value)")
    if cuda:
        lines.append("  ms a chunk (first call) per bucket, * picked: " + ", ".join(
            f"{label} timed on {len(timed)} texts of {sum(timed)} tokens" for label, _, timed, _ in ATTENTION_BUCKETS))
    for e in fig["attention_candidates"]:
        if "reason" in e:
            state = f"not here: {e['expected']}" if e["expected"] else f"FAILED: {e['reason'][:90]}"
        else:
            state = f"rel. error {e['error']:.1e}" + "".join(
                f"  {'*' if runner.attention[label] == e['name'] else ' '}{e['time_ms'][label]:7.3f} "
                f"({e['first_ms'][label]:7.1f})" for label in BUCKET_LABELS if label in e.get("time_ms", {}))
        lines.append(f"    {e['name']:<14} {state}")
    lines += [f"    {kind:<14} not offered: {why}" for kind, why in fig["attention_not_offered"].items()]
    errors = ", ".join(f"{k} {v:.1e}" for k, v in runner.kernel_errors.items() if k != "lm_head")
    fused_here = None if cuda else "not on the CPU" if triton is not None else "triton is not installed"
    lines.append(f"kernels    {runner.kernels.name}" + (f" (rel. error against float32 math: {errors})" if errors else
                                                        f" (fused Triton kernels: {fused_here})" if fused_here else "")
                 + f"; float32 logits by {runner.kernels.head.__name__} (rel. error against float64 math: "
                   f"{runner.kernel_errors['lm_head']:.1e})")
    if cfg.quantized:
        held = (f"block-wise FP8 ({cfg.fp8_scales} scales): held and streamed as FP8" if cfg.fp8_scales else
                "MXFP4 experts (e2m1 codes, an e8m0 scale a 32: 4.25 bits a weight): held and streamed as MXFP4")
        lines.append(f"weights    {held} (a layer {cfg.layer_bytes / 1e9:.2f} GB), dequantized on {dev} into a bf16 "
                     f"scratch before each layer runs, by the {runner.kernels.name} kernel "
                     + ("in one launch a layer" if runner.kernels.name == "triton" else "tensor by tensor")
                     + " (checked bit for bit against transformers' math)"
                     + ("; the routed experts stay FP8 (the plan's budget), dequantized in their GEMMs"
                        if cfg.fp8_experts else ""))
    if cfg.num_experts:
        dense = cfg.layer_kinds.count("mlp")
        lines.append(f"routing    {cfg.num_experts} experts a layer, {cfg.router.describe()}"
                     + (f"; shared experts {cfg.shared_intermediate_size} wide" if cfg.shared_expert else "")
                     + (f"; {dense} of {cfg.num_hidden_layers} layers dense" if dense else ""))
        lines.append(f"experts    {runner.experts} (checked against float32 experts on uneven routing)"
                     + (f"; ms and TFLOP/s of a {plan.moe_chunk_tokens}-token slice's experts after routing, * picked"
                        if cuda else ""))
        for e in fig["expert_candidates"]:
            state = f"refused: {e['reason'][:90]}" if "reason" in e else f"error {e['error']:.1e}" + (
                f"  {'*' if e['name'] == runner.experts else ' '}{e['time_ms']:7.3f} ms {e['tflops']:5.0f}"
                if "time_ms" in e else "")
            lines.append(f"    {e['name']:<18} {state}")
    if cuda:
        for library, rates in fig["gemm_tflops"].items():
            lines.append(f"{'BLAS' if library == BLAS_LIBRARIES[0] else '':<10} {'*' if library == runner.blas else ' '}"
                         f" {library:<9} TFLOP/s " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
    lines.append(fig["plan"])  # "plan for ..."
    if cuda:
        lines.append(f"projected  contest-100 ({CONTEST_TOKENS} tokens): GEMMs {fig['contest100_compute_s']:.1f} s at "
                     f"the rates above; streaming {fig['contest100_transfer_s']:.1f} s, hidden while it is smaller")
    lines.append(f"repeat     the same request twice: {'identical' if fig['repeat_identical'] else 'DIFFERENT'}"
                 + "".join(f"; {caveat}" for caveat in fig["same_bits_caveats"]))
    lines.append("verdict    " + ("; ".join(problems) if problems else "every required path works" + (
        f"; {len(failed)} attention candidate(s) FAILED where they should run ({', '.join(failed)}): see above"
        if failed else "")))
    return lines, fig, problems


def serve(args, protocol):
    """--doctor: the report on stdout (and as JSON in --stats FILE); exit 2 where a required path fails."""
    if args.stats:
        check_writable(args.stats)
    runner = runner_of(args, args.wave_tokens or WAVE_STEP)
    warmed_up(runner)
    lines, figures, problems = doctor(runner)
    protocol.write("".join(line + "\n" for line in lines))
    protocol.flush()
    if args.stats:
        Path(args.stats).write_text(json.dumps(dict(figures, lines=lines), indent=1))
    return 2 if problems else 0
