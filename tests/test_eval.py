"""Continuation scoring and the prefix tree (prefill.py's evaluation section) and the lm-eval backend (prefill_eval.py),
against transformers in float32 and against lm-eval's own HF backend, on a tiny random Qwen3 with the real tokenizer.

prefill computes in bf16, the references in float32. On this model bf16 moves a request's log-likelihood by 0.4%
relative at most, as much as transformers' own bf16 run differs from its float32 run (test_bf16_noise_is_the_
tolerance): TOLERANCE is 1%. The ablations (a tree whose nodes lose their ancestors, see a sibling, or read positions
in the wave instead of depths) move requests by 10-30%.
"""
import collections
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prefill

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.01  # relative, per request's log-likelihood: bf16's noise here is 0.4% (test_bf16_noise_is_the_tolerance)
WORDS = ("the cat dog sat on a mat red blue green river stone house tree bird sky sun moon star fish boat "
         "one two three four five").split()


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def eval_checkpoint(tmp_path_factory, qwen_tokenizer_dir):
    """A 2-layer Qwen3 (GQA, head_dim 16 with 4 heads != hidden 48) whose attention is sharp enough that positions
    and visibility decide the log-likelihoods, mild enough that bf16 stays within TOLERANCE of float32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    out = tmp_path_factory.mktemp("eval-ckpt")
    config = Qwen3Config(vocab_size=151936, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, (6 if ("q_proj" in name or "k_proj" in name) else 1) / p.shape[1] ** 0.5)
            else:
                p.normal_(2 if ("q_norm" in name or "k_norm" in name) else 1, 0.1)
        model.model.embed_tokens.weight.normal_(0, 0.5)
        model.lm_head.weight.normal_(0, 1.5 / config.hidden_size ** 0.5)
    model.save_pretrained(out)
    for f in Path(qwen_tokenizer_dir).iterdir():
        shutil.copy(f, out)
    return out


@pytest.fixture(scope="session")
def float32_model(eval_checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(eval_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def eval_runner(eval_checkpoint):
    return prefill.Runner(eval_checkpoint, device="cpu", attention="sdpa", chunk_tokens=48)


def reference_loglikelihood(model, context, continuation):
    """(log-likelihood, is_greedy) as lm-eval's HF backend computes it, in float32."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = model(ids[:, :-1]).logits.float().log_softmax(-1)[0, -len(continuation):]
    target = torch.tensor(continuation)
    return logprobs.gather(1, target[:, None]).sum().item(), bool((logprobs.argmax(-1) == target).all())


def shared_requests(seed=0):
    """MMLU- and HellaSwag-like token requests: a few-shot prefix shared by questions, one-token choices of one
    question all reading its last token, multi-token endings sharing a context (two long ones, so that a node that
    saw its sibling would show), a text as a continuation of its first token, an exact duplicate."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1000, 50000, (n,), generator=gen).tolist()
    prefix, requests = ids(40), []
    for _ in range(3):
        question = prefix + ids(9)
        requests += [(question, [choice]) for choice in ids(4)]
        requests += [(question, ids(n)) for n in (2, 5)]
    context = ids(12)
    requests += [(context, ids(n)) for n in (1, 3, 7, 16, 16)] + [(prefix[:1], prefix[1:])]
    return requests + [requests[0]]


def relative_errors(results, references):
    return [abs(r.logprob - ref) / abs(ref) for r, (ref, _) in zip(results, references)]


# ----------------------------------------------------------------------------- prefill's continuations, token level

@pytest.fixture(scope="session")
def shared(eval_runner, float32_model):
    requests = shared_requests()
    return requests, eval_runner.loglikelihoods(requests, token_logprobs=True), dict(eval_runner.stats), \
        [reference_loglikelihood(float32_model, *r) for r in requests]


def test_continuations_match_transformers_float32(shared):
    requests, results, stats, references = shared
    assert max(relative_errors(results, references)) < TOLERANCE
    assert [r.tokens for r in results] == [len(c) for _, c in requests]
    for r in results:
        assert len(r.token_logprobs) == r.tokens and math.fsum(r.token_logprobs) == r.logprob
    # shared: the prefix once, the duplicate not at all; every scored token read once per distinct (row, target)
    assert stats["tokens_computed"] < stats["tokens_requested"] / 2
    assert stats["requests"] == len(requests) - 1


def test_bf16_noise_is_the_tolerance(eval_checkpoint, float32_model, shared):
    # transformers' own bf16 differs from its float32 as prefill does: the tolerance is bf16's, not slack
    from transformers import AutoModelForCausalLM
    requests, results, _, references = shared
    bf16 = AutoModelForCausalLM.from_pretrained(eval_checkpoint, dtype=torch.bfloat16).eval()
    noise = max(abs(reference_loglikelihood(bf16, *r)[0] - ref) / abs(ref) for r, (ref, _) in zip(requests, references))
    prefill_err = max(relative_errors(results, references))
    assert TOLERANCE / 10 < noise < TOLERANCE / 2 and prefill_err < 2 * noise, (noise, prefill_err)


def test_shared_prefixes_equal_each_request_alone_and_repeat_bitwise(eval_runner, shared):
    requests, results, _, _ = shared
    alone = [eval_runner.loglikelihoods([r])[0] for r in requests]
    assert max(abs(a.logprob - r.logprob) / abs(a.logprob) for a, r in zip(alone, results)) < TOLERANCE
    assert [a.greedy for a in alone] == [r.greedy for r in results]
    again = eval_runner.loglikelihoods(list(reversed(requests)), token_logprobs=True)[::-1]  # another order
    assert [prefill.dataclasses.replace(r, index=i) for i, r in enumerate(again)] == results


def test_a_text_as_a_continuation_is_its_whole_text_nll(eval_runner, shared):
    requests, results, _, _ = shared
    context, continuation = requests[-2]  # one token of context, the rest of a text
    [nll] = [s.nll_sum for s in eval_runner.score_batch([(0, context + continuation, None)])]
    assert abs(results[-2].logprob + nll) / nll < 1e-2


def test_float32_logits_leave_no_ties_and_come_closer_to_float32(eval_runner, float32_model, monkeypatch):
    # 256 one-token choices after one context (a question's " A".." D", many times over), all read from one row:
    # with the logits rounded to bf16 (prefill.LOGITS' "bf16", transformers bf16's way) choices tie bit for bit and
    # lm-eval would take the first; float32 logits (the default) leave none, and sit closer to transformers float32.
    # Measured: no tied pair against 20 (transformers bf16: the same 20). The network's own bf16 noise dominates on
    # this random model (mean squared error 3.10e-3 against 3.13e-3), so the margin is small; on real SmolLM2 weights
    # it is not (test_families' MMLU-style test)
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(1000, 50000, (20,), generator=gen).tolist()
    choices = (torch.randperm(49000, generator=gen)[:256] + 1000).tolist()
    requests = [(context, [c]) for c in choices]
    with torch.no_grad():
        row = float32_model(torch.tensor([context])).logits[0, -1].double().log_softmax(-1)
    want = [row[c].item() for c in choices]
    ours = [r.logprob for r in eval_runner.loglikelihoods(requests)]
    monkeypatch.setitem(prefill.LOGITS, "continuations", "bf16")
    rounded = [r.logprob for r in eval_runner.loglikelihoods(requests)]

    def tied_pairs(values):
        return sum(n * (n - 1) // 2 for n in collections.Counter(values).values())

    def mean_squared_error(values):
        return sum((v - w) ** 2 for v, w in zip(values, want)) / len(want)
    assert tied_pairs(ours) == 0 and tied_pairs(rounded) >= 5, (tied_pairs(ours), tied_pairs(rounded))
    assert mean_squared_error(ours) < mean_squared_error(rounded), (mean_squared_error(ours), mean_squared_error(rounded))


def test_greedy_holds_where_every_target_is_the_argmax(eval_runner, float32_model):
    # continuations made of the float32 model's own argmax: greedy; one token changed: not greedy
    context = torch.randint(1000, 50000, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = list(context)
    for _ in range(4):
        with torch.no_grad():
            ids.append(int(float32_model(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy, spoiled = (context, ids[10:]), (context, ids[10:13] + [ids[13] + 1])
    results = eval_runner.loglikelihoods([greedy, spoiled])
    assert [r.greedy for r in results] == [True, False]
    assert [reference_loglikelihood(float32_model, *r)[1] for r in (greedy, spoiled)] == [True, False]


@pytest.mark.parametrize("bug", ["ancestors_dropped", "sibling_visible", "positions_in_the_wave"])
def test_a_wrong_tree_falls_outside_tolerance(eval_checkpoint, shared, bug, monkeypatch):
    requests, _, _, references = shared
    keys, planted = prefill.chunk_keys, prefill.chunk_keys
    if bug == "ancestors_dropped":
        def planted(chunk, i, k):
            if chunk.ancestors is None:
                return keys(chunk, i, k)
            return keys(prefill.dataclasses.replace(chunk, ancestors=[[] for _ in chunk.ancestors]), i, k)
    elif bug == "sibling_visible":  # a node also sees the node before it in its chunk, whole
        def planted(chunk, i, k):
            if chunk.ancestors is None or i == 0:
                return keys(chunk, i, k)
            widened = [list(a) for a in chunk.ancestors]
            widened[i] = sorted(set(widened[i]) | {(chunk.start + chunk.seq_bounds[i - 1],
                                                    chunk.start + chunk.seq_bounds[i])})
            return keys(prefill.dataclasses.replace(chunk, ancestors=widened), i, k)
    else:
        wave = prefill.tree_wave
        monkeypatch.setattr(prefill, "tree_wave", lambda *a: prefill.dataclasses.replace(
            w := wave(*a), positions=torch.arange(w.positions.numel())))
    runner = prefill.Runner(eval_checkpoint, device="cpu", attention="sdpa", chunk_tokens=48)
    runner.tree_attention()  # picked (and checked) before the bug is planted: the check would refuse it
    monkeypatch.setattr(prefill, "chunk_keys", planted)
    errs = relative_errors(runner.loglikelihoods(requests), references)
    assert max(errs) > 3 * TOLERANCE


def test_bad_requests_are_refused_in_one_line(eval_runner):
    for bad in [([], [1]), ([1], []), ([1, "x"], [2]), ("12", [1]), ([1, True], [2]), ([1], [-2]), ([1.0], [2])]:
        with pytest.raises(prefill.UserError, match="request 0: "):
            eval_runner.loglikelihoods([bad])


def test_requests_are_ordered_as_their_token_tuples():
    # the batches are cut from the requests in this order: bytes compared by memcmp must sort as the tuples do
    gen = torch.Generator().manual_seed(5)
    stems = [torch.randint(2**62, (n,), generator=gen).tolist() for n in (0, 1, 5)]
    requests = [prefill.Request(stem + torch.randint(k, (n,), generator=gen).tolist(), [t])
                for stem in stems for k in (2, 300, 2**40) for n in (1, 2, 3) for t in (0, 255, 256, 2**62)]
    tuples = sorted(range(len(requests)), key=lambda i: tuple(requests[i].context + requests[i].continuation))
    keys = sorted(range(len(requests)), key=lambda i: prefill.order_key(requests[i]))
    assert [prefill.order_key(requests[i]) for i in tuples] == [prefill.order_key(requests[i]) for i in keys]


def test_waves_are_cut_by_unique_tokens_and_hold_every_ancestor(eval_checkpoint, shared):
    # waves of 60 unique tokens: the 40-token prefix is in every batch that needs it, and the numbers stay
    requests, results, _, _ = shared
    items = [(i, prefill.Request(*map(list, r)), None) for i, r in enumerate(sorted(requests))]
    cut = list(prefill.request_batches(items, 60))
    assert len(cut) > 2 and [i for b in cut for i, _, _ in b] == list(range(len(items)))
    for batch in cut:
        trie = prefill.PrefixTrie()
        for _, request, _ in batch:
            trie.insert(request.input)
        assert trie.tokens <= 60 or len(batch) == 1
    small = prefill.Runner(eval_checkpoint, device="cpu", attention="sdpa", chunk_tokens=48, wave_tokens=60)
    assert small.plan.tree_wave_tokens < 60  # the wave's keys and values take room too
    waves = small.loglikelihoods(requests)
    assert small.stats["waves"] > 2
    assert max(abs(a.logprob - r.logprob) / abs(r.logprob) for a, r in zip(waves, results)) < TOLERANCE


def test_tree_waves_put_ancestors_first_and_positions_at_depth():
    requests = [prefill.Request([1, 2, 3], [4, 5]), prefill.Request([1, 2, 3], [6]), prefill.Request([1, 7], [8, 9])]
    wave = prefill.tree_wave(requests, 2, torch.device("cpu"))
    assert wave.ids.tolist() == [1, 2, 3, 4, 7, 8]  # depth first; [1, 2, 3] read by two requests, once
    assert wave.positions.tolist() == [0, 1, 2, 3, 1, 2] and wave.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    assert wave.requested == 4 + 3 + 3
    # nodes: [1] (it branches), [2, 3], [4] (cut at 2 tokens), [7, 8]; ancestors whole, ranges that touch merged
    assert [(c.start, c.end, c.ancestors) for c in wave.chunks] == [
        (0, 1, None), (1, 3, [[(0, 1)]]), (3, 4, [[(0, 3)]]), (4, 6, [[(0, 1)]])]
    # (row, target) pairs: the row of 3 scores 4 and 6, each once
    assert list(zip(wave.rows.tolist(), wave.targets.tolist())) == [(2, 4), (2, 6), (3, 5), (4, 8), (5, 9)]
    assert wave.pairs == [[0, 2], [1], [3, 4]]
    seen = prefill.tree_visibility(wave.parents, torch.arange(6))
    assert seen.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                                   [1, 0, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1]]


# ----------------------------------------------------------------------------- the tree backends' start-up check

CPU = torch.device("cpu")
TINY = dict(model_type="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=False)
# the families' attention at the tree check's lengths: Gemma 2's scale and softcaps with a window, Gemma 3's windowed
# and full layers, windows far shorter than the tree's 1050-token paths (and Gemma 3's real 1024, which the check
# outruns with a deeper branch)
GEMMA = dict(TINY, head_dim=16, query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")
TREE_CONFIGS = {"qwen3": TINY,
                "gemma2": dict(GEMMA, model_type="gemma2", sliding_window=100, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0),
                "gemma3": dict(GEMMA, model_type="gemma3_text", sliding_window=1024, sliding_window_pattern=2)}


def test_the_tree_check_covers_what_can_go_wrong():
    cfg = prefill.ModelConfig.from_json(TINY)
    cases = list(prefill.tree_check_cases(CPU, cfg))
    chunks = [chunk for _, _, (_, _, _, chunk), _ in cases]
    ranges = [r for c in chunks for rs in c.ancestors for r in rs]
    assert any(len(rs) >= 2 for c in chunks for rs in c.ancestors)  # two ranges apart
    assert any((b - a) % 64 for a, b in ranges)  # a range ends mid-tile
    assert any(not rs for c in chunks for rs in c.ancestors)  # a root beside nodes with ancestors
    assert any(a < c.start for c in chunks for a, _ in (r for rs in c.ancestors for r in rs))  # earlier chunks


def test_the_tree_check_covers_each_setting_of_the_model_past_its_window():
    for name, config in TREE_CONFIGS.items():
        cfg = prefill.ModelConfig.from_json(config)
        cases = list(prefill.tree_check_cases(CPU, cfg))
        assert {(how, sharp) for how, sharp, _, _ in cases} == {
            (how, sharp) for how in prefill.attention_settings(cfg)
            for sharp in ((False, True) if how.window or how.softcap else (False,))}, name
        for how, _, (_, _, _, chunk), _ in cases:  # the window's edge inside some node's ancestors' keys
            if how.window:
                assert int(chunk.depths.max()) >= how.window + 299, name
    gemma2 = prefill.ModelConfig.from_json(TREE_CONFIGS["gemma2"])
    assert {(how.scale, how.window, how.softcap) for how in gemma2.attention} == {(1 / math.sqrt(24), 100, 50.0),
                                                                                   (1 / math.sqrt(24), None, 50.0)}


def planted_tree_bug(bug, monkeypatch):
    # a bug in what SDPA's tree path attends to, patched in: the keys (chunk_keys), the window's mask (seen_keys) or
    # the softcap (softcapped_attention)
    keys, seen, capped = prefill.chunk_keys, prefill.seen_keys, prefill.softcapped_attention
    replaced = {
        "ancestor_dropped": ("chunk_keys", lambda chunk, i, k: keys(prefill.dataclasses.replace(  # its last range
            chunk, ancestors=[a[:-1] for a in chunk.ancestors]), i, k)),
        "sibling_visible": ("chunk_keys", lambda chunk, i, k: keys(prefill.dataclasses.replace(  # + earlier nodes
            chunk, ancestors=[sorted(set(a) | {(chunk.start, chunk.start + chunk.seq_bounds[j])})
                              for j, a in enumerate(chunk.ancestors)]), i, k)),
        "window_one_wider": ("seen_keys", lambda chunk, i, r, rows, keys, a, window, device: seen(
            chunk, i, r, rows, keys, a, window and window + 1, device)),
        "window_by_wave_index": ("seen_keys", lambda chunk, i, r, rows, keys, a, window, device: seen(  # not depth
            prefill.dataclasses.replace(chunk, depths=torch.arange(chunk.depths.numel())), i, r, rows, keys, a,
            window, device)),
        "softcap_dropped": ("softcapped_attention", lambda q, k, v, seen, how, sinks=None: capped(
            q, k, v, seen, prefill.dataclasses.replace(how, softcap=1e9), sinks)),
    }
    monkeypatch.setattr(prefill, *replaced[bug])


# Qwen3's plain attention; Gemma 2's settings (window 100 by depth, softcap 50, scale 24^-1/2)
@pytest.mark.parametrize("config, bug", [("qwen3", None), ("qwen3", "ancestor_dropped"), ("qwen3", "sibling_visible"),
                                         ("gemma2", None), ("gemma2", "window_one_wider"),
                                         ("gemma2", "window_by_wave_index"), ("gemma2", "softcap_dropped")])
def test_tree_attention_check_refuses_a_planted_bug(config, bug, monkeypatch):
    cfg = prefill.ModelConfig.from_json(TREE_CONFIGS[config])
    if bug is None:
        name, attend, report = prefill.pick_tree_attention("sdpa", CPU, cfg)
        assert name == "sdpa" and report[0]["error"] < prefill.CHECK_TOLERANCE
        return
    planted_tree_bug(bug, monkeypatch)
    with pytest.raises(prefill.UserError, match="no attention backend reads a prefix tree on cpu: sdpa: differs"
                       + (" .* with window 100" if config == "gemma2" else "")):
        prefill.pick_tree_attention("sdpa", CPU, cfg)


def test_only_triton_and_sdpa_read_trees():
    cfg = prefill.ModelConfig.from_json(TINY)
    for requested in ("flash", "cudnn", "torch-flash", "auto"):  # no tree variant: the tree kinds in their order
        named = requested if requested in prefill.TREE_KINDS else "auto"
        kinds = [kind for _, kind, _ in prefill.attention_candidates(named, "nvidia") if kind in prefill.TREE_KINDS]
        assert kinds == ["triton", "triton", "sdpa"]
    assert prefill.pick_tree_attention("flash", CPU, cfg)[0] == "sdpa"  # Triton cannot run on CPU tensors here


TREE_KERNEL_CHECK = """
import json, sys, torch, prefill
cfg = prefill.ModelConfig.from_json(json.loads(sys.argv[1]))
prefill.TREE_CHECK = json.loads(sys.argv[2]) or prefill.TREE_CHECK
report = {}
def worst(key, err):
    report[key] = max(report.get(key, 0), err)
for how, sharp, (q, k, v, chunk), want in prefill.tree_check_cases(torch.device("cpu"), cfg):
    # the interpreter multiplies bfloat16 tiles as raw integers: float16 here (bf16 on a GPU)
    q, k, v = (t.half() for t in (q, k, v))
    for tile in sorted({t for family in ("nvidia", "rdna3") for t in prefill.tree_attention_tiles(family, cfg)}):
        worst(str(tile), prefill.check_error(prefill.attention_triton(q, k, v, chunk, how, tile), want))
    tile = prefill.ATTENTION_TILES["nvidia"][0]
    dropped = prefill.dataclasses.replace(chunk, ancestor_bounds=torch.zeros_like(chunk.ancestor_bounds))
    worst("ancestors dropped", prefill.check_error(prefill.attention_triton(q, k, v, dropped, how, tile), want))
    if sharp and how.window:  # the window one key wider; by wave index, not depth
        wider = prefill.dataclasses.replace(how, window=how.window + 1)
        worst("window one wider", prefill.check_error(prefill.attention_triton(q, k, v, chunk, wider, tile), want))
        flat = prefill.dataclasses.replace(chunk, depths=torch.arange(chunk.depths.numel(), dtype=torch.int32))
        worst("window by wave index", prefill.check_error(prefill.attention_triton(q, k, v, flat, how, tile), want))
    if sharp and how.softcap:
        uncapped = prefill.dataclasses.replace(how, softcap=None)
        worst("softcap dropped", prefill.check_error(prefill.attention_triton(q, k, v, chunk, uncapped, tile), want))
print(json.dumps(report))
"""


# The interpreter runs the Triton kernel ~1000x slower than a GPU: each family's variant (Qwen3's too: the check's own
# tree took it 50 s more) on a tree of the check's shape at a tenth of its size (nodes in earlier chunks of 64, two
# ranges apart, ranges ending mid-tile, a root beside them), with windows of 24 and 30 keys against paths of 150 tokens;
# 4 query heads to 2 KV heads, not 8 (a program a head: half the time)
SMALL_TREE = [[[40, 7], [40, 20, 90], [40, 20, 3], [12, 9], [12, 1]], 64]
KERNEL_HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
KERNEL_CASES = {"qwen3": (dict(TINY, **KERNEL_HEADS), SMALL_TREE),
                "gemma2": (dict(TREE_CONFIGS["gemma2"], sliding_window=24, **KERNEL_HEADS), SMALL_TREE),
                "gemma3": (dict(TREE_CONFIGS["gemma3"], sliding_window=30, **KERNEL_HEADS), SMALL_TREE)}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_triton_tree_kernel_matches_the_reference_and_misses_are_caught(name):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    config, tree = KERNEL_CASES[name]
    p = subprocess.run([sys.executable, "-c", TREE_KERNEL_CHECK, json.dumps(config), json.dumps(tree)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    cfg = prefill.ModelConfig.from_json(config)
    for tile in {t for family in ("nvidia", "rdna3") for t in prefill.tree_attention_tiles(family, cfg)}:
        assert report[str(tile)] < prefill.CHECK_TOLERANCE / 4, report
    misses = {"qwen3": ["ancestors dropped"], "gemma3": ["ancestors dropped", "window one wider",
                                                         "window by wave index"]}.get(name, [
        "ancestors dropped", "window one wider", "window by wave index", "softcap dropped"])
    assert sorted(k for k in report if not k.startswith("(")) == sorted(misses)
    for miss in misses:
        assert report[miss] > 4 * prefill.CHECK_TOLERANCE, (miss, report)


# ----------------------------------------------------------------------------- lm-eval: prefill against its HF backend

MAX_LENGTH = 40  # both backends cut contexts to this from the left; rolling documents run past it
TASKS = ["t_mc", "t_ll", "t_roll"]


def write_tasks(folder, model, tokenizer):
    """Local lm-eval tasks (json datasets, no hub): multiple choice with a 2-shot prefix and endings of 1-4 words
    (acc, acc_norm); loglikelihood (perplexity, acc = is_greedy) where some continuations are the float32 model's
    own argmax; rolling perplexity over documents up to ~4x MAX_LENGTH; and a generate_until task."""
    import random
    rng = random.Random(0)
    mc = [{"question": sentence(rng, 8), "choices": [sentence(rng, rng.randint(1, 4)) for _ in range(4)],
           "label": rng.randrange(4)} for _ in range(10)]
    ll = [{"context": sentence(rng, 6), "continuation": " " + sentence(rng, rng.randint(1, 3))} for _ in range(6)]
    for row in ll[:3]:  # greedy: the model's own next two tokens
        ids = tokenizer.encode(row["context"])
        with torch.no_grad():
            for _ in range(2):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        row["continuation"] = tokenizer.decode(ids[-2:])
    data = {"mc_train": mc[:3], "mc_test": mc[3:], "ll": ll,
            "roll": [{"text": sentence(rng, n)} for n in (3, 30, 60, 100, 150)]}
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def task(name, output_type, files, text, target, metrics, extra=""):
        splits = "".join(f"    {split}: {folder / file}.jsonl\n" for split, file in files.items())
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{splits}output_type: {output_type}\n"
            f"test_split: test\ndoc_to_text: \"{text}\"\ndoc_to_target: {target}\n{extra}metric_list:\n"
            + "".join(f"  - metric: {m}\n" for m in metrics))
    task("t_mc", "multiple_choice", {"train": "mc_train", "test": "mc_test"}, "Question: {{question}}\\nAnswer:",
         "label", ["acc", "acc_norm"], "training_split: train\nnum_fewshot: 2\ndoc_to_choice: \"{{choices}}\"\n")
    task("t_ll", "loglikelihood", {"test": "ll"}, "{{context}}", "\"{{continuation}}\"", ["perplexity", "acc"])
    task("t_roll", "loglikelihood_rolling", {"test": "roll"}, "{{text}}", "\"{{text}}\"",
         ["word_perplexity", "byte_perplexity", "bits_per_byte"])
    task("t_gen", "generate_until", {"test": "ll"}, "{{context}}", "\"{{continuation}}\"", ["exact_match"])
    return folder


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory, eval_checkpoint, float32_model):
    from transformers import AutoTokenizer
    return write_tasks(tmp_path_factory.mktemp("tasks"), float32_model, AutoTokenizer.from_pretrained(eval_checkpoint))


def evaluate(model, model_args, task_dir):
    import lm_eval
    import prefill_eval  # noqa: F401 (registers "prefill")
    from lm_eval.tasks import TaskManager  # the test's tasks alone: indexing lm-eval's ~10k built-in ones takes ~9 s
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, device="cpu", log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                   batch_size=4)


@pytest.fixture(scope="session")
def evaluated(eval_checkpoint, task_dir):
    common = f"pretrained={eval_checkpoint},max_length={MAX_LENGTH}"
    return {"prefill": evaluate("prefill", f"{common},attention=sdpa,chunk_tokens=48", task_dir),
            "hf": evaluate("hf", f"{common},dtype=float32,softmax_dtype=float32", task_dir)}


def responses(result, task):
    # per request, in lm-eval's order: (log-likelihood, is_greedy or None for rolling)
    out = []
    for sample in sorted(result["samples"][task], key=lambda s: s["doc_id"]):
        for (value,) in sample["resps"]:
            out.append((float(value[0]), value[1] in (True, "True")) if isinstance(value, (list, tuple))
                       else (float(value), None))
    return out


@pytest.mark.parametrize("task", TASKS)
def test_lm_eval_requests_match_its_hf_backend(evaluated, task):
    got, want = responses(evaluated["prefill"], task), responses(evaluated["hf"], task)
    assert len(got) == len(want) > 4
    assert max(abs(g - w) / abs(w) for (g, _), (w, _) in zip(got, want)) < TOLERANCE
    assert [g for _, g in got] == [w for _, w in want]
    if task == "t_ll":
        assert any(w for _, w in want) and not all(w for _, w in want)  # greedy both ways


@pytest.mark.parametrize("task", TASKS)
def test_lm_eval_metrics_match_its_hf_backend(evaluated, task):
    got, want = evaluated["prefill"]["results"][task], evaluated["hf"]["results"][task]
    metrics = [k for k in want if "," in k and "stderr" not in k]
    assert metrics
    for key in metrics:
        if key.startswith(("acc", "acc_norm")):
            assert got[key] == want[key], key
        else:  # perplexities: exponentials of the log-likelihoods' means
            assert abs(math.log(got[key]) - math.log(want[key])) / abs(math.log(want[key])) < TOLERANCE, key


def test_rolling_documents_run_past_max_length(evaluated, eval_checkpoint):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(eval_checkpoint)
    lengths = [len(tokenizer.encode(s["doc"]["text"])) for s in evaluated["prefill"]["samples"]["t_roll"]]
    assert min(lengths) < MAX_LENGTH and max(lengths) > 3 * MAX_LENGTH


def test_generate_until_is_refused_before_any_model_loads(task_dir, tmp_path):
    # a folder without a checkpoint: the refusal comes first, one line naming the task, exit 2, with lm-eval's task
    # manager built once and nothing imported that lm-eval's own start does not import (prefill, transformers)
    empty = tmp_path / "no-checkpoint"
    empty.mkdir()
    probe = ("import sys, runpy, lm_eval.tasks as t; made = []; init = t.TaskManager.__init__; "
             "t.TaskManager.__init__ = lambda self, *a, **k: made.append(1) or init(self, *a, **k); "
             "sys.argv = sys.argv[1:]; code = None\ntry: runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as e: code = e.code\n"
             "print('task managers', len(made), 'imported', sorted(m for m in ('prefill', 'transformers') "
             "if m in sys.modules), file=sys.stderr); sys.exit(code)")
    p = subprocess.run([sys.executable, "-c", probe, str(ROOT / "prefill_eval.py"), "--model", "prefill",
                        "--model_args", f"pretrained={empty}", "--tasks", "t_ll,t_gen", "--include_path",
                        str(task_dir), "--device", "cpu"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "t_gen" in errors[0] and "t_ll" not in errors[0], p.stderr[-2000:]
    assert p.stderr.splitlines()[-1] == "task managers 1 imported []", p.stderr[-2000:]


def test_generate_until_runs_for_another_model(eval_checkpoint, task_dir, tmp_path):
    # the refusal is prefill's alone: lm-eval's HF backend generates t_gen (one document, two tokens)
    p = subprocess.run([sys.executable, str(ROOT / "prefill_eval.py"), "--model", "hf", "--model_args",
                        f"pretrained={eval_checkpoint}", "--tasks", "t_gen", "--include_path", str(task_dir),
                        "--device", "cpu", "--limit", "1", "--gen_kwargs", "max_gen_toks=2"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0 and "does not generate" not in p.stderr, p.stderr[-2000:]
    assert "t_gen" in p.stdout and "exact_match" in p.stdout, p.stdout[-2000:]


def test_help_lists_prefill_s_model_args_and_lm_eval_s_own():
    p = subprocess.run([sys.executable, str(ROOT / "prefill_eval.py"), "--help"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    for key in ("pretrained", "gpu_memory", "max_length", "wave_tokens", "chunk_tokens", "attention", "kernels",
                "host_memory", "picks", "add_bos_token"):
        assert f"  {key}=" in p.stdout, key
    # lm-eval's own help, under this script's name; --device is optional
    assert "usage: prefill_eval.py" in p.stdout and "usage: lm-eval" not in p.stdout and "pass --device" not in p.stdout


# ----------------------------------------------------------------------------- corpus mode, torchrun

def run_prefill(*args, ranks=1, timeout=300):
    # every process with this one's threads (its share of the cores under pytest-xdist), one rank or two alike: the
    # runs are compared bit for bit, and torchrun would give each rank one thread
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    return subprocess.run([*launcher, str(ROOT / "prefill.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def continuation_corpus(path):
    import random
    rng, rows = random.Random(1), []
    for q in range(6):
        context = f"Question {q}: {sentence(rng, 12)}\nAnswer:"  # a shared prefix, then each question's own
        rows += [{"id": f"{q}{c}", "ctx": context, "cont": c} for c in (" A", " B", " " + sentence(rng, 5))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.slow
def test_a_corpus_of_continuations_scores_resumes_and_runs_on_two_ranks(eval_checkpoint, eval_runner, tmp_path):
    rows = continuation_corpus(tmp_path / "in.jsonl")
    out, args = tmp_path / "out.jsonl", ["--model", eval_checkpoint, "--input", tmp_path / "in.jsonl", "--device",
                                         "cpu", "--attention", "sdpa", "--context-field", "ctx",
                                         "--continuation-field", "cont", "--token-logprobs", "--wave-tokens", "120"]
    p = run_prefill(*args, "--output", out)
    assert p.returncode == 0 and p.stdout == "", p.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [row["id"] for row in rows]
    want = eval_runner.loglikelihoods(eval_runner.encode_pairs([(row["ctx"], row["cont"]) for row in rows]))
    for r, w in zip(records, want):
        assert r["continuation_tokens"] == w.tokens and r["tokens"] == r["context_tokens"] + w.tokens
        assert abs(r["logprob"] - w.logprob) / abs(w.logprob) < TOLERANCE and r["greedy"] == w.greedy
        assert r["nll_sum"] == -r["logprob"] and r["loss"] == r["nll_sum"] / w.tokens
        assert len(r["token_logprobs"]) == w.tokens and math.fsum(r["token_logprobs"]) == r["logprob"]
    lines = [line for line in p.stderr.splitlines() if line.startswith("prefill:")]
    assert len(lines) == 4 and " computed for " in lines[-1]  # load, plan, the tree backend, the summary
    # without --output: the same records on stdout, but for the digest (nothing to resume there)
    p = run_prefill(*args)
    assert p.returncode == 0, p.stderr[-2000:]
    assert [json.loads(line) for line in p.stdout.splitlines()] == [
        {k: v for k, v in r.items() if k != "digest"} for r in records]
    # resumed from a cut file: byte for byte the uninterrupted run's
    whole = out.read_bytes()
    out.write_bytes(whole[:len(whole) // 2])
    assert run_prefill(*args, "--output", out, "--resume").returncode == 0 and out.read_bytes() == whole
    # two ranks claim whole batches: the same file
    two = tmp_path / "two.jsonl"
    p = run_prefill(*args, "--output", two, ranks=2)
    assert p.returncode == 0 and two.read_bytes() == whole, p.stderr[-2000:]


def test_a_corpus_holds_one_kind_and_token_logprobs_need_continuations(eval_checkpoint, tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"context": "a b", "continuation": " c"}\n{"text": "a b c"}\n')
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "a b c"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"context": "  ", "continuation": " c"}\n')
    for path, extra, message in [(mixed, [], "line 2 is a text where the records before it are continuations"),
                                 (texts, ["--token-logprobs"], "--token-logprobs: the input's records are texts"),
                                 (empty, [], "line 1: the context is empty")]:
        p = run_prefill("--model", eval_checkpoint, "--input", path, "--device", "cpu", *extra)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr


DATA_PARALLEL = """
import json, sys
import lm_eval, prefill_eval
from lm_eval.tasks import TaskManager
tasks = TaskManager(include_path=sys.argv[2], include_defaults=False)  # the test's tasks, not lm-eval's ~10k
r = lm_eval.simple_evaluate(model="prefill", model_args=sys.argv[1], tasks=sys.argv[3].split(","), device="cpu",
                            log_samples=True, task_manager=tasks)
if r is not None:  # rank 0
    # each request's first response: lm-eval pads a rank's requests with copies of its last, whose extra responses
    # land on that same request
    print(json.dumps({t: [[resps[0] for resps in s["resps"]] for s in sorted(r["samples"][t], key=lambda s: s["doc_id"])]
                      for t in r["samples"]}))
"""


@pytest.mark.slow
def test_lm_eval_data_parallel_equals_one_process(eval_checkpoint, task_dir, tmp_path):
    args = [f"pretrained={eval_checkpoint},max_length={MAX_LENGTH},attention=sdpa,chunk_tokens=48,wave_tokens=200",
            str(task_dir), "t_ll,t_roll"]  # not t_mc: lm-eval draws each rank's few-shot examples anew (its own
    # sampler's state runs over the rank's documents), so its data-parallel contexts differ from one process's
    runs = []
    for ranks in (1, 2):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
            if ranks > 1 else [sys.executable]
        p = subprocess.run([*launcher, "-c" if ranks == 1 else str(tmp_path / "dp.py"), *(
            [DATA_PARALLEL] if ranks == 1 else []), *args], capture_output=True, text=True, timeout=600,
            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        (tmp_path / "dp.py").write_text(DATA_PARALLEL)
    assert runs[0] == runs[1]  # every request's numbers, bit for bit
