"""Does a text's loss depend on which texts share its batch (issue 38)? The same texts cut into batches of several
sizes by prefill.batches, each batch scored alone (Runner.score_batch): per batch size, how many texts' float64 NLL
sums differ in any bit from those of one batch of all, and by how much; then the same with the layers left out
(embedding, final norm, head and log-softmax alone), which tells the loss's part from the layers'.

    python bench/batch_dependence.py --device cpu                  # the tiny dense and MoE geometries, as in the note
    python bench/batch_dependence.py --device cuda --geometry mid --geometry tiny-moe   # the GPU path's logic

A corpus's batches are sized by time (prefill.timed_batch_tokens) only because the answer is yes: a resumed run must
cut the batches the interrupted one cut, so the batch is kept in OUT.settings.json. Writes OUT/batch_dependence.json
with --out OUT (default: $OUT, where set); the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # as make_checkpoint.py: no shadowing
sys.path.insert(0, str(HERE.parent))

import prefill  # noqa: E402
from bench.make_checkpoint import GEOMETRIES, QWEN3_32B, build, tiny  # noqa: E402

# a dense model whose GEMMs are large enough to let a GPU library choose among kernels by their rows
GEOMETRIES = {**GEOMETRIES, "mid": tiny(QWEN3_32B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                                         num_attention_heads=16, num_key_value_heads=4, head_dim=128)}
LENGTHS = [1, 2, 3, 5, 17, 64, 129, 250, 700, 1500, 3000]
SIZES = [65536, 8192, 2048, 777, 300, 64, 1]


def sums(runner, items, size, layers=None):
    out = {}
    for batch in prefill.batches(items, size):
        for s in runner.score_batch(batch, layers):
            out[s.index] = s.nll_sum
    return out


def compare(base, other):
    differ = [i for i in base if base[i] != other[i]]
    worst = max((abs(other[i] - base[i]) / abs(base[i]) for i in differ if base[i]), default=0.0)
    return len(differ), worst


def run(name, folder, device, texts, seed):
    runner = prefill.Runner(str(folder), device=device, attention="sdpa" if device == "cpu" else "auto")
    rng = random.Random(seed)
    items = [(i, [rng.randrange(runner.cfg.vocab_size) for _ in range(rng.choice(LENGTHS))], None)
             for i in range(texts)]
    rows = []
    for label, layers in (("whole model", None), ("loss alone", ())):
        base = sums(runner, items, SIZES[0], layers)
        again = compare(base, sums(runner, items, SIZES[0], layers))[0]  # the same batches twice: no bit may move
        for size in SIZES:
            t0 = time.perf_counter()
            n, worst = compare(base, sums(runner, items, size, layers)) if size != SIZES[0] else (again, 0.0)
            rows.append({"geometry": name, "device": device, "part": label, "batch_tokens": size,
                         "batches": len(list(prefill.batches(items, size))), "texts": texts, "texts_differing": n,
                         "max_rel_diff": worst, "seconds": time.perf_counter() - t0,
                         "attention": runner.attention, "experts": runner.experts})
            print(f"{name} {label} batches of {size}: {n} of {texts} texts differ (max rel {worst:.2e})",
                  file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--geometry", action="append", choices=sorted(GEOMETRIES), help="default: tiny and tiny-moe")
    ap.add_argument("--texts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoints", help="folder for the checkpoints (default: a temporary one)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="a folder for the JSON report (default: $OUT)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.geometry or ["tiny", "tiny-moe"]:
            folder = Path(args.checkpoints or tmp) / f"batch-dependence-{name}"
            folder.mkdir(parents=True, exist_ok=True)
            build(folder, GEOMETRIES[name], seed=0, device=args.device, tokenizer=None, reuse=True)
            rows += run(name, folder, args.device, args.texts, args.seed)
    if args.out:
        Path(args.out, "batch_dependence.json").write_text(json.dumps(rows, indent=1))
    print(f"{'geometry':10} {'part':12} {'batch':>6} {'batches':>7} {'differ':>8} {'max rel':>9}")
    for r in rows:
        print(f"{r['geometry']:10} {r['part']:12} {r['batch_tokens']:>6} {r['batches']:>7} "
              f"{r['texts_differing']:>4}/{r['texts']:<3} {r['max_rel_diff']:>9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
