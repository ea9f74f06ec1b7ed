"""prefill's corpus mode: `prefill.py --input FILE [--output OUT.jsonl [--resume]]`, imported by prefill.py's command
line when those options are given (and under torchrun, which serves the protocol through the same loop).

--input FILE --output OUT.jsonl scores a corpus of any size: records are read and tokenized on a side thread a few
batches ahead (Runner.text_batches, Runner.request_batches), and each batch's records are appended to OUT in one
write, flushed and fsynced. OUT holds whole batches at every moment, but for the one a kill cut short, which --resume
cuts off and redoes. Each record carries a digest of what its numbers were computed from (its token ids and every
setting), so that a resumed run keeps only records it can prove were scored from the input as it is now.
"""
import array
import contextlib
import hashlib
import itertools
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from prefill import (JSON_SPACE, LOGITS, PAIR_FIELDS, SAFETENSORS_MAX_HEADER, WAVE_STEP, ModelConfig, PeerFailed,
                     Progress, Terminated, UserError, Workers, check_writable, decoded, json_array, log, model_folder,
                     parse_json, parse_request, print_losses, report, request_line, runner_of, shown, signals_held,
                     since_process_start, text_of, warmed_up)
from prefill_dist import (RankZeroPicks, all_ready, publish_loglikelihoods, publish_picks, publish_scores,
                          receive_loglikelihoods, receive_scores, shared)

CHECKED_RECORDS = 1000  # records read and checked before the model loads: a typo costs seconds, not a 65 GB load
DIGEST_HEX = 16  # a record's digest: 64 bits, so an edited text passes for the old one with a chance of 2^-64


NO_ID = object()  # a record without the id field (null is an id)


@dataclass
class Record:
    text: str                # None in a continuation's record
    id: object = NO_ID
    context: str = None      # a continuation's record: the two strings instead of a text
    continuation: str = None
    where: str = "the request"  # where the input holds it ("in.jsonl line 7"), for --resume's messages


def record_of(value, where, text_field, id_field, pair_fields=PAIR_FIELDS):
    if not isinstance(value, dict):
        return Record(text_of(value, where), NO_ID, where=where)
    context_field, continuation_field = pair_fields
    if context_field in value:  # a continuation to score given its context (docs/corpus.md)
        if continuation_field not in value:
            raise UserError(f"{where} has the context field {shown(context_field)} but not the continuation field "
                            f"{shown(continuation_field)} (--continuation-field)")
        context = text_of(value[context_field], f"{where} field {shown(context_field)}")
        continuation = text_of(value[continuation_field], f"{where} field {shown(continuation_field)}")
        if not context.rstrip() or not continuation:
            raise UserError(f"{where}: the {'context' if not context.rstrip() else 'continuation'} is empty (a "
                            "continuation is predicted from at least one token of context)")
        return Record(None, value.get(id_field, NO_ID), context, continuation, where)
    if text_field not in value:
        raise UserError(f"{where} is an object without the text field {shown(text_field)} (--text-field) or the "
                        f"context field {shown(context_field)} (--context-field)")
    return Record(text_of(value[text_field], f"{where} field {shown(text_field)}"), value.get(id_field, NO_ID),
                  where=where)


def read_located(path, text_field, id_field, pair_fields):
    # read_records' (where, Record) pairs
    space = JSON_SPACE.encode()
    try:
        with contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb") as f:
            # lines end at b"\n" only, not at every break splitlines() knows: a JSON string may hold a raw U+2028
            lines = ((number, line) for number, line in enumerate(f, 1) if line.strip(space))
            first = next(lines, None)
            if first and first[1].lstrip(space).startswith(b"["):
                for i, value in enumerate(json_array(first[1] + f.read(), path)):
                    where = f"{path}: element {i}"
                    yield where, record_of(value, where, text_field, id_field, pair_fields)
                return
            for number, line in itertools.chain([first] if first else [], lines):
                where = f"{path} line {number}"
                yield where, record_of(parse_json(decoded(line), where), where, text_field, id_field, pair_fields)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


def read_records(path, text_field="text", id_field="id", pair_fields=PAIR_FIELDS):
    """--input FILE ('-': stdin), one Record at a time: a JSON array, read whole, or JSON lines, read line by line
    (blank lines skipped; the format for big corpora). An element or line is a string, or an object whose
    text_field is a string, or one whose context and continuation fields (pair_fields) are (its id_field, any JSON
    value, is kept; other fields are ignored). Every record of a file is of the first one's kind. A problem names
    the element, or the line (1-based, as editors count)."""
    kind = None
    for where, record in read_located(path, text_field, id_field, pair_fields):
        if kind is None:
            kind = record.text is None
        elif kind != (record.text is None):
            raise UserError(f"{where} is a {'text' if kind else 'continuation'} where the records before it are "
                            f"{'continuations' if kind else 'texts'}: a corpus holds one kind")
        yield record


def count_records(path):
    """How many records --input holds, for the progress bar's ETA: its non-blank lines, or its array's length.
    Counted on a side thread while the model loads; None where unknown (stdin, a file that does not parse)."""
    space = JSON_SPACE.encode()
    with contextlib.suppress(OSError, UserError):
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if head.lstrip(space).startswith(b"["):
                return len(json_array(head + f.read(), path))
            f.seek(0)
            return sum(1 for line in f if line.strip(space))
    return None


# The files whose bytes decide a checkpoint's numbers besides the weights' values: what an edit in place (another
# config, tokenizer or set of tensors at the same path) changes. The weights are not read (65 GB): a safetensors file
# counts by its header (each tensor's name, dtype, shape and offsets) and its size.
FINGERPRINT_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                     "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer.model")


def checkpoint_fingerprint(model_dir):
    """A digest of model_dir's FINGERPRINT_FILES and safetensors headers: milliseconds, before the model loads."""
    folder = model_folder(model_dir)
    digest = hashlib.sha256()
    for path in [folder / name for name in FINGERPRINT_FILES] + sorted(folder.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                if path.suffix != ".safetensors":
                    data = f.read()
                else:  # a corrupt length reads at most the header limit; the loader names what is wrong with it
                    head = f.read(8)
                    data = head + f.read(min(int.from_bytes(head, "little"), SAFETENSORS_MAX_HEADER)) + \
                        os.fstat(f.fileno()).st_size.to_bytes(8, "little")
        except FileNotFoundError:
            data = b""
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror}") from None
        digest.update(f"{path.name} {len(data)}\n".encode() + data)
    return digest.hexdigest()[:DIGEST_HEX]


def settings_digest(settings):
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def numbers_digest(settings_key, *token_lists):
    """What a record's numbers were computed from, in DIGEST_HEX hex digits: the run's settings (settings_key, the
    settings_digest of everything OUT.settings.json holds: the options, the checkpoint's fingerprint, the kernels
    picked) and the token ids (a text's; a record of another kind passes each of its token lists). --resume keeps a
    record only where what the input gives now has the digest stored with it."""
    digest = hashlib.sha256(settings_key.encode())
    for ids in token_lists:
        digest.update(len(ids).to_bytes(8, "little") + array.array("q", ids).tobytes())
    return digest.hexdigest()[:DIGEST_HEX]


# ----------------------------------------------------------------------------- texts or continuations
# A corpus holds one kind of record. Each step that differs between the two is a field of its Kind, chosen once
# from the first record: the batches, their scoring, what crosses between ranks, what a record of OUT holds.

@dataclass(frozen=True)
class Kind:
    unit: str           # "text" or "request": in messages and the progress
    batches: object     # (runner, records) -> batches of (index, ids, record), read ahead
    score: object       # (runner, batch, token_logprobs) -> the batch's results (Scores or Loglikelihoods)
    tally: object       # (runner, batch, results): another rank's batch, into this rank's stats
    publish: object     # results -> bytes for the other ranks, and back: (batch, bytes) -> results
    receive: object
    token_lists: object  # ids -> the token lists a record's digest covers
    counts: object      # ids -> the token counts a record holds, checked by --resume
    fields: object      # (result, ids) -> the numbers a record holds


def text_fields(score, ids):
    return {"tokens": score.tokens, "loss": score.loss, "nll_sum": score.nll_sum}


def continuation_fields(result, ids):
    # loss and nll_sum are the continuation's (its mean and summed NLL), as a text's are its predicted tokens'
    fields = dict(tokens=len(ids.context) + len(ids.continuation), context_tokens=len(ids.context),
                  continuation_tokens=result.tokens, loss=-result.logprob / result.tokens, nll_sum=-result.logprob,
                  logprob=result.logprob, greedy=result.greedy)
    return fields if result.token_logprobs is None else dict(fields, token_logprobs=result.token_logprobs)


TEXTS = Kind("text", lambda runner, records: runner.text_batches(records, text=lambda record: record.text),
             lambda runner, batch, _: runner.score_batch(batch),
             lambda runner, batch, scores: runner.add_stats(scores), publish_scores, receive_scores,
             lambda ids: (ids,), lambda ids: {"tokens": len(ids)}, text_fields)
CONTINUATIONS = Kind("request", lambda runner, records: runner.pair_batches(
                         records, lambda record: (record.context, record.continuation)),
                     lambda runner, batch, token_logprobs: runner.score_requests(batch, token_logprobs),
                     lambda runner, batch, results: runner.add_request_stats(batch, results),
                     publish_loglikelihoods, receive_loglikelihoods, lambda ids: (ids.context, ids.continuation),
                     lambda ids: {"tokens": len(ids.context) + len(ids.continuation),
                                  "continuation_tokens": len(ids.continuation)}, continuation_fields)


def record_digest(kind, ids, settings_key):
    return numbers_digest(settings_key, *kind.token_lists(ids))


def record_key(kind, index, ids, record, settings_key):
    """What a record of OUT must hold for --resume to take it as the input's: its index, token counts, id, and the
    digest of the token ids (a continuation's context and continuation, each) and settings its numbers came from."""
    return ({"index": index} | kind.counts(ids) | ({} if record.id is NO_ID else {"id": record.id})
            | {"digest": record_digest(kind, ids, settings_key)})


def output_line(kind, result, ids, record, digest=None):
    fields = {"index": result.index} | ({} if record.id is NO_ID else {"id": record.id}) | kind.fields(result, ids)
    if digest is not None:  # None: printed without --output, where there is nothing to resume
        fields["digest"] = digest
    return json.dumps(fields) + "\n"  # floats as repr: the shortest text that reads back to the same bits


def write_atomically(path, text):
    # a kill leaves the old file or the new one, never a part of one
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def record_differences(got, want):
    """How a record OUT holds differs from the one the input gives now (want): a list of phrases, empty if none."""
    if not (isinstance(got, dict) and isinstance(got.get("nll_sum"), float)):
        return ["it is not a record prefill writes"]
    differs = [f"{key} {shown(got[key]) if key in got else 'absent'} there, {shown(want[key])} now" for key in want
               if key not in got or json.dumps(got[key]) != json.dumps(want[key])]
    return differs + (["an id there, none now"] if "id" in got and "id" not in want else [])


class CorpusOutput:
    """OUT.jsonl, appended a batch at a time. With --resume, each batch the file already holds whole is checked
    against the input (index, tokens, id, and the digest of the token ids and settings its numbers came from) and
    skipped; at the first it does not hold whole (the one a kill cut: whole records and a cut line alike) the file is
    cut back to the batch's start and scoring goes on. Batches are cut from token counts alone and each batch's
    numbers are the same on every run, so the finished file is byte for byte what one uninterrupted run writes.
    OUT.settings.json (settings) is written just before OUT first changes: a refused resume leaves both as they were."""

    def __init__(self, path, resume, settings, kind):
        self.path, self.records, self.size, self.kind = path, 0, 0, kind  # records and bytes: whole batches
        self.settings, self.settings_key = settings, settings_digest(settings)
        self.old = open(path, "rb") if resume and os.path.exists(path) and os.path.getsize(path) else None
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.old is None:
            os.ftruncate(self.fd, 0)  # empty already, or absent: check_output refused anything else

    def holds(self, batch):
        """The batch's records as OUT holds them (dicts), or None where it does not hold the whole batch. Whole lines
        are checked against the input even then: a wrong input must not pass for a cut batch."""
        if self.old is None:
            return None
        lines = list(itertools.takewhile(lambda line: line.endswith(b"\n"), (self.old.readline() for _ in batch)))
        records = []
        for line_no, line, (index, ids, record) in zip(itertools.count(self.records + 1), lines, batch):
            want = record_key(self.kind, index, ids, record, self.settings_key)
            try:
                got = json.loads(line)
            except ValueError:
                got = None
            differs = record_differences(got, want)
            if differs:
                why = ("it was scored from another text than the input holds there now, or with another checkpoint "
                       "or setting." if differs[0].startswith("digest ") else
                       "another input, tokenizer or --id-field?")
                raise UserError(f"{self.path} line {line_no} does not match {record.where} ({'; '.join(differs)}): "
                                f"{why} Resume with the input and settings it was made with, or move {self.path} "
                                "away to score afresh")
            records.append(got)
        if len(records) < len(batch):  # the end of what an interrupted run wrote: whole records, maybe a cut line
            self._cut()
            return None
        self.records += len(batch)
        self.size += sum(map(len, lines))
        return records

    def _settings_written(self):
        if self.settings is not None:
            write_atomically(self.path + ".settings.json", json.dumps(self.settings))
            self.settings = None

    def append(self, scores, batch):
        self._settings_written()
        data = memoryview("".join(output_line(self.kind, s, ids, record, record_digest(self.kind, ids,
                                                                                       self.settings_key))
                                  for s, (_, ids, record) in zip(scores, batch)).encode())
        with signals_held():
            written = len(data)
            while data:
                data = data[os.write(self.fd, data):]
            os.fsync(self.fd)
            self.records += len(batch)
            self.size += written

    def close(self):
        if self.old is not None:  # every batch of the input was there already
            if b"\n" in self.old.read():
                raise UserError(f"{self.path} holds more records than the input ({self.records}): another input?")
            self._cut()
        os.close(self.fd)

    def _cut(self):
        self._settings_written()
        self.old.close()
        self.old = None
        os.ftruncate(self.fd, self.size)


def scored_batches(runner, kind, batches, output, token_logprobs):
    """One process: (batch, its results, None) of each batch, in order, or (batch, None, records) for those OUT
    holds (--resume). Where the plan's wave holds more than a batch (a MoE model's planned wave), consecutive batches
    of texts run as one wave, up to its tokens: the same numbers, each layer copied once for all of them."""
    waves = kind is TEXTS and runner.wave_plan is not None
    group, tokens = [], 0  # batches of texts waiting for their wave
    for batch in itertools.chain(batches, [None]):
        held = output.holds(batch) if output and batch is not None else None
        n = sum(len(ids) for _, ids, _ in batch) if waves and batch is not None and held is None else None
        if group and not (n is not None and tokens + n <= runner.plan.wave_tokens):
            yield from zip(group, runner.score_wave(group), itertools.repeat(None))
            group, tokens = [], 0
        if n is not None:
            group.append(batch)
            tokens += n
        elif batch is not None:
            yield batch, (None if held is not None else kind.score(runner, batch, token_logprobs)), held


def claimed_batches(group, runner, kind, batches, output, token_logprobs):
    """Under torchrun: scored_batches over every rank, through prefill_dist.shared. Rank 0 checks what OUT holds
    (--resume) and tells the ranks where scoring starts; every rank then claims and scores batches from there."""
    batches, start = iter(batches), 0
    if group.rank == 0:
        for batch in batches:
            held = output.holds(batch) if output else None
            if held is None:
                batches = itertools.chain([batch], batches)
                break
            yield batch, None, held
            start += 1
        group.set("start", str(start))
    else:
        start = int(group.wait("start"))
        batches = itertools.islice(batches, start, None)
    for batch, results in shared(group, batches, lambda batch: kind.score(runner, batch, token_logprobs),
                                 kind.publish, kind.receive, lambda batch, results: kind.tally(runner, batch, results),
                                 start):
        yield batch, results, None


def corpus_settings(args):
    """The settings an --output file's numbers depend on that are known before the model loads: the options, and the
    fingerprint of the checkpoint's files (an edit in place keeps the path). Kept beside OUT in OUT.settings.json to
    name what changed, and digested into each record (numbers_digest) to prove nothing did."""
    # a mixture of experts' wave of WAVE_STEP (torchrun's, where a wave is one batch, or given) is recorded as the
    # planned one (None) it equals in every number: texts are cut into batches of WAVE_STEP tokens whatever the wave
    # (score_wave), so a file begun on one process resumes under torchrun and the other way round, and the two files
    # are the same bytes. A dense model's wave is recorded as given, as before (its records' digests stay valid)
    checkpoint = checkpoint_fingerprint(args.model)  # first: what it says of a bad folder is the error shown
    wave = None if args.wave_tokens == WAVE_STEP and ModelConfig.from_dir(args.model).num_experts else args.wave_tokens
    return {"model": str(Path(args.model).resolve()), "checkpoint": checkpoint,
            "text_field": args.text_field, "id_field": args.id_field, "context_field": args.context_field,
            "continuation_field": args.continuation_field, "token_logprobs": args.token_logprobs,
            "chunk_tokens": args.chunk_tokens,
            "wave_tokens": wave, "attention": args.attention, "kernels": args.kernels,
            "device": args.device or "auto", "logits": dict(LOGITS)}


def picked_settings(runner):
    """The settings that the start-up picks among those the options allow (by the picks file, which can change
    between runs, or by the GPU itself): the rest of what the numbers depend on, known once the model is loaded."""
    device = runner.device
    # a mixture of experts' expert kernel (a dense model's settings are what they were: its records' digests stay
    # valid). Not the wave planned for it: batches are cut at WAVE_STEP tokens whatever the wave (score_wave).
    moe = {"experts": runner.experts} if runner.experts else {}
    # the batch sized by time (the corpus's default, timed_batch_tokens), where it is not WAVE_STEP, as every batch
    # was before it (those records' digests stay valid): which texts share a batch decides their numbers' last bits
    batch = runner.plan.batch_tokens
    timed = {"batch_tokens": batch} if runner.timed_batches and batch != WAVE_STEP else {}
    return {**{f"attention {label}": name for label, name in runner.attention.items()},
            "elementwise kernels": runner.kernels.name, "blas": runner.blas,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type, **moe, **timed}


def settings_changes(kept, now):
    # "key then, now now" for each setting of `now` that OUT.settings.json (`kept`, {} when unreadable) holds otherwise;
    # one it lacks is left to the records' digests, which cover every setting
    return [f"{key} {shown(kept[key])}, now {shown(now[key])}" for key in now if key in (kept or {}) and
            kept[key] != now[key]]


def check_output(args):
    """--output, before the model loads: never clobber an earlier run; resume it only with its own settings. Returns
    this run's settings (corpus_settings) and those OUT.settings.json holds (None: nothing to resume; {}: unreadable,
    when the records' digests alone prove the settings)."""
    if not args.input:
        raise UserError("--output needs --input FILE")
    check_writable(args.output, "--output")
    size = os.path.getsize(args.output) if os.path.exists(args.output) else 0
    if size and args.input != "-" and os.path.exists(args.input) and os.path.samefile(args.input, args.output):
        raise UserError(f"--output {args.output} is the --input file")
    now = corpus_settings(args)
    if not size:
        return now, None  # nothing there to lose
    if not args.resume:
        raise UserError(f"--output {args.output} exists ({size} bytes): pass --resume to continue it, or remove it")
    with open(args.output, "rb") as f:
        first = f.readline()
    with contextlib.suppress(ValueError):  # a cut first line is the first batch to redo
        record = json.loads(first)
        if isinstance(record, dict) and "digest" not in record:
            raise UserError(f"--output {args.output} was written by an older prefill.py, whose records carry no "
                            "digest of the text and settings they were scored from, so none can be proven to match "
                            f"this input: move {args.output} away to score afresh")
    try:
        kept = json.loads(Path(args.output + ".settings.json").read_text())
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    changed = settings_changes(kept, now)
    if changed:
        raise UserError(f"--output {args.output} was made with other settings ({'; '.join(changed)}): resume with "
                        "the same ones" + (" (checkpoint: a digest of config.json, the tokenizer files and the "
                                           "safetensors headers)" if "checkpoint" in kept and
                                           kept["checkpoint"] != now["checkpoint"] else ""))
    return now, kept


def serve(args, protocol, group=None):
    writer = group is None or group.rank == 0  # rank 0 alone writes OUT and speaks the protocol
    records = total = settings = kept = None
    pairs = False  # the records are continuations (context and continuation fields), not texts
    # a corpus's records land a batch at a time: without --wave-tokens, batches of about BATCH_SECONDS (the Runner's
    # timed_batches), so that an interrupt loses little work
    timed = bool(args.output) and args.wave_tokens is None
    if args.wave_tokens is None:  # None (the Runner plans it): a mixture of experts' corpus, on one process (under
        # torchrun the ranks claim batches one at a time, so a wave is one batch there)
        moe = args.input and not group and ModelConfig.from_dir(args.model).num_experts
        args.wave_tokens = None if moe else WAVE_STEP
    if args.output:
        if writer:
            settings, kept = check_output(args)
    elif args.resume:
        raise UserError("--resume needs --output OUT")
    if args.input:  # the input opens and its first records (all of them without --output) parse before the load
        records = read_records(args.input, args.text_field, args.id_field,
                               (args.context_field, args.continuation_field))
        head = list(itertools.islice(records, CHECKED_RECORDS if args.output else None))
        if len(head) < CHECKED_RECORDS or not args.output:
            total = len(head)
        elif args.input != "-":  # counted while the model loads, for the progress bar's ETA, on a daemon thread:
            # an interrupt does not wait for it to read the rest of a huge file
            counter = Workers(1, "prefill-counter")
            total = counter.submit(count_records, args.input)
            counter.close()
        records = itertools.chain(head, records)
        pairs = bool(head) and head[0].text is None
        if args.token_logprobs and not pairs:
            raise UserError("--token-logprobs: the input's records are texts; it applies to context/continuation "
                            "records (a text's token log-probs: give it as the continuation of its first token)")
    if args.stats and writer:
        check_writable(args.stats)
    runner = runner_of(args, args.wave_tokens, picks=None if writer else RankZeroPicks(group), timed_batches=timed)
    if group and writer:
        publish_picks(group, runner, args.attention, args.experts)
    if settings is not None:
        settings.update(picked := picked_settings(runner))
        changed = settings_changes(kept, picked)
        if changed:
            raise UserError(f"--output {args.output} was made with other kernels or batches than this start-up picked "
                            f"({'; '.join(changed)}): the picks file (--picks), the GPU or prefill changed since; "
                            f"resume with those it was made with, or move {args.output} away to score afresh")
    warm_up_s = warmed_up(runner)
    if group:
        all_ready(group)
    runner.since_start_s["ready"] = since_process_start()
    if records is None and not writer:
        line = group.wait("request")  # rank 0's request line, parsed here too: a bad one fails every rank alike
    elif records is None:
        line = request_line(runner, warm_up_s, protocol)
        if not line:
            log("stdin closed before a request arrived")
            return 1
        if group:
            group.set("request", line)
    if records is None:
        records = [Record(text) for text in parse_request(line)]
        total = len(records)
    kind = CONTINUATIONS if pairs else TEXTS
    output = CorpusOutput(args.output, args.resume, settings, kind) if args.output and writer else None
    batches = kind.batches(runner, records)
    results = claimed_batches(group, runner, kind, batches, output, args.token_logprobs) if group else \
        scored_batches(runner, kind, batches, output, args.token_logprobs)
    if not writer:  # computes and publishes; rank 0 writes, prints and logs
        for _ in results:
            pass
        group.set(f"done/{group.rank}")
        return 0
    t_start, start_unix_s = time.perf_counter(), time.time()  # wall clock: bench times a corpus run's ready
    announce = output is not None and args.resume  # where a resumed run picks up, once it is known
    scores, resumed = [], {"texts": 0, "tokens": 0, "predicted_tokens": 0, "nll_sum": 0.0}
    progress = Progress(total.result() if hasattr(total, "result") else total, kind.unit)
    runner.stats = {}
    try:
        for batch, batch_scores, held in results:
            if held is not None:  # --resume: already in OUT, checked against the input
                for r in held:
                    resumed.update(texts=resumed["texts"] + 1, tokens=resumed["tokens"] + r["tokens"],
                                   predicted_tokens=resumed["predicted_tokens"]
                                   + r.get("continuation_tokens", max(0, r["tokens"] - 1)),
                                   nll_sum=resumed["nll_sum"] + r["nll_sum"])
                progress.add(len(batch), 0, held=True)
                continue
            if announce:
                log(f"resume: {resumed['texts']} {progress.unit}s of {args.output} match the input and are kept; "
                    f"scoring from {progress.unit} {batch[0][0]} ({batch[0][2].where})")
                announce = False
            if output:
                output.append(batch_scores, batch)
            else:
                scores += zip(batch_scores, batch)  # with (index, ids, record): a continuation's line names them
            progress.add(len(batch), sum(s.tokens for s in batch_scores))
        if announce:
            log(f"resume: all {resumed['texts']} {progress.unit}s of {args.output} match the input and are kept; "
                "none is left to score")
        if output:
            output.close()
    except (KeyboardInterrupt, Terminated, PeerFailed) as e:
        if output:  # to paste as it is, in any directory: this one's, this interpreter (or torchrun's module under
            # it), the script and the arguments as given, quoted
            command = f"cd {shlex.quote(os.getcwd())} && " + shlex.join(
                (group.relaunch() if group else [sys.executable]) + args.command + ([] if args.resume else ["--resume"]))
            e.add_note(f"{output.records} of {progress.total or 'all'} {progress.unit}s done in {args.output}; "
                       "resume with: "
                       f"{command}")
        raise
    finally:  # the batches' side thread ends here, not at a later garbage collection or the interpreter's exit
        results.close()
        batches.close()
        progress.close()
    if not output and kind is CONTINUATIONS:  # one JSON line per record, --output's fields but the digest, at once
        protocol.write("".join(output_line(kind, result, ids, record) for result, (_, ids, record) in scores))
        protocol.flush()
    elif not output:
        print_losses(protocol, [result for result, _ in scores])
    report(args, runner, time.perf_counter() - t_start, warm_up_s, start_unix_s, progress.unit, resumed, group)
    return 0
