#!/usr/bin/env bash
# The GPU checks of the dtype / attention / warm-up / peer work, for device calls, results under $OUT:
#   tests    pytest -m gpu: the dtype x head_dim x backend x (eager, graphs) sweep, Triton + FA4 against the
#            torch reference (pages 16 and 128), nothing compiling after the warm-up  -> $OUT/gpu_tests.log
#   suite    every GPU test: the kernel test files whole (their interpreter tests and bf16 cases run on the
#            GPU), then pytest -m gpu over the rest (engines against transformers, graphs against eager, FP8,
#            speculation)  -> $OUT/gpu_kernel_tests.log, $OUT/gpu_suite.log
#   kernels  benchmarks/kernels_bench.py --prefill-only: Triton vs FA4 prefill / extend / verify
#            -> $OUT/kernels/results.{json,md}
#   peers    benchmarks/peer_compare.py: nano-vllm and llmserve on the same prompts, and with BASELINE=TREE an
#            earlier llmserve checkout too  -> $OUT/peer/{peer_compare.json,peer_compare.md,peer.log}
#   layer    benchmarks/decode_layer_bench.py: a decode layer's small kernels before and after their
#            fusion, checked, then timed in CUDA graphs (about a minute; needs no FA4)  -> $OUT/decode_layer.json
#   spec     pytest -m gpu over the speculative engine and the graph class (graphs == eager, the fused chain
#            step included), then benchmarks/spec_timing.py for the chain (batch 1, 4, 16, 64), a dynamic
#            tree (6 steps x top-4, 32 nodes) and the static eagle-small tree (batch 1, 16)
#            -> $OUT/spec_tests.log, $OUT/spec_timing{,_dynamic,_static}/
#   ngram    pytest -m gpu over prompt lookup (verify graphs == eager == plain), then benchmarks/ngram_timing.py:
#            the ngram step against a decode at batch 1, 16, 64 for 3, 5, 8 drafts, and the host's proposal
#            cost at batch 64 x 32k tokens (about 3 minutes)  -> $OUT/ngram_tests.log, $OUT/ngram_timing/
#   serving  benchmarks/spec_serving.py --quick: closed loops over IPC with speculation on and off (8B shape
#            + dummy draft at concurrency 1, 16, 64, 256; the trained tiny pair at 1 and 8)  -> $OUT/serving/
#   grammar  benchmarks/grammar_mask_cost.py: a JSON-schema mask's cost per decode step at batch 1 and 64
#            (needs xgrammar and its wheels)  -> $OUT/grammar.json
#   profile  benchmarks/decode_profile.py: the decode step at batch 1, 64, 256 against its floor, kernels
#            and idle time  -> $OUT/decode_profile.json
#   moe      tests/test_moe_kernels.py whole (its interpreter tests on the GPU, the Qwen3-30B-A3B shapes bf16 and
#            FP8, graphs against eager), then benchmarks/moe_bench.py (the kernels alone against their floors,
#            about 2-3 minutes)  -> $OUT/moe_tests.log, $OUT/moe_bench.json
#   moee2e   benchmarks/moe_e2e.py: Qwen3-30B-A3B through the engine, bf16 then FP8 (decode at batch 1-256, prefill,
#            the EAGLE-3 step and the policy's choice, against floors of the same run; about 5 minutes, ~70 GB)
#            -> $OUT/moe_e2e/moe_e2e.{json,md}, $OUT/moe_e2e.log
#   fp8      the FP8 kernel and engine GPU tests, then the open FP8 measurement: fp8_tma_tiles.py (one-row a8
#            tiles with TMA weight loads against the engine's kernels, then the batch-1 FP8 step with any
#            winner patched in), and fp8_block_gemm_tiles.py (the block-scaled W8A8 GEMM: cuBLAS's block
#            scaling and the Triton tile against other tiles, then the prefill steps on the Triton tile and
#            any winner), and fp8_skinny_gemm.py (17-128 rows: the tables' GEMV tiles against cuBLAS's FP8 GEMM,
#            per channel and per block)
#            -> $OUT/fp8_tests.log, $OUT/fp8_tma.json, $OUT/fp8_block_gemm.json, $OUT/fp8_skinny.json
#   kv1      issue 62's shape (one KV head, vocab 512, a 64-token budget) on every backend x dtype x (eager, graphs):
#            tests/test_gpu_one_kv_head.py; a failure is rerun alone with LLMSERVE_CHECK_INDICES=1 and
#            CUDA_LAUNCH_BLOCKING=1 (a bad index named on the host), then without PDL, async scheduling or the
#            warm-up  -> $OUT/kv1.log, $OUT/kv1_checked.log
#   gpusuite the whole `pytest -m gpu` (SUITE_TIMEOUT s, default 450; issue 62's shape file in a second process,
#            last), with the pass / skip / fail counts and every test's duration
#            -> $OUT/gpu_suite.{log,xml,md,json}, $OUT/kv1.log
#   fuzz     benchmarks/gpu_fuzz.py for FUZZ_BUDGET s (default 100): seeded random engines against transformers
#            (float32) or the torch backend (bf16 / fp16), a worker process per crash  -> $OUT/fuzz/fuzz.{json,md}
#   issue62  gpusuite (issue 62's shape tests among them; their failures rerun checked, as kv1 does), then fuzz for
#            what is left of the call (CALL_BUDGET s, default 570, minus the suite; FUZZ_BUDGET overrides it)
# Usage (repo root, FA4 unpacked, the flash_attn shim and the wheels installed, PYTHONPATH set; see
# benchmarks/README.md, "Running on a GPU"): bash benchmarks/gpu_checks.sh [STAGE ...]   (default: tests kernels peers)
# Each stage's exit status is reported; the script exits non-zero if any stage failed.
set -uo pipefail
out=${OUT:?OUT must name the folder for results}
stages=${*:-tests kernels peers}
# A device copy of the tree may carry a stale .git: a .commit file written before the call names the commit.
commit=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
declare -A status
card=$(python3 -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null || echo "no CUDA device")

# Rerun issue 62's shape tests that failed, each in a fresh process (a device-side assert spoils the rest of
# its own): with the index checks on and synchronous launches, so the first bad index is named on the host or
# the failing kernel shows in the traceback; then without PDL, async scheduling or the warm-up, which tells
# what part of the default path the failure needs (the first three failures only: each costs a minute).
kv1_rerun_checked() {
  local failed t variant
  failed=$(grep -oE "^FAILED tests/test_gpu_one_kv_head.py::[^ ]+" "$1" | sed 's/^FAILED //' | head -3 || true)
  for t in $failed; do
    for variant in "LLMSERVE_CHECK_INDICES=1 CUDA_LAUNCH_BLOCKING=1" "LLMSERVE_PDL=0" \
        'LLMSERVE_KV1_OVERRIDES={"async_scheduling":false}' 'LLMSERVE_KV1_OVERRIDES={"warmup":false}'; do
      echo "== $t with $variant" >> "$out/kv1_checked.log"
      env $variant timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=long "$t" >> "$out/kv1_checked.log" 2>&1
    done
  done
  [ -z "$failed" ] || grep -E "^== |IndexCheckError|[0-9]+ (passed|failed)" "$out/kv1_checked.log" | tail -40
}

kv1() {
  python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_gpu_one_kv_head.py > "$out/kv1.log" 2>&1
  status[$stage]=$?
  grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$out/kv1.log" | tail -20
  kv1_rerun_checked "$out/kv1.log"
}

gpusuite() {
  # Every GPU test: issue 62's shape file in a process of its own, last (a device-side assert would fail every
  # test after it in the same process), the rest in one. SIGINT past SUITE_TIMEOUT still writes the XML, so the
  # counts and durations of what ran come back.
  local t0=$SECONDS s1 s2
  timeout -s INT -k 30 "${SUITE_TIMEOUT:-450}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs --durations=25 \
    --junitxml="$out/gpu_suite.xml" --ignore=tests/test_gpu_one_kv_head.py tests/ > "$out/gpu_suite.log" 2>&1
  s1=$?
  local left=$(( ${SUITE_TIMEOUT:-450} + 90 - (SECONDS - t0) ))
  timeout -s INT -k 30 $(( left > 120 ? left : 120 )) python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    --junitxml="$out/gpu_suite_kv1.xml" tests/test_gpu_one_kv_head.py > "$out/kv1.log" 2>&1
  s2=$?
  [ "$s1" = 0 ] && [ "$s2" = 0 ]; status[$stage]=$?
  tail -40 "$out/gpu_suite.log"; tail -5 "$out/kv1.log"
  python3 benchmarks/pytest_summary.py "$out/gpu_suite.xml" "$out/gpu_suite_kv1.xml" "$out/gpu_suite" \
    --title "pytest -m gpu" --card "$card" --commit "$commit" || status[$stage]=1
  [ -z "${kv1_checked_rerun:-}" ] || kv1_rerun_checked "$out/kv1.log"
}

fuzz() {
  python3 benchmarks/gpu_fuzz.py --budget "${FUZZ_BUDGET:-100}" --out "$out/fuzz" > "$out/fuzz.log" 2>&1
  status[$stage]=$?
  grep -E "^seed .*FAILED|cases \(seeds" "$out/fuzz.log" | tail -20
}

for stage in $stages; do
  start=$SECONDS
  case $stage in
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_dtypes.py tests/test_warmup.py \
        tests/test_kernels.py -k "gpu_dtypes or backend_decodes or nothing_compiles or fa4 or flash" \
        2>&1 | tee "$out/gpu_tests.log" | tail -40
      status[$stage]=${PIPESTATUS[0]} ;;
    suite)
      # The kernel test files run whole: their interpreter tests run on the GPU where one is present, and
      # the bfloat16 cases the interpreter cannot run exist only there. Elsewhere, the tests marked gpu.
      kernel_files="tests/test_gemv.py tests/test_kernels.py tests/test_fp8_kernels.py tests/test_qk_norm_rope.py
                    tests/test_decode_rows.py tests/test_stream_gemv.py tests/test_sampling_kernel.py"
      python3 -m pytest -q -p no:cacheprovider $kernel_files > "$out/gpu_kernel_tests.log" 2>&1
      status[$stage]=$?; tail -3 "$out/gpu_kernel_tests.log"
      # --continue-on-collection-errors: the device lacks the HTTP frontend's packages (openai, starlette),
      # whose modules hold no GPU tests; one missing import must not stop the rest.
      python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests/ \
        $(printf -- "--ignore=%s " $kernel_files) \
        > "$out/gpu_suite.log" 2>&1 || status[$stage]=1
      tail -25 "$out/gpu_suite.log" ;;
    kernels)
      python3 benchmarks/kernels_bench.py "$out/kernels" --prefill-only --budget-s 150 --commit "$commit"
      status[$stage]=$? ;;
    peers)
      python3 benchmarks/peer_compare.py --peer .peer --out "$out/peer" ${BASELINE:+--baseline "$BASELINE"}
      status[$stage]=$? ;;
    layer)
      python3 benchmarks/decode_layer_bench.py "$out/decode_layer.json" --budget-s 80
      status[$stage]=$? ;;
    spec)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_speculative_engine.py tests/test_batch_builder.py \
        > "$out/spec_tests.log" 2>&1
      status[$stage]=$?; tail -3 "$out/spec_tests.log"
      python3 benchmarks/spec_timing.py --out "$out/spec_timing" --commit "$commit" --iters 20 > "$out/spec_timing.log" 2>&1 \
        && python3 benchmarks/spec_timing.py --out "$out/spec_timing_dynamic" --commit "$commit" --iters 20 \
             --batch-sizes 1,16 --dynamic-tree 6,4,32 > "$out/spec_timing_dynamic.log" 2>&1 \
        && python3 benchmarks/spec_timing.py --out "$out/spec_timing_static" --commit "$commit" --iters 20 \
             --batch-sizes 1,16 --tree eagle-small > "$out/spec_timing_static.log" 2>&1
      [ $? = 0 ] || status[$stage]=1
      grep -h "^| " "$out"/spec_timing*/spec_timing.md ;;
    ngram)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ngram_engine.py > "$out/ngram_tests.log" 2>&1
      status[$stage]=$?; tail -3 "$out/ngram_tests.log"
      python3 benchmarks/ngram_timing.py --out "$out/ngram_timing" --commit "$commit" > "$out/ngram_timing.log" 2>&1
      [ $? = 0 ] || status[$stage]=1
      grep -h "^| \|^- host" "$out/ngram_timing/ngram_timing.md" ;;
    serving)
      python3 benchmarks/spec_serving.py --out "$out/serving" --quick --commit "$commit" > "$out/serving.log" 2>&1
      status[$stage]=$?; grep "^| " "$out/serving/spec_serving.md" ;;
    grammar)
      python3 benchmarks/grammar_mask_cost.py --out "$out/grammar.json" > "$out/grammar.log" 2>&1
      status[$stage]=$?; tail -16 "$out/grammar.log" ;;
    profile)
      python3 benchmarks/decode_profile.py --label "$commit" --out "$out/decode_profile.json" --batches 1,64,256 \
        --steps 40 > "$out/decode_profile.log" 2>&1
      status[$stage]=$?; tail -8 "$out/decode_profile.log" ;;
    moe)
      python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernels.py > "$out/moe_tests.log" 2>&1
      status[$stage]=$?; tail -5 "$out/moe_tests.log"
      python3 benchmarks/moe_bench.py --commit "$commit" --out "$out/moe_bench.json" > "$out/moe_bench.log" 2>&1 \
        || status[$stage]=1
      tail -25 "$out/moe_bench.log" ;;
    moee2e)
      python3 benchmarks/moe_e2e.py --commit "$commit" --out "$out/moe_e2e" > "$out/moe_e2e.log" 2>&1
      status[$stage]=$?; tail -32 "$out/moe_e2e.log" ;;
    fp8)
      python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_gpu_fp8.py > "$out/fp8_tests.log" 2>&1
      status[$stage]=$?; tail -3 "$out/fp8_tests.log"
      python3 benchmarks/fp8_tma_tiles.py --commit "$commit" --out "$out/fp8_tma.json" > "$out/fp8_tma.log" 2>&1 \
        || status[$stage]=1
      tail -30 "$out/fp8_tma.log"
      python3 benchmarks/fp8_block_gemm_tiles.py --commit "$commit" --out "$out/fp8_block_gemm.json" \
        > "$out/fp8_block_gemm.log" 2>&1 || status[$stage]=1
      tail -20 "$out/fp8_block_gemm.log"
      python3 benchmarks/fp8_skinny_gemm.py --commit "$commit" --rows 17,32,64,128 --scales channel,block \
        --out "$out/fp8_skinny.json" > "$out/fp8_skinny.log" 2>&1 || status[$stage]=1
      grep -v "^    [a-z0-9_]*:" "$out/fp8_skinny.log" | tail -32 ;;
    kv1)
      kv1 ;;
    gpusuite)
      gpusuite ;;
    fuzz)
      fuzz ;;
    issue62)
      kv1_checked_rerun=1
      gpusuite; suite_status=${status[$stage]}
      # the fuzzer gets what is left of a 10-minute call (CALL_BUDGET s), at least a minute
      left=$(( ${CALL_BUDGET:-570} - (SECONDS - start) - 20 ))
      FUZZ_BUDGET=${FUZZ_BUDGET:-$(( left > 60 ? left : 60 ))} fuzz
      [ "$suite_status" = 0 ] && [ "${status[$stage]}" = 0 ]; status[$stage]=$? ;;
    *) echo "unknown stage $stage (tests, suite, kernels, peers, layer, spec, ngram, serving, grammar, profile, fp8, moe, moee2e, kv1, gpusuite, fuzz, issue62)"; status[$stage]=2 ;;
  esac
  echo "== $stage: exit ${status[$stage]} in $((SECONDS - start)) s (commit $commit)"
done
for stage in $stages; do [ "${status[$stage]}" = 0 ] || exit 1; done
