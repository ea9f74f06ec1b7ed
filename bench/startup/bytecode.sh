#!/bin/bash
# Issue 27.6 on the H200: is the machine's `import torch` (3.7-5.5 s in 2026-12-02-h200-startup-phases.json) slow
# because its Python environment has no byte-compiled files (PYTHONDONTWRITEBYTECODE set, every process compiling
# torch from source again)? An environment installed as the README says (uv sync --compile-bytecode) has them.
# Run from the repository root with .cache/tokenizer carried; COMMIT names the checkout (the device's .git is older).
#   COMMIT=abc1234 bash bench/startup/bytecode.sh
# Writes into $OUT: env.txt (the interpreter's bytecode settings, whether torch has __pycache__), import.txt
# (`python3 -c "import torch"` three times plain, then three times reading a byte-compiled cache), and bench/run.py's
# report for the contest workload's runner (three starts, the first one fills the picks file and Triton cache) plain
# and with the cache, on the same checkpoint in the same call.
set -u
export PYTHONUNBUFFERED=1
C=${COMMIT:?COMMIT=... names the checkout}
env | grep '^PYTHON' > $OUT/env.txt
python3 - >> $OUT/env.txt <<'EOF'
import importlib.util, os, sys
d = os.path.dirname(importlib.util.find_spec("torch").origin)
pc = os.path.join(d, "__pycache__")
print("dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix)
print("torch at", d, "__pycache__:", os.path.isdir(pc), len(os.listdir(pc)) if os.path.isdir(pc) else 0,
      "files; writable:", os.access(d, os.W_OK))
EOF
imports() { for i in 1 2 3; do /usr/bin/time -f "$1 %e s" python3 -c "import torch" 2>> $OUT/import.txt; done; }
imports plain
mkdir -p /tmp/pyc
# The cache, filled once: everything the runner imports, compiled into PYTHONPYCACHEPREFIX (site-packages is not ours)
( unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
  /usr/bin/time -f "fill the cache %e s" python3 -c "import torch, triton, tokenizers, safetensors, transformers, prefill" \
      2>> $OUT/import.txt )
PYTHONPYCACHEPREFIX=/tmp/pyc imports cached
for mode in plain cached; do
  echo "=== runner $mode $(date +%T)"
  prefix=(); [ $mode = cached ] && prefix=(env PYTHONPYCACHEPREFIX=/tmp/pyc)
  timeout 280 "${prefix[@]}" python3 bench/run.py --tokenizer .cache/tokenizer --texts 100 --baseline-texts 0 \
      --skip-gemm --skip-reference --skip-storage --repeat-args '' --repeat-args '' --commit "$C" \
      --workload contest-100-startup-$mode --out /tmp/res-$mode --deadline-s 260 > /tmp/run-$mode.log 2>&1
  tail -n 30 /tmp/run-$mode.log
  cp /tmp/res-$mode/*.json $OUT/; cp /tmp/res-$mode/run.log $OUT/run-$mode.log
done
cat $OUT/import.txt
python3 - <<'EOF'
import glob, json
for p in sorted(glob.glob("/tmp/res-*/*.json")):
    r = json.load(open(p))
    print(p, "ready", r.get("time_to_ready_s"), "warm", r.get("warm_time_to_ready_s"), "T", r.get("t_seconds"))
EOF
