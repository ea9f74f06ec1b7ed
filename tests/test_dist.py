"""prefill.py under torchrun on the CPU (gloo-free: the ranks share torchrun's store): 2 ranks write what 1 process
writes, byte for byte, in corpus and protocol mode; a rank killed mid-run stops the run within seconds with one line
naming it, and the output it leaves resumes (under torchrun, by the command that line gives) to the uninterrupted
run's."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import interact
import prefill_dist
from test_prefill import CORPUS_ARGS, NEWLINE, TEXTS, Fault, batch_ends, corpus_file, corpus_in_process, main_in_process

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--device", "cpu", "--attention", "sdpa", *map(str, CORPUS_ARGS)]  # waves of 64 tokens: many batches
# the ranks compute with as many threads as this process, whose in-process runs they are compared with bit for bit
# (torchrun would give each rank one)
THREADS = str(torch.get_num_threads())


@pytest.fixture
def model(gqa_checkpoint):  # test_prefill's checkpoint, built once per session (conftest)
    return gqa_checkpoint[0]


def prefill(model, *args, ranks=1, stdin="", timeout=180, env=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "prefill.py"), "--model", str(model), *ARGS, *map(str, args)],
                          input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS=THREADS, **(env or {})))


def own_lines(stderr):  # prefill's lines, not torchrun's report of a failed worker
    return [line for line in stderr.splitlines() if line.startswith("prefill:")]


@pytest.mark.slow
def test_two_ranks_give_the_one_process_protocol_output(fp8_folder, tmp_path, monkeypatch, capsys):
    # the protocol, 2 ranks started by interact.py --nproc 2 as the contest harness would talk to them (the corpus
    # mode's file: the killed run below, resumed, is the one process's file). The one process is prefill.main() in
    # this one, as the killed run's reference is: the process itself is not what is compared. On test_fp8's block-wise
    # FP8 checkpoint, which each rank dequantizes itself (the other runs here are bf16): a torchrun run of its own
    # would cost the suite what this test costs, 15 s on two CPU cores with either checkpoint
    model = fp8_folder
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(TEXTS * 4))
    with monkeypatch.context() as patch:
        rc, solo, err = main_in_process(patch, capsys, model, Fault("", CORPUS_ARGS, texts.read_bytes() + b"\n"))
    assert rc == 0 and len(solo.splitlines()) == 1 + 4 * len(TEXTS), err
    rc = interact.main(["--model", str(model), "--texts", str(texts), "--nproc", "2",
                        "--json", str(tmp_path / "i.json"), "--", *ARGS])
    record = json.loads((tmp_path / "i.json").read_text())
    assert rc == 0 and record["runner_cmd"][1:5] == ["-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node=2"]
    assert [repr(x) for x in record["losses"]] == solo.splitlines()[1:]  # nan too: repr(nan) == 'nan'


@pytest.mark.slow
@pytest.mark.parametrize("args, stdin, message", [
    (("--input", "missing.jsonl"), "", "cannot read missing.jsonl"),  # before the load, on every rank
    ((), '["a", 3]\n', "stdin: element 1 is int"),                    # after `ready`, on every rank
])
def test_an_error_every_rank_makes_is_one_line(model, args, stdin, message):
    p = prefill(model, *args, stdin=stdin, ranks=2)
    errors = [line for line in own_lines(p.stderr) if "error" in line]
    assert p.returncode != 0 and len(errors) == 1 and message in errors[0], p.stderr
    assert p.stdout == ("ready\n" if stdin else "")


def rank_pid(marker, rank, timeout=60):
    """The pid of the worker of rank `rank` among the processes whose environment holds `marker`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for proc in Path("/proc").iterdir():
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if marker.encode() in env and f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
                return int(proc.name)
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} worker found")


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_in_seconds_with_one_line_and_the_output_resumes(model, tmp_path, monkeypatch,
                                                                                     capsys):
    texts = corpus_file(tmp_path / "in.jsonl", 200)
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    assert corpus_in_process(monkeypatch, capsys, model, "--input", texts, "--output", full)[0] == 0  # one process
    want, ends = full.read_bytes(), batch_ends(full)
    marker = f"PREFILL_TEST_RUN={tmp_path}"
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(ROOT / "prefill.py"), "--model", str(model), *ARGS, "--input", str(texts), "--output",
                          str(out)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS=THREADS, PREFILL_TEST_RUN=str(tmp_path)))
    victim = rank_pid(marker, 1)
    while (out.stat().st_size if out.exists() else 0) == 0 and p.poll() is None:  # rank 0 has written a batch
        time.sleep(0.002)
    assert p.poll() is None, p.communicate()
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    stdout, stderr = p.communicate(timeout=60)
    assert time.monotonic() - killed < 15, stderr  # torchrun's agent sees it within 0.1 s; rank 0 ends its batch
    lines = own_lines(stderr)
    assert p.returncode != 0 and stdout == "", stderr
    relaunch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    command = shlex.join(relaunch + [str(ROOT / "prefill.py"), "--model", str(model), *ARGS, "--input", str(texts),
                                     "--output", str(out), "--resume"])
    command = f"cd {shlex.quote(os.getcwd())} && {command}"  # this directory's: pasted anywhere, it works
    assert f"rank 1 (pid {victim}) ended without an error" in lines[-1], stderr
    assert lines[-1].endswith(f"; resume with: {command}"), stderr
    assert sum("rank 1" in line for line in lines) == 1, stderr
    size = out.stat().st_size
    assert 0 < size < len(want) and size in ends and want.startswith(out.read_bytes())  # whole batches
    cut = ends[ends.index(size) + 1]  # as if killed amid the next batch's write: whole records, then a cut line
    out.write_bytes(want[:want.rindex(b"\n", 0, cut - 1) + 9])
    p = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS=THREADS))  # the command as it was printed, elsewhere
    assert p.returncode == 0 and out.read_bytes() == want and p.stdout == "", p.stderr
    lines = own_lines(p.stderr)  # rank 0's load, plan, resume and summary lines; rank 1 says nothing
    assert len(lines) == 4 and lines[2].startswith(f"prefill: resume: {want[:size].count(NEWLINE)} texts of {out}")
    assert f"({want[:size].count(NEWLINE)} texts were in {out} already)" in lines[-1] and " on 2 ranks, " in lines[-1]


@pytest.mark.parametrize("hip", [False, True])
def test_each_rank_sees_only_its_own_gpu(hip):
    # the variable the runtime reads is narrowed to LOCAL_RANK's entry of what was visible: a rank's side threads then
    # cannot reach another rank's GPU
    import prefill
    name = "HIP_VISIBLE_DEVICES" if hip else "CUDA_VISIBLE_DEVICES"
    env = {}
    assert prefill_dist.only_rank_gpu(env, 1, hip) == name and env == {name: "1"}
    env = {name: "4, 6,7"}
    prefill_dist.only_rank_gpu(env, 1, hip)
    assert env == {name: "6"}
    with pytest.raises(prefill.UserError, match="names 3 GPU"):
        prefill_dist.only_rank_gpu({name: "4,6,7"}, 3, hip)
