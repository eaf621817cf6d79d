#!/usr/bin/env bash
# The GPU checks of the dtype / attention / warm-up / peer work, for device calls, results under $OUT:
#   tests    pytest -m gpu: the dtype x head_dim x backend x (eager, graphs) sweep, Triton + FA4 against the
#            torch reference (pages 16 and 128), nothing compiling after the warm-up  -> $OUT/gpu_tests.log
#   kernels  benchmarks/kernels_bench.py --prefill-only: Triton vs FA4 prefill / extend / verify
#            -> $OUT/kernels/results.{json,md}
#   peers    benchmarks/peer_compare.py: nano-vllm and llmserve on the same prompts
#            -> $OUT/peer/{peer_compare.json,peer_compare.md,peer.log}
#   layer    benchmarks/decode_layer_bench.py: a decode layer's small kernels before and after their
#            fusion, checked, then timed in CUDA graphs (about a minute; needs no FA4)  -> $OUT/decode_layer.json
# Usage (repo root, FA4 unpacked, the flash_attn shim and the wheels installed, PYTHONPATH set; see
# README "GPU checks"): bash benchmarks/gpu_checks.sh [tests] [kernels] [peers] [layer]   (default: the first three)
# Each stage's exit status is reported; the script exits non-zero if any stage failed.
set -uo pipefail
out=${OUT:?OUT must name the folder for results}
stages=${*:-tests kernels peers}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
declare -A status
for stage in $stages; do
  start=$SECONDS
  case $stage in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_dtypes.py tests/test_warmup.py \
        tests/test_kernels.py -k "gpu_dtypes or backend_decodes or nothing_compiles or fa4 or flash" \
        2>&1 | tee "$out/gpu_tests.log" | tail -40
      status[$stage]=${PIPESTATUS[0]} ;;
    kernels)
      python3 benchmarks/kernels_bench.py "$out/kernels" --prefill-only --budget-s 150 --commit "$commit"
      status[$stage]=$? ;;
    peers)
      python3 benchmarks/peer_compare.py --peer .peer --out "$out/peer"
      status[$stage]=$? ;;
    layer)
      python3 benchmarks/decode_layer_bench.py "$out/decode_layer.json" --budget-s 80
      status[$stage]=$? ;;
    *) echo "unknown stage $stage (tests, kernels, peers, layer)"; status[$stage]=2 ;;
  esac
  echo "== $stage: exit ${status[$stage]} in $((SECONDS - start)) s (commit $commit)"
done
for stage in $stages; do [ "${status[$stage]}" = 0 ] || exit 1; done
