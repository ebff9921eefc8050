#!/usr/bin/env bash
# One device call: kernel tests on the GPU, then the benchmarks; logs and JSON under $OUT.
# usage (device): bash bench/gpu_suite.sh [probe] [layout] [parts] [pass0] [sequence] [gap] [profile] [fused] [attention] [decode] [tests] [check] [offload_tests] [offload] [stalls]
# ATTENTION_ARGS, SEQUENCE_ARGS, PROBE_ARGS, ... (env) pass extra arguments to a bench (e.g. --flush read);
# DECODE_ARGS (env) passes extra arguments to the decode bench, e.g. --attn-cfg '{"waves": 4, ...}'.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the ctxcache namespace without pip: a folder of links mirroring setup.py's mapping
SHIM=/tmp/ctxshim/ctxcache; rm -rf /tmp/ctxshim; mkdir -p $SHIM
for f in core/*; do ln -s "$PWD/$f" "$SHIM/$(basename $f)"; done
for p in bench decoder indexer store service; do ln -sfn "$PWD/$p" "$SHIM/$p"; done
export PYTHONPATH=/tmp/ctxshim
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for what in "${@:-tests attention}"; do
  case $what in
    tests) python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels 2>&1 | tee "$OUT/tests.log" | tail -5 ;;
    probe) python3 -m ctxcache.bench.step_probe --out "$OUT" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log" ;;
    layout) python3 -m ctxcache.bench.kv_layout_probe --out "$OUT" ${LAYOUT_ARGS:-} 2>&1 | tee "$OUT/layout.log" ;;
    sequence) python3 -m ctxcache.bench.layer_sequence --out "$OUT" ${SEQUENCE_ARGS:-} 2>&1 | tee "$OUT/sequence.log" ;;
    pass0) python3 -m ctxcache.bench.pass0_attention_probe --out "$OUT" ${PASS0_ARGS:-} 2>&1 | tee "$OUT/pass0.log" ;;
    parts) python3 -m ctxcache.bench.attn_parts_probe --out "$OUT" ${PARTS_ARGS:-} 2>&1 | tee "$OUT/parts.log" ;;
    gap) python3 -m ctxcache.bench.attention_gap --out "$OUT" 2>&1 | tee "$OUT/gap.log" ;;
    profile) python3 -m ctxcache.bench.profile_decode --out "$OUT" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" ;;
    fused) python3 -m ctxcache.bench.fused_tune --out "$OUT" ${FUSED_ARGS:-} 2>&1 | tee "$OUT/fused.log" ;;
    attention) python3 -m ctxcache.bench.attention --out "$OUT" ${ATTENTION_ARGS:-} 2>&1 | tee "$OUT/attention.log" ;;
    decode) eval python3 -m ctxcache.bench.decode --out "$OUT" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" ;;
    offload_tests) python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/kernels/test_offload_attention.py 2>&1 | tee "$OUT/offload_tests.log" | tail -5 ;;
    offload) python3 -m ctxcache.bench.offload --out "$OUT" 2>&1 | tee "$OUT/offload.log" ;;
    stalls)  # ncu warp-stall sampling per SASS line of the selection kernels, 128K, batch 8 and 1 (CSV)
      for b in 8 1; do
        ncu --clock-control none -k regex:'dense_score|pass1|collect16' --launch-skip 3 --launch-count 3 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
          --section SourceCounters -f -o /tmp/ncu_b$b python3 -m ctxcache.bench.profile_step --batch $b > /dev/null
        ncu -i /tmp/ncu_b$b.ncu-rep --page details --csv > "$OUT/ncu_b${b}_details.csv"
        ncu -i /tmp/ncu_b$b.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_b${b}_sass.csv"
      done ;;
    check) python3 -m ctxcache.decoder.gpu.check --out "$OUT" 2>&1 | grep -v "it/s" | tee "$OUT/check.log" ;;
  esac
done
