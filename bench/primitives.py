"""The primitives prefill's loading and attention rest on, each timed on its own (one device command, ~1-2 min).

    python bench/primitives.py [--tokenizer DIR] [--gib 8] [--out DIR]

Loading: CUDA init; transformers import + tokenizer load; page-locking host memory (cudaHostRegister on 4 KiB
pages and on transparent huge pages, cudaHostAlloc), alone and from 8 threads at once; pread from tmpfs into
fresh and into already-faulted memory; host->device through small pinned staging buffers from 16 threads.
File pages: a checkpoint-like file's page cache registered in place (shared read-only map, the read-only flag),
from one thread and from eight. GIL: whether other Python threads run while 4 GiB of file pages register (torch's
binding). Tokenizer: the Rust tokenizer alone against transformers' load.
Compute: torch's flash kernel called directly with 8 KV heads (GQA) against varlen_attn with repeated KV heads,
and a GEMM with the residual fused in (addmm, beta=1) against GEMM + add.
Attention: prefill's backends and Triton attention tiles (ATTENTION_TILES and a few more) on one chunk of
contest-length texts at Qwen3-32B's heads, each checked against SDPA.
Prints a table last and writes it as JSON to --out.
"""
import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

IMPORT_TORCH_S = time.perf_counter() - T0
GiB = 2**30
rows = {}


def record(name, value, unit):
    rows[name] = (round(value, 4), unit)
    print(f"{name:55s} {value:10.3f} {unit}", file=sys.stderr, flush=True)


def timed(fn, *a):
    t = time.perf_counter()
    out = fn(*a)
    return out, time.perf_counter() - t


def gpu_ms(fn, reps):
    # mean milliseconds per call after one warm-up call, the GPU drained before and after
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def register(t):
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0))


def unregister(t):
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def anon_buffer(nbytes, huge):
    m = mmap.mmap(-1, nbytes)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def pread_into(fd, t, offset):
    view = memoryview((ctypes.c_char * t.nbytes).from_address(t.data_ptr())).cast("B")
    done = 0
    while done < t.nbytes:
        done += os.preadv(fd, [view[done:]], offset + done)


def make_file(path, nbytes):
    block = os.urandom(64 * 2**20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)


def section_load(args, path):
    fd = os.open(path, os.O_RDONLY)

    # page-locking, one thread, 1 GiB
    for label, make in [("4K pages, untouched", lambda: anon_buffer(GiB, False)),
                        ("4K pages, filled", lambda: anon_buffer(GiB, False)),
                        ("THP madvise, filled", lambda: anon_buffer(GiB, True))]:
        keep, t = make()
        if "filled" in label:
            _, s = timed(pread_into, fd, t, 0)
            record(f"pread 1 GiB into fresh memory ({label.split(',')[0]})", 1 / s, "GiB/s")
        _, s = timed(register, t)
        record(f"cudaHostRegister 1 GiB, {label}", s, "s")
        unregister(t)
        del t, keep
    _, s = timed(lambda: torch.empty(GiB, dtype=torch.uint8, pin_memory=True))
    record("cudaHostAlloc (pin_memory=True) 1 GiB", s, "s")

    # page-locking from 8 threads at once, 1 GiB each, filled first
    for huge in (False, True):
        bufs = [anon_buffer(GiB, huge) for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            t = time.perf_counter()
            list(pool.map(lambda b: pread_into(fd, b[1], 0), bufs))
            fill_s = time.perf_counter() - t
            t = time.perf_counter()
            list(pool.map(lambda b: register(b[1]), bufs))
            pin_s = time.perf_counter() - t
        kind = "THP" if huge else "4K"
        record(f"8 threads pread 8 GiB fresh ({kind})", 8 / fill_s, "GiB/s")
        record(f"8 threads cudaHostRegister 8 GiB ({kind}), wall", pin_s, "s")
        for b in bufs:
            unregister(b[1])
        del bufs

    # pread into faulted memory (the pages already exist): the copy alone
    buf = torch.empty(GiB, dtype=torch.uint8)
    pread_into(fd, buf, 0)
    _, s = timed(pread_into, fd, buf, GiB)
    record("pread 1 GiB into faulted memory, 1 thread", 1 / s, "GiB/s")

    # host->device through pinned staging, 16 threads, each 2 buffers of `piece` bytes, file -> device
    dev = torch.empty(args.gib * GiB, dtype=torch.uint8, device="cuda")
    for piece_mib in (16, 64):
        piece = piece_mib * 2**20
        pieces = list(range(0, args.gib * GiB, piece))
        lock = threading.Lock()
        it = iter(pieces)

        def worker():
            stream = torch.cuda.Stream()
            staging = [torch.empty(piece, dtype=torch.uint8).pin_memory() for _ in range(2)]
            done = [torch.cuda.Event(), torch.cuda.Event()]
            i = 0
            while True:
                with lock:
                    off = next(it, None)
                if off is None:
                    break
                done[i].synchronize()
                pread_into(fd, staging[i], off)
                with torch.cuda.stream(stream):
                    dev[off:off + piece].copy_(staging[i], non_blocking=True)
                    done[i].record(stream)
                i ^= 1
            stream.synchronize()

        t = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(f.result() for f in [pool.submit(worker) for _ in range(16)])
        s = time.perf_counter() - t
        record(f"file -> 2x{piece_mib} MiB pinned staging -> GPU, 16 threads", args.gib / s, "GiB/s")
        assert torch.equal(dev[:1024].cpu(), torch.frombuffer(bytearray(os.pread(fd, 1024, 0)), dtype=torch.uint8))
    del dev
    os.close(fd)



def section_file(args, path):
    # the checkpoint file's own page cache, page-locked in place (no host copy at all), then host->device from it
    fd = os.open(path, os.O_RDONLY)
    for access, label in [(mmap.ACCESS_READ, "shared read-only map"), (mmap.ACCESS_COPY, "private (COW) map")]:
        m = mmap.mmap(fd, 0, access=access)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that a read-only buffer is not writable
            t = torch.frombuffer(m, dtype=torch.uint8)
        for flags, flag_label in [(8, "cudaHostRegisterReadOnly"), (0, "no flags")]:
            rc, s = timed(lambda: torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, flags))
            rc = int(getattr(rc, "value", rc))
            record(f"register {args.gib} GiB file pages, {label}, {flag_label}: error code", rc, "")
            if rc != 0:
                continue
            record(f"register {args.gib} GiB file pages, {label}, {flag_label}", s, "s")
            dev = torch.empty(t.nbytes, dtype=torch.uint8, device="cuda")
            piece = 256 * 2**20
            torch.cuda.synchronize()
            start = time.perf_counter()
            for off in range(0, t.nbytes, piece):
                dev[off:off + piece].copy_(t[off:off + piece], non_blocking=True)
            torch.cuda.synchronize()
            record(f"file pages -> GPU, {label}, {flag_label}", args.gib / (time.perf_counter() - start), "GiB/s")
            assert torch.equal(dev[-4096:].cpu(), t[-4096:])
            del dev
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
        del t
        m.close()
    os.close(fd)


def section_threads(args):
    # registering file pages (shared read-only maps) from 1 thread and from 8, eight 1 GiB files
    paths = [f"/dev/shm/primitives-probe-{i}.bin" for i in range(8)]
    for p in paths:
        make_file(p, GiB)
    try:
        for threads in (1, 8):
            fds = [os.open(p, os.O_RDONLY) for p in paths]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that a read-only buffer is not writable
                ts = [torch.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), dtype=torch.uint8) for fd in fds]

            def register_read_only(t):
                return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 8))
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                errors = sum(rc != 0 for rc in pool.map(register_read_only, ts))
            record(f"register 8 x 1 GiB file pages read-only, {threads} thread(s), wall ({errors} refused)",
                   time.perf_counter() - start, "s")
            for t in ts:
                unregister(t)
            for fd in fds:
                os.close(fd)
    finally:
        for p in paths:
            os.unlink(p)


def section_gil(args):
    # does registering 4 GiB of file pages through torch's binding let other Python threads run meanwhile?
    # (commit 1d2f7df also timed a ctypes call of the runtime's cudaHostRegister: the same, so it was reverted)
    path = "/dev/shm/primitives-gil.bin"
    make_file(path, 4 * GiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), dtype=torch.uint8)
        ticks, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.001)
        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.2)
        before, start = ticks[0], time.perf_counter()
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 8))
        seconds, during = time.perf_counter() - start, ticks[0] - before
        stop.set()
        spinner.join()
        record(f"register 4 GiB file pages via torch.cuda.cudart() (rc {rc})", seconds, "s")
        record("  other thread's 1 ms sleeps completed meanwhile", during, f"(~{seconds * 1e3:.0f} if free)")
        unregister(t)
    finally:
        os.close(fd)
        os.unlink(path)


def section_tokenizer(args):
    # where the tokenizer's load time goes: the Rust tokenizer alone, then transformers (imported already)
    import tokenizers
    import transformers
    _, s = timed(tokenizers.Tokenizer.from_file, str(Path(args.tokenizer) / "tokenizer.json"))
    record("tokenizers.Tokenizer.from_file (no transformers)", s, "s")
    _, s = timed(transformers.AutoTokenizer.from_pretrained, args.tokenizer)
    record("transformers AutoTokenizer.from_pretrained, second load", s, "s")


def section_compute():
    # attention: torch's flash kernel, GQA native and strided views of a fused qkv, vs varlen_attn + repeat
    torch.manual_seed(0)
    lens = [455] * 9
    T, H, KV, D = sum(lens), 64, 8, 128
    qkv = torch.randn(T, (H + 2 * KV) * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + KV) * D].view(T, KV, D), qkv[:, (H + KV) * D:].view(T, KV, D)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")

    def aten_flash():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max(lens), max(lens), 0.0, True, False)[0]

    def repeated():
        kr, vr = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
        return torch.ops.aten._flash_attention_forward(q, kr, vr.contiguous(), cu, cu, max(lens), max(lens), 0.0,
                                                       True, False)[0]
    ref = torch.cat([F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                    v[a:b].transpose(0, 1), is_causal=True, enable_gqa=True)
                     .transpose(0, 1) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    record("aten flash GQA max abs err vs SDPA", (aten_flash().float() - ref.float()).abs().max().item(), "")
    for name, fn in [("aten flash, 8 KV heads (strided views)", aten_flash),
                     ("repeat KV to 64 heads + flash", repeated)]:
        record(f"attention {T} tokens: {name}", gpu_ms(fn, 50), "ms")

    # residual fused into the GEMM vs GEMM then add, the model's two residual GEMMs at 4096 tokens
    for kname, kdim in [("o_proj", 8192), ("down", 25600)]:
        a = torch.randn(4096, kdim, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(5120, kdim, device="cuda", dtype=torch.bfloat16) / kdim**0.5
        x = torch.randn(4096, 5120, device="cuda", dtype=torch.bfloat16)
        for name, fn in [("linear + add_", lambda: x.add_(F.linear(a, w))), ("addmm_", lambda: x.addmm_(a, w.t()))]:
            record(f"{kname} 4096x{kdim}x5120: {name}", gpu_ms(fn, 100), "ms")



def section_attention():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import prefill
    from bench.make_checkpoint import QWEN3_32B
    cfg = prefill.ModelConfig.from_json(dict(QWEN3_32B, model_type="qwen3"))
    how = cfg.attention[0]
    lens = [279, 607, 455, 512, 330, 600, 390, 470, 440]  # 4083 tokens, the contest's range
    q, k, v, chunk = prefill.attention_inputs(torch.device("cuda"), cfg, lens, seed=0)
    ref = prefill.attention_sdpa(q, k, v, chunk, how).float()
    flops = sum(2 * cfg.num_attention_heads * cfg.head_dim * n * (n + 1) for n in lens)  # QK^T and PV, causal
    candidates = [(kind, None) for kind in ("torch-flash", "flash")]
    offered = prefill.ATTENTION_TILES["nvidia"] + prefill.ATTENTION_TILES["rdna3"]
    tiles = offered + [t for t in [(128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 2), (64, 32, 4, 2),
                                   (64, 32, 4, 3), (32, 32, 4, 2)] if t not in offered]
    candidates += [("triton", t) for t in tiles]
    for kind, tile in candidates:
        name = kind if tile is None else f"triton {tile}"
        try:
            attend = prefill.make_attention(kind, tile)
            err = (attend(q, k, v, chunk, how).float() - ref).abs().max().item() / ref.abs().max().item()
            ms = gpu_ms(lambda: attend(q, k, v, chunk, how), 50)
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            continue
        record(f"attention {sum(lens)} tokens: {name} rel err", err, "")
        record(f"attention {sum(lens)} tokens: {name}", ms, f"ms ({flops / ms / 1e9:.0f} TFLOP/s)")
    device = torch.device("cuda")
    picked = prefill.pick_attention("auto", device, cfg, prefill.Picks(None, None))[0]  # no cache: first
    print(f"pick_attention('auto'), no picks file -> {picked}", file=sys.stderr)
    rows["pick_attention auto, no picks file"] = (picked, "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="tokenizer folder, to time transformers' import and the tokenizer load")
    ap.add_argument("--gib", type=int, default=8, help="size of the test file in /dev/shm (default 8)")
    ap.add_argument("--sections", default="load,file,threads,gil,tokenizer,compute,attention",
                    help="comma-separated: load, file, threads, gil, tokenizer, compute, attention (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    record("import torch", IMPORT_TORCH_S, "s")
    _, s = timed(lambda: (torch.cuda.init(), torch.zeros(1, device="cuda"), torch.cuda.mem_get_info()))
    record("CUDA init (first allocation, mem_get_info)", s, "s")
    if args.tokenizer:
        def tok():
            import transformers
            return transformers.AutoTokenizer.from_pretrained(args.tokenizer)
        _, s = timed(tok)
        record("import transformers + load tokenizer", s, "s")
    try:
        record("THP enabled=[always] (1) / [madvise] (2) / never (0)", {"always": 1, "madvise": 2}.get(
            Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0], 0), "")
    except OSError:
        pass

    sections = args.sections.split(",")
    path = "/dev/shm/primitives-probe.bin"
    if "load" in sections or "file" in sections:
        make_file(path, args.gib * GiB)
    try:
        if "load" in sections:
            section_load(args, path)
        if "file" in sections:
            section_file(args, path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if "threads" in sections:
        section_threads(args)
    if "gil" in sections:
        section_gil(args)
    if "tokenizer" in sections and args.tokenizer:
        section_tokenizer(args)
    if "compute" in sections:
        section_compute()
    if "attention" in sections:
        section_attention()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "primitives.json").write_text(json.dumps(
        {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print("\n".join(f"{k:60s} {v[0]:>10} {v[1]}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
