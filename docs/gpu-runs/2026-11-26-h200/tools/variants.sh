#!/usr/bin/env bash
# Kernel variants side by side on one GPU: build each in its own copy, check it, bench it (A/B/A/B).
set -uo pipefail
root=$PWD; out=${1:-/tmp/variants}; mkdir -p $out
mk() {  # mk NAME UNROLL MAXTHREADS [base]
  local d=/tmp/v_$1; rm -rf $d; mkdir -p $d; cp -r $root/kvcache $root/csrc $root/setup.py $root/tests $root/pyproject.toml $d/
  if [ "${4:-}" = base ]; then cp $root/.gpu/kvc_page.base.h $d/csrc/kvc_page.h
  else sed -i "s/kCopyUnroll = 4;/kCopyUnroll = $2;/; s/kMaxThreads = 256;/kMaxThreads = $3;/" $d/csrc/kvc_page.h; fi
  rm -f $d/kvcache/_native*.so
  (cd $d && KVCACHE_BUILD_CUDA=1 python3 setup.py build_ext --inplace >$out/build_$1.log 2>&1) || echo "build $1 FAILED"
}
mk base 0 0 base & mk u4 4 256 & mk u2 2 256 & wait
i=0
for v in base u4 u2 base u4; do
  i=$((i+1)); d=/tmp/v_$v; echo "=== $v (round $i)"
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 120 python3 -m kvcache.bench transfer --device cuda --dtypes bf16,fp8 \
     --layouts NL_X_TWO_NB_BS_NH_HS,NL_X_NB_PAGE,NL_X_NB_BS_HS --no-async --out $out/bench_${i}_$v.json 2>&1 | grep -v "^wrote")
done
