"""prefill's fused experts (fused_experts: align_experts' three launches, the gate+up GEMM with the activation, the
down GEMM, the sum into x with the routing weights) in Triton's interpreter: against float32 experts on uneven routing,
gpt-oss's experts (their layout, biases and clamped SwiGLU) against float32 experts and the grouped path with each
feature ablated, the alignment against its specification (hypothesis), the start-up check refusing planted bugs (in
gpt-oss's experts too), and the whole tiny Qwen3-MoE of test_moe.py against transformers in float32 (gpt-oss's:
test_gpt_oss.py); their FP8 variant against the dequantized experts, bit for bit, and with its scales misread.

The interpreter multiplies bf16 tiles as raw integers, so the interpreted process runs prefill in float16
(prefill.DTYPE, read when a tensor is made): the kernels round to their tensors' own dtype, bf16 on a GPU. One process
does it all (its imports, the checkpoint's load and the start-up checks cost as much as the cases themselves).
"""
import json

import pytest
import torch

import prefill
from test_families import TEXTS
from test_gpt_oss import GEOMETRY as GPT_OSS
from test_mla import GEOMETRY as MLA
from test_moe import CPU, geometry_config, reference, moe_checkpoint, save_moe_checkpoint  # noqa: F401 (fixtures)
from test_prefill import TOLERANCE, interpreted, max_rel_err
from bench.make_checkpoint import QWEN3_30B_A3B

RUNNER_TEXTS = [0, 8]  # 59 tokens and 1: the interpreter runs the model's kernels a program a block

SCRIPT = """
import json, sys, types
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
import prefill
prefill.DTYPE = torch.float16  # the interpreter multiplies bf16 tiles as raw integers
prefill.CHECK_LENGTHS = [37, 100]  # the attention check (SDPA) on short texts: the experts are under test here
cpu, report = torch.device("cpu"), {}

# fused_experts against float32 experts (moe_reference) on expert_inputs' uneven routing (expert 0 takes half the
# tokens, over several blocks and a partial one; the last expert none): top-2 in every tile offered anywhere, top-1
# (weights not renormalised, so that they matter) and top-3 in the interpreter's tile, sizes that no tile divides
# (hidden 80, moe_intermediate 48: partial K and column tiles in both GEMMs), and weights stored [experts, K, N] (as
# gpt-oss stores them) read through strides; each twice, for the bits
def case(hidden, inter, tokens, k, renormalize, tile, transposed=False):
    geometry = types.SimpleNamespace(hidden_size=hidden, moe_intermediate_size=inter, fused_experts=False,
                                     fp8_experts=False)
    h, w = prefill.expert_inputs(cpu, geometry, seed=k, tokens=tokens, experts=8)
    want = prefill.moe_reference(h, F.linear(h, w.router), w.gate_up, w.down, k, renormalize)
    if transposed:
        w.gate_up, w.down = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (w.gate_up, w.down))
    runs = [prefill.moe_ffn(torch.zeros_like(h), h, w, prefill.Router("softmax", k, renormalize), prefill.make_experts("fused", tile),
                            prefill.TORCH_KERNELS) for _ in range(2)]
    return {"error": prefill.check_error(runs[0], want), "same_bits": torch.equal(*runs)}

tiles = sorted({t for family in prefill.FUSED_TILES.values() for shape in family.values() for t in shape})
[here] = prefill.FUSED_TILES["cpu"].values()
report["cases"] = {f"top-2 {tile}": case(64, 32, 200, 2, True, tile) for tile in tiles}
report["cases"] |= {"top-1": case(64, 32, 70, 1, False, here[0]), "top-3": case(64, 32, 45, 3, True, here[0]),
                    "hidden 80, moe_intermediate 48": case(80, 48, 150, 2, True, here[0]),
                    "[experts, K, N] weights": case(64, 32, 100, 2, True, here[0], transposed=True)}

# gpt-oss's experts (expert_inputs' gpt-oss layer: [experts, in, out] storage read through strides and by TMA, gate
# and up interleaved, a bias on each GEMM, a clamp at its default 7 that bites) against float32 experts and against the
# grouped path (the loop with gated_act and combine: its steps rounded as the fused epilogue's, here float16), in every
# tile gpt-oss's shapes are offered (both models' slices, every GPU family; the interpreter's twice, for the bits) and
# sizes no tile divides; then the fused path with each feature ablated, which must miss both
OSS = prefill.ClampedSwiGLU(1.702, 7.0)
def oss_case(hidden, inter, tile, activation=OSS, biases=True, runs=1):
    geometry = types.SimpleNamespace(hidden_size=hidden, moe_intermediate_size=inter, fused_experts=True,
                                     fp8_experts=False)
    h, w = prefill.expert_inputs(cpu, geometry, seed=5, tokens=40, experts=8)
    want = prefill.moe_reference(h, F.linear(h, w.router), w.gate_up, w.down, 2, True, OSS, w.gate_up_bias,
                                 w.down_bias)
    router = prefill.Router("softmax", 2, True)
    grouped = prefill.moe_ffn(torch.zeros_like(h), h, w, router, prefill.make_experts("loop", None, OSS),
                              prefill.TORCH_KERNELS)
    if not biases:
        w.gate_up_bias = w.down_bias = None
    runs = [prefill.moe_ffn(torch.zeros_like(h), h, w, router, prefill.make_experts("fused", tile, activation),
                            prefill.TORCH_KERNELS) for _ in range(runs)]
    return {"error": prefill.check_error(runs[0], want), "to grouped": prefill.check_error(runs[0], grouped.float()),
            "same_bits": torch.equal(*runs) if len(runs) == 2 else None}

shapes = [types.SimpleNamespace(hidden_size=2880, moe_intermediate_size=2880, num_experts_per_tok=4, num_experts=e)
          for e in (32, 128)]  # gpt-oss-20b's and 120b's
oss_tiles = sorted({t for family in prefill.FUSED_TILES for cfg in shapes for tokens in (4096, 16384, 65536)
                    for t in prefill.fused_tiles(family, cfg, tokens)})
report["gpt-oss"] = {str(tile): oss_case(64, 32, tile, runs=1 + (tile == here[0])) for tile in oss_tiles}
report["gpt-oss"]["hidden 80, moe_intermediate 48"] = oss_case(80, 48, here[0])
report["gpt-oss ablated"] = {"biases dropped": oss_case(64, 32, here[0], biases=False),
                             "clamp dropped": oss_case(64, 32, here[0], prefill.ClampedSwiGLU(1.702, 6e4)),
                             "SiLU of gate and up as halves": oss_case(64, 32, here[0], "silu")}

# align_experts against its specification, written out: expert by expert, each one's (token, slot) rows in token
# order, padded with `rows` to a multiple of the block; then the blocks' experts, -1 past the last; the running sums
# over the chunks taken a chunk at a time too (ALIGN_SCAN 1: a carry between steps, which 3 chunks at most never need
# at the default)
@settings(max_examples=40, deadline=None, database=None)
@given(tokens=st.integers(1, 300), experts=st.integers(1, 40), k=st.integers(1, 4), spread=st.floats(0, 6),
       block_m=st.sampled_from([16, 64]), scan=st.sampled_from([1, prefill.ALIGN_SCAN]), seed=st.integers(0, 2**16))
@example(tokens=300, experts=20, k=4, spread=0.0, block_m=16, scan=1, seed=1)  # 3 chunks a step at a time, always
def aligned(tokens, experts, k, spread, block_m, scan, seed):
    k, prefill.ALIGN_SCAN = min(k, experts), scan
    gen = torch.Generator().manual_seed(seed)  # a few favoured experts, the others often empty
    scores = torch.rand(tokens, experts, generator=gen) + spread * torch.randn(experts, generator=gen)
    chosen = scores.topk(k, dim=-1).indices.sort(dim=-1).values
    flat, rows, ids, blocks = chosen.flatten(), chosen.numel(), [], []
    for e in range(experts):
        mine = (flat == e).nonzero().flatten().tolist()
        padded = -(-len(mine) // block_m) * block_m
        ids += mine + [rows] * (padded - len(mine))
        blocks += [e] * (padded // block_m)
    got_ids, got_blocks = prefill.align_experts(chosen, experts, block_m)
    assert got_blocks.shape[0] == -(-rows // block_m) + experts
    assert got_blocks[:len(blocks)].tolist() == blocks and (got_blocks[len(blocks):] == -1).all()
    assert got_ids[:len(ids)].tolist() == ids

scan = prefill.ALIGN_SCAN
try:
    aligned()
    report["alignment"] = "as specified"
except AssertionError as e:
    report["alignment"] = f"{type(e).__name__}: {e}"[:2000]
prefill.ALIGN_SCAN = scan

# the start-up check of the fused candidate on the model's shapes, with a planted bug each
cfg = prefill.ModelConfig.from_dir(sys.argv[1])
[candidate] = prefill.expert_candidates("fused", cpu, cfg, 4096)
make, align = prefill.make_experts, prefill.align_experts

def last_slot_dropped(weights):
    weights = weights.clone()
    weights[:, -1] = 0
    return weights

def next_expert(chosen, experts, block_m):  # each block's rows through the next expert's weights
    ids, block_expert = align(chosen, experts, block_m)
    return ids, torch.where(block_expert >= 0, (block_expert + 1) % experts, block_expert)

for name, bug in {"weights of the two slots swapped": lambda weights: weights.flip(-1).contiguous(),
                  "a slot skipped": last_slot_dropped, "the next expert's weights": None}.items():
    prefill.align_experts = next_expert if bug is None else align
    prefill.make_experts = lambda kind, tile, activation, bug=bug: (lambda x, h, weights, chosen, w, kernels: make(
        kind, tile, activation)(x, h, weights if bug is None else bug(weights), chosen, w, kernels))
    [entry] = prefill.check_experts([candidate], cpu, cfg)
    report[name] = [entry["error"], entry.get("reason")]
prefill.align_experts, prefill.make_experts = align, make

# the same check of gpt-oss's fused experts on its shapes (GEOMETRY of test_gpt_oss: a clamp at 3) with their biases
# dropped, or the SiLU in place of the clamped SwiGLU (test_gpt_oss's Runner passes it on the same shapes)
oss_cfg = prefill.ModelConfig.from_json(json.loads(sys.argv[3]))
[candidate] = prefill.expert_candidates("fused", cpu, oss_cfg, 4096)
fused = prefill.fused_experts
unbiased = lambda x, h, weights, chosen, w, tile, activation: fused(
    x, h, weights, chosen, prefill.dataclasses.replace(w, gate_up_bias=None, down_bias=None), tile, activation)
report["gpt-oss check"] = {}
for name, (fn, activation) in {"biases dropped": (unbiased, oss_cfg.expert_activation),
                               "SiLU for the clamp": (fused, "silu")}.items():
    prefill.fused_experts = fn
    prefill.make_experts = lambda kind, tile, _, activation=activation: make(kind, tile, activation)
    [entry] = prefill.check_experts([candidate], cpu, oss_cfg)
    report["gpt-oss check"][name] = [entry["error"], entry.get("reason")]
prefill.fused_experts, prefill.make_experts = fused, make

# the whole model with the fused experts (its start-up check passes them): two texts (60 tokens), scored twice
r = prefill.Runner(sys.argv[1], device="cpu", attention="sdpa", experts="fused", picks="")
ids = r.tokenize(json.loads(sys.argv[2]))
losses = r.losses(ids)
report["runner"] = {"experts": r.experts, "check_error": r.experts_report[0]["error"], "losses": losses,
                    "again": r.losses(ids) == losses}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def interpreted_report(moe_checkpoint):  # noqa: F811 (a fixture of test_moe)
    p = interpreted(SCRIPT, moe_checkpoint[0], json.dumps([TEXTS[i] for i in RUNNER_TEXTS]),
                    json.dumps({"model_type": "gpt_oss", **GPT_OSS}))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_fused_experts_match_float32_experts_in_the_interpreter(interpreted_report):
    # uneven routing (an empty expert, partial blocks), top-1, -2 and -3, every tile offered, sizes no tile divides,
    # transposed weights: float16 against float32 math, the same bits a second time
    cases = interpreted_report["cases"]
    assert len(cases) == len({t for f in prefill.FUSED_TILES.values() for s in f.values() for t in s}) + 4, cases
    assert all(c["same_bits"] and c["error"] < 2e-3 for c in cases.values()), cases  # measured: 1.0e-3-1.35e-3


def test_gpt_oss_s_fused_experts_match_float32_and_the_grouped_path_and_each_feature_matters(interpreted_report):
    # every tile gpt-oss's shapes are offered, partial tiles; measured 1.1e-3 against float32 (1.0e-3 in partial
    # tiles), and against the grouped path 0 in 8 of 10 tiles, 3.2e-4 at most: both weight each bf16 row in float32
    # in the sum (until the routing weight moved from the down GEMM's epilogue into moe_sum: 1.6e-3 and 9.5e-4)
    cases, [here] = interpreted_report["gpt-oss"], prefill.FUSED_TILES["cpu"].values()
    assert len(cases) >= 8 and cases[str(here[0])]["same_bits"], cases
    assert all(c["error"] < 2e-3 and c["to grouped"] < 1e-3 for c in cases.values()), cases
    for name, c in interpreted_report["gpt-oss ablated"].items():  # measured 0.66, 0.64, 4.1
        assert min(c["error"], c["to grouped"]) > 4 * prefill.CHECK_TOLERANCE, (name, c)


def test_the_alignment_numbers_every_row_once_expert_by_expert_and_pads_the_rest(interpreted_report):
    assert interpreted_report["alignment"] == "as specified"


def test_the_start_up_check_refuses_planted_bugs_in_the_fused_experts(interpreted_report):
    for bug in ("weights of the two slots swapped", "a slot skipped", "the next expert's weights"):
        error, reason = interpreted_report[bug]
        assert error > 4 * prefill.CHECK_TOLERANCE and reason.startswith("differs from float32 experts"), (bug, error)
    assert set(interpreted_report["gpt-oss check"]) == {"biases dropped", "SiLU for the clamp"}
    for bug, (error, reason) in interpreted_report["gpt-oss check"].items():
        assert error > 4 * prefill.CHECK_TOLERANCE and reason.startswith("differs from float32 experts"), (bug, error)


def test_the_fused_experts_through_the_model_match_transformers(interpreted_report, reference):
    run = interpreted_report["runner"]
    assert run["experts"].startswith("fused") and run["check_error"] < prefill.CHECK_TOLERANCE / 4, run
    assert max_rel_err(run["losses"], [reference[i] for i in RUNNER_TEXTS]) < TOLERANCE and run["again"], run


def test_fused_experts_are_offered_on_gpus_with_the_nearest_shapes_tiles(monkeypatch):
    cfg = geometry_config(QWEN3_30B_A3B)
    assert [kind for _, kind, _ in prefill.expert_candidates("auto", CPU, cfg, 16384)] == ["grouped_mm", "loop"]
    assert [c[2] for c in prefill.expert_candidates("fused", CPU, cfg, 16384)] == prefill.FUSED_TILES["cpu"][
        2048, 768, 1024]  # asked for by kind: the interpreter's tile
    # of two shapes, each model gets the tiles of the nearest: sizes compared by their logarithms
    monkeypatch.setitem(prefill.FUSED_TILES, "cpu", {(2048, 768, 1024): ["small"], (4096, 1536, 1024): ["large"]})
    big = dict(QWEN3_30B_A3B, hidden_size=4096, moe_intermediate_size=1536)
    assert prefill.fused_tiles("cpu", cfg, 16384) == ["small"] and prefill.fused_tiles("cpu", cfg, 512) == ["small"]
    assert prefill.fused_tiles("cpu", geometry_config(big), 16384) == ["large"]


# The fused experts' FP8 variant (issue 37: FP8 weights dequantized tile by tile in the GEMMs, not offered yet; its
# speed: bench/fp8_experts.py): against the same kernels on the bf16 (here float16) weights dequantize_fp8 makes of the
# same FP8 bytes, projection by projection as a checkpoint holds them, bit for bit in the same tile; against float32
# experts on those weights; and with the scales misread as three index bugs would misread them. Sides of 320 (three
# blocks, the last partial: partial scale rows and columns), 96 (one block, smaller than 128: the up projection's
# scales start at row 1, not at 96 / 128), 256; K tiles of 32 and 64 (96 in tiles of 64: a partial K tile), pointers
# and TMA. Scales random floats (not powers of two: the product's rounding matters), each block's from 1/4 to 4 times
# the next's, so that a misread scale is off by O(1).
FP8_SCRIPT = """
import json, types
import torch
import torch.nn.functional as F
import prefill
GEOMETRY = json.loads(MLA_JSON)  # tests/test_mla.py's tiny DeepSeek-V3
prefill.DTYPE = torch.float16  # the interpreter multiplies bf16 tiles as raw integers
cpu, gen, report = torch.device("cpu"), torch.Generator().manual_seed(0), {}

def quantized(E, N, K):  # float8_e4m3fn [E, N, K] (no NaN) and its block scales [E, cdiv(N, 128), cdiv(K, 128)]
    q = (torch.randn(E, N, K, generator=gen) * 64).clamp(-448, 448).to(prefill.FP8)
    grid = prefill.scale_grid((N, K))
    factor = 2.0 ** torch.randint(-2, 3, (E, *grid), generator=gen) * (1 + torch.rand(E, *grid, generator=gen))
    return q, (factor * K ** -0.5 / 64).float()

def dequantized(q, scales):  # dequantize_fp8, expert by expert, into the float16 experts
    out = torch.empty(q.shape, dtype=prefill.DTYPE)
    for e in range(q.shape[0]):
        prefill.dequantize_fp8(q[e], scales[e], out[e])
    return out

def case(hidden, inter, tile, tokens=60, experts=4, bugs=False):
    geometry = types.SimpleNamespace(hidden_size=hidden, moe_intermediate_size=inter, fused_experts=False,
                                     fp8_experts=False)
    h, w = prefill.expert_inputs(cpu, geometry, seed=1, tokens=tokens, experts=experts)
    (gate, gate_s), (up, up_s), (down, down_s) = (quantized(experts, inter, hidden), quantized(experts, inter, hidden),
                                                  quantized(experts, hidden, inter))
    fp8 = prefill.dataclasses.replace(w, gate_up=torch.cat([gate, up], 1), gate_up_scales=torch.cat([gate_s, up_s], 1),
                                      down=down, down_scales=down_s)
    bf16 = prefill.dataclasses.replace(w, gate_up=torch.cat([dequantized(gate, gate_s), dequantized(up, up_s)], 1),
                                       down=dequantized(down, down_s))
    router, experts_fn = prefill.Router("softmax", 2, True), prefill.make_experts("fused", tile)
    run = lambda w: prefill.moe_ffn(torch.zeros_like(h), h, w, router, experts_fn, prefill.TORCH_KERNELS)
    want, got = run(bf16), run(fp8)
    f32 = prefill.moe_reference(h, F.linear(h, w.router), bf16.gate_up, bf16.down, 2, True)
    result = {"same_bits": torch.equal(got, want), "error": prefill.check_error(got, f32),
              "bf16 error": prefill.check_error(want, f32)}
    if bugs:  # the scales as a wrong index would read them: each misread one's error against the dequantized path
        misread = {"the next block of K's scales": dict(gate_up_scales=fp8.gate_up_scales.roll(1, 2)),
                   "up's columns by the gate's scales": dict(gate_up_scales=torch.cat([gate_s, gate_s], 1)),
                   "the next block of columns' scales": dict(down_scales=down_s.roll(1, 1))}
        result["bugs"] = {name: prefill.check_error(run(prefill.dataclasses.replace(fp8, **change)), want.float())
                          for name, change in misread.items()}
    return result

[here] = prefill.FUSED_TILES["cpu"].values()
tma = (32, (32, 64, 1, 4, 1, True), (64, 64, 1, 4, 1, True))
report["320, 96 " + str(here[0])] = case(320, 96, here[0], bugs=True)
report["320, 96 " + str(tma)] = case(320, 96, tma)
report["256, 320 " + str(here[0])] = case(256, 320, here[0])

# A DeepSeek-V3 MoE layer held as today and with its experts held apart in FP8 (fp8_experts), the same checkpoint
# tensors in each (random, FP8 without NaN): dequantized as the streamer does it (dequantize_layer into the bf16
# scratch; the experts viewed where held), then moe_block (its router, the shared expert, the fused experts in the
# interpreter's tile): the same bits. gate and up 96 wide, one block smaller than 128: the up's scales a grid apart
def held_apart(tile):
    raw = {**GEOMETRY, "model_type": "deepseek_v3", "moe_intermediate_size": 96, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
    today = prefill.ModelConfig.from_json(raw)
    apart = prefill.dataclasses.replace(today, fp8_experts=True)
    data = {}
    for name, _, shape, dtype in today.held[1]:
        if dtype == prefill.FP8:
            q = torch.randint(256, shape, generator=gen, dtype=torch.uint8)
            data[name] = q.masked_fill_(q % 128 == 127, 0).view(prefill.FP8)
        else:
            scale = 2.0 ** -7 if name.endswith("_scale_inv") else 0.5
            data[name] = (torch.rand(shape, generator=gen) * scale).to(dtype)
    x = torch.randn(50, raw["hidden_size"], generator=gen).to(prefill.DTYPE)
    outs = []
    for cfg in (today, apart):
        held = torch.zeros(cfg.layer_bytes, dtype=torch.uint8)
        for name, offset, shape, dtype in cfg.held[1]:
            prefill.typed(held, offset, data[name].numel(), dtype).copy_(data[name].flatten())
        scratch = torch.zeros(cfg.dequantized_bytes // 2, dtype=prefill.DTYPE)
        prefill.dequantize_layer(held, scratch, prefill.fp8_layer(cfg.held[1], cfg.layouts["moe"], cpu))
        w = prefill.layer_views(scratch, cfg, "moe", held)
        out = x.clone()
        prefill.moe_block(out, w, cfg, 64, prefill.TORCH_KERNELS, prefill.make_experts("fused", tile))
        outs.append(out)
    return {"same_bits": torch.equal(*outs), "fp8": str(w.gate_up.dtype), "moved": (outs[0] - x).abs().mean().item(),
            "bytes": [today.dequantized_bytes, apart.dequantized_bytes, today.layer_bytes, apart.layer_bytes]}

report["held layout"] = held_apart(here[0])

# the start-up check of the fused candidate on FP8-held experts (that V3's shapes): passed, and refused with the next
# expert's down scales planted (fused_experts given them)
held = prefill.dataclasses.replace(prefill.ModelConfig.from_json({**GEOMETRY, "model_type": "deepseek_v3",
    "moe_intermediate_size": 96, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
    "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}), fp8_experts=True)
[candidate] = prefill.expert_candidates("fused", cpu, held, 4096)
fused, report["held check"] = prefill.fused_experts, {}
for name, change in {"right": lambda w: {}, "the next expert's down scales": lambda w: dict(
        down_scales=w.down_scales.roll(1, 0))}.items():
    prefill.fused_experts = lambda x, h, weights, chosen, w, *rest, change=change: fused(
        x, h, weights, chosen, prefill.dataclasses.replace(w, **change(w)), *rest)
    [entry] = prefill.check_experts([candidate], cpu, held)
    report["held check"][name] = [entry["error"], entry.get("reason")]
prefill.fused_experts = fused
print(json.dumps(report))
""".replace("MLA_JSON", repr(json.dumps(MLA)))


@pytest.fixture(scope="module")
def fp8_report():
    p = interpreted(FP8_SCRIPT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_fp8_experts_are_the_dequantized_experts_bit_for_bit_in_the_interpreter(fp8_report):
    cases = {name: c for name, c in fp8_report.items() if name not in ("held layout", "held check")}
    assert len(cases) == 3
    for name, c in cases.items():
        assert c["same_bits"] and c["error"] == c["bf16 error"] < 2e-3, (name, c)


def test_fp8_experts_held_apart_run_as_the_layer_dequantized_whole_bit_for_bit_in_the_interpreter(fp8_report):
    c = fp8_report["held layout"]
    today_scratch, apart_scratch, today_bytes, apart_bytes = c["bytes"]
    assert c["same_bits"] and c["fp8"] == "torch.float8_e4m3fn" and c["moved"] > 0.1, c
    assert apart_scratch < 0.7 * today_scratch and apart_bytes <= today_bytes, c


def test_the_check_passes_fp8_held_fused_experts_and_refuses_misread_scales_in_the_interpreter(fp8_report):
    (right_error, right_reason), (_, wrong_reason) = fp8_report["held check"].values()
    assert right_reason is None and right_error < prefill.CHECK_TOLERANCE and "differs" in wrong_reason, fp8_report


def test_fp8_experts_with_misread_scales_miss_the_dequantized_experts(fp8_report):
    [bugs] = [c["bugs"] for c in fp8_report.values() if "bugs" in c]
    assert len(bugs) == 3 and all(error > 4 * prefill.CHECK_TOLERANCE for error in bugs.values()), bugs
