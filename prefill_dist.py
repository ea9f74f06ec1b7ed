"""prefill under torchrun: one process per GPU, rank 0 speaking for all. Imported by prefill.py's command line when
WORLD_SIZE > 1, and by prefill_eval.py under torchrun.

Under torchrun (WORLD_SIZE > 1; docs/distributed.md) every rank loads the model on its own GPU (LOCAL_RANK) with its
own memory plan, reads and tokenizes the same input, and so cuts the same batches (batches() looks at token counts
alone). The ranks claim whole batches from a shared counter as they become free. A batch runs whole on one rank, so
its numbers are those of a 1-process run on the same GPU model, bit for bit (the same GEMM shapes), whichever rank
ran it. Rank 0 alone speaks: it prints `ready` once every rank is ready, reads the request, writes OUT in input order
and logs; the other ranks compute, publish and stay silent (their errors reach the user through rank 0's line).
What crosses between ranks is a few bytes a batch (its texts' float64 NLL sums), the request line and rank 0's
picks. They go through torchrun's own TCPStore (torch.distributed.rendezvous("env://")), not a process group: it
works the same with CPU, CUDA and ROCm builds (no NCCL/RCCL, so none of their 10-minute timeouts), its atomic add
makes claiming race-free, and torchrun's agent hosts it, so it outlives a dying rank, whose error stays readable.
A rank that dies on this node is seen by its torchrun agent within --monitor-interval (0.1 s) and the others get
SIGTERM (the 143 path: after the batch being written, with the resume line). A rank on another node that dies
without a word stops its heartbeat, and the ranks waiting on it stop after PEER_SILENT_S.
"""
import array
import collections
import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from prefill import Loglikelihood, PeerFailed, Picks, UserError, gpu_vendor_here, scores_of

POLL_S = 0.05         # how often a waiting rank looks at the store (TCPStore.wait's timeout logs a C++ warning)
BEAT_S = 1.0
PEER_SILENT_S = 30.0  # a rank whose heartbeat has not moved for this long is gone (its node down, or hung)
SPEAK_WAIT_S = 10.0   # how long a failing rank > 0 waits for rank 0 to report the failure


def only_rank_gpu(env, local_rank, hip):
    """Leaves this rank's GPU (LOCAL_RANK of those visible) the only one the runtime will see, as device 0; returns
    the variable set. torch.cuda.set_device would not do: the current device is per thread, and the start-up checks,
    loading threads, copier and Triton launches would work on GPU 0 (seen on the 2-GPU H200: rank 1's start-up
    allocated on GPU 0 and rank 0 ran out of memory). Read once, when the runtime starts: before any CUDA call. HIP
    reads HIP_VISIBLE_DEVICES (ROCm docs, reference/env-variables: HIP GPU isolation variables; whether it also reads
    CUDA_VISIBLE_DEVICES differs between ROCm versions), relative to ROCR_VISIBLE_DEVICES where that is set."""
    name = "HIP_VISIBLE_DEVICES" if hip else "CUDA_VISIBLE_DEVICES"
    visible = [v for v in env.get(name, "").split(",") if v.strip()]
    if visible and local_rank >= len(visible):
        raise UserError(f"LOCAL_RANK {local_rank}, but {name}={env[name]} names {len(visible)} GPU(s): give torchrun "
                        "at most that --nproc-per-node")
    env[name] = visible[local_rank].strip() if visible else str(local_rank)
    return name


def process_alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


class Group:
    """This process's rank among torchrun's, and the store the ranks share."""

    def __init__(self, env, device):
        try:
            self.rank, self.world, self.local_rank = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        except (KeyError, ValueError):
            raise UserError("WORLD_SIZE > 1 but no RANK and LOCAL_RANK: start prefill.py with torchrun") from None
        self.nodes = self.world // int(env.get("LOCAL_WORLD_SIZE", self.world))
        if device != "cpu":  # `cuda` below is then this rank's GPU, in every thread
            name = only_rank_gpu(env, self.local_rank, hip=torch.version.hip is not None)
            if not torch.cuda.is_available() and gpu_vendor_here():
                raise UserError(f"LOCAL_RANK {self.local_rank}: no such GPU here ({name}={env[name]}); give torchrun "
                                "at most as many --nproc-per-node as there are GPUs")
        try:
            store, _, _ = next(torch.distributed.rendezvous("env://", timeout=datetime.timedelta(seconds=60)))
        except (RuntimeError, ValueError) as e:
            raise UserError(f"cannot reach torchrun's store: {e}") from None
        # a prefix per torchrun restart: a restarted group must not read the keys of the one before
        self.store = torch.distributed.PrefixStore(f"prefill/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}/", store)
        self.store.set(f"proc/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self.beats, self.stopping, self.closed = {}, threading.Event(), threading.Event()
        self.beater = threading.Thread(target=self._beat, args=(self.store.clone(),), name="prefill-heartbeat",
                                       daemon=True)
        self.beater.start()
        for signum in (signal.SIGINT, signal.SIGTERM):  # a side thread waiting on the store must let go too
            handler = signal.getsignal(signum)
            if callable(handler):
                signal.signal(signum, lambda signum, frame, then=handler: (self.stopping.set(), then(signum, frame)))

    @staticmethod
    def from_env(device):
        return Group(os.environ, device) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None

    def _beat(self, store):
        with contextlib.suppress(Exception):  # the store has gone: so has the run
            while not self.closed.is_set():
                store.add(f"beat/{self.rank}", 1)
                self.closed.wait(BEAT_S)

    def close(self):
        # the heartbeat ends before the interpreter does: a daemon thread inside the store's C++ client at exit can
        # abort the process ("terminate called without an active exception", seen in CI on a rank's error exit)
        self.closed.set()
        self.beater.join(timeout=2 * BEAT_S)

    def spoke(self):  # rank 0 has said why the run ends
        self.set("spoken")

    def await_rank_zero(self):
        # a rank > 0 that fails waits (bounded) for rank 0 to say why, on stderr, before its own exit makes torchrun
        # SIGTERM rank 0, which may still be importing torch and die without a word
        end = time.monotonic() + SPEAK_WAIT_S
        with contextlib.suppress(Exception):
            while not self.store.check(["spoken"]) and time.monotonic() < end:
                time.sleep(POLL_S)

    def set(self, key, value=b""):
        self.store.set(key, value)

    def claim(self, tag=""):  # the next unclaimed number of a round's shared counter, from 0
        return self.store.add(f"{tag}claimed", 1) - 1

    def has(self, key):
        return self.store.check([key])

    def wait(self, key):
        """The value of key once a rank has set it; PeerFailed if a rank fails or falls silent first."""
        checked = 0.0
        while not self.store.check([key]):
            if time.monotonic() - checked >= BEAT_S:
                self.check_peers()
                checked = time.monotonic()
            time.sleep(POLL_S)
        return self.store.get(key)

    def check_peers(self):
        if self.stopping.is_set():
            raise PeerFailed("stopped by a signal")
        if self.store.check(["failed"]):
            raise PeerFailed(self.store.get("failed").decode())
        now = time.monotonic()
        for rank in range(self.world):
            if rank == self.rank or self.store.check([f"done/{rank}"]):
                continue
            count = self.store.add(f"beat/{rank}", 0)
            if self.beats.get(rank, (None,))[0] != count:
                self.beats[rank] = (count, now)
            elif count and now - self.beats[rank][1] > PEER_SILENT_S:  # from its first beat: imports can be slow
                raise PeerFailed(f"rank {rank} has been silent for {PEER_SILENT_S:.0f} s (its node down, or hung)")

    def fail(self, line):  # the first rank to fail is the one the others report
        with contextlib.suppress(Exception):
            self.store.compare_set("failed", "", f"rank {self.rank}: {line}")

    def cause(self):
        """Why the run is being stopped, as far as this rank can tell: the first failure a rank recorded, else a rank
        of this node whose process has gone without recording one (SIGKILL, the OOM killer), else None."""
        with contextlib.suppress(Exception):
            if self.store.check(["failed"]):
                return self.store.get("failed").decode()
            for rank in range(self.world):
                if rank != self.rank and self.store.check([f"proc/{rank}"]):
                    host, pid = self.store.get(f"proc/{rank}").decode().split()
                    if host == socket.gethostname() and not process_alive(int(pid)):
                        return f"rank {rank} (pid {pid}) ended without an error: killed by a signal or the OOM killer?"
        return None

    def relaunch(self):  # how this run was started, for the resume line: torchrun's module, whatever its spelling was
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.world // self.nodes}"] + (
            [f"--nnodes={self.nodes}", "<the same rendezvous options>"] if self.nodes > 1 else ["--standalone"])


class RankZeroPicks(Picks):
    """Ranks > 0 take rank 0's timing-based choices: timed on several GPUs at once, they could differ, and with them the
    numbers. Rank 0 publishes its choices once loaded; this rank's check of the candidates runs meanwhile."""

    def __init__(self, group):
        super().__init__(None, None)  # nothing is read, written or timed here
        self.group = group

    def get(self, what):
        return json.loads(self.group.wait("picks")).get(what)


def publish_picks(group, runner, attention, experts):
    kept = {f"attention {attention} {label}": name for label, name in runner.attention.items()}
    group.set("picks", json.dumps(dict(kept, blas=runner.blas, **{f"experts {experts}": runner.experts})))


def all_ready(group):
    group.set(f"ready/{group.rank}")
    for rank in range(group.world):
        group.wait(f"ready/{rank}")


# What crosses between ranks for a batch: a text's NLL sum (float64 bytes); a continuation's log-prob, greedy and
# token log-probs (JSON: floats as repr, the same bits back)

def publish_scores(scores):
    return array.array("d", (s.nll_sum for s in scores)).tobytes()


def receive_scores(batch, data):
    return scores_of(batch, array.array("d", data).tolist())


def publish_loglikelihoods(results):
    return json.dumps([[r.logprob, r.greedy, r.token_logprobs] for r in results])


def receive_loglikelihoods(batch, data):
    return [Loglikelihood(index, logprob, len(request.continuation), greedy, token_logprobs)
            for (index, request, _), (logprob, greedy, token_logprobs) in zip(batch, json.loads(data))]


def shared(group, batches, score, publish, receive, tally=None, start=0, tag=""):
    """The ranks' one way of sharing work, for the corpus and the protocol (prefill_corpus) and lm-eval
    (prefill_eval): every rank reads the same batches, numbered from `start` (cut from token counts alone, they are
    the same on every rank); each is claimed from the store's counter by the first rank free, scored there (`score`)
    and published (`publish`: bytes); every rank yields every batch's (batch, results) in order, another rank's read
    back (`receive`) and counted in this rank's stats (`tally`). tag: a prefix for one round's keys (lm-eval calls
    again with new requests)."""
    def ready(k, batch, results):
        if results is None:  # another rank's
            results = receive(batch, group.wait(f"{tag}sums/{k}"))
            if tally is not None:
                tally(batch, results)
            if group.store.add(f"{tag}read/{k}", 1) == group.world - 1:  # the last rank to read it frees it
                group.store.delete_key(f"{tag}sums/{k}")
        return batch, results

    pending, mine = collections.deque(), start + group.claim(tag)  # pending: [k, batch, results or None], in order
    for k, batch in enumerate(batches, start):
        results = None
        if k == mine:
            results = score(batch)
            group.set(f"{tag}sums/{k}", publish(results))
            mine = start + group.claim(tag)
        pending.append((k, batch, results))
        while pending and (pending[0][2] is not None or group.has(f"{tag}sums/{pending[0][0]}")):
            yield ready(*pending.popleft())
        group.check_peers()  # a rank gone on another node: stop rather than score for nobody
    while pending:
        yield ready(*pending.popleft())
