# Tests of the harness interact.py: contest rules, texts, random checkpoints, the protocol.

import json
import math
import sys
import textwrap

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
    # 1.0505 is 5.05% off in float, but rounds to bf16 1.046875: 4.7% off, a match.
    assert interact.compare_losses([1.0505], [1.0]) == ([], pytest.approx(0.046875))
    bad, _ = interact.compare_losses([1.0, 1.07, 0.93], [1.0, 1.0, 1.0])
    assert bad == [1, 2]
    assert interact.compare_losses([1.02], [1.0], rtol=0.01)[0] == [0]


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


def test_texts_file_array_and_json_lines(tmp_path):
    texts = ["a", 'b "quoted"\nline', "ü∑"]
    array = tmp_path / "a.json"
    array.write_text(json.dumps(texts))
    lines = tmp_path / "a.jsonl"
    lines.write_text("\n".join(json.dumps(t) for t in texts) + "\n\n")
    assert interact.load_texts_file(array) == texts
    assert interact.load_texts_file(lines) == texts


@pytest.mark.parametrize("content", ['{"a": 1}', "[1, 2]", "not json", '"a"\n{'])
def test_texts_file_bad(tmp_path, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(UserError, match="bad.json"):
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

    texts = interact.demo_texts(qwen_tokenizer, 2, seed=0)
    losses = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([qwen_tokenizer(text)["input_ids"]])
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert all(abs(x - math.log(TINY["vocab_size"])) > 1 for x in losses)
    assert losses[0] != losses[1]


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
# The protocol, end to end against fake runners
# ---------------------------------------------------------------------------

FAKE_RUNNER = textwrap.dedent(
    """
    import json, os, sys, time
    print("loading...", flush=True)
    print("flag", os.environ.get("FLASH_ATTENTION_TRITON_AMD_ENABLE"), sys.argv[1:], file=sys.stderr)
    if "--die" in sys.argv:
        sys.exit(3)
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
    assert "check: 0 mismatches of 3" in capsys.readouterr().out

    ref.write_text(json.dumps({"texts_sha256": interact.texts_sha256(texts), "losses": [0.3, 0.7, 3.0]}))
    assert interact.main([*base, "--check", str(ref)]) == 1
    assert "check: 1 mismatches of 3" in capsys.readouterr().out
    ref.write_text(json.dumps({"texts_sha256": "other", "losses": [0.3, 0.7, 2.5]}))
    assert interact.main([*base, "--check", str(ref)]) == 1
    assert "made for other texts" in capsys.readouterr().err


def test_harness_runner_dies_before_ready(harness, capsys):
    _, _, base = harness
    assert interact.main([*base, "--", "--die"]) == 1
    err = capsys.readouterr().err
    assert "flag TRUE" in err  # the runner's stderr is shown
    assert "exited before `ready`" in err and "exit code 3" in err


def test_make_reference_refuses_a_folder_without_tokenizer_files(harness, capsys):
    # transformers gives such a folder an empty tokenizer: every reference loss would be nan, and --check pass
    tmp_path, _, base = harness
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert interact.main([*base, "--make-reference", str(tmp_path / "ref.json")]) == 1
    assert "no usable tokenizer in" in capsys.readouterr().err and not (tmp_path / "ref.json").exists()
