#!/bin/bash
# Issue 36's family records again at the current commit (issue 37: each family within 1.20x of its floor), one device
# command of ~7 min from the checkout's root with .cache carried (the Qwen3 tokenizer in .cache/tokenizer):
#   bash bench/moe_families.sh COMMIT [geometry ...]     (default: the four below; writes $OUT/families.tgz)
# Each: bench/moe_run.py's contest at 48 and 24 GiB (--skip-corpus), 20 texts against transformers bf16, at the cut
# bench/NOTES.md gives (what the machine's RAM and /dev/shm hold beside the reference); the checkpoint is removed
# after each, so that the next fits.
set -u
C=$1; shift
S=/dev/shm/prefill-bench; R=/tmp/families
rm -rf $S $R; mkdir -p $S $R
mount -o remount,size=110G /dev/shm 2>/dev/null
declare -A CUT=([mixtral-8x7b]="--layers 16" [glm-4.5-air]="--layers 10" [gpt-oss-20b]="--mxfp4")
for g in ${@:-qwen1.5-moe-a2.7b mixtral-8x7b glm-4.5-air moonlight-16b-a3b}; do
  timeout 170 python bench/moe_run.py --tokenizer .cache/tokenizer --geometry $g ${CUT[$g]:-} --skip-corpus \
      --reference-texts 20 --ckpt $S/$g --commit $C --out $R/$g@$C.json > $R/$g@$C.log 2>&1
  echo "$g rc=$?"; tail -n 4 $R/$g@$C.log
  rm -rf $S/*
done
tar -czf $OUT/families.tgz -C /tmp families
