# Tests of the harness interact.py: contest rules, texts, random checkpoints, the protocol.

import importlib.machinery
import json
import math
import shutil
import sys
import textwrap
import types

import pytest
import torch
from safetensors.torch import load_file

import interact
from interact import UserError

# ---------------------------------------------------------------------------
# Contest rules
# ---------------------------------------------------------------------------


def test_score():
    assert interact.contest_score(0) == 100
    assert interact.contest_score(75) == 100
    assert interact.contest_score(100) == pytest.approx(100 / math.e)
    assert 0 < interact.contest_score(129.9) < 1
    assert interact.contest_score(130) == 0
    assert interact.contest_score(500) == 0


def test_compare_relative_branch_rounds_to_bf16_first():
    # 1.0505 is 5.05% off in float, but rounds to bf16 1.046875: 4.7% off, a match; the unrounded error is reported too
    assert interact.compare_losses([1.0505], [1.0]) == ([], pytest.approx(0.046875), pytest.approx(0.0505))
    bad, _, _ = interact.compare_losses([1.0, 1.07, 0.93], [1.0, 1.0, 1.0])
    assert bad == [1, 2]
    assert interact.compare_losses([1.02], [1.0], rtol=0.01)[0] == [0]
    # an error far below bf16's steps: 0 after rounding, not unrounded
    assert interact.compare_losses([1.00000005], [1.0], rtol=1e-9)[1:] == (0.0, pytest.approx(5e-8))


def test_compare_absolute_branch_and_nan():
    # |ref| <= 1e-3: an absolute error up to 1e-2 is fine, whatever the relative error.
    assert interact.compare_losses([0.009], [5e-4])[0] == []
    assert interact.compare_losses([0.02], [5e-4])[0] == [0]
    nan = float("nan")
    assert interact.compare_losses([nan, nan, 1.0], [nan, 1.0, nan])[0] == [1, 2]
    with pytest.raises(UserError):
        interact.compare_losses([1.0], [1.0, 2.0])


# ---------------------------------------------------------------------------
# Texts
# ---------------------------------------------------------------------------


def test_demo_texts_are_deterministic_rendered_chats(qwen_tokenizer):
    texts = interact.demo_texts(qwen_tokenizer, 30, seed=0)
    assert texts == interact.demo_texts(qwen_tokenizer, 30, seed=0)
    assert texts != interact.demo_texts(qwen_tokenizer, 30, seed=1)
    assert len(texts) == 30 and len(set(texts)) == 30
    for t in texts:
        assert len(t) < interact.MAX_CHARS
        assert t.startswith("<|im_start|>user\n")
        assert "<|im_end|>\n<|im_start|>assistant\n" in t and t.endswith("<|im_end|>\n")
    assert any("\\frac" in t for t in texts) and any("\\boxed" in t for t in texts)


def test_long_workload_is_documents_of_1k_to_32k_tokens_deterministic_in_its_seed(qwen_tokenizer):
    from bench.workload import LONG_TOKENS, make_long_texts, token_counts
    texts = make_long_texts(6, 0, qwen_tokenizer)
    counts = token_counts(texts, qwen_tokenizer)
    # each document reaches its drawn length by whole contest texts (the joins may merge a token or two)
    assert all(LONG_TOKENS[0] - 8 <= n <= LONG_TOKENS[1] for n in counts), counts
    assert make_long_texts(4, 0, qwen_tokenizer) == texts[:4] and make_long_texts(6, 1, qwen_tokenizer) != texts
    assert all(t.startswith("<|im_start|>user\n") and t.count("<|im_start|>user\n") >= 2 for t in texts)  # joined


def test_texts_file_array_and_json_lines(tmp_path):
    # every layout prefill.py --input reads, through its reader: strings, and objects with a text field
    texts = ["a", 'b "quoted"\nline', "ü∑"]
    array = tmp_path / "a.json"
    array.write_text(json.dumps(texts))
    lines = tmp_path / "a.jsonl"
    lines.write_text("\n".join(json.dumps(t) for t in texts) + "\n\n")
    objects = tmp_path / "o.jsonl"
    objects.write_text("\n".join(json.dumps({"id": i, "text": t} if i else t) for i, t in enumerate(texts)))
    assert interact.load_texts_file(array) == texts
    assert interact.load_texts_file(lines) == texts
    assert interact.load_texts_file(objects) == texts
    objects.write_text("\n".join(json.dumps({"body": t}) for t in texts))
    assert interact.load_texts_file(objects, text_field="body") == texts


@pytest.mark.parametrize("content, where", [('{"a": 1}', "bad.json line 1 is an object without the text field"),
                                            ("[1, 2]", "bad.json: element 0 is int"),
                                            ("not json", "bad.json line 1: not JSON"),
                                            ('"a"\n{', "bad.json line 2: not JSON")])
def test_texts_file_bad(tmp_path, content, where):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(UserError, match=where):
        interact.load_texts_file(bad)
    with pytest.raises(UserError, match="cannot read"):
        interact.load_texts_file(tmp_path / "missing.json")


# ---------------------------------------------------------------------------
# Random checkpoints round-trip through transformers
# ---------------------------------------------------------------------------

TINY = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


@pytest.mark.parametrize("tied, shard_bytes", [(True, 4 * 2**30), (False, 4 * 2**30), (True, 2**20), (False, 2**20)])
def test_random_checkpoint_loads_in_transformers(tmp_path, qwen_tokenizer_dir, qwen_tokenizer, tied, shard_bytes):
    from transformers import Qwen3ForCausalLM

    out = interact.write_random_checkpoint(
        tmp_path,
        {**TINY, "tie_word_embeddings": tied},
        seed=1,
        shard_bytes=shard_bytes,
        tokenizer_dir=qwen_tokenizer_dir,
    )
    shards = sorted(out.glob("*.safetensors"))
    written = {k: v for f in shards for k, v in load_file(f).items()}
    if shard_bytes < 2**30:
        assert len(shards) > 1 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(written)
        assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in written.values())
    else:
        assert [f.name for f in shards] == ["model.safetensors"]
    assert ("lm_head.weight" in written) == (not tied)
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    assert (out / "tokenizer_config.json").is_file()

    model = Qwen3ForCausalLM.from_pretrained(out, **{interact.dtype_kwarg(): torch.bfloat16}).eval()
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in written.items():
        assert torch.equal(params[name], t), name
    assert torch.equal(model.lm_head.weight, written["lm_head.weight" if not tied else "model.embed_tokens.weight"])

    if shard_bytes < 2**30:
        return  # the weights were just shown to be what was written; their losses are the one-file case's (10 s)
    texts = interact.demo_texts(qwen_tokenizer, 2, seed=0)
    losses = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([qwen_tokenizer(text)["input_ids"]])
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert all(abs(x - math.log(TINY["vocab_size"])) > 1 for x in losses)
    assert losses[0] != losses[1]


@pytest.mark.parametrize("geometry", ["tiny-gemma3", "tiny-qwen2.5", "tiny-llama"])
def test_random_checkpoint_of_each_family_is_what_transformers_loads(tmp_path, qwen_tokenizer_dir, geometry):
    # the bench's checkpoints of the other families: prefill's tensor list for the family is transformers' own, every
    # parameter written (none left to random initialisation), none extra, Gemma's norms centred on 0 (scale 1 + w)
    from transformers import AutoModelForCausalLM

    from bench.make_checkpoint import GEOMETRIES

    config = GEOMETRIES[geometry]
    out = interact.write_random_checkpoint(tmp_path, config, seed=1, tokenizer_dir=qwen_tokenizer_dir)
    written = load_file(out / "model.safetensors")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                       **{interact.dtype_kwarg(): torch.bfloat16})
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.model_type == config["model_type"]
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in written.items():
        assert torch.equal(params[name], t), name
    assert set(written) | {"lm_head.weight"} >= set(params)
    norms = [t.float().mean().item() for name, t in written.items() if name.endswith("norm.weight")]
    assert all(abs(m - (0.0 if geometry == "tiny-gemma3" else 1.0)) < 0.05 for m in norms)


def test_profile_gaps_split_the_compute_streams_idle_time_by_cause():
    # bench/profile_run.py's gap analysis on a hand-made trace (microseconds): B's launch came 5 us after A ended, and
    # B began 10 us after (host late 5, other 5); C was launched long before and began 10 us after B (a wait: other);
    # the copy stream's long kernel is another stream's, and D overlaps C (no gap)
    from bench.profile_run import compute_gaps

    def kernel(name, ts, dur, corr, stream=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr, "stream": stream}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 1,
                "args": {"correlation": corr}}

    def host(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = {"traceEvents": [kernel("A", 0, 10, 1), launch(0, 1), kernel("B", 20, 10, 2), launch(15, 2),
                             kernel("C", 40, 10, 3), launch(3, 3), kernel("D", 45, 10, 4), launch(4, 4),
                             kernel("copy", 0, 500, 5, stream=9), launch(0, 5),
                             # B's delay (10-15 us) was spent in topk, inside route, on the launching thread
                             host("python_function", "route", 0, 20), host("cpu_op", "aten::linear", 1, 8),
                             host("cpu_op", "aten::topk", 10, 4), host("cpu_op", "other thread", 9, 9, tid=2)]}
    gaps = compute_gaps(trace)
    assert gaps["stream"] == 9  # the most kernel time: here the copy's
    next(e for e in trace["traceEvents"] if e["name"] == "copy")["dur"] = 1
    gaps = compute_gaps(trace)
    assert gaps["stream"] == 7 and gaps["kernels"] == 4
    assert gaps["span_s"] == pytest.approx(55e-6) and gaps["busy_s"] == pytest.approx(40e-6)
    assert gaps["host_late_s"] == pytest.approx(5e-6) and gaps["other_s"] == pytest.approx(15e-6)
    assert {name: (late, rest, n) for name, late, rest, n in gaps["by_next"]} == {
        "B": (pytest.approx(5e-6), pytest.approx(5e-6), 1), "C": (0.0, pytest.approx(10e-6), 1)}
    assert gaps["host_late_in"] == [["aten::topk < route", pytest.approx(5e-6)]]


def test_the_moe_layer_bench_runs_its_steps_on_the_cpu(tmp_path, capsys):
    # bench/moe_layer.py on the CPU at its tiny shape: every candidate checked, timed and split (its model config is
    # its own namespace, which the model's later fields had left behind once)
    from bench import moe_layer

    out = tmp_path / "layer.json"
    assert moe_layer.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "64", "--repeats", "1",
                           "--out", str(out)]) == 0
    record = json.loads(out.read_text())["records"][0]
    assert {"grouped_mm", "loop"} <= set(record["candidates"]) and "same bits twice True" in capsys.readouterr().out


def test_demo_model_is_built_once_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = interact.demo_model_dir()
    assert path.parent == tmp_path / "prefill" and [p.name for p in path.parent.iterdir()] == [path.name]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 64 and config["tie_word_embeddings"]
    assert (path / "model.safetensors").stat().st_size < 100e6
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert interact.demo_model_dir() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp


# ---------------------------------------------------------------------------
# Reference model placement (--make-reference): CPU, whole on the GPU, or spread by accelerate
# ---------------------------------------------------------------------------

GIB = 2**30


@pytest.fixture(autouse=True)
def accelerate_looked_up_afresh():
    # transformers caches whether accelerate is importable (an lru_cache) the first time it asks: in a test that hides
    # accelerate (fake_accelerate), that answer would stay for every test after it in the process, and the order of
    # tests in a pytest-xdist worker is not the file's
    from transformers.utils import import_utils
    import_utils.is_accelerate_available.cache_clear()
    yield
    import_utils.is_accelerate_available.cache_clear()


def fake_accelerate(monkeypatch, present: bool):
    """accelerate installed or not, as importlib.util.find_spec sees it (None in sys.modules: not importable)."""
    if present:
        module = types.ModuleType("accelerate")
        module.__spec__ = importlib.machinery.ModuleSpec("accelerate", None)
        monkeypatch.setitem(sys.modules, "accelerate", module)
    else:
        monkeypatch.setitem(sys.modules, "accelerate", None)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU with 47 GiB free on each device, as torch.cuda reports it; returns a model dir of `size` bytes."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: asked.append(i) or (47 * GIB, 48 * GIB))
    monkeypatch.setattr(interact, "host_memory_available", lambda: 100 * GIB)

    def model_dir(size: int):
        out = tmp_path / "model"
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text("{}")
        with open(out / "model.safetensors", "wb") as f:
            f.truncate(size)  # sparse: only its size is read
        return out

    model_dir.asked = asked
    return model_dir


def test_reference_placement_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = interact.reference_placement(tmp_path)
    assert (p.kwargs, p.move_to) == ({}, "cpu")
    assert "sees no GPU" in p.summary and torch.__version__ in p.summary
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CPU asked for, beside a GPU
    p = interact.reference_placement(tmp_path, "cpu")
    assert (p.kwargs, p.move_to, p.summary) == ({}, "cpu", "reference: transformers on the CPU")


@pytest.mark.parametrize("present", [True, False])
def test_reference_placement_whole_model_on_the_gpu(fake_gpu, monkeypatch, present):
    fake_accelerate(monkeypatch, present)
    model = fake_gpu(40 * GIB)  # fits in 47 GiB free less the 4 GiB margin
    p = interact.reference_placement(model)
    if present:  # straight onto the GPU, no host copy of the whole model first
        assert (p.kwargs, p.move_to) == ({"device_map": "cuda"}, None)
    else:
        assert (p.kwargs, p.move_to) == ({}, "cuda")
    assert "the whole model" in p.summary


def test_reference_placement_spreads_a_larger_model_with_accelerate(fake_gpu, monkeypatch):
    fake_accelerate(monkeypatch, True)
    model = fake_gpu(int(65.5 * GIB))
    p = interact.reference_placement(model)
    budget = 47 * GIB - int(interact.REFERENCE_GPU_MARGIN_GIB * GIB)
    assert p.kwargs == {"device_map": "auto", "max_memory": {0: budget, "cpu": 100 * GIB}}
    assert p.move_to is None and "accelerate" in p.summary
    # an explicit budget replaces free memory less the margin; cuda:1 is asked about, and filled, itself
    p = interact.reference_placement(model, "cuda:1", gpu_gib=20)
    assert p.kwargs["max_memory"] == {1: 20 * GIB, "cpu": 100 * GIB}
    assert fake_gpu.asked == [0]  # mem_get_info only where no budget was given
    assert interact.reference_placement(model, gpu_gib=70).kwargs == {"device_map": "cuda"}


def test_make_reference_without_accelerate_on_a_small_gpu_is_one_line(fake_gpu, monkeypatch, tmp_path, capsys,
                                                                     qwen_tokenizer_dir):
    fake_accelerate(monkeypatch, False)
    model = fake_gpu(int(65.5 * GIB))
    for f in qwen_tokenizer_dir.iterdir():  # the tokenizer is loaded (and probed) before the model
        shutil.copy(f, model)
    (tmp_path / "texts.json").write_text(json.dumps(["some text"]))
    out = tmp_path / "ref.json"
    rc = interact.main(["--model", str(model), "--texts", str(tmp_path / "texts.json"), "--make-reference", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert err.count("\n") == 1 and "interact.py: error: --make-reference: the model (65.5 GiB)" in err
    assert "needs accelerate: uv sync --extra reference" in err
    assert interact.main(["--model", str(model), "--reference-gpu-memory", "-1", "--make-reference", str(out)]) == 2
    assert "--reference-gpu-memory -1: must be >= 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, qwen_tokenizer_dir, qwen_tokenizer):
    out = interact.write_random_checkpoint(
        tmp_path_factory.mktemp("tiny"), TINY, seed=2, tokenizer_dir=qwen_tokenizer_dir
    )
    texts = interact.demo_texts(qwen_tokenizer, 3, seed=1) + ["x"]  # one text of a single token: nan
    return out, texts


@pytest.fixture(scope="module")
def plain_losses(tiny_checkpoint):
    """The reference as interact computed it before placements: from_pretrained in bf16 on the CPU, one forward a
    text; once for the three tests that compare against it (16 s on an AVX2 CPU, whose bf16 GEMMs are slow)."""
    model_dir, texts = tiny_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, **{interact.dtype_kwarg(): torch.bfloat16}).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    losses = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tok(text)["input_ids"]])
            losses.append(model(input_ids=ids, labels=ids).loss.item() if ids.shape[1] > 1 else float("nan"))
    return losses


def test_reference_losses_on_the_cpu_are_the_plain_forward(tiny_checkpoint, plain_losses, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model_dir, texts = tiny_checkpoint
    model = interact.load_reference_model(model_dir)
    assert "reference: transformers on the CPU" in capsys.readouterr().out
    got = interact.reference_losses(model, interact.load_tokenizer(model_dir), texts)
    assert got[:-1] == plain_losses[:-1] and math.isnan(got[-1]) and math.isnan(plain_losses[-1])


# accelerate's own placement at 2 MiB of "host" memory: everything offloaded, the embedding too; and a given map
# that keeps all but lm_head (with its largest layer reserved, "auto" cannot split this tiny model that way)
SPREADS = {
    "auto": {"device_map": "auto", "max_memory": {"cpu": 2 * 2**20}},
    "lm_head-offloaded": {"device_map": {"model": "cpu", "lm_head": "disk"}},
}


@pytest.mark.parametrize("spread", list(SPREADS))
def test_reference_losses_of_a_model_accelerate_spread(tiny_checkpoint, plain_losses, tmp_path, monkeypatch, capsys,
                                                      spread):
    """load_reference_model with accelerate's placement, as on a small GPU: the losses are the plain forward's.
    The CPU stands in for the GPU and disk for host memory; an offloaded embedding's weight is on the meta
    device, so the inputs start on the host. Skipped where the `reference` extra is not installed."""
    pytest.importorskip("accelerate")
    model_dir, texts = tiny_checkpoint
    kwargs = {**SPREADS[spread], "offload_folder": str(tmp_path / "offload")}
    monkeypatch.setattr(interact, "reference_placement", lambda *a: interact.Placement(kwargs, None, "spread"))
    model = interact.load_reference_model(model_dir)
    out = capsys.readouterr().out
    if spread == "auto":
        assert set(model.hf_device_map.values()) == {"disk"}
        assert model.get_input_embeddings().weight.device.type == "meta"
    else:
        assert "reference: modules per device: cpu: 1, disk: 1" in out
    got = interact.reference_losses(model, interact.load_tokenizer(model_dir), texts)
    assert got[:-1] == pytest.approx(plain_losses[:-1], rel=1e-6) and math.isnan(got[-1])


# ---------------------------------------------------------------------------
# The protocol, end to end against fake runners
# ---------------------------------------------------------------------------

FAKE_RUNNER = textwrap.dedent(
    """
    import json, os, sys, time
    print("loading...", flush=True)
    print("flag", os.environ.get("FLASH_ATTENTION_TRITON_AMD_ENABLE"), sys.argv[1:], file=sys.stderr)
    if "--die" in sys.argv:
        sys.exit(3)
    if "--bad-input" in sys.argv:  # as prefill.py refuses a bad option, input or checkpoint
        sys.exit(2)
    time.sleep(0.2)
    print("ready", flush=True)
    texts = json.loads(sys.stdin.readline())
    time.sleep(0.3)
    for t in texts:
        print(len(t) / 10, flush=True)
    """
)


@pytest.fixture
def harness(tmp_path):
    runner = tmp_path / "runner.py"
    runner.write_text(FAKE_RUNNER)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # the fake runner never reads it
    texts = ["abc", "defghij", "x" * 25]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    base = ["--model", str(model), "--runner", str(runner), "--texts", str(tmp_path / "texts.json")]
    return tmp_path, texts, base


def test_harness_end_to_end(harness, capsys):
    tmp_path, texts, base = harness
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"texts_sha256": interact.texts_sha256(texts), "losses": [0.3, 0.7, 2.6]}))
    rc = interact.main([*base, "--json", str(tmp_path / "run.json"), "--check", str(ref), "--", "--x", "1"])
    assert rc == 0
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["losses"] == [0.3, 0.7, 2.5]
    assert record["texts"] == 3
    assert 0.3 <= record["t_seconds"] < 5
    assert 0.2 <= record["time_to_ready_s"] < 30
    assert record["score"] == 100
    assert record["runner_cmd"][0] == sys.executable and record["runner_cmd"][-4:] == ["--model", base[1], "--x", "1"]
    assert "flag TRUE" in record["stderr"]
    assert ("check: 0 mismatches of 3; max relative error 3.61e-02 with both sides rounded to bf16 (the contest's "
            "comparison), 3.85e-02 unrounded") in capsys.readouterr().out  # 2.5 against 2.6

    ref.write_text(json.dumps({"texts_sha256": interact.texts_sha256(texts), "losses": [0.3, 0.7, 3.0]}))
    assert interact.main([*base, "--check", str(ref)]) == 1
    assert "check: 1 mismatches of 3" in capsys.readouterr().out
    # a reference for other texts, or of another length: refused before the runner starts, as bad input
    for record, why in (({"texts_sha256": "other", "losses": [0.3, 0.7, 2.5]}, "was made for other texts"),
                        ({"texts_sha256": interact.texts_sha256(texts), "losses": [0.3]}, "do not number the 3")):
        ref.write_text(json.dumps(record))
        assert interact.main([*base, "--check", str(ref)]) == 2
        out, err = capsys.readouterr()
        assert why in err and "runner:" not in out and "flag" not in err, (out, err)


def test_the_demo_shows_tokens_per_s_and_only_a_real_model_run_is_scored(harness, tiny_checkpoint, qwen_tokenizer,
                                                                       monkeypatch, capsys):
    # the contest's score is set for Qwen3-32B on a W7800: the demo's toy model gets time and tokens/s instead
    tmp_path, _, base = harness
    runner = base[base.index("--runner") + 1]
    monkeypatch.setattr(interact, "demo_model_dir", lambda: tiny_checkpoint[0])
    assert interact.main(["--runner", runner, "--n", "3", "--json", str(tmp_path / "demo.json")]) == 0
    out = capsys.readouterr().out
    tokens = sum(len(qwen_tokenizer(t)["input_ids"]) for t in interact.demo_texts(qwen_tokenizer, 3, seed=0))
    record = json.loads((tmp_path / "demo.json").read_text())
    assert f"tokens: {tokens}, {tokens / record['t_seconds']:.0f} tokens/s" in out and record["tokens"] == tokens
    assert "score" not in out and record["score"] is None
    assert "--make-reference ref.json, then --check ref.json" in out
    # with --model (the texts from a file: no tokenizer loaded, no tokens/s): scored
    assert interact.main(base) == 0
    out = capsys.readouterr().out
    assert "score: 100.00" in out and "tokens/s" not in out and "--make-reference" not in out


def test_harness_runner_dies_before_ready(harness, capsys):
    _, _, base = harness
    assert interact.main([*base, "--", "--die"]) == 1
    err = capsys.readouterr().err
    assert "flag TRUE" in err  # the runner's stderr is shown
    assert "exited before `ready`" in err and "exit code 3" in err
    assert interact.main([*base, "--", "--bad-input"]) == 2  # the runner's verdict on its input is passed on
    assert "exit code 2" in capsys.readouterr().err


def test_make_reference_refuses_a_folder_without_tokenizer_files(harness, capsys):
    # transformers gives such a folder an empty tokenizer: every reference loss would be nan, and --check pass
    tmp_path, _, base = harness
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert interact.main([*base, "--make-reference", str(tmp_path / "ref.json")]) == 2
    assert "no usable tokenizer in" in capsys.readouterr().err and not (tmp_path / "ref.json").exists()


def test_a_missing_model_path_or_a_file_is_named_as_such(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for model, why in ((tmp_path / "absent", "does not exist"), (tmp_path / "file", "is not a directory")):
        assert interact.main(["--model", str(model)]) == 2
        assert f"interact.py: error: the model folder {model} {why}" in capsys.readouterr().err
