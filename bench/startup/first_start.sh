#!/bin/bash
# Where a first start's time goes on a fresh machine (issue 37's noticed regression: gpt-oss-20b's load 5.4 -> 15.4 s
# between 1990ca1 and c6dfe8f). One device command, from the checkout's root, with .cache carried (the Qwen3 tokenizer
# in .cache/tokenizer, 1990ca1's prefill.py in .cache/old-1990ca1):
#   bash bench/startup/first_start.sh        (writes $OUT/first-start.tgz and prints a table)
# gpt-oss-20b's random MXFP4 checkpoint; each variant starts once on an empty picks file and Triton cache of its own
# (--stats: load_wall_s, side_done_s), scoring 4 texts; the gated variants through gated_main.py (the gate's series
# counted). Variants: HEAD; HEAD with GATE_TRIES 1; HEAD with the experts fixed to grouped_mm (no fused variant
# compiled or timed); 1990ca1 (no gate, grouped_mm picked); then HEAD again on its own kept picks and cache.
set -u
R=/tmp/first-start; CK=/dev/shm/prefill-bench/g20; TOK=$PWD/.cache/tokenizer
mkdir -p $R /dev/shm/prefill-bench
export PYTHONUNBUFFERED=1
python3 -c "import json,torch,triton,transformers;print(json.dumps(dict(torch=torch.__version__,triton=triton.__version__,transformers=transformers.__version__)))" > $R/versions.json
python3 bench/make_checkpoint.py --out $CK --geometry gpt-oss-20b --mxfp4 --device cuda --tokenizer $TOK --reuse > $R/build.log 2>&1
python3 -c "import json;print(json.dumps(['The quick brown fox jumps over the lazy dog. '*40]*4))" > $R/texts.json
start() {  # name, cache tag, command...
  local name=$1 tag=$2; shift 2
  local t=$(date +%s.%N)
  XDG_CACHE_HOME=/tmp/xdg-$tag TRITON_CACHE_DIR=/tmp/triton-$tag timeout 200 "$@" > $R/$name.stdout 2> $R/$name.stderr
  echo "$name rc=$? wall=$(python3 -c "print(round($(date +%s.%N)-$t,1))")" | tee -a $R/walls.txt
}
S="--model $CK --input $R/texts.json --gpu-memory 48"
start head head python3 bench/startup/gated_main.py --gate-out $R/head-gate.json -- $S --stats $R/head.json
start tries1 tries1 python3 bench/startup/gated_main.py --tries 1 --gate-out $R/tries1-gate.json -- $S --stats $R/tries1.json
start grouped grouped python3 bench/startup/gated_main.py --gate-out $R/grouped-gate.json -- $S --experts grouped_mm --stats $R/grouped.json
cp prefill.py /tmp/prefill-head.py; cp .cache/old-1990ca1/prefill.py /tmp/old.py 2>/dev/null
( mkdir -p /tmp/old && cp .cache/old-1990ca1/prefill.py /tmp/old/prefill.py && start old old python3 /tmp/old/prefill.py $S --stats $R/old.json )
start head-kept head python3 bench/startup/gated_main.py --gate-out $R/head-kept-gate.json -- $S --stats $R/head-kept.json
python3 - $R <<'PY'
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
print(f"{'variant':10} {'ready_s':>8} {'weights':>8} {'attention':>9} {'blas':>6} {'experts':>8} {'gated series/retried/s':>24}  experts picked")
for v in ("head", "tries1", "grouped", "old", "head-kept"):
    try:
        s = json.loads((R / f"{v}.json").read_text())
    except Exception as e:
        print(f"{v:10} no stats ({e})"); continue
    g = json.loads((R / f"{v}-gate.json").read_text()) if (R / f"{v}-gate.json").exists() else {}
    side, since = s.get("side_done_s", {}), s.get("since_start_s", {})
    f = lambda d, k: f"{d[k]:.1f}" if isinstance(d.get(k), (int, float)) else "-"
    print(f"{v:10} {f(since, 'ready'):>8} {f(s.get('load_wall_s', {}), 'weights'):>8} {f(side, 'attention'):>9} "
          f"{f(side, 'blas'):>6} {f(side, 'experts'):>8} {str(g.get('series', '-')) + '/' + str(g.get('retried', '-')) + '/' + str(g.get('gated_s', '-')):>24}  {s.get('experts')}")
PY
tar -czf $OUT/first-start.tgz -C /tmp first-start
