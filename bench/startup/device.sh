#!/bin/bash
# The one device command of bench/results/primitives/2026-12-02-h200-startup-phases.json (issue 27.6): run from the
# session checkout's root with this folder carried as .venv/startup-probe (with the Qwen3 tokenizer in tok/).
# Clean checkouts of both commits from .git; each version's bench/run.py runner step three times (the first fills
# an empty picks file and Triton cache of its own, the next two are the warm runs), then per version
# python -X importtime -c "import prefill" twice, the script's compile, and bench/startup_probe.py on a cold and
# on the warm caches. Everything under /tmp/res, summarised into $OUT.
set -u
NEW=${NEW:-69590ee}; OLD=${OLD:-218bc62}
P=$PWD/.venv/startup-probe; TOK=$P/tok; R=/tmp/res; CK=/dev/shm/prefill-bench/qwen3-32b-L64-s0
git log --oneline -1 || { echo "NO .git"; exit 3; }
git cat-file -e $OLD^{commit} || { echo "old commit missing"; exit 3; }
mkdir -p $R; rm -rf /tmp/new /tmp/old
tar -xzf $P/new.tgz -C /tmp && git archive --prefix=old/ $OLD | tar -x -C /tmp || exit 3
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > $R/nvidia-smi.txt 2>&1
python3 -c "import json,platform,torch,triton,tokenizers,transformers,os;print(json.dumps(dict(python=platform.python_version(),torch=torch.__version__,cuda=torch.version.cuda,triton=triton.__version__,tokenizers=tokenizers.__version__,transformers=transformers.__version__,cpus=os.cpu_count())))" > $R/versions.json 2>$R/versions.err
declare -A C=([new]=$NEW [old]=$OLD) D=([new]=300 [old]=170)
for v in new old; do
  echo "=== runner $v $(date +%T)"
  ( cd /tmp/$v && XDG_CACHE_HOME=/tmp/xdg-$v TRITON_CACHE_DIR=/tmp/triton-$v timeout 330 python3 bench/run.py \
      --tokenizer $TOK --texts 100 --baseline-texts 0 --skip-gemm --skip-reference --skip-storage \
      --repeat-args '' --repeat-args '' --ckpt-dir $CK --commit ${C[$v]} --out $R/run-$v --results-dir $R/run-$v \
      --work-dir /tmp/work-$v --deadline-s ${D[$v]} > $R/run-$v.stdout 2>&1 ) ; tail -n 25 $R/run-$v.stdout
  cp /tmp/work-$v/*interact.json /tmp/work-$v/*runner_stats.json $R/run-$v/ 2>/dev/null
done
for v in new old; do
  echo "=== imports $v $(date +%T)"
  cd /tmp/$v
  for i in 1 2; do python3 -X importtime -c "import prefill" 2> $R/importtime-$v-$i.txt; done
  python3 -c "import time;s=open('prefill.py').read();t=time.perf_counter();compile(s,'prefill.py','exec');print(time.perf_counter()-t)" > $R/compile-$v.txt
  for i in 1 2 3; do /usr/bin/time -f %e python3 -c "import torch" 2>> $R/import-torch-$v.txt; done
  for i in 1 2 3; do /usr/bin/time -f %e python3 -c "import prefill" 2>> $R/import-prefill-$v.txt; done
  cd - > /dev/null
done
for v in new old; do
  echo "=== probes $v $(date +%T)"
  XDG_CACHE_HOME=/tmp/xdg-$v-cold TRITON_CACHE_DIR=/tmp/triton-$v-cold timeout 120 python3 $P/startup_probe.py --checkout /tmp/$v --model $CK --out $R/probe-$v-cold.json 2> $R/probe-$v-cold.err
  for i in 1 2; do XDG_CACHE_HOME=/tmp/xdg-$v TRITON_CACHE_DIR=/tmp/triton-$v timeout 120 python3 $P/startup_probe.py --checkout /tmp/$v --model $CK --out $R/probe-$v-warm$i.json 2> $R/probe-$v-warm$i.err; done
done
echo "=== summary $(date +%T)"
python3 $P/summarize.py $R $OUT/startup.json
tar -czf $OUT/raw.tgz -C /tmp res --exclude='*.safetensors' 2>/dev/null
ls -la $OUT
