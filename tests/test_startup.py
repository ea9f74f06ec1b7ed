"""What prefill decides at start-up: kernel checks against float32 math, the picks kept per machine, and the ROCm
decisions (loading, pinning, BLAS library, a GPU that torch cannot see), with a HIP build simulated on the CPU.
"""
import dataclasses
import io
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import prefill
import prefill_doctor

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
TINY = dict(model_type="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, rms_norm_eps=1e-6, rope_theta=1e6,
            tie_word_embeddings=False)


@pytest.fixture
def cfg():
    return prefill.ModelConfig.from_json(TINY)


def full(cfg):  # a layer's plain causal attention settings
    return cfg.attention[0]


def stand_in_flash(monkeypatch, attend):
    # a flash_attn module whose varlen kernel is `attend(q, k, v, bounds)`
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal):
        return attend(q, k, v, cu_q.tolist())
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))


def windowed_attention(window):
    # correct causal attention over the first `window` keys of each text only: a kernel whose key loop goes wrong
    # after its first few tiles (a miscompiled steady state), exact for short texts
    def attend(q, k, v, bounds):
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for s, e in zip(bounds[:-1], bounds[1:]):
            n = e - s
            allowed = torch.ones(n, n, dtype=torch.bool).tril() & (torch.arange(n) < window)[None, :]
            kv = [t[s:e].transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v)]
            out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), *kv, attn_mask=allowed).transpose(0, 1)
        return out
    return attend


# ----------------------------------------------------------------------------- attention checked against float32

def test_attention_reference_is_causal_gqa_attention(cfg):
    q, k, v, chunk = prefill.attention_inputs(CPU, cfg, [5, 70], seed=3)
    want = prefill.attention_reference(q, k, v, chunk, full(cfg))
    assert prefill.check_error(prefill.attention_sdpa(q.float(), k.float(), v.float(), chunk, full(cfg)), want) < 1e-5
    assert prefill.check_error(windowed_attention(10 ** 6)(q.float(), k.float(), v.float(), [0, 5, 75]), want) < 1e-5


def test_sdpa_in_blocks_of_query_rows_is_still_causal_attention(cfg, monkeypatch):
    # the fallback bounds its scores by working in blocks of query rows: each block must see exactly its own past
    q, k, v, chunk = prefill.attention_inputs(CPU, cfg, [70, 5, 130], seed=4)
    want = prefill.attention_reference(q, k, v, chunk, full(cfg))
    q, k, v = q.float(), k.float(), v.float()
    monkeypatch.setattr(prefill, "SDPA_SCORES", cfg.num_attention_heads * 130 * 16)  # 16-row blocks of the longest
    assert prefill.check_error(prefill.attention_sdpa(q, k, v, chunk, full(cfg)), want) < 1e-5
    tril = torch.Tensor.tril
    monkeypatch.setattr(torch.Tensor, "tril", lambda t, d=0: tril(t, d + 1))  # one key of the future leaks in
    assert prefill.check_error(prefill.attention_sdpa(q, k, v, chunk, full(cfg)), want) > 1e-2


def test_a_kernel_wrong_only_past_its_first_key_tiles_is_refused(cfg, monkeypatch):
    stand_in_flash(monkeypatch, windowed_attention(256))  # right for every key below 256: four 64-key tiles
    picks = prefill.Picks(None, None)
    with pytest.raises(prefill.UserError, match="flash: differs from float32 attention"):
        prefill.pick_attention("flash", CPU, cfg, picks)
    # the texts the check used before (37 and 100 tokens) never reach the fault: the long texts are what catches it
    monkeypatch.setattr(prefill, "CHECK_LENGTHS", [37, 100])
    assert prefill.check_attention(prefill.attention_candidates("flash", "cpu"), CPU, cfg)[0]["attend"] is not None
    # ...and each bucket's own texts, checked through the dispatcher, catch it still
    with pytest.raises(prefill.UserError, match="flash: differs from float32 attention by .* on texts of <=1024"):
        prefill.pick_attention("flash", CPU, cfg, picks)


def test_a_kernel_that_returns_nan_or_inf_is_refused(cfg, monkeypatch):
    exact = windowed_attention(10 ** 6)
    for bad in (float("nan"), float("inf")):
        def attend(q, k, v, bounds, bad=bad):
            out = exact(q, k, v, bounds)
            out[-1, 0, 0] = bad  # one value of the last row
            return out
        stand_in_flash(monkeypatch, attend)
        report = prefill.check_attention(prefill.attention_candidates("flash", "cpu"), CPU, cfg)
        assert report[0]["attend"] is None and report[0]["error"] == float("inf")


# ----------------------------------------------------------------------------- fused kernels checked per launch

def fused_stand_ins(monkeypatch, head_norm_rope=None):
    # the fused kernels as their PyTorch math (what a correct compile computes), head_norm_rope as given: the check's
    # coverage is under test here, not Triton
    for name, torch_fn in [("rms_norm", prefill.rms_norm), ("gated_act", prefill.gated_act),
                           ("token_nll", prefill.token_nll), ("combine", prefill.combine)]:
        monkeypatch.setattr(prefill, f"{name}_triton", torch_fn)
    monkeypatch.setattr(prefill, "head_norm_rope_triton", head_norm_rope or prefill.head_norm_rope)
    monkeypatch.setattr(prefill, "route_triton", prefill.route)
    monkeypatch.setattr(prefill, "FUSED_DEVICES", ("cpu",))


def test_a_miscompile_of_the_key_head_launch_alone_is_refused_at_start_up(cfg, monkeypatch, capsys):
    # the key launch of head_norm_rope has the KV head count (another lane layout): a kernel that handles one head
    # too few there, and only there, is caught, and "auto" falls back to PyTorch naming the launch
    fused_stand_ins(monkeypatch)
    assert prefill.pick_kernels("auto", CPU, cfg)[0].name == "triton"
    launches = [(kernel, launch) for kernel, launch, _ in prefill.kernel_checks(CPU, cfg)]
    assert ("head_norm_rope", "8 query heads") in launches and ("head_norm_rope", "2 key heads") in launches

    def one_head_short_on_keys(x, w, cos, sin, eps, offset, interleave=False):
        out = prefill.head_norm_rope(x, w, cos, sin, eps, offset, interleave)
        if x.shape[1] == cfg.num_key_value_heads:
            out[:, -1] = 0  # the last head never written
        return out
    fused_stand_ins(monkeypatch, one_head_short_on_keys)
    errors = {(kernel, launch): error for kernel, launch, error in prefill.kernel_checks(CPU, cfg)}
    assert errors[("head_norm_rope", "8 query heads")] <= prefill.CHECK_TOLERANCE < \
        errors[("head_norm_rope", "2 key heads")]
    kernels, errors = prefill.pick_kernels("auto", CPU, cfg)
    # the torch kernels, beside the float32 head picked on its own check (pick_head)
    assert kernels == dataclasses.replace(prefill.TORCH_KERNELS, head=kernels.head) and errors.keys() == {"lm_head"}
    assert "head_norm_rope (2 key heads)" in capsys.readouterr().err
    with pytest.raises(prefill.UserError, match=r"--kernels triton is unusable on cpu: .*head_norm_rope \(2 key"):
        prefill.pick_kernels("triton", CPU, cfg)


def test_the_kernel_check_covers_the_dense_and_the_expert_widths(monkeypatch):
    fused_stand_ins(monkeypatch)
    moe = prefill.ModelConfig.from_json(dict(TINY, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0]))
    launches = [(kernel, launch) for kernel, launch, _ in prefill.kernel_checks(CPU, moe)]
    assert {launch for kernel, launch in launches if kernel == "gated_act"} == {"160 wide, silu", "48 wide, silu"}
    assert ("combine", "2 experts a token") in launches
    assert [launch for kernel, launch in launches if kernel == "route"] == [
        "4 experts, top-2", "4 experts, top-2, ties at the k-th place"]
    assert set(prefill.check_kernels(CPU, moe)) == {"rms_norm", "head_norm_rope", "gated_act", "token_nll", "combine",
                                                    "route"}


def test_a_router_kernel_that_keeps_other_experts_is_refused_alone(monkeypatch, capsys):
    # route_checks' planted ties catch a router that keeps the highest index among them; the pick then runs route
    # beside the other fused kernels, under "triton" too (the kernel itself in the interpreter: test_moe's)
    fused_stand_ins(monkeypatch)
    moe = prefill.ModelConfig.from_json(dict(TINY, model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2,
                                             moe_intermediate_size=48, norm_topk_prob=True))
    kernels, errors = prefill.pick_kernels("auto", CPU, moe)  # the stand-in, route itself, passes
    assert kernels.route is prefill.TRITON_KERNELS.route and errors["route"] == 0

    def highest_index_ties(h, w, router):
        weights, experts = prefill.route(h, dataclasses.replace(w, router=w.router.flip(0)), router)
        return weights.flip(1), (w.router.shape[0] - 1 - experts).flip(1)
    monkeypatch.setattr(prefill, "route_triton", highest_index_ties)
    errors = {launch: error for kernel, launch, error in prefill.kernel_checks(CPU, moe) if kernel == "route"}
    assert errors["6 experts, top-2, renormalised, ties at the k-th place"] == float("inf"), errors
    for requested in ("auto", "triton"):
        kernels, errors = prefill.pick_kernels(requested, CPU, moe)
        assert kernels.name == "triton" and kernels.route is prefill.TORCH_KERNELS.route, requested
        assert "route" not in errors and "combine" in errors
        assert "fused routing unavailable on cpu" in capsys.readouterr().err


# ----------------------------------------------------------------------------- picks kept per machine

def test_picks_are_kept_per_machine_and_model(cfg, tmp_path):
    path = tmp_path / "sub" / "picks.json"
    first = prefill.Picks(path, prefill.machine_key(CPU, cfg))
    assert first.writable() and first.get("attention auto") is None
    first.put("attention auto", "sdpa")
    first.put("blas", "cublaslt")
    again = prefill.Picks(path, prefill.machine_key(CPU, cfg))
    assert again.get("attention auto") == "sdpa" and again.get("blas") == "cublaslt"
    other_model = prefill.Picks(path, prefill.machine_key(CPU, prefill.ModelConfig.from_json(dict(TINY, head_dim=32))))
    assert other_model.get("attention auto") is None
    assert not prefill.Picks(None, first.key).writable()
    path.write_text("not json")  # a damaged file is no pick, and is replaced whole
    assert again.get("blas") is None
    again.put("blas", "cublas")
    assert json.loads(path.read_text())[again.key] == {"blas": "cublas"}


def test_attention_pick_follows_the_kept_choice_else_the_fixed_order(cfg, tmp_path, monkeypatch):
    stand_in_flash(monkeypatch, windowed_attention(10 ** 6))  # a correct flash: flash and sdpa both pass
    picks = prefill.Picks(tmp_path / "picks.json", prefill.machine_key(CPU, cfg))
    everywhere = dict.fromkeys(prefill.BUCKET_LABELS, "flash")
    assert prefill.pick_attention("auto", CPU, cfg, picks)[0] == everywhere  # nothing kept: first in order
    for label in prefill.BUCKET_LABELS:
        picks.put(f"attention auto {label}", "sdpa")
    names, _, report = prefill.pick_attention("auto", CPU, cfg, picks)
    # every bucket's kernel kept: only that one is checked at start-up
    assert names == dict.fromkeys(prefill.BUCKET_LABELS, "sdpa") and [e["name"] for e in report] == ["sdpa"]
    picks.put("attention auto >4096", "triton 64x64")  # kept, but refused here: the first usable one instead
    names, _, report = prefill.pick_attention("auto", CPU, cfg, picks)
    assert names == {"<=1024": "sdpa", "<=4096": "sdpa", ">4096": "flash"} and len(report) > 2
    assert picks.get("attention flash <=1024") is None  # each --attention value keeps its own picks


def test_bucket_picks_are_timed_once_per_bucket_then_kept(cfg, tmp_path, monkeypatch):
    stand_in_flash(monkeypatch, windowed_attention(10 ** 6))
    exact = windowed_attention(10 ** 6)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward",  # a second stand-in: torch-flash
                        lambda q, k, v, cu, *_: (exact(q, k, v, cu.tolist()),), raising=False)
    monkeypatch.setattr(prefill, "TIMED_DEVICES", ("cpu",))
    timed = []

    def time_attention(entries, label, device, config,
                       fast={"<=1024": "flash", "<=4096": "torch-flash", ">4096": "torch-flash"}):
        timed.append(label)
        assert "sdpa" not in [e["name"] for e in entries]  # the fallback is never timed where others run
        for e in entries:  # the bucket's winner 1 ms, the others 2 ms; a first call (plan) amortised over the layers
            e.setdefault("time_ms", {})[label] = 1.0 if e["name"] == fast[label] else 2.0
            e.setdefault("first_ms", {})[label] = e["time_ms"][label]
    monkeypatch.setattr(prefill, "time_attention", time_attention)
    picks = prefill.Picks(tmp_path / "picks.json", prefill.machine_key(CPU, cfg))
    want = {"<=1024": "flash", "<=4096": "torch-flash", ">4096": "torch-flash"}
    names, attend, _ = prefill.pick_attention("auto", CPU, cfg, picks)
    assert names == want and timed == prefill.BUCKET_LABELS
    assert {label: picks.get(f"attention auto {label}") for label in prefill.BUCKET_LABELS} == want
    # later runs: the same kernels, nothing timed, whatever a timing would say now
    timed.clear()
    monkeypatch.setattr(prefill, "time_attention", lambda *a: pytest.fail("timed again"))
    for _ in range(2):
        assert prefill.pick_attention("auto", CPU, cfg, picks)[0] == want
    # a second Runner can ask for exactly these kernels; no writable picks file: nothing timed, the fixed order
    assert prefill.pick_attention(dict(want), CPU, cfg, prefill.Picks(None, None))[0] == want
    assert prefill.pick_attention("auto", CPU, cfg, prefill.Picks(None, None))[0] == dict.fromkeys(want, "flash")
    with pytest.raises(prefill.UserError, match="must name each of"):
        prefill.pick_attention({"<=1024": "sdpa"}, CPU, cfg, picks)


def test_timing_overrides_the_order_of_preference_only_by_the_margin():
    cost = {"a": 1.0, "b": 0.95, "c": 0.85, "d": 0.84, "e": 2.0}.get  # b within 10% of a; c clearly faster; d not of c
    assert prefill.pick_order(list("abcde"), cost) == list("cdabe")  # then d over a (0.84), and so on
    assert prefill.pick_order(list("ab"), cost) == list("ab") and prefill.pick_order(list("ba"), cost) == list("ba")


def test_timed_calls_are_timed_again_behind_a_longer_gate_while_the_host_outruns_it(monkeypatch):
    # the gate (GPU work queued ahead of the timed calls) must still be running when their last launch returns, else
    # the events may time the host: then the calls go again behind a gate twice as long, at most GATE_TRIES times
    class Drained:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    for drains, scales in (([True, True, False], [1, 2, 4]), ([False], [1]), ([True] * 9, [1, 2, 4, 8])):
        gates, launches = [], []
        monkeypatch.setattr(prefill, "queue_gate", lambda device, scale=1: gates.append(scale) or
                            Drained(drains[len(gates) - 1]))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(synchronize=lambda: None))
        prefill.gated("cuda", lambda: launches.append(len(gates)))
        assert gates == scales and launches == list(range(1, len(scales) + 1))


def test_re_timing_under_noise_within_the_margin_picks_the_same_kernels(cfg, tmp_path, monkeypatch):
    # each start times afresh (a new container, an edited prefill.py): with every time off by up to 4% either way,
    # the picks stay those of the order of preference and of clear wins, where the fastest-timed one would flip
    stand_in_flash(monkeypatch, windowed_attention(10 ** 6))
    exact = windowed_attention(10 ** 6)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward",
                        lambda q, k, v, cu, *_: (exact(q, k, v, cu.tolist()),), raising=False)
    monkeypatch.setattr(prefill, "TIMED_DEVICES", ("cpu",))
    monkeypatch.setattr(prefill, "CHECK_LENGTHS", [37, 100])  # the checks are not under test here: short ones
    monkeypatch.setattr(prefill, "passes_bucket", lambda entry, label, device, config: True)
    true_ms = {"<=1024": {"flash": 1.0, "torch-flash": 0.97},  # within the margin: flash, first in the order
               "<=4096": {"flash": 1.0, "torch-flash": 0.75},  # a clear win
               ">4096": {"flash": 1.0, "torch-flash": 1.03}}
    gen = torch.Generator().manual_seed(0)
    fastest = set()

    def time_attention(entries, label, device, config):
        for e in entries:
            ms = true_ms[label][e["name"]] * (1 + 0.04 * (2 * torch.rand((), generator=gen).item() - 1))
            e.setdefault("time_ms", {})[label] = e.setdefault("first_ms", {})[label] = ms
        fastest.add((label, min(entries, key=lambda e: e["time_ms"][label])["name"]))
    monkeypatch.setattr(prefill, "time_attention", time_attention)
    want = {"<=1024": "flash", "<=4096": "torch-flash", ">4096": "flash"}
    for start in range(12):
        picks = prefill.Picks(tmp_path / f"start{start}" / "picks.json", "machine")
        assert prefill.pick_attention("auto", CPU, cfg, picks)[0] == want
    assert ("<=1024", "torch-flash") in fastest and ("<=1024", "flash") in fastest  # the noise did reorder the times

    # the BLAS library on ROCm, likewise: hipBLASLt 3% faster stays behind rocBLAS, 20% faster wins
    monkeypatch.setattr(torch.version, "hip", "7.1.25424")
    monkeypatch.delenv("TORCH_BLAS_PREFER_HIPBLASLT", raising=False)
    state = {"library": "cublas"}

    def preferred_blas_library(backend=None):
        if backend is not None:
            state["library"] = backend
        return types.SimpleNamespace(name=state["library"].capitalize())
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    for lt_speedup, library in ((1.03, "cublas"), (1.2, "cublaslt")):
        def gemm_tflops(device, shapes, weights=None):
            rate = 50.0 * (lt_speedup if state["library"] == "cublaslt" else 1.0)
            return {name: rate * (1 + 0.04 * (2 * torch.rand((), generator=gen).item() - 1)) for name, *_ in shapes}
        monkeypatch.setattr(prefill, "gemm_tflops", gemm_tflops)
        for start in range(12):
            picks = prefill.Picks(tmp_path / f"blas{lt_speedup}-{start}" / "picks.json", "machine")
            assert prefill.pick_blas(torch.device("cuda"), cfg, picks)[0] == library


def test_a_plan_built_per_length_counts_against_its_kernel(cfg):
    # cuDNN builds a graph for each new text length, once a process; every layer then reuses it
    fast_but_planning = {"time_ms": {"b": 1.0}, "first_ms": {"b": 1.0 + 64 * 2.0}}
    steady = {"time_ms": {"b": 2.5}, "first_ms": {"b": 2.5}}
    cfg.num_hidden_layers = 64
    assert prefill.attention_cost(fast_but_planning, "b", cfg) == 3.0 > prefill.attention_cost(steady, "b", cfg)


def test_the_dispatcher_runs_each_bucket_s_kernel_and_a_kernel_wrong_in_one_bucket_is_caught(cfg, monkeypatch):
    ran = []

    def recorder(label):
        def attend(q, k, v, chunk, how):
            ran.append(label)
            return prefill.attention_sdpa(q, k, v, chunk, how)
        return attend
    attend = prefill.bucketed_attention({label: recorder(label) for label in prefill.BUCKET_LABELS})
    for lengths, label in [([37, 1024], "<=1024"), ([1025, 3], "<=4096"), ([4096], "<=4096"), ([4097], ">4096")]:
        q, k, v, chunk = prefill.attention_inputs(CPU, cfg, lengths, seed=0)
        attend(q, k, v, chunk, full(cfg))
        assert ran.pop() == label and prefill.attention_bucket(chunk.max_len) == label
    # a flash right on texts of up to 4096 tokens only: it passes the general check and two buckets, not the third
    stand_in_flash(monkeypatch, windowed_attention(4096))
    picks = prefill.Picks(None, None)
    names, attend, report = prefill.pick_attention("auto", CPU, cfg, picks)
    assert names == {"<=1024": "flash", "<=4096": "flash", ">4096": "sdpa"}
    flash = next(e for e in report if e["name"] == "flash")
    assert flash["bucket_error"][">4096"] > prefill.CHECK_TOLERANCE >= flash["bucket_error"]["<=4096"]
    q, k, v, chunk = prefill.attention_inputs(CPU, cfg, [4500], seed=5)
    assert prefill.check_error(attend(q, k, v, chunk, full(cfg)),
                               prefill.attention_reference(q, k, v, chunk, full(cfg))) < 1e-2


def test_cudnn_is_offered_on_nvidia_only(hip, monkeypatch):
    props = types.SimpleNamespace(gcnArchName="gfx1100:sramecc-:xnack-", major=11, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    family = prefill.gpu_family(hip)
    assert family == "rdna3"
    for fam in (family, "amd", "cpu"):
        assert "cudnn" not in [kind for _, kind, _ in prefill.attention_candidates("auto", fam)]
        with pytest.raises(prefill.UserError, match="'cudnn' is not offered on this GPU family"):
            prefill.attention_candidates("cudnn", fam)
    assert [name for name, _, _ in prefill.attention_candidates("cudnn", "nvidia")] == ["cudnn"]
    # where torch cannot run it (here: no GPU), the check refuses it in one line instead of failing
    report = prefill.check_attention([("cudnn", "cudnn", None)], CPU, prefill.ModelConfig.from_json(TINY))
    assert report[0]["attend"] is None and report[0]["reason"]


def test_an_attention_kernel_that_is_not_deterministic_is_refused(cfg, monkeypatch):
    exact, calls = windowed_attention(10 ** 6), []

    def attend(q, k, v, bounds):
        out = exact(q, k, v, bounds)
        calls.append(1)
        out[0, 0, 0] += len(calls) * 2 ** -7 * out[0, 0, 0].abs()  # a few last bits that change from call to call
        return out
    stand_in_flash(monkeypatch, attend)
    report = prefill.check_attention(prefill.attention_candidates("flash", "cpu"), CPU, cfg)
    assert report[0]["attend"] is None and "other bits" in report[0]["reason"]


# ----------------------------------------------------------------------------- ROCm decisions, HIP simulated

@pytest.fixture
def hip(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "7.1.25424")
    return torch.device("cuda")


GB = 10 ** 9
QWEN3_32B = prefill.ModelConfig.from_json(dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600,
                                               num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                                               head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                                               tie_word_embeddings=False))
STREAMED = prefill.plan_memory(QWEN3_32B, 48 * prefill.GiB).streamed_layers  # 20 layers at the W7800's 48 GiB
STAGING = 2 * 16 * prefill.STAGING_BYTES  # 16 loading threads' staging buffers


SPANS = len(STREAMED) * QWEN3_32B.layer_bytes  # the streamed layers' pages, what map locks in place


def host_plan(budget, requested="auto", device=torch.device("cuda"), bf16=True, pin="register"):
    return prefill.plan_host(QWEN3_32B, STREAMED, budget, requested, device, bf16, SPANS, pin, STAGING)


def test_rocm_copies_instead_of_registering_the_page_cache(hip, monkeypatch):
    assert host_plan(100 * GB, device=hip).load == "copy"
    assert host_plan(100 * GB, "map", device=hip).load == "map"  # still there when asked for
    assert prefill.pin_method("auto") == "alloc" and prefill.pin_method("register") == "register"
    assert prefill.pinned_bytes(975_000_000, "alloc") == 2 ** 30  # the pinned allocator's power of two
    assert host_plan(100 * GB, device=hip, pin="alloc").pinned_bytes == STAGING + len(STREAMED) * 2 ** 30
    monkeypatch.setattr(torch.version, "hip", None)
    assert host_plan(100 * GB).load == "map"
    assert prefill.pin_method("auto") == "register" and prefill.pinned_bytes(975_000_000, "register") == 975_000_000


def test_host_plan_holds_what_the_budget_allows_and_reads_the_rest_from_storage():
    layer = QWEN3_32B.layer_bytes
    assert len(STREAMED) == 20
    big = host_plan(100 * GB)  # the streamed layers' pages locked in place: nothing read from storage
    assert (big.load, big.locked_bytes, big.pinned_bytes, big.storage_layers) == ("map", SPANS, STAGING, ())
    assert host_plan(None).load == "map"  # no limit known: not checked
    assert host_plan(SPANS + STAGING).load == "map"  # just fits, the staging buffers counted
    copies = host_plan(SPANS + STAGING - 1)  # pinned copies take what locking in place takes: as many as fit
    assert copies.load == "copy" and copies.storage_layers and copies.pinned_bytes <= SPANS + STAGING - 1
    copies = host_plan(40 * GB, "copy")
    assert copies.load == "copy" and copies.pinned_layers == STREAMED and copies.storage_layers == ()
    assert copies.pinned_bytes == STAGING + 20 * layer and copies.ring_slots == 0
    assert host_plan(100 * GB, bf16=False).load == "copy"  # float32 files cannot be copied from in place
    previous = 0
    for budget in [3.1 * GB, 5 * GB, 10 * GB, 15 * GB, 20 * GB, 20.5 * GB]:  # 20.6 holds them all
        plan = host_plan(budget)
        assert plan.load == "copy" and plan.pinned_bytes <= budget, budget
        assert sorted(plan.pinned_layers + plan.storage_layers) == list(STREAMED)
        assert 2 <= plan.ring_slots <= prefill.RING_SLOTS < len(plan.storage_layers)
        assert plan.pinned_bytes + layer > budget  # nothing left that one more pinned layer would fit in
        assert len(plan.pinned_layers) >= previous
        previous = len(plan.pinned_layers)
        steps = [STREAMED.index(i) for i in plan.storage_layers]  # spread evenly among the streamed layers
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        assert not gaps or max(gaps) - min(gaps) <= 1
    smallest = host_plan(STAGING + 2 * layer)
    assert (smallest.ring_slots, smallest.pinned_layers, len(smallest.storage_layers)) == (2, (), 20)
    assert smallest.describe() == ("host 2.8 GiB: 2.8 GiB pinned (0 layers, a ring of 2); 18.2 GiB read from "
                                   "storage per wave (20 layers)")
    with pytest.raises(prefill.UserError, match=r"smallest plan needs 2.82 GiB .* the budget is 2.82 GiB"):
        host_plan(STAGING + 2 * layer - 1)
    with pytest.raises(prefill.UserError, match=r"--load map would page-lock .* \(20.6 GB\) but the host memory "
                                                r"budget is 20.0 GB"):
        host_plan(20 * GB, "map")
    with pytest.raises(prefill.UserError, match="bf16"):
        host_plan(100 * GB, "map", bf16=False)
    # the CPU: no limit unless asked for (then planned as on a GPU); nothing streamed, nothing to hold
    assert prefill.plan_host(QWEN3_32B, STREAMED, None, "auto", CPU, True, 65.5 * GB).load == "map"
    assert prefill.plan_host(QWEN3_32B, (), 0, "copy").pinned_bytes == 0


def test_spare_host_memory_from_meminfo_and_the_cgroup(tmp_path):
    GiB = 2 ** 30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {128 * GiB // 1024} kB\nMemFree: 1 kB\nMemAvailable: {100 * GiB // 1024} kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert prefill.host_memory_spare(meminfo, cgroup) == 100 * GiB - 128 * GiB // 20  # margin: 5% of MemTotal
    (cgroup / "memory.max").write_text(f"{64 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{30 * GiB}\n")
    (cgroup / "memory.stat").write_text(f"anon {20 * GiB}\nfile {10 * GiB}\n")  # page cache is reclaimable
    assert prefill.host_memory_spare(meminfo, cgroup) == (64 - 20) * GiB - 128 * GiB // 20
    (cgroup / "memory.max").write_text("max\n")
    assert prefill.host_memory_spare(meminfo, cgroup) == 100 * GiB - 128 * GiB // 20
    assert prefill.host_memory_spare(tmp_path / "absent", cgroup) is None


def test_blas_library_is_timed_once_on_rocm_then_kept(hip, cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_BLAS_PREFER_HIPBLASLT", raising=False)
    state, timed = {"library": "cublas"}, []

    def preferred_blas_library(backend=None):
        if backend is not None:
            state["library"] = backend
        return types.SimpleNamespace(name=state["library"].capitalize())

    def gemm_tflops(device, shapes, weights=None, repeats=5):
        timed.append(state["library"])
        return {name: (60.0 if state["library"] == "cublaslt" else 50.0) for name, *_ in shapes}

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    monkeypatch.setattr(prefill, "gemm_tflops", gemm_tflops)
    picks = prefill.Picks(tmp_path / "picks.json", "machine")
    library, rates = prefill.pick_blas(hip, cfg, picks)
    assert library == "cublaslt" and timed == ["cublas", "cublaslt"] and set(rates) == {"cublas", "cublaslt"}
    state["library"], timed[:] = "cublas", []
    assert prefill.pick_blas(hip, cfg, picks) == ("cublaslt", {}) and timed == []  # kept: not timed again
    monkeypatch.setenv("TORCH_BLAS_PREFER_HIPBLASLT", "0")  # the user's choice wins, untimed
    state["library"] = "cublas"
    assert prefill.pick_blas(hip, cfg, picks) == ("cublas", {}) and timed == []
    monkeypatch.setattr(torch.version, "hip", None)  # CUDA: torch's default, untimed
    monkeypatch.delenv("TORCH_BLAS_PREFER_HIPBLASLT")
    assert prefill.pick_blas(torch.device("cuda"), cfg, picks) == ("cublas", {}) and timed == []


def test_a_gpu_torch_cannot_see_is_an_error_not_the_cpu(tmp_path, monkeypatch):
    kfd = tmp_path / "kfd"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(prefill, "GPU_DEVICE_FILES", [(str(kfd), "AMD")])
    assert prefill.choose_device(None) == CPU  # no GPU here at all
    with pytest.raises(prefill.UserError, match="--device cuda asks for one"):
        prefill.choose_device("cuda")
    kfd.touch()  # an AMD GPU, and a torch (CUDA or CPU-only build) that cannot see it
    with pytest.raises(prefill.UserError, match="sees no GPU, but this machine has an AMD GPU") as refused:
        prefill.choose_device(None)
    assert prefill.choose_device("cpu") == CPU
    # the README section the message names exists under that name
    section = str(refused.value).split("README: ")[1].split(")")[0] + ")"
    assert f"\n## {section}\n" in (ROOT / "README.md").read_text(), section


# ----------------------------------------------------------------------------- the doctor

def test_doctor_reports_every_decision_and_exits_0(tmp_path, monkeypatch, capsys):
    # in-process (main), the report on the protocol's stdout. What cannot run on a CPU is said to be expected there,
    # not reported as a failure; here torch's flash kernel stands in for one that should have run and did not
    from tests.test_prefill import write_checkpoint
    from interact import qwen_tokenizer_dir
    write_checkpoint(tmp_path / "ckpt", qwen_tokenizer_dir())
    stats, report = tmp_path / "doctor.json", io.StringIO()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(prefill, "take_stdout", lambda: report)
    expected = prefill_doctor.unavailable_here
    monkeypatch.setattr(prefill_doctor, "unavailable_here", lambda kind, device: None if kind == "torch-flash" else
                        expected(kind, device))
    rc = prefill.main(["--model", str(tmp_path / "ckpt"), "--device", "cpu", "--doctor", "--stats", str(stats)])
    assert rc == 0, capsys.readouterr().err
    lines = report.getvalue().splitlines()
    for head in ("machine", "memory", "load", "attention", "kernels", "plan", "repeat", "verdict"):
        assert any(line.startswith(head) for line in lines), head
    assert lines[-1] == ("verdict    every required path works; 1 attention candidate(s) FAILED where they should run "
                         "(torch-flash): see above") and len(lines) <= 30
    figures = json.loads(stats.read_text())
    assert figures["repeat_identical"] is True and figures["attention"] == dict.fromkeys(prefill.BUCKET_LABELS, "sdpa")
    assert any(line.startswith("attention  by the longest text in a chunk: sdpa (<=1024)") for line in lines)
    assert [e["name"] for e in figures["attention_candidates"]][-1] == "sdpa"
    candidates = {line.split()[0] + (" " + line.split()[1] if line.split()[0] == "triton" else ""): line
                  for line in lines if line.startswith("    ")}
    assert candidates.keys() == {e["name"] for e in figures["attention_candidates"]}, lines
    flash = "flash_attn is not installed" if prefill.package_version("flash_attn") is None else "not on the CPU"
    assert all(line.endswith("not here: a GPU kernel, not on the CPU") for name, line in candidates.items()
               if name.startswith("triton")) and candidates["flash"].endswith(flash), lines
    assert candidates["torch-flash"].split()[1:3] == ["FAILED:", "NotImplementedError:"], lines
    assert candidates["sdpa"].split()[1:3] == ["rel.", "error"], lines
    assert any(line.startswith("kernels    torch (fused Triton kernels: not on the CPU); float32 logits by head_upcast "
                               "(rel. error against float64 math: ") for line in lines), lines


def test_flash_is_not_offered_on_amd_to_a_model_with_a_window_or_softcap():
    # flash-attn 2.8.3's Triton AMD varlen_fwd takes window_size and softcap and ignores them: refused by name there,
    # with the reason the doctor prints, where the CUDA build's flash computes both
    gemma2 = prefill.ModelConfig.from_json(dict(TINY, model_type="gemma2", sliding_window=64, head_dim=16,
                                                query_pre_attn_scalar=16))
    for family in ("rdna3", "amd"):
        assert "flash" not in [kind for _, kind, _ in prefill.attention_candidates("auto", family, gemma2)]
        with pytest.raises(prefill.UserError, match="'flash' has no softcap or window, .*ignores window_size and softc"):
            prefill.attention_candidates("flash", family, gemma2)
        assert "ignores window_size" in prefill.unoffered_attention(family, gemma2)["flash"]
        assert prefill.unoffered_attention(family, prefill.ModelConfig.from_json(TINY)) == {}  # plain causal: offered
        assert "flash" in [kind for _, kind, _ in prefill.attention_candidates("auto", family,
                                                                               prefill.ModelConfig.from_json(TINY))]
    assert "flash" in [kind for _, kind, _ in prefill.attention_candidates("auto", "nvidia", gemma2)]
    assert set(prefill.unoffered_attention("nvidia", gemma2)) == {"torch-flash", "cudnn"}


def test_the_doctor_says_what_can_change_the_bits_between_starts():
    assert prefill_doctor.same_bits_caveats(None, {}) == []
    rocm = prefill_doctor.same_bits_caveats("7.1.25424", {})
    assert len(rocm) == 1 and "rocBLAS may sum with atomics" in rocm[0]
    tuned = prefill_doctor.same_bits_caveats(None, {"PYTORCH_TUNABLEOP_ENABLED": "1"})
    assert len(tuned) == 1 and "picks each GEMM's kernel by timing" in tuned[0]


def test_what_cannot_run_on_this_machine_by_design(monkeypatch):
    assert prefill_doctor.unavailable_here("sdpa", CPU) is None
    assert prefill_doctor.unavailable_here("torch-flash", CPU) == "a GPU kernel, not on the CPU"
    assert prefill_doctor.unavailable_here("torch-flash", torch.device("cuda")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs its kernels on the CPU (the tests' way)
    assert prefill_doctor.unavailable_here("triton", CPU) is None
    monkeypatch.setattr(prefill_doctor, "triton", None)
    assert prefill_doctor.unavailable_here("triton", torch.device("cuda")) == "triton is not installed"
    monkeypatch.setattr(prefill_doctor, "package_version", lambda name: None)
    assert prefill_doctor.unavailable_here("flash", torch.device("cuda")) == "flash_attn is not installed"


def test_checkpoint_on_tmpfs_costs_no_host_memory_to_lock_in_place(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
                      "/dev/sdb1 /data\\040disk xfs rw 0 0\n")
    assert prefill.filesystem_type("/dev/shm/prefill-bench/qwen3", mounts) == "tmpfs"
    assert prefill.filesystem_type("/dev/shmx", mounts) == "ext4"  # a prefix of the name is not the mount
    assert prefill.filesystem_type("/data disk/ckpt", mounts) == "xfs"
    assert prefill.filesystem_type("/x", tmp_path / "absent") is None


def test_gpu_family_from_the_rocm_arch_name(hip, monkeypatch):
    props = types.SimpleNamespace(gcnArchName="gfx1100:sramecc-:xnack-", major=11, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert prefill.gpu_arch(props) == "gfx1100" and prefill.gpu_family(hip) == "rdna3"
    props.gcnArchName = "gfx942:sramecc+:xnack-"  # MI300: not RDNA3, the small tiles all the same
    assert prefill.gpu_family(hip) == "amd" and prefill.ATTENTION_TILES["amd"] == prefill.ATTENTION_TILES["rdna3"]
    monkeypatch.setattr(torch.version, "hip", None)
    assert prefill.gpu_arch(types.SimpleNamespace(gcnArchName="NVIDIA H200", major=9, minor=0)) == "sm_90"
    assert prefill.gpu_family(torch.device("cuda")) == "nvidia" and prefill.gpu_family(CPU) == "cpu"


def test_a_first_run_plans_room_for_the_scratch_of_the_attention_timings(tmp_path, monkeypatch):
    # timing every candidate while the weights load holds more GPU memory than a kept pick's check: only then the
    # plan leaves PICK_SCRATCH more
    gpu = torch.device("cuda")
    picks = prefill.Picks(tmp_path / "picks.json", "this machine")
    assert prefill.attention_to_time("auto", gpu, picks)
    assert not prefill.attention_to_time("auto", CPU, picks)  # nothing is timed on the CPU
    assert not prefill.attention_to_time("auto", gpu, prefill.Picks(None, None))  # nor without a picks file
    for label in prefill.BUCKET_LABELS:
        picks.put(f"attention auto {label}", "triton 64x64")
    assert not prefill.attention_to_time("auto", gpu, picks)
    assert prefill.attention_to_time("triton", gpu, picks)  # another request: its own picks
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 48 * 2**30))
    first, later = (types.SimpleNamespace(device=gpu, times_attention=t) for t in (True, False))
    assert prefill.Runner._budget(later, None) - prefill.Runner._budget(first, None) == prefill.PICK_SCRATCH
    assert prefill.Runner._budget(first, 20) == prefill.Runner._budget(later, 20) == 20 * 2**30  # as asked
    # an FP8 MoE's way (its experts held FP8 or not) is decided at the total memory, which a first run's timings do
    # not move, nor does what other processes hold: the free memory is 40 GiB here
    assert prefill.Runner._held_budget(first, None) == prefill.Runner._held_budget(later, None) \
        == 48 * 2**30 - prefill.HELD_RESERVE
    assert prefill.Runner._held_budget(first, 20) == 20 * 2**30
