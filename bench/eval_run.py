"""The evaluation benchmark in one command: continuation log-likelihoods over prefix trees against lm-eval's way.

    python bench/eval_run.py                                   # Qwen3-32B, GPU held to 48 GiB free, both workloads
    python bench/eval_run.py --geometry tiny --device cpu --subjects 2 --questions 6 --contexts 12   # a CPU try-out

Workloads (token level, random tokens of the real vocabulary, seeded; the choices are the tokenizer's " A".." D"):
  mmlu-shaped       --subjects x --questions: a fixed --prefix-tokens few-shot prefix per subject, questions of
                    --question-tokens ending in "\\nAnswer:", four one-token choices
  hellaswag-shaped  --contexts contexts of --context-tokens, four endings of --ending-tokens each

Steps (the heavy ones in subprocesses of their own, this file's own subcommands, so memory is freed between them):
  a. gemm        bench/run.py's: bf16 GEMM rate at the model's shapes, burst and sustained
  b. checkpoint  bench/run.py's: random weights into /dev/shm (reused when there)
  c. prefill     under a blocker leaving --cap-gib GiB free: prefill.Runner.loglikelihoods (the path prefill_eval.py
                 and the corpus mode take; lm-eval itself is not installed on the device) on each workload, after a
                 warm-up with a prefix tree; T per workload, tokens requested and computed
  d. hf          under the same cap: what lm-eval's HF backend does (its Collator's order, longest first; one forward
                 per distinct context + continuation[:-1], its logits_cache; batches of --hf-batch padded right;
                 log-softmax; the continuation's log-probs gathered) on transformers with accelerate's
                 device_map="auto" and max_memory --hf-gpu-gib; the batches after the first are timed, for up to
                 --hf-seconds per workload, and scaled to every forward of the workload by the tokens it feeds
  e. reference   the blocker gone: transformers bf16 with the whole model on the GPU, one forward per request, on
                 --reference-requests requests of each workload (every k-th): max_rel_err of prefill's log-likelihoods

Report: bench/results/<date>-<machine>-eval[-LN].json (and a copy in $OUT), with per workload requests_per_s,
tokens_requested, tokens_computed, t_over_unique_floor (T over the floor of the tree's unique tokens: their matrix
FLOPs, lm_head on the scored rows only, and the tree's attention pairs, at the sustained GEMM rate of step a),
speedup_vs_hf_offload and max_rel_err. The report has no top-level "workload", so bench/table.py (the contest table)
leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as bench/run.py: no shadowed modules
sys.path.insert(0, str(REPO))

from bench import make_checkpoint, run  # noqa: E402

WORKLOADS = ("mmlu-shaped", "hellaswag-shaped")
SPECIAL_TOKENS = 151643  # Qwen3's special tokens start here: random tokens stay below


# ---------------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------------

def make_workloads(args, tokenizer_dir: str) -> dict:
    """{workload: [(context ids, continuation ids)]}, from the arguments' sizes and seed alone."""
    import torch

    import prefill
    encode = prefill.load_tokenizer(tokenizer_dir)
    gen = torch.Generator().manual_seed(args.seed)

    def ids(n):
        return torch.randint(1000, SPECIAL_TOKENS, (n,), generator=gen).tolist()
    choices = [c for [c] in encode([" A", " B", " C", " D"])]
    answer = encode(["\nAnswer:"])[0]
    mmlu = []
    for _ in range(args.subjects):
        prefix = ids(args.prefix_tokens)
        for _ in range(args.questions):
            question = prefix + ids(args.question_tokens - len(answer)) + answer
            mmlu += [(question, [c]) for c in choices]
    hellaswag = []
    for _ in range(args.contexts):
        context = ids(args.context_tokens)
        hellaswag += [(context, ids(args.ending_tokens)) for _ in range(4)]
    return {"mmlu-shaped": mmlu, "hellaswag-shaped": hellaswag}


def requested_tokens(requests) -> int:
    return sum(len(c) + len(k) - 1 for c, k in requests)


# ---------------------------------------------------------------------------------------------------------
# Children (python bench/eval_run.py _prefill|_hf|_reference ...)
# ---------------------------------------------------------------------------------------------------------

def write(path: str, record: dict) -> None:
    Path(path).write_text(json.dumps(record))


def child_prefill(a) -> int:
    import torch

    import prefill
    workloads = json.loads(Path(a.requests).read_text())
    t0 = time.perf_counter()
    runner = prefill.Runner(a.model, device=a.device, gpu_memory_gib=a.gpu_memory)
    runner.warm_up(trees=True)
    record = {"ready_s": time.perf_counter() - t0, "plan": runner.plan.describe(), "attention": runner.attention,
              "tree_attention": runner.tree_attention_name, "kernels": runner.kernels.name, "workloads": {}}
    for name, requests in workloads.items():
        if a.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        results = runner.loglikelihoods(requests)  # on the host when it returns
        seconds = time.perf_counter() - t
        record["workloads"][name] = {
            "t_seconds": seconds, "stats": runner.stats, "logprobs": [r.logprob for r in results],
            "greedy": [r.greedy for r in results],
            "peak_gpu_bytes": torch.cuda.max_memory_reserved() if a.device == "cuda" else None}
        print(f"prefill: {name}: {len(requests)} requests in {seconds:.2f} s; {runner.stats['tokens_computed']} "
              f"tokens computed for {runner.stats['tokens_requested']} requested", flush=True)
        write(a.json, record)
    return 0


def hf_forwards(requests):
    """lm-eval's HF backend's forwards for these requests: one per distinct context + continuation[:-1] (its
    logits_cache groups them), longest first (its Collator); each (input ids, [(request, continuation)])."""
    groups = {}
    for i, (context, continuation) in enumerate(requests):
        whole = context + continuation
        groups.setdefault(tuple(whole[:-1]), []).append((i, continuation))
    return sorted(groups.items(), key=lambda g: (-len(g[0]), g[0]))


def child_hf(a) -> int:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    workloads = json.loads(Path(a.requests).read_text())
    t0 = time.perf_counter()
    max_memory = {"cpu": f"{a.cpu_gib}GiB"} | ({0: f"{a.gpu_gib}GiB"} if a.device == "cuda" else {})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, device_map="auto",
                                                 max_memory=max_memory).eval()
    placement = getattr(model, "hf_device_map", None) or {}
    record = {"load_s": time.perf_counter() - t0, "gpu_gib": a.gpu_gib, "batch": a.batch,
              "device_map": {str(d): sum(1 for v in placement.values() if v == d) for d in set(placement.values())},
              "workloads": {}}
    first = "cuda:0" if a.device == "cuda" else "cpu"
    write(a.json, record)
    for name, requests in workloads.items():
        forwards = hf_forwards(requests)
        batches = [forwards[i:i + a.batch] for i in range(0, len(forwards), a.batch)]
        timed, timed_tokens, done, started = 0.0, 0, 0, time.perf_counter()
        with torch.inference_mode():
            for k, batch in enumerate(batches):
                t = time.perf_counter()
                width = len(batch[0][0])  # the longest: the Collator sorts longest first
                inputs = torch.tensor([list(ids) + [0] * (width - len(ids)) for ids, _ in batch], device=first)
                logprobs = F.log_softmax(model(inputs).logits, dim=-1)  # the HF backend's softmax_dtype default
                for row, (ids, owners) in enumerate(batch):
                    for _, continuation in owners:
                        n = len(continuation)
                        picked = logprobs[row, len(ids) - n:len(ids)].gather(
                            1, torch.tensor(continuation, device=logprobs.device)[:, None])
                        float(picked.sum())  # the backend's float(): a synchronisation per request
                done += sum(len(owners) for _, owners in batch)
                if k:  # the first batch pays for kernels' first calls
                    timed += time.perf_counter() - t
                    timed_tokens += width * len(batch)
                if k and time.perf_counter() - started > a.seconds:
                    break
        padded = sum(len(b[0][0]) * len(b) for b in batches)  # the tokens every forward would feed
        per_token = timed / timed_tokens if timed_tokens else None
        record["workloads"][name] = {
            "requests": len(requests), "forwards": len(forwards), "batches": len(batches),
            "timed_batches": max(0, k), "timed_s": timed, "timed_tokens": timed_tokens, "padded_tokens": padded,
            "t_seconds_scaled": per_token * padded if per_token else None,
            "scaling": "the timed batches' seconds per fed (padded) token, times every batch's fed tokens"}
        print(f"hf: {name}: {max(0, k)} of {len(batches)} batches timed in {timed:.1f} s; all "
              f"~{record['workloads'][name]['t_seconds_scaled'] or float('nan'):.0f} s", flush=True)
        write(a.json, record)
    return 0


def child_reference(a) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    workloads = json.loads(Path(a.requests).read_text())
    device = "cuda:0" if a.device == "cuda" else "cpu"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(device).eval()
    record = {"load_s": time.perf_counter() - t0, "workloads": {}}
    for name, requests in workloads.items():
        step = max(1, len(requests) // a.count)
        chosen, logprobs = list(range(0, len(requests), step))[:a.count], []
        with torch.inference_mode():
            for i in chosen:
                context, continuation = requests[i]
                ids = torch.tensor([context + continuation[:-1]], device=device)
                out = model(ids).logits[0, -len(continuation):].float().log_softmax(-1)
                logprobs.append(float(out.gather(1, torch.tensor(continuation, device=device)[:, None]).sum()))
        record["workloads"][name] = {"indices": chosen, "logprobs": logprobs}
        write(a.json, record)
    return 0


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------

def floors(cfg: dict, stats: dict, tflops: float | None) -> dict:
    """The compute floor of what a prefix tree must compute: every unique token's matrix FLOPs but lm_head's, lm_head
    on the scored rows, and the attention pairs' FLOPs (q.k and p.v), at the GEMM rate."""
    shapes = make_checkpoint.matrix_shapes(cfg)
    head = 2 * shapes["lm_head"][0] * shapes["lm_head"][1]
    per_token = make_checkpoint.flops_per_token(cfg) - head
    model = make_checkpoint.model_config(cfg)
    attention = 2 * model.num_attention_heads * (model.head_dim + model.v_head_dim) * model.num_hidden_layers
    flops = stats["tokens_computed"] * per_token + stats["scored_rows"] * head + stats["attention_pairs"] * attention
    return {"unique_flops": flops, "unique_floor_s": flops / (tflops * 1e12) if tflops else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command:
        return {"_prefill": child_prefill, "_hf": child_hf, "_reference": child_reference}[args.command](args)
    deadline = run.Deadline(args.deadline_s)
    cfg = make_checkpoint.geometry(args.geometry, args.layers)
    layers = cfg["num_hidden_layers"]
    args.ckpt_dir = args.ckpt_dir or f"/dev/shm/prefill-bench/{args.geometry}-L{layers}-s{args.ckpt_seed}"
    args.keep_other_ckpts, args.gemm_m = False, "4096,16384"
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out) if args.out else work
    log = run.Log(out_dir / "eval_run.log")
    vers = run.versions(args.device)
    machine = args.machine or run.machine_name(vers)
    full = layers == make_checkpoint.GEOMETRIES[args.geometry]["num_hidden_layers"]
    date = time.strftime("%Y-%m-%d", time.gmtime())
    name = "eval" + ("" if full else f"-L{layers}") + ("" if args.geometry == "qwen3-32b" else f"-{args.geometry}")
    report_paths = [Path(args.results_dir) / f"{date}-{machine}-{name}.json", out_dir / f"{date}-{machine}-{name}.json"]
    res = {"experiment": name, "machine": machine, "date": date, "commit": args.commit or run.git_commit(),
           "command": shlex.join(["python", "bench/eval_run.py", *(sys.argv[1:] if argv is None else argv)]),
           "gpu_memory_cap_gib": args.cap_gib if args.device == "cuda" else None, "geometry": cfg, "versions": vers,
           "workloads": {}, "errors": []}

    def attempt(step, fn, *fargs):
        try:
            return fn(*fargs)
        except Exception as e:  # a failed step is recorded; the report keeps what the others measured
            res["errors"].append(f"{step}: {type(e).__name__}: {e}")
            log(f"FAILED {step}: {e}")
            return None

    def child(step, command, extra, timeout):
        out = work / f"eval_{step}.json"
        out.unlink(missing_ok=True)
        run.run_child(step, [sys.executable, str(HERE / "eval_run.py"), command, "--model", args.ckpt_dir,
                             "--requests", str(work / "eval_requests.json"), "--json", str(out), "--device",
                             args.device, *map(str, extra)], min(timeout, deadline.left() - run.RESERVE_S), log)
        return json.loads(out.read_text())

    gemm = attempt("gemm", run.step_gemm, args, cfg, work, deadline, log) or {}
    res["gemm_sustained_tflops"] = gemm.get("gemm_sustained_tflops")
    ckpt = attempt("checkpoint", run.step_checkpoint, args, cfg, deadline, log)
    if ckpt is None:
        run.write_report(res, report_paths)
        return 1
    workloads = make_workloads(args, args.tokenizer or ckpt["path"])
    (work / "eval_requests.json").write_text(json.dumps(workloads))
    for w, requests in workloads.items():
        res["workloads"][w] = {"requests": len(requests), "tokens_requested": requested_tokens(requests)}
    log(f"workloads: " + ", ".join(f"{w} {len(r)} requests" for w, r in workloads.items()))
    blocker = attempt("blocker", run.Blocker, args.cap_gib, log) if args.device == "cuda" else None
    try:
        ours = attempt("prefill", child, "prefill", "_prefill", [], 240) or {"workloads": {}}
        run.write_report(res, report_paths)
        hf = attempt("hf", child, "hf", "_hf", ["--gpu-gib", args.hf_gpu_gib, "--batch", args.hf_batch,
                                                "--seconds", args.hf_seconds], 300) or {"workloads": {}}
    finally:
        if blocker is not None:
            blocker.close()
    reference = attempt("reference", child, "reference", "_reference", ["--count", args.reference_requests],
                        240) or {"workloads": {}}
    res.update(prefill={k: v for k, v in ours.items() if k != "workloads"},
               hf_offload={k: v for k, v in hf.items() if k != "workloads"},
               reference_load_s=reference.get("load_s"))
    for w, entry in res["workloads"].items():
        mine, theirs, ref = ours["workloads"].get(w), hf["workloads"].get(w), reference["workloads"].get(w)
        if mine:
            t, stats = mine["t_seconds"], mine["stats"]
            entry.update(t_seconds=t, requests_per_s=entry["requests"] / t, tokens_computed=stats["tokens_computed"],
                         tokens_requested_tree=stats["tokens_requested"], waves=stats["waves"],
                         scored_rows=stats["scored_rows"], peak_gpu_gib=(mine["peak_gpu_bytes"] or 0) / 2**30,
                         prepare_s=stats.get("prepare_s"), tree_s=stats.get("tree_s"),  # where T went
                         gpu_phases_s=stats.get("phases"),
                         **floors(cfg, stats, res["gemm_sustained_tflops"]))
            entry["t_over_unique_floor"] = run._div(t, entry["unique_floor_s"])
        if theirs:
            entry["hf_offload"] = theirs
            entry["speedup_vs_hf_offload"] = run._div(theirs["t_seconds_scaled"], entry.get("t_seconds"))
        if mine and ref:
            errors = [abs(mine["logprobs"][i] - r) / abs(r) for i, r in zip(ref["indices"], ref["logprobs"])]
            entry.update(max_rel_err=max(errors), mean_rel_err=sum(errors) / len(errors),
                         reference_requests=len(errors))
    run.write_report(res, report_paths)
    for w, e in res["workloads"].items():
        log(f"{w}: " + ", ".join(f"{k} {e[k]:.4g}" if isinstance(e.get(k), float) else f"{k} {e.get(k)}"
                                 for k in ("requests", "requests_per_s", "tokens_requested", "tokens_computed",
                                           "t_over_unique_floor", "speedup_vs_hf_offload", "max_rel_err")))
    log(f"report: {report_paths[0]}" + (f"; errors: {res['errors']}" if res["errors"] else ""))
    return 1 if res["errors"] else 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs="?", choices=["_prefill", "_hf", "_reference"], help=argparse.SUPPRESS)
    ap.add_argument("--geometry", choices=sorted(make_checkpoint.GEOMETRIES), default="qwen3-32b")
    ap.add_argument("--layers", type=int, help="a shallower model (default: the geometry's)")
    ap.add_argument("--ckpt-seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", help="default /dev/shm/prefill-bench/GEOMETRY-LLAYERS-sSEED (bench/run.py's)")
    ap.add_argument("--tokenizer", help="Qwen3 tokenizer folder (default: the checkpoint's copy)")
    ap.add_argument("--cap-gib", type=float, default=48.0, help="GPU memory left free for prefill and the HF run")
    ap.add_argument("--hf-gpu-gib", type=float, default=36.0,
                    help="accelerate's max_memory for the GPU (default 36: at 44, a batch of 8 ran out of memory on "
                         "its logits on the H200, 2026-12-01)")
    ap.add_argument("--hf-batch", type=int, default=8, help="the HF backend's batch size (default 8)")
    ap.add_argument("--hf-seconds", type=float, default=45.0, help="time the HF run spends per workload (default 45)")
    ap.add_argument("--reference-requests", type=int, default=200, help="reference requests per workload")
    ap.add_argument("--subjects", type=int, default=5)
    ap.add_argument("--questions", type=int, default=100, help="questions per subject")
    ap.add_argument("--prefix-tokens", type=int, default=700)
    ap.add_argument("--question-tokens", type=int, default=80)
    ap.add_argument("--contexts", type=int, default=500)
    ap.add_argument("--context-tokens", type=int, default=80)
    ap.add_argument("--ending-tokens", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gemm-sustained-s", type=float, default=5.0)
    ap.add_argument("--deadline-s", type=float, default=560)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--work-dir", default="/tmp/prefill-bench")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--machine")
    ap.add_argument("--commit")
    # the children's own
    ap.add_argument("--model")
    ap.add_argument("--requests")
    ap.add_argument("--json")
    ap.add_argument("--gpu-memory", type=float)
    ap.add_argument("--gpu-gib", type=float)
    ap.add_argument("--cpu-gib", type=float, default=110.0)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--count", type=int)
    return ap.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
