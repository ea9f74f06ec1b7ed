"""The heavy steps of bench/run.py, each run in a process of its own so that its memory is freed when it ends.

    python bench/steps.py gemm      --config CFG.json --m 4096,16384 --json OUT.json [--device cuda]
    python bench/steps.py storage   --model DIR --json OUT.json [--threads 16] [--drop-cache]
                                    (read bandwidth of *.safetensors; --drop-cache: from storage, not the page cache)
    python bench/steps.py blocker   --cap-gib 48          (holds all but 48 GiB of the GPU until stdin closes)
    python bench/steps.py host-blocker --leave-gib 12     (holds all but 12 GiB of available RAM until stdin closes)
    python bench/steps.py reference --model DIR --texts T.json --json OUT.json [--device cuda]
    python bench/steps.py baseline  --model DIR --texts T.json --json OUT.json --gpu-gib 43.2 [--k 10]

Each writes one JSON file (baseline rewrites it after every text, so a run killed at the deadline still
leaves its timings).  run.py reads those files; the steps print only a line or two of progress.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Python puts a script's own folder first on sys.path, where a sibling named like a standard module (a
# bench/profile.py shadows `profile`, which transformers imports through cProfile) would replace it.  So the
# folder comes off the path, and the bench modules are imported as the package `bench` from the repo root.
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(REPO))

GiB = 2**30


def _write(path: str, record: dict) -> None:
    """Whole or not at all (a temporary file renamed): run.py may kill a step while it writes."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# gemm: bf16 GEMM rate at the model's projection shapes, and host->device copy bandwidth
# ---------------------------------------------------------------------------------------------------------

def _time_op(fn, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after `warmup` untimed ones (CUDA events on the GPU)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rates(cfg: dict, ms: list[int], device: str, warmup: int = 3, repeats: int = 10) -> dict:
    """Per (M, shape) TFLOP/s of x[M,K] @ W[N,K]^T, and per M the FLOP-weighted aggregate over one token's
    pass through the model (every projection of every layer, and lm_head).

    Random data, not zeros: tensor cores run faster on zeros (an H200 gave 894 vs 788 TFLOP/s at 8192^3)."""
    import torch

    from bench.make_checkpoint import matrix_shapes

    shapes = matrix_shapes(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    per_m = {}
    for m in ms:
        rows, token_seconds, token_flops = {}, 0.0, 0.0
        for name, (n, k, count) in shapes.items():
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            seconds = _time_op(functools.partial(torch.matmul, x, w.t(), out=out), device, warmup, repeats)
            flops = 2.0 * m * n * k
            rows[name] = {"n": n, "k": k, "seconds": seconds, "tflops": flops / seconds / 1e12}
            token_seconds += count * seconds / m  # this matrix's share of one token's pass
            token_flops += count * 2.0 * n * k
            del x, w, out
        per_m[str(m)] = {"shapes": rows, "aggregate_tflops": token_flops / token_seconds / 1e12}
        print(f"gemm M={m}: " + ", ".join(f"{k} {v['tflops']:.0f}" for k, v in rows.items())
              + f" -> aggregate {per_m[str(m)]['aggregate_tflops']:.1f} TFLOP/s", flush=True)
    # The floor should be the best this GPU reaches at these shapes: the best M's aggregate.
    best = max(per_m.values(), key=lambda r: r["aggregate_tflops"])["aggregate_tflops"]
    return {"per_m": per_m, "gemm_tflops": best}


def gemm_sustained(cfg: dict, m: int, device: str, seconds: float = 5.0, weight_sets: int = 4) -> dict:
    """TFLOP/s of one layer's GEMMs (qkv, o, gate_up, down; MLA's q_b, kv_b) at M tokens run back to back for
    ~`seconds`, with no synchronisation in between, timed as one whole: what a forward pass can sustain (clocks under
    a long load, launch gaps), unlike the burst medians above.  Each iteration takes the next of `weight_sets`
    weight sets (0.98 GB each for Qwen3-32B), so no weight sits in L2 from the iteration before."""
    import torch

    from bench.make_checkpoint import matrix_shapes

    shapes = {k: v for k, v in matrix_shapes(cfg).items() if k in ("qkv", "q_b", "kv_b", "o", "gate_up", "down")}
    gen = torch.Generator(device=device).manual_seed(1)
    xs = {k: torch.randn(m, kk, generator=gen, device=device, dtype=torch.bfloat16) for k, (n, kk, _) in shapes.items()}
    outs = {k: torch.empty(m, n, device=device, dtype=torch.bfloat16) for k, (n, _, _) in shapes.items()}
    sets = [{k: torch.randn(n, kk, generator=gen, device=device, dtype=torch.bfloat16).t()
             for k, (n, kk, _) in shapes.items()} for _ in range(weight_sets)]
    layer_flops = sum(2.0 * m * n * k for n, k, _ in shapes.values())

    def run(iters: int) -> None:
        for i in range(iters):
            w = sets[i % weight_sets]
            for k in shapes:
                torch.matmul(xs[k], w[k], out=outs[k])

    def timed(iters: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(iters)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.perf_counter()
        run(iters)
        return time.perf_counter() - t0

    run(weight_sets)  # warm-up: cuBLAS heuristics, clocks up
    probe = timed(2 * weight_sets)
    iters = max(weight_sets, round(seconds / (probe / (2 * weight_sets))))
    elapsed = timed(iters)
    out = {"m": m, "iterations": iters, "weight_sets": weight_sets, "seconds": elapsed,
           "flops": layer_flops * iters, "tflops": layer_flops * iters / elapsed / 1e12}
    print(f"gemm sustained M={m}: {iters} layers back to back in {elapsed:.2f} s -> {out['tflops']:.1f} TFLOP/s",
          flush=True)
    return out


def h2d_bandwidth(nbytes: int = GiB, repeats: int = 5) -> dict:
    """GB/s (1e9) of host->device copies of nbytes from pinned and from pageable memory (median of repeats)."""
    import torch
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pinned.fill_(1)
    pageable = torch.ones(nbytes, dtype=torch.uint8)  # touched, so no page faults are timed
    t_pinned = _time_op(lambda: dst.copy_(pinned, non_blocking=True), "cuda", 1, repeats)
    t_pageable = _time_op(lambda: dst.copy_(pageable), "cuda", 1, max(3, repeats // 2))
    out = {"bytes": nbytes, "pinned_gbps": nbytes / t_pinned / 1e9, "pageable_gbps": nbytes / t_pageable / 1e9}
    print(f"h2d: pinned {out['pinned_gbps']:.1f} GB/s, pageable {out['pageable_gbps']:.1f} GB/s", flush=True)
    return out


def cmd_gemm(args) -> int:
    import torch
    cfg = json.loads(Path(args.config).read_text())
    ms = [int(m) for m in args.m.split(",")]
    record = {"device": args.device}
    if args.device == "cuda":
        record["gpu_name"] = torch.cuda.get_device_name(0)
        record["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    record.update(gemm_rates(cfg, ms, args.device, repeats=args.repeats))
    if args.sustained_s > 0:
        record["sustained"] = gemm_sustained(cfg, args.sustained_m, args.device, seconds=args.sustained_s)
        record["gemm_sustained_tflops"] = record["sustained"]["tflops"]
    record["h2d"] = h2d_bandwidth() if args.device == "cuda" else None
    _write(args.json, record)
    return 0


# ---------------------------------------------------------------------------------------------------------
# storage: how fast the checkpoint's files can be read (the floor of the runner's time to ready)
# ---------------------------------------------------------------------------------------------------------

def _filesystem(path: Path) -> dict:
    """The mount holding path, from /proc/mounts (longest mount point that is a prefix): {mount, type}."""
    best = {"mount": None, "type": None}
    try:
        real = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and \
                    len(mount) >= len(best["mount"] or ""):
                best = {"mount": mount, "type": parts[2]}
    except OSError:
        pass
    return best


def storage_read(files: list[Path], threads: int, buffer_bytes: int = 64 * 2**20) -> dict:
    """GB/s (1e9) reading every byte of files with `threads` threads, each os.preadv-ing into its own reusable
    buffer: the files' bytes, laid end to end, are cut into `threads` contiguous shares (so a share may span
    files, and a large file is read by several threads at once)."""
    import threading

    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    threads = max(1, min(threads, max(1, total // buffer_bytes) or 1))
    bounds = [total * i // threads for i in range(threads + 1)]

    def segments(lo: int, hi: int) -> list[tuple[Path, int, int]]:
        """(file, start, end) pieces of the global byte range [lo, hi)."""
        out, base = [], 0
        for f, size in zip(files, sizes):
            a, b = max(lo, base), min(hi, base + size)
            if a < b:
                out.append((f, a - base, b - base))
            base += size
        return out

    done = [0] * threads
    errors: list[str] = []
    barrier = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        buf = bytearray(b"\x01") * buffer_bytes  # written once: no page faults while timed
        view = memoryview(buf)
        barrier.wait()
        try:
            for f, start, end in segments(bounds[i], bounds[i + 1]):
                fd = os.open(f, os.O_RDONLY)
                try:
                    pos = start
                    while pos < end:
                        n = os.preadv(fd, [view[: min(buffer_bytes, end - pos)]], pos)
                        if n <= 0:
                            raise OSError(f"{f}: short read at {pos}")
                        pos += n
                        done[i] += n
                finally:
                    os.close(fd)
        except OSError as e:
            errors.append(str(e))

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise OSError("; ".join(errors[:3]))
    read = sum(done)
    return {"files": len(files), "bytes": read, "threads": threads, "buffer_bytes": buffer_bytes,
            "seconds": seconds, "gbps": read / seconds / 1e9}


def resident_fraction(files: list[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore(2) on a private map; None where it cannot tell)."""
    import ctypes
    import mmap
    page, resident, total = mmap.PAGESIZE, 0, 0
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
        for f in files:
            size = f.stat().st_size
            if not size:
                continue
            with open(f, "rb") as fh:
                m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # writable, so ctypes can take its address
            vec = (ctypes.c_ubyte * (-(-size // page)))()
            buf = ctypes.c_char.from_buffer(m)
            rc = mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
            del buf
            m.close()
            if rc:
                return None
            resident += sum(b & 1 for b in bytes(vec))
            total += len(vec)
    except (AttributeError, OSError):
        return None
    return resident / total if total else None


def drop_page_cache(files: list[Path]) -> dict:
    """Evicts the files from the page cache, so that the next read comes from storage: written back first (dirty
    pages cannot be dropped), then posix_fadvise(DONTNEED) per file, which needs no root (it cannot drop pages that
    a process maps, nor tmpfs pages: those are memory); as root, /proc/sys/vm/drop_caches too for what is left.
    Returns how, and the share of pages still cached."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method, left = "fadvise", resident_fraction(files)
    if left:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")  # 1: the page cache only
            method, left = "fadvise, drop_caches", resident_fraction(files)
        except OSError:
            pass
    print(f"page cache: dropped by {method}; {'?' if left is None else f'{left:.1%}'} of the checkpoint still cached",
          flush=True)
    return {"method": method, "resident_after": left}


def cmd_storage(args) -> int:
    model = Path(args.model)
    files = sorted(model.glob("*.safetensors"))
    if not files:
        print(f"storage: no *.safetensors in {model}", file=sys.stderr)
        return 1
    dropped = drop_page_cache(files) if args.drop_cache else None
    record = storage_read(files, args.threads or min(16, os.cpu_count() or 1))
    record.update(path=str(model), filesystem=_filesystem(model), dropped=dropped)
    print(f"storage: {record['bytes'] / 1e9:.2f} GB in {record['files']} files read by {record['threads']} threads "
          f"in {record['seconds']:.2f} s -> {record['gbps']:.1f} GB/s ({record['filesystem']['type']} at "
          f"{record['filesystem']['mount']})", flush=True)
    _write(args.json, record)
    return 0


# ---------------------------------------------------------------------------------------------------------
# blocker: make the GPU look like a card of CAP GiB, as the contest's W7800 (48 GB) is
# ---------------------------------------------------------------------------------------------------------

def cmd_blocker(args) -> int:
    """Allocates all but cap GiB of the GPU's free memory, prints one JSON line, holds it until stdin closes.

    The runner started next sees cap GiB free, less its own CUDA context, as it would on the W7800.  The
    parent holds our stdin: when it closes it (or dies), read() returns and the memory is released.  Its total
    memory stays the H200's, which is what an FP8 MoE's experts are held FP8 or not by without --gpu-memory
    (prefill's HELD_RESERVE): where the cap calls for the held way, pass --runner-gpu-memory, or prefill stops."""
    import torch
    cap = int(args.cap_gib * GiB)
    torch.cuda.init()
    held, stable = [], 0
    # Memory a process that just ended (the reference) held may come back a little later: keep topping up
    # until two checks half a second apart find no more than the cap free (10 s at most).
    for _ in range(20):
        free, total = torch.cuda.mem_get_info()
        if free - cap >= 64 * 2**20:
            held.append(torch.empty(free - cap, dtype=torch.uint8, device="cuda"))
            stable = 0
        else:
            stable += 1
            if stable == 2:
                break
        time.sleep(0.5)
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({"held_bytes": sum(t.numel() for t in held), "free_bytes": free, "total_bytes": total}),
          flush=True)
    sys.stdin.read()
    return 0


def meminfo() -> dict:
    """/proc/meminfo in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items() if v.split()[1:] == ["kB"]}


def cmd_host_blocker(args) -> int:
    """Holds all but leave_gib GiB of the host's available memory (MemAvailable), touched, so that none of it is
    page cache the kernel could reclaim; prints one JSON line, holds it until stdin closes. The runner started next
    sees about leave_gib GiB available, as on a machine with less RAM. Touched from several threads (ctypes.memset
    releases the GIL), in huge pages where the kernel gives them: faulting in 100 GiB page by page takes a minute."""
    import ctypes
    import mmap
    import threading
    before = meminfo()
    held = max(0, before["MemAvailable"] - int(args.leave_gib * GiB))
    buf = mmap.mmap(-1, max(held, mmap.PAGESIZE))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    threads = min(16, os.cpu_count() or 1)
    bounds = [held * i // threads for i in range(threads + 1)]
    t0 = time.perf_counter()
    pool = [threading.Thread(target=ctypes.memset, args=(base + lo, 1, hi - lo)) for lo, hi in zip(bounds, bounds[1:])]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    after = meminfo()
    print(json.dumps({"held_bytes": held, "touch_s": time.perf_counter() - t0,
                      "mem_available_before": before["MemAvailable"], "mem_available_after": after["MemAvailable"],
                      "mem_total": after["MemTotal"], "swap_total": after.get("SwapTotal")}), flush=True)
    sys.stdin.read()
    return 0


# ---------------------------------------------------------------------------------------------------------
# reference: transformers, the whole model on one device, one forward per text (the loss's definition, README); an
# FP8 checkpoint's model dequantized to bf16 (interact.dequantized_kwargs)
# ---------------------------------------------------------------------------------------------------------

def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def cmd_reference(args) -> int:
    import torch

    import interact

    texts = interact.load_texts_file(args.texts)
    t0 = time.perf_counter()
    model = interact.load_reference_model(args.model, args.device)
    tok = interact.load_tokenizer(args.model)
    _sync(args.device)
    load_s = time.perf_counter() - t0
    print(f"reference: loaded in {load_s:.1f} s", flush=True)
    t1 = time.perf_counter()
    losses = interact.reference_losses(model, tok, texts)
    forward_s = time.perf_counter() - t1
    tokens = sum(len(tok(text)["input_ids"]) for text in texts)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    print(f"reference: {len(texts)} texts, {tokens} tokens in {forward_s:.1f} s", flush=True)
    _write(args.json, {"texts_sha256": interact.texts_sha256(texts), "losses": losses, "tokens": tokens,
                       "load_s": load_s, "forward_s": forward_s, "peak_gpu_bytes": peak})
    return 0


# baseline: the contest handout's runner (transformers + accelerate device_map="auto", one forward per text)
# ---------------------------------------------------------------------------------------------------------

def cmd_baseline(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import interact

    texts = interact.load_texts_file(args.texts)[: args.k]
    record = {"gpu_gib": args.gpu_gib, "cpu_gib": args.cpu_gib, "load_s": None, "per_text_s": [], "losses": [],
              "tokens": []}
    _write(args.json, record)
    t0 = time.perf_counter()
    max_memory = {"cpu": f"{args.cpu_gib}GiB"}
    if args.device == "cuda":
        max_memory[0] = f"{args.gpu_gib}GiB"
    # An FP8 checkpoint is loaded dequantized, as the reference is: transformers' FP8 matmuls would need a kernel from
    # the Hub, which the device machine cannot reach, and would compute other losses (W8A8)
    model = AutoModelForCausalLM.from_pretrained(args.model, **{interact.dtype_kwarg(): torch.bfloat16}, device_map="auto",
                                                 max_memory=max_memory,
                                                 **interact.dequantized_kwargs(args.model)).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    record["load_s"] = time.perf_counter() - t0
    # accelerate's placement, module -> device (absent when everything landed on one device).
    placement = getattr(model, "hf_device_map", None) or {}
    record["device_map"] = {str(d): sum(1 for v in placement.values() if v == d) for d in set(placement.values())}
    _write(args.json, record)
    print(f"baseline: loaded in {record['load_s']:.1f} s; modules per device: {record['device_map']}", flush=True)
    first = "cuda:0" if args.device == "cuda" else "cpu"
    with torch.inference_mode():
        for text in texts:
            t1 = time.perf_counter()
            ids = tok(text)["input_ids"]
            t = torch.tensor([ids], device=first)
            loss = model(input_ids=t, labels=t).loss.item()  # .item() synchronizes
            record["per_text_s"].append(time.perf_counter() - t1)
            record["losses"].append(loss)
            record["tokens"].append(len(ids))
            _write(args.json, record)  # a run killed at the deadline keeps the texts done so far
            print(f"baseline: text {len(record['losses'])}/{len(texts)} in {record['per_text_s'][-1]:.2f} s",
                  flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)

    g = sub.add_parser("gemm")
    g.add_argument("--config", required=True, help="JSON geometry (make_checkpoint's keys)")
    g.add_argument("--m", default="4096,16384", help="token counts M, comma-separated")
    g.add_argument("--repeats", type=int, default=10)
    g.add_argument("--json", required=True)
    g.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    g.add_argument("--sustained-m", type=int, default=4096, help="M of the sustained per-layer GEMM run")
    g.add_argument("--sustained-s", type=float, default=5.0, help="its length in seconds (0: not run)")
    g.set_defaults(fn=cmd_gemm)

    s = sub.add_parser("storage")
    s.add_argument("--model", required=True, help="checkpoint folder: its *.safetensors are read")
    s.add_argument("--threads", type=int, default=0, help="reader threads (default min(16, cpu count))")
    s.add_argument("--json", required=True)
    s.add_argument("--drop-cache", action="store_true", help="evict the files from the page cache first")
    s.set_defaults(fn=cmd_storage)

    hb = sub.add_parser("host-blocker")
    hb.add_argument("--leave-gib", type=float, required=True, help="GiB of available host memory to leave")
    hb.set_defaults(fn=cmd_host_blocker)

    b = sub.add_parser("blocker")
    b.add_argument("--cap-gib", type=float, required=True)
    b.set_defaults(fn=cmd_blocker)

    r = sub.add_parser("reference")
    r.add_argument("--model", required=True)
    r.add_argument("--texts", required=True)
    r.add_argument("--json", required=True)
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.set_defaults(fn=cmd_reference)

    h = sub.add_parser("baseline")
    h.add_argument("--model", required=True)
    h.add_argument("--texts", required=True)
    h.add_argument("--json", required=True)
    h.add_argument("--k", type=int, default=10, help="how many of the texts to run")
    h.add_argument("--gpu-gib", type=float, required=True, help="max_memory for GPU 0")
    h.add_argument("--cpu-gib", type=float, default=120, help="max_memory for the CPU")
    h.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    h.set_defaults(fn=cmd_baseline)

    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
