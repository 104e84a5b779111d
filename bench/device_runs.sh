#!/usr/bin/env bash
# The GPU runs behind bench/results/*h200*, from the repository root. On a 4 x H200 machine:
#   OUT=/some/dir bash bench/device_runs.sh pipeline   # PP=4: ours and 1F1B one adapter, bubble vs global batches
#   OUT=/some/dir bash bench/device_runs.sh pp2_tp2    # PP=2 vs 1 GPU || TP=2 vs 1 GPU serving
#   OUT=/some/dir bash bench/device_runs.sh singles    # one job per GPU, side by side
# On one H200, one call each (10-minute calls): kernels, train, serve; on 2 x H200: two_gpus.
# Jobs that share the machine run on separate GPUs (CUDA_VISIBLE_DEVICES); each JSON names its GPU.
# Needs highspy (the MILP) importable; logs go to $OUT/log_<name>.txt.
set -u
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
LIMIT=${LIMIT:-560}
JIT_CACHE=/tmp/jaxlora_serve_jit_cache  # jax's persistent compile cache (.jitcache unpacked into it)

job() {  # job NAME GPUS SECONDS COMMAND...: one background job, its output in $OUT/log_NAME.txt; with
  # PIN=1 a one-GPU job runs on its own quarter of the CPU cores (taskset), so one job's compile does
  # not slow another's host-bound steps (the 15:10 run: the guard's base decode step 5.7 -> 11.1 ms
  # beside three compiling jobs)
  local name=$1 gpus=$2 seconds=$3 pin=()
  shift 3
  if [ "${PIN:-0}" = 1 ] && command -v taskset >/dev/null; then
    local n; n=$(nvidia-smi -L 2>/dev/null | wc -l); [ "${n:-0}" -gt 0 ] || n=4  # a share per GPU of the machine
    local per=$(($(nproc) / n)); pin=(taskset -c $((gpus * per))-$((gpus * per + per - 1)))
  fi
  (CUDA_VISIBLE_DEVICES=$gpus timeout "$seconds" "${pin[@]}" "$@" >"$OUT/log_$name.txt" 2>&1
   echo "[$name exit $?]" >>"$OUT/log_$name.txt") &
}

# The README's engine sizes for jaxlora-serve (bench/cold_start.py's --server-args)
README_SIZES="--max-adapters-on-device 64 --max-lora-rank 16 --max-num-seqs 256 --max-num-batched-tokens 2048 \
--max-model-len 1024"

server_wheels() {  # the server's wheels (.whl, carried) into /tmp/site, on PYTHONPATH
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
}

collect_logs() {  # the logs as one file (what comes back from the machine is limited in files)
  for f in "$OUT"/log_*.txt; do echo "=== $f"; cat "$f"; done >"$OUT/logs_$1.txt"
  rm -f "$OUT"/log_*.txt
  tail -n 60 "$OUT/logs_$1.txt"
}

pipeline() {  # PP=4 on 4 GPUs: our schedule and 1F1B one adapter, 4 global batches, balanced split; then
  # ours at 2 and 8 global batches, and ours with the old hand-over between GPUs (the last skipped first if
  # --time-budget runs short). ~6-7 min on 4 x H200.
  nvidia-smi -L
  # carry .whl alone (its py312/highspy, 8 MB, and .jitcache together pass the 64 MiB carry limit); jobs importing
  # train.data need the server wheels installed into /tmp/site first (gguf, via the vision loader)
  python3 -c "import highspy" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/.whl/py312  # carried: .whl/py312/highspy
  python3 -c "import highspy; print('highspy', highspy.__file__)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  timeout $((LIMIT - SECONDS - 5)) python3 bench/pipeline.py --stages 4 --workloads xsum mixed --batches 4 \
      --sweep-batches 2 8 --compare-copies --time-budget $((LIMIT - SECONDS - 40)) \
      --out "$OUT/pipeline_4xh200.json" 2>&1 | tee "$OUT/log_pp4.txt"
  collect_logs pipeline
}

pp2_tp2() {  # on 4 GPUs: PP=2 vs 1 GPU (GPUs 0,1) || TP=2 vs 1 GPU serving (GPUs 2,3)
  nvidia-smi -L
  job pp2 0,1 $((LIMIT - SECONDS)) python3 bench/pipeline.py --stages 2 1 --variants ours --workloads xsum wikisum \
      --batches 2 --out "$OUT/pipeline_2xh200.json"
  job tp2 2,3 $((LIMIT - SECONDS)) python3 bench/tp_serve.py --out "$OUT/tp_serve_2xh200.json"
  wait
  collect_logs pp2_tp2
}

singles() {
  nvidia-smi -L
  job kernels 0 $((LIMIT - 10)) bash -c "python3 -m pytest -q -m gpu_only tests/pallas_kernels \
      tests/jaxlora/lora/test_multi_adapter_batch_gpu.py -p no:cacheprovider; \
      python3 -m pallas_kernels.tune --plan quick --time-budget 240 && cp pallas_kernels/tile_table.json $OUT/"
  job train 1 $((LIMIT - 10)) bash -c "python3 bench/train.py --layers 8 --capacity 4096 \
      --variants jaxlora jaxlora-xla sequential --out $OUT/train_h200_jax.json; \
      python3 bench/train.py --layers 8 --capacity 4096 --variants peft-best peft-padded --out $OUT/train_h200_peft.json"
  job serve 2 $((LIMIT - 10)) python3 bench/serve.py --time-budget $((LIMIT - 90)) --out "$OUT/serve_h200.json"
  job fused 3 $((LIMIT - 10)) python3 bench/fused_lora.py --name fused_lora_h200 --out "$OUT" --budget-s 420
  wait
  collect_logs singles
}

kernels() {  # one GPU: the GPU tests, then the tile profiler for this device; 4-stage replay last
  nvidia-smi -L
  timeout 240 python3 -m pytest -q -m gpu_only tests/pallas_kernels tests/jaxlora/lora/test_multi_adapter_batch_gpu.py \
      tests/jaxlora/test_gpu_forward.py -p no:cacheprovider 2>&1 | tee "$OUT/log_gpu_tests.txt" | tail -n 25
  timeout $((LIMIT - SECONDS - 150)) python3 -m pallas_kernels.tune --time-budget $((LIMIT - SECONDS - 200)) \
      --out "$OUT/tile_table.json" --log "$OUT/tune_log.json" 2>&1 | tail -n 20
  timeout $((LIMIT - SECONDS - 5)) python3 bench/pipeline.py --stages --simulate-stages 4 --workloads xsum mixed \
      --out "$OUT/pipeline_sim4_h200.json" 2>&1 | tail -n 12
}

train() {  # one GPU: the flash attention tests, jaxlora vs sequential jobs (JAX), then HF+PEFT
  nvidia-smi -L
  python3 -c "import jax; a = jax.typeof(jax.numpy.ones(2)); print('jax', jax.__version__, 'aval.mat', hasattr(a, 'mat'), 'aval.vma', hasattr(a, 'vma'))"
  timeout 120 python3 -m pytest -q tests/pallas_kernels/test_attention.py -p no:cacheprovider 2>&1 | tail -n 3
  timeout $((LIMIT - SECONDS - 130)) python3 bench/train.py --layers 8 --capacity 4096 --breakdown --profile onehot \
      --variants jaxlora jaxlora-xla sequential --workloads wikisum xsum cnndm mixed \
      --out "$OUT/train_h200_jax.json" 2>&1 | grep -v "cuda_timer\\|Warning" | tail -n 45
  timeout $((LIMIT - SECONDS - 5)) python3 bench/train.py --layers 8 --capacity 4096 --variants peft-best peft-padded \
      --out "$OUT/train_h200_peft.json" 2>&1 | tail -n 20
}

fused_and_profile() {  # one GPU: the fused LoRA kernel benchmark (all shapes), then a profile of the train step
  nvidia-smi -L
  timeout 330 python3 bench/fused_lora.py --name fused_lora_h200 --out "$OUT" --budget-s 300 2>&1 \
      | grep -v "cuda_timer\|Warning" | tail -n 30
  timeout $((LIMIT - SECONDS - 5)) python3 bench/train.py --layers 8 --capacity 4096 --profile onehot fused \
      --variants --out "$OUT/train_profile_h200.json" 2>&1 | grep -v "cuda_timer\|Warning" | tail -n 30
}

train_xla_flags() {  # one GPU: the grad step's profile and one workload, without and with XLA's dynamic-slice fusion
  nvidia-smi -L
  for flags in "" "--xla_gpu_enable_dynamic_slice_fusion=true"; do
    echo "=== XLA_FLAGS=$flags"
    XLA_FLAGS="$flags" timeout 200 python3 bench/train.py --layers 8 --capacity 4096 --profile onehot \
        --variants jaxlora-xla --workloads mixed --out "$OUT/train_flags${flags:+_dsf}_h200.json" 2>&1 \
        | grep -v "cuda_timer\\|Warning" | tail -n 16
  done
}

train_gemm() {  # one GPU: where the backward GEMMs run, with and without XLA's Triton GEMMs
  nvidia-smi -L
  local left=2
  for flags in "" "--xla_gpu_enable_triton_gemm=false"; do
    echo "=== XLA_FLAGS=$flags"
    XLA_FLAGS="$flags" timeout $(((LIMIT - SECONDS - 5) / left--)) python3 bench/train.py \
        --layers 8 --capacity 4096 --profile onehot --variants jaxlora-xla --workloads wikisum mixed \
        --out "$OUT/train_gemm${flags:+_notriton}_h200.json" 2>&1 | grep -v "cuda_timer\\|Warning" | tail -n 17
  done
}

serve() {  # one GPU: the serving benchmark (engine sized like vLLM's), a 256-request saturation case, the HF peer
  nvidia-smi -L
  timeout 430 python3 bench/serve.py --requests 64 --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 \
      --prefill-chunk 2048 \
      --cases punica:distinct "slora:n=1000,alpha=1,cv=1,mode=throughput" punica:identical punica:uniform punica:skewed \
      "punica:identical,requests=256" --time-budget 400 --out "$OUT/serve_h200.json" 2>&1 \
      | grep -v "cuda_timer\\|Warning" | tail -n 40
  timeout 140 python3 bench/serve_hf_peer.py --requests 64 --out "$OUT/serve_hf_peer_h200.json" 2>&1 | tail -n 12
}

serve_profile() {  # one GPU: per-kernel time of one engine step (decode of 32/64/256 rows, mixed), base vs hybrid LoRA,
  # and the matmul-only decode step at the same row counts
  nvidia-smi -L
  timeout $((LIMIT - 5)) python3 bench/serve.py --profile --lora-backend hybrid \
      --out "$OUT/serve_profile_h200.json" 2>&1 | grep -v "cuda_timer\\|Warning" | tail -n 80
  rm -rf "$OUT/serve_profile_traces"
}

serve_tune() {  # one GPU: tile-table entries for the serving step's BGMV shapes (k = 14336; n = 1024, 14336)
  nvidia-smi -L
  timeout $((LIMIT - 5)) python3 -m pallas_kernels.tune --plan serve --time-budget 150 \
      --out "$OUT/tile_table.json" --log "$OUT/tune_serve_log.json" 2>&1 | tail -n 20
}

train_and_serve() {  # one GPU, one call: the training benchmark (JAX, then PEFT), then serving cases
  nvidia-smi -L
  timeout 200 python3 bench/train.py --layers 8 --capacity 4096 --variants jaxlora jaxlora-xla sequential \
      --out "$OUT/train_h200_jax.json" 2>&1 | grep -v cuda_timer | tail -n 14
  timeout 120 python3 bench/train.py --layers 8 --capacity 4096 --variants peft-best peft-padded \
      --out "$OUT/train_h200_peft.json" 2>&1 | tail -n 10
  timeout $((LIMIT - SECONDS - 5)) python3 bench/serve.py --requests 64 --time-budget $((LIMIT - SECONDS - 40)) \
      --cases punica:distinct punica:uniform punica:skewed punica:identical "slora:n=1000,alpha=1,cv=1,mode=throughput" \
      --out "$OUT/serve_h200.json" 2>&1 | grep -v cuda_timer | tail -n 16
}

compile_probe() {  # 4 GPUs: bench/compile_time.py per variant (default with XLA's phase timers, no GEMM
  # autotuning, layers as a scan, half the KV pool), one GPU each
  nvidia-smi -L
  local t=$((LIMIT - 20))
  job default 0 $t env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,nvptx_compiler=1 \
      python3 bench/compile_time.py --label default --out "$OUT/compile_default.jsonl" "$@"
  job noautotune 1 $t env XLA_FLAGS=--xla_gpu_autotune_level=0 \
      python3 bench/compile_time.py --label noautotune --out "$OUT/compile_noautotune.jsonl" "$@"
  job scan 2 $t python3 bench/compile_time.py --label scan --layers-as scan --out "$OUT/compile_scan.jsonl" "$@"
  job mem05 3 $t python3 bench/compile_time.py --label mem05 --memory 0.5 --out "$OUT/compile_mem05.jsonl" "$@"
  wait
  grep -a "time:\|remat\|RESOURCE\|Out of memory" "$OUT/log_default.txt" | head -n 400 >"$OUT/log_default_timers.txt"
  grep -av "^I[0-9]\{4\} " "$OUT/log_default.txt" >"$OUT/default.tmp"; mv "$OUT/default.tmp" "$OUT/log_default.txt"
  collect_logs compile_probe
}

scan_probe() {  # 4 GPUs: the layers as a scan with XLA flags that may let the GEMMs read the stacked
  # weights in place (no per-layer copy), against the unrolled layers; one GPU each
  nvidia-smi -L
  local t=$((LIMIT - 20)) p="--programs base_decode64 lora_decode64 lora_mixed256 base_mixed2048"
  job unrolled 0 $t python3 bench/compile_time.py --label unrolled --out "$OUT/scan_unrolled.jsonl" $p "$@"
  job scan 1 $t python3 bench/compile_time.py --label scan --layers-as scan --out "$OUT/scan_scan.jsonl" $p "$@"
  job dsfusion 2 $t env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python3 bench/compile_time.py \
      --label scan_dsfusion --layers-as scan --out "$OUT/scan_dsfusion.jsonl" $p "$@"
  job tritonany 3 $t env XLA_FLAGS=--xla_gpu_triton_gemm_any=true python3 bench/compile_time.py \
      --label scan_tritonany --layers-as scan --out "$OUT/scan_tritonany.jsonl" $p "$@"
  wait
  collect_logs scan_probe
}

fallback_probe() {  # 4 GPUs: XLA's Triton GEMMs without the cuBLAS fallback (a Triton GEMM fusion reads a
  # dynamic slice of the stacked weights in place; cuBLAS needs it copied out), scan vs unrolled
  nvidia-smi -L
  local t=$((LIMIT - 20)) p="--programs base_decode64 lora_decode64 lora_mixed256 base_mixed2048"
  local f=--xla_gpu_cublas_fallback=false
  job scan_nofb 0 $t env XLA_FLAGS=$f python3 bench/compile_time.py --label scan_nofallback --layers-as scan \
      --out "$OUT/fb_scan.jsonl" $p "$@"
  job unrolled_nofb 1 $t env XLA_FLAGS=$f python3 bench/compile_time.py --label unrolled_nofallback \
      --layers-as unrolled --out "$OUT/fb_unrolled.jsonl" $p "$@"
  job scan_nofb_ds 2 $t env XLA_FLAGS="$f --xla_gpu_enable_dynamic_slice_fusion=true" python3 bench/compile_time.py \
      --label scan_nofallback_dsfusion --layers-as scan --out "$OUT/fb_scan_ds.jsonl" $p "$@"
  job scan_nofb_more 3 $t env XLA_FLAGS=$f python3 bench/compile_time.py --label scan_nofallback_more --layers-as scan \
      --out "$OUT/fb_scan_more.jsonl" --programs base_decode32 window_decode64 lora_decode128 window_mixed2048 "$@"
  wait
  collect_logs fallback_probe
}

autotune_probe() {  # 4 GPUs: the unrolled layers' compile is XLA's GEMM autotuning (config-assigner, 38 of
  # 43 s): cheaper autotuning levels. (Its fourth job, unrolled layers indexing the stack with an
  # opaque layer number, ran out of memory on the copies and was removed; NOTES_serve.md issue 35.)
  nvidia-smi -L
  local t=$((LIMIT - 20)) p="--programs base_decode64 lora_decode64 lora_mixed256"
  job unrolled 0 $t python3 bench/compile_time.py --label unrolled --layers-as unrolled --out "$OUT/at_unrolled.jsonl" $p "$@"
  job level1 1 $t env XLA_FLAGS=--xla_gpu_autotune_level=1 python3 bench/compile_time.py --label autotune1 \
      --layers-as unrolled --out "$OUT/at_level1.jsonl" $p "$@"
  job level2 2 $t env XLA_FLAGS=--xla_gpu_autotune_level=2 python3 bench/compile_time.py --label autotune2 \
      --layers-as unrolled --out "$OUT/at_level2.jsonl" $p "$@"
  wait
  collect_logs autotune_probe
}

cold_start() {  # one GPU: bench/cold_start.py (the real server: cold and warm compile cache) with the
  # server's wheels carried in .whl (bench/server_wheels.txt); extra arguments go to cold_start.py
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || return 1
  PYTHONPATH=.:/tmp/site timeout $((LIMIT - 10)) python3 bench/cold_start.py --after-ready 60 --deadline $((LIMIT - 25)) \
      --out "$OUT/cold_start_$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}').json" \
      "$@" 2>&1 | tail -n 20
}

many_adapters() {  # 4 x H200, issue 34 in one call: GPU 0 the regression guard's serving trace
  # (bench/regress.py --only serve), GPU 1 the 100-request distinct trace then the GPU kernel tests,
  # GPU 2 Compress-then-Serve (1000 adapters, uncompressed beside compressed), GPU 3 the guard's
  # slora_disk n=2000 case. Needs .jitcache carried; everything comes back as many_adapters.tgz, and
  # the guard's compile cache as jitcache.partNN (carry it as .jitcache next time).
  nvidia-smi -L
  local final=$OUT work=/tmp/many_adapters
  mkdir -p $work/regress $work/slora && OUT=$work
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  cp -r /tmp/jaxlora_serve_jit_cache /tmp/jc_regress  # the guard's own cache comes back as .jitcache parts
  job regress 0 $((LIMIT - 20)) python3 bench/regress.py --only serve --out-dir $work/regress \
      --compile-cache /tmp/jc_regress
  job serve100_tests 1 $((LIMIT - 20)) bash -c "python3 bench/serve.py --lora-backend hybrid --max-num-seqs 256 \
      --token-budget 2048 --prefill-chunk 2048 --requests 100 --cases punica:distinct --out $work/serve100_h200.json; \
      python3 -m pytest -q -rA -m gpu_only tests/pallas_kernels -p no:cacheprovider > $work/gpu_tests_h200.txt 2>&1"
  job compress 2 $((LIMIT - 20)) python3 bench/compress_serve.py --requests 300 --out $work/compress_serve_h200.json
  job slora 3 $((LIMIT - 20)) python3 bench/regress.py --only slora_disk --out-dir $work/slora
  wait
  collect_logs many_adapters
  OUT=$final
  tar czf "$OUT/many_adapters.tgz" -C $work .
  python3 bench/jit_cache.py pack /tmp/jc_regress "$OUT/jitcache"
}

serve_check() {  # one H200: the guard's serving trace, the merged-mode switch under block sweeps, then
  # the server's cold start (wheels in .whl carried); sequential, each result in $OUT
  nvidia-smi -L
  timeout 240 python3 bench/regress.py --only serve --out-dir "$OUT" 2>&1 | grep -v cuda_timer | tail -n 40
  rm -f "$OUT/regress_serve.png" "$OUT/regress_log.txt"
  timeout 100 python3 bench/merge_switch.py --repeats 6 --blocks 16,256,4 32,512,4 32,256,2 16,512,4 32,128,4 \
      --out "$OUT/merge_switch_h200.json" 2>&1 | grep -v cuda_timer | tail -n 10
  LIMIT=$((LIMIT - SECONDS)) cold_start --after-ready 30
}

disk_and_100() {  # one H200, alone: the guard's slora_disk n=2000 case, then the 100-request distinct trace
  # (more adapters than device slots); .jitcache carried
  nvidia-smi -L
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  timeout $((LIMIT - 150)) python3 bench/regress.py --only slora_disk --out-dir "$OUT" 2>&1 | grep -v cuda_timer | tail -n 30
  rm -f "$OUT/regress_log.txt"
  timeout $((LIMIT - SECONDS - 5)) python3 bench/serve.py --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 \
      --prefill-chunk 2048 --requests 100 --cases punica:distinct --out "$OUT/serve100_h200.json" 2>&1 \
      | grep -v "cuda_timer\\|Warning" | tail -n 20
}

scan_check() {  # one H200: the guard's serving trace, then slora_disk n=2000 (a=1, 400 requests) with the
  # engine's default scan_layers_from_tokens (one adapter) and with 512 (disk and one); .jitcache carried
  nvidia-smi -L
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  timeout 240 python3 bench/regress.py --only serve --out-dir "$OUT" 2>&1 | grep -v cuda_timer | tail -n 32
  rm -f "$OUT/regress_serve.png" "$OUT/regress_log.txt"
  local common="bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters --cases slora:n=2000,alpha=1 \
      --mode throughput --requests 400"
  python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters --write-only 2>&1 | tail -n 2
  timeout 150 python3 $common --runs one --out "$OUT/slora_scan256.json" 2>&1 | grep -v cuda_timer | tail -n 4
  timeout $((LIMIT - SECONDS - 5)) python3 $common --runs disk one --scan-layers-from-tokens 512 \
      --out "$OUT/slora_scan512.json" 2>&1 | grep -v cuda_timer | tail -n 5
}

compress_alone() {  # one H200, alone: Compress-then-Serve on its 1000-adapter collection, single /
  # compressed / uncompressed side by side (issue 34 item 5); .jitcache carried
  nvidia-smi -L
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  timeout $((LIMIT - SECONDS - 5)) python3 bench/compress_serve.py --requests 300 \
      --cases "slora:n=1000,alpha=1,cv=1,mode=throughput" --out "$OUT/compress_serve_h200.json" 2>&1 \
      | grep -v "cuda_timer\\|Warning" | tail -n 25
}

window_probe() {  # one H200: device time of decode steps whose 32 / 64 rows use 32 / 64 distinct
  # adapters, through the hybrid kernels against an adapter window of 64 slots (every pool slot)
  nvidia-smi -L
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  timeout $((LIMIT - SECONDS - 5)) python3 bench/serve.py --profile --lora-backend hybrid --max-num-seqs 256 \
      --token-budget 2048 --prefill-chunk 2048 --adapter-window 64 --profile-steps decode32 decode64 \
      --profile-windows 32 64 --profile-variants base base+window hybrid window32 window64 \
      --out "$OUT/window_probe_h200.json" 2>&1 | grep -v "cuda_timer\\|Warning" | tail -n 40
  rm -rf "$OUT/serve_profile_traces"
}

modes_skew() {  # one GPU, issue 38: bench/serve.py --modes-skew at the README's sizes (hybrid, 256 rows, 2048
  # tokens), the modes auto (measured costs), merged, unmerged, mixed on the shares of SKEWS (default all six;
  # a 10-minute call fits about two shares once the programs are in the compile cache: SKEWS="0.5 0.6" TAG=a);
  # the compile cache: .jitcache carried (H200 programs), else it stays in /tmp/jaxlora_serve_jit_cache while the
  # machine is held. On an 80 GB GPU the README's 16384 KV pages (32 GB) and merged mode's base copy do not
  # fit: pass NUM_PAGES=8192 (32 requests use far fewer)
  nvidia-smi -L
  [ -d .jitcache ] && python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  local sizes="--modes-skew --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  sizes="$sizes"
  timeout $((LIMIT - 10)) python3 bench/serve.py $sizes --compile-only 2>&1 | grep -v cuda_timer | tail -n 3
  timeout $((LIMIT - SECONDS - 5)) python3 bench/serve.py $sizes --skews ${SKEWS:-0.5 0.6 0.7 0.8 0.9 1.0} \
      --requests ${REQUESTS:-32} --modes ${MODES:-auto merged unmerged mixed} --time-budget $((LIMIT - SECONDS - 90)) \
      --out "$OUT/modes_skew_${TAG:-h200}.json" 2>&1 | grep -v "cuda_timer\\|Warning" | tail -n 45
}

owed_benches() {  # 4 x H200, one call: GPU 0 window_probe; GPU 1 the guard's serving trace with prefix caching on
  # (the default) and off; GPU 2 bench/prefix_cache.py (rates 0 and 8, 64 requests) then bench/structured_outputs.py;
  # GPU 3 the guard with decode steps through a 64-slot adapter window, then --modes-skew at 0.8 and 1.0.
  # .jitcache carried; each job's JSON under $OUT/<job>/, logs as logs_owed_benches.txt
  nvidia-smi -L
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  mkdir -p $OUT/window $OUT/prefix_on $OUT/prefix_off $OUT/window_guard $OUT/owed
  local t=$((LIMIT - 20)) sizes="--lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  job window 0 $t python3 bench/serve.py --profile $sizes --adapter-window 64 --profile-steps decode32 decode64 \
      --profile-windows 32 64 --profile-variants base base+window hybrid window32 window64 \
      --out "$OUT/window/window_probe_h200.json"
  job guard_prefix 1 $t bash -c "python3 bench/regress.py --only serve --out-dir $OUT/prefix_on; \
      python3 bench/regress.py --only serve --serve-args=--no-prefix-caching --out-dir $OUT/prefix_off"
  job prefix_structured 2 $t bash -c "python3 bench/prefix_cache.py --rates 0 8 --requests 64 \
      --out $OUT/owed/prefix_cache_h200.json; python3 bench/structured_outputs.py --out $OUT/owed/structured_outputs_h200.json"
  job window_modes 3 $t bash -c "python3 bench/regress.py --only serve \
      --serve-args='--adapter-window 64 --window-mixed-adapters 8' --out-dir $OUT/window_guard; \
      python3 bench/serve.py --modes-skew $sizes --skews 0.8 1.0 --modes auto merged unmerged mixed \
      --time-budget 150 --out $OUT/owed/modes_skew_h200_a.json"
  wait
  rm -rf $OUT/window/serve_profile_traces $OUT/*/regress_serve.png
  collect_logs owed_benches
}

modes_and_owed() {  # 4 x H200, one call, each job on its own 16 cores (PIN=1): GPUs 0-2 bench/serve.py
  # --modes-skew at the README's sizes on two shares each (issue 38), GPU 3 bench/structured_outputs.py
  # (llguidance's wheel carried in .whl) then bench/prefix_cache.py at rate 0 (issue 36)
  nvidia-smi -L
  export PIN=1
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/llguidance*.whl
  mkdir -p $OUT/owed
  local t=$((LIMIT - 20)) sizes="--modes-skew --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  local gpu=0
  for shares in "0.5 0.6" "0.7 0.8" "0.9 1.0"; do
    job modes$gpu $gpu $t bash -c "python3 bench/serve.py $sizes --compile-only; python3 bench/serve.py $sizes \
        --skews $shares --modes auto merged unmerged mixed --out $OUT/owed/modes_skew_h200_g$gpu.json"
    gpu=$((gpu + 1))
  done
  job structured_prefix 3 $t bash -c "PYTHONPATH=\$PYTHONPATH:/tmp/site python3 bench/structured_outputs.py \
      --out $OUT/owed/structured_outputs_h200.json; python3 bench/prefix_cache.py --rates 0 \
      --out $OUT/owed/prefix_cache_h200_rate0.json"
  wait
  collect_logs modes_and_owed
}

checks_x4() {  # 4 x H200, one call, each job on its own cores (PIN=1): GPU 0 the guard's serving trace (its
  # compile cache comes back as jitcache.partNN: carry it as .jitcache next time); GPU 1 the GPU kernel tests
  # (issue 37 item 1's log) and the shared-memory limit the device reports; GPU 2 the server's cold start, cold
  # and warm (.whl carried); GPU 3 the 100-request distinct trace (issue 34 item 4)
  nvidia-smi -L
  export PIN=1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p $OUT/guard $OUT/checks
  local t=$((LIMIT - 20))
  job guard 0 $t python3 bench/regress.py --only serve --out-dir $OUT/guard --compile-cache /tmp/jc_guard
  job kernels 1 $t bash -c "python3 -c \"import jax; d = jax.devices()[0]; print(d.device_kind, \
      getattr(d, 'compute_capability', None), getattr(d, 'shared_memory_per_block_optin', None))\"; \
      python3 -m pytest -q -rA -m gpu_only tests/pallas_kernels -p no:cacheprovider > $OUT/checks/gpu_tests_h200.txt 2>&1; \
      tail -n 3 $OUT/checks/gpu_tests_h200.txt; python3 -m pytest -q tests/pallas_kernels/test_fused_lora_smem.py \
      -p no:cacheprovider 2>&1 | tail -n 3"
  job cold 2 $t env PYTHONPATH=$PYTHONPATH:/tmp/site python3 bench/cold_start.py --after-ready 60 \
      --out $OUT/checks/cold_start_h200.json
  job serve100 3 $t python3 bench/serve.py --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 \
      --prefill-chunk 2048 --requests 100 --cases punica:distinct --out $OUT/checks/serve100_h200.json
  wait
  rm -f $OUT/guard/regress_serve.png $OUT/guard/regress_log.txt $OUT/checks/*.png
  collect_logs checks_x4
  tar czf $OUT/checks_x4.tgz -C $OUT guard checks && rm -rf $OUT/guard $OUT/checks  # few files come back
  timeout 90 python3 bench/jit_cache.py pack /tmp/jc_guard "$OUT/jitcache"
}

final_x4() {  # 4 x H200, one call, pinned (PIN=1): GPU 0 the guard's serving trace (.jitcache carried); GPU 1
  # the server's cold start, cold and warm (.whl carried); GPUs 2 and 3 the decode steps' kernel profile
  # (base, hybrid BGMV) with XLA's command buffers as they are and off (--xla_gpu_enable_command_buffer=)
  nvidia-smi -L
  export PIN=1
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p $OUT/final
  local t=$((LIMIT - 20))
  local prof="--profile --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048 \
      --profile-steps decode32 decode64 --profile-variants base hybrid"
  job guard 0 $t python3 bench/regress.py --only serve --out-dir $OUT/final
  job cold 1 $t env PYTHONPATH=$PYTHONPATH:/tmp/site python3 bench/cold_start.py --after-ready 30 \
      --out $OUT/final/cold_start_h200.json
  job graphs_default 2 $t python3 bench/serve.py $prof --out $OUT/final/graphs_default_h200.json
  job graphs_off 3 $t env XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 bench/serve.py $prof \
      --compile-cache "" --out $OUT/final/graphs_off_h200.json
  wait
  rm -rf $OUT/final/regress_serve.png $OUT/final/regress_log.txt $OUT/final/serve_profile_traces $OUT/final/*.png
  collect_logs final_x4
  tar czf $OUT/final_x4.tgz -C $OUT final && rm -rf $OUT/final
}

dispatch_probe() {  # one GPU, issue 35 item 2 / 34 item 3: does a step's call return before its device work is
  # done? bench/dispatch_probe.py: the window1 decode32 forward unrolled and scanned, with and without XLA's
  # command buffers (WHILE too); .whl carried
  nvidia-smi -L
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || return 1
  PYTHONPATH=$PYTHONPATH:/tmp/site timeout $((LIMIT - SECONDS - 5)) python3 bench/dispatch_probe.py \
      --out "$OUT/dispatch_probe_${TAG:-gpu}.json" ${PROBE_ARGS:-} 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 40
}

modes_table_and_guard() {  # 4 x H200, one call, pinned (PIN=1): GPUs 0-2 bench/serve.py --modes-skew at the
  # README's sizes, two shares each, all four modes, 32 requests (issue 38's table); GPU 3 the guard's serving
  # trace on this tree, then on the tree in old_guard/ (an older commit, untracked: a same-machine comparison).
  # On 2 GPUs: SHARES="1.0 0.8" GUARD_GPU=1 (SHARES: one group of shares per GPU, groups split by ';')
  nvidia-smi -L
  export PIN=1
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  mkdir -p $OUT/mt/guard_head $OUT/mt/guard_old
  local t=$((LIMIT - 20)) sizes="--modes-skew --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  local gpu=0 guard_gpu=${GUARD_GPU:-3}
  local groups
  IFS=';' read -ra groups <<<"${SHARES:-0.6 0.5;0.8 0.7;1.0 0.9}"
  for shares in "${groups[@]}"; do
    job modes$gpu $gpu $t bash -c "python3 bench/serve.py $sizes --compile-only; python3 bench/serve.py $sizes \
        --requests 32 --skews $shares --modes auto merged unmerged mixed --time-budget $((t - 290)) \
        --out $OUT/mt/modes_skew_h200_g$gpu.json"
    gpu=$((gpu + 1))
  done
  job guards $guard_gpu $t bash -c "python3 bench/regress.py --only serve --out-dir $OUT/mt/guard_head; \
      cd old_guard && PYTHONPATH=\$PWD python3 bench/regress.py --only serve --out-dir $OUT/mt/guard_old"
  wait
  rm -rf $OUT/mt/*/regress_serve.png $OUT/mt/*/regress_log.txt
  collect_logs modes_table_and_guard
  tar czf $OUT/modes_table_and_guard.tgz -C $OUT mt && rm -rf $OUT/mt
}

modes_cold_fused() {  # 4 x H200, one call, pinned (PIN=1): GPU 0 --modes-skew at all six shares, four modes,
  # 32 requests (issue 38's table); GPU 1 the guard's serving trace; GPU 2, once the guard is done, the
  # server's cold start with 150 s of completions after ready (issue 35 item 2: the background compile's
  # effect); GPU 3 bench/fused_lora.py (issue 37 item 2's figures with today's resolver). .jitcache, .whl carried
  nvidia-smi -L
  export PIN=1
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p $OUT/mcf
  local t=$((LIMIT - 20)) sizes="--modes-skew --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  job modes 0 $t bash -c "python3 bench/serve.py $sizes --compile-only; python3 bench/serve.py $sizes --requests 32 \
      --skews 0.5 0.6 0.7 0.8 0.9 1.0 --modes auto merged unmerged mixed --time-budget $((t - 110)) \
      --out $OUT/mcf/modes_skew_h200.json"
  job guard 1 $t python3 bench/regress.py --only serve --out-dir $OUT/mcf
  job cold 2 $t bash -c "sleep 190; PYTHONPATH=\$PYTHONPATH:/tmp/site python3 bench/cold_start.py --runs cold \
      --after-ready 150 --out $OUT/mcf/cold_start_h200.json"
  job fused 3 $t python3 bench/fused_lora.py --name fused_lora_h200 --out $OUT/mcf --budget-s 400
  wait
  rm -rf $OUT/mcf/regress_serve.png $OUT/mcf/regress_log.txt
  collect_logs modes_cold_fused
  tar czf $OUT/modes_cold_fused.tgz -C $OUT mcf && rm -rf $OUT/mcf
}

final_s6() {  # 4 x H200, one call, pinned (PIN=1): GPU 0 the guard's serving trace (.jitcache carried); GPU 1
  # --modes-skew at all six shares (issue 38's table); GPU 2 bench/vision_serve.py (issue 39 item 4); GPU 3, once
  # the guard is done, the server's cold start: cold, warm, warm without the stored executables (issue 35; .whl)
  nvidia-smi -L
  export PIN=1
  python3 -c "import PIL; print('Pillow', PIL.__version__)"
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p $OUT/f6
  local t=$((LIMIT - 20)) sizes="--modes-skew --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  job guard 0 $t python3 bench/regress.py --only serve --out-dir $OUT/f6
  job modes 1 $t bash -c "python3 bench/serve.py $sizes --compile-only; python3 bench/serve.py $sizes --requests 32 \
      --skews 0.5 0.6 0.7 0.8 0.9 1.0 --modes auto merged unmerged mixed --time-budget $((t - 110)) \
      --out $OUT/f6/modes_skew_h200.json"
  job vision 2 $t env PYTHONPATH=$PYTHONPATH:/tmp/site python3 bench/vision_serve.py --compile-cache /tmp/jaxlora_vision_jit_cache \
      --time-budget $((t - 60)) --out $OUT/f6/vision_serve_h200.json
  job cold 3 $t bash -c "sleep 140; PYTHONPATH=\$PYTHONPATH:/tmp/site python3 bench/cold_start.py \
      --runs cold warm --after-ready 20 --out $OUT/f6/cold_start_h200.json"
  wait
  rm -rf $OUT/f6/regress_serve.png $OUT/f6/regress_log.txt
  collect_logs final_s6
  tar czf $OUT/final_s6.tgz -C $OUT f6 && rm -rf $OUT/f6
}

modes_and_scan() {  # 4 x H200, one call, pinned (PIN=1): GPUs 0-1 --modes-skew (issue 38's table, three shares
  # each, four modes, 32 requests, each mode warmed on a short trace first); GPU 2 the decode32 profile with every
  # layer scanned (issue 35 item 2: the stand-ins' cost), then the unrolled reference; GPU 3 the scanned profile
  # with XLA's dynamic-slice fusion (lets a GEMM read its layer's weights in the stack in place). .jitcache carried
  nvidia-smi -L
  export PIN=1
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  mkdir -p $OUT/ms/p2 $OUT/ms/p3
  local t=$((LIMIT - 20)) sizes="--lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  local prof="bench/serve.py --profile $sizes --profile-steps decode32 --profile-variants base hybrid"
  job modes0 0 $t bash -c "python3 bench/serve.py --modes-skew $sizes --compile-only; python3 bench/serve.py \
      --modes-skew $sizes --requests 32 --skews 0.5 0.6 0.7 --modes auto merged unmerged mixed \
      --time-budget $((t - 110)) --out $OUT/ms/modes_skew_h200_a.json"
  job modes1 1 $t bash -c "python3 bench/serve.py --modes-skew $sizes --compile-only; python3 bench/serve.py \
      --modes-skew $sizes --requests 32 --skews 1.0 0.9 0.8 --modes auto merged unmerged mixed \
      --time-budget $((t - 110)) --out $OUT/ms/modes_skew_h200_b.json"
  job scan 2 $t bash -c "python3 $prof --scan-layers-from-tokens 1 --compile-cache '' --out $OUT/ms/p2/scan.json; \
      python3 $prof --out $OUT/ms/p2/unrolled.json"
  job scan_dsf 3 $t env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python3 $prof \
      --scan-layers-from-tokens 1 --compile-cache '' --out $OUT/ms/p3/scan_dsf.json
  wait
  rm -rf $OUT/ms/*/serve_profile_traces
  collect_logs modes_and_scan
  tar czf $OUT/modes_and_scan.tgz -C $OUT ms && rm -rf $OUT/ms
}

bisect_variants() {  # 4 x H200, one call, pinned (PIN=1): the guard's serving trace (regress.py --only serve) on
  # this tree (GPU 0) and on copies of it overlaid with variants/<V>/ (untracked files of a branch: GPUs 1-3,
  # VARIANTS="A B C"), side by side; then slora_disk n=2000 on this tree and on the variant SLORA names (GPUs
  # 0 and 2). .jitcache and .whl carried; results come back as bisect.tgz
  nvidia-smi -L
  export PIN=${PIN:-1}
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  local work=/tmp/bisect t=$((LIMIT - 20)) gpu=1 slora=${SLORA:-B}
  mkdir -p $work/main $work/main_slora $work/${slora}_slora
  for v in ${VARIANTS:-A B C}; do
    mkdir -p /tmp/tree_$v $work/$v
    tar cf - --exclude=./.jitcache --exclude=./.whl --exclude=./variants . | tar xf - -C /tmp/tree_$v
    cp -r variants/$v/. /tmp/tree_$v/
    local then=""
    [ "$v" = "$slora" ] && then="; python3 bench/regress.py ${TINY:+--tiny} --only slora_disk --out-dir $work/${v}_slora"
    job guard_$v $gpu $t bash -c "cd /tmp/tree_$v && PYTHONPATH=/tmp/tree_$v:/tmp/site \
        python3 bench/regress.py ${TINY:+--tiny} --only serve --out-dir $work/$v $then"
    gpu=$((gpu + 1))
  done
  job guard_main 0 $t bash -c "python3 bench/regress.py ${TINY:+--tiny} --only serve --out-dir $work/main; \
      python3 bench/regress.py ${TINY:+--tiny} --only slora_disk --out-dir $work/main_slora"
  wait
  rm -f $work/*/regress_*.png
  collect_logs bisect
  tar czf "$OUT/bisect.tgz" -C $work .
  for d in $work/*/; do echo "== $d"; python3 -c "
import json, glob, sys
for f in sorted(glob.glob('$d/regress_*.json')):
    r = json.load(open(f))
    if 'figures' not in r: continue
    for k, v in r['figures'].items():
        print(f\"{k:55s} {v['value']:10.3f}  {r['verdicts'].get(k, {}).get('verdict', '')}\")"; done
}

slora_pair() {  # one H200: the guard's slora_disk part (n=2000, alpha 1 and 0.3, 400 requests) on this tree and
  # on a copy overlaid with variants/old/ (the files before a change), the same adapter folders, written (and
  # synced to disk) before either run; ORDER="old new" (default) or "new old"
  nvidia-smi -L
  python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  mkdir -p /tmp/tree_old "$OUT/slora_new" "$OUT/slora_old"
  tar cf - --exclude=./.jitcache --exclude=./.whl --exclude=./variants . | tar xf - -C /tmp/tree_old
  cp -r variants/old/. /tmp/tree_old/
  python3 bench/slora_disk.py ${TINY:+--tiny} --dir /tmp/slora_dirs --write-only \
      2>&1 | tail -n 2
  sync
  local which tree
  for which in ${ORDER:-old new}; do
    tree=$PWD; [ "$which" = old ] && tree=/tmp/tree_old
    (cd $tree && PYTHONPATH=$tree:/tmp/site timeout $((LIMIT - SECONDS - 5)) python3 bench/regress.py \
        ${TINY:+--tiny} --only slora_disk --adapter-dir /tmp/slora_dirs --out-dir "$OUT/slora_$which" 2>&1 \
        | grep -v "cuda_timer\|Warning\|^W11" | tail -n 16)
  done
  rm -f "$OUT"/slora_*/regress_*.png
}

scan_cublas() {  # one GPU, issue 35 item 2: the decode32 profile with every layer scanned, its GEMMs on cuBLAS
  # (XLA's Triton GEMMs off) with XLA's dynamic-slice fusion (cuBLAS reading each layer's weights in the stack
  # in place, no copy); then cuBLAS alone; then the scanned default (the baseline, same machine)
  nvidia-smi -L
  local sizes="--lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048"
  local prof="bench/serve.py ${TINY:+--tiny} --profile $sizes --profile-steps decode32 --profile-variants base hybrid \
      --scan-layers-from-tokens 1 --compile-cache="
  local off="--xla_gpu_enable_triton_gemm=false"
  XLA_FLAGS="$off --xla_gpu_enable_dynamic_slice_fusion=true" timeout $((LIMIT - SECONDS - 5)) python3 $prof \
      --out "$OUT/scan_cublas_dsf.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 12
  XLA_FLAGS="$off" timeout $((LIMIT - SECONDS - 5)) python3 $prof --out "$OUT/scan_cublas.json" 2>&1 \
      | grep -v "cuda_timer\|Warning\|^W11" | tail -n 12
  timeout $((LIMIT - SECONDS - 5)) python3 $prof --out "$OUT/scan_default.json" 2>&1 \
      | grep -v "cuda_timer\|Warning\|^W11" | tail -n 12
  rm -rf "$OUT"/serve_profile_traces
}

standin_profile() {  # one GPU, issue 35 item 2: the stand-ins' decode32 step (every layer scanned, cuBLAS
  # GEMMs) against the unrolled program that replaces it, base rows and rows on one adapter in the window
  # (what a cold server's first completions run); .whl carried (the server's packages)
  nvidia-smi -L
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || return 1
  local prof="bench/serve.py --profile --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 --prefill-chunk 2048 \
      --profile-steps decode32 --profile-variants base window1 --profile-windows 1 --compile-cache="
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" PYTHONPATH=$PYTHONPATH:/tmp/site timeout $((LIMIT - SECONDS - 5)) \
      python3 $prof --scan-layers-from-tokens 1 --out "$OUT/standin_scanned.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 14
  PYTHONPATH=$PYTHONPATH:/tmp/site timeout $((LIMIT - SECONDS - 5)) python3 $prof --out "$OUT/standin_unrolled.json" 2>&1 \
      | grep -v "cuda_timer\|Warning\|^W11" | tail -n 14
  rm -rf "$OUT"/serve_profile_traces
}

unrolled_together() {  # one GPU, issue 35: why the 4 smallest buckets compiled unrolled before ready did not
  # finish (09:08 UTC, 2026-11-28): one unrolled program's compile alone, then four at once (threads of one
  # process, as the server's start-up), then four at once with autotuning off; each step capped in time
  nvidia-smi -L
  local ct="python3 bench/compile_time.py --layers-as unrolled --runs 5 --out $OUT/unrolled_together.jsonl"
  local four="base_decode32 lora_decode64 window_decode64 base_decode64"
  timeout 150 $ct --label alone --programs window_decode64 2>&1 | grep -v "cuda_timer\|Warning" | tail -n 5
  timeout 220 $ct --label four --threads 4 --programs $four 2>&1 | grep -iv "cuda_timer\|^W11" | grep -i \
      "memory\|error\|{" | tail -n 12
  timeout $((LIMIT - SECONDS - 5)) $ct --label four_autotune0 --threads 4 --option xla_gpu_autotune_level=0 \
      --programs $four 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 6
}

remat_probe() {  # one GPU, issue 35: is XLA's rematerialization pass the unrolled compile's time? (12:37 UTC
  # 2026-11-28, H200: one unrolled window_decode64 compile alone 51 s, four at once 138 s, each warning "Can't
  # reduce memory use below 87.7GiB by rematerialization": the donated KV pool counted twice.) The same programs
  # with the pass off, then with XLA's memory limit raised; the step's device time checked in each
  nvidia-smi -L
  local ct="python3 bench/compile_time.py --layers-as unrolled --runs 5 --out $OUT/remat_probe.jsonl"
  local off="--option xla_disable_hlo_passes=rematerialization"
  local four="base_decode32 lora_decode64 window_decode64 base_decode64"
  timeout 130 $ct --label remat_off $off --programs window_decode64 base_decode32 2>&1 | grep -i "remat\|{" | tail -n 5
  timeout 100 $ct --label slop400 --option xla_gpu_memory_limit_slop_factor=400 --programs window_decode64 2>&1 \
      | grep -i "remat\|{" | tail -n 4
  timeout $((LIMIT - SECONDS - 5)) $ct --label four_remat_off --threads 4 $off --programs $four 2>&1 \
      | grep -i "remat\|{" | tail -n 6
}

split_probe() {  # one GPU, issue 35: the unrolled decode programs' compile with the layers' weights one
  # array a layer (bench/compile_time.py --split-layers: one autotuning key for 32 equal layers, per-layer
  # operands) against the stacked weights, both at --memory 0.7 (the split copies the weights once)
  nvidia-smi -L
  local ct="python3 bench/compile_time.py --layers-as unrolled --runs 5 --memory 0.7 --out $OUT/split_probe.jsonl"
  timeout $((LIMIT / 2)) $ct --label split --split-layers --programs window_decode64 base_decode32 2>&1 \
      | grep -i "error\|{" | tail -n 4
  timeout $((LIMIT - SECONDS - 5)) $ct --label stacked --programs window_decode64 2>&1 | grep -i "error\|{" | tail -n 3
}

split_check() {  # one H200, issue 35: the engine on split layers (EngineConfig.split_layers), measured twice: the
  # guard's serving trace (every program unrolled over per-layer arrays; must not be slower than the README),
  # then a cold start with --split-layers (ready, first completion, the first 30 s after ready against steady)
  nvidia-smi -L
  server_wheels || return 1
  timeout $((LIMIT / 2)) python3 bench/regress.py --only serve --out-dir "$OUT" --compile-cache /tmp/split_cache \
      --serve-args="--split-layers" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 32
  rm -f "$OUT"/regress_serve.png
  timeout $((LIMIT - SECONDS - 10)) python3 bench/cold_start.py --runs cold --after-ready 150 \
      --deadline $((LIMIT - SECONDS - 25)) --out "$OUT/cold_start_split.json" --server-args "--max-adapters-on-device 64 \
      --max-lora-rank 16 --max-num-seqs 256 --max-num-batched-tokens 2048 --max-model-len 1024 --split-layers" 2>&1 | tail -n 8
}

split_x4() {  # 4 x H200, one call, pinned (PIN=1), issue 35 with split layers: GPU 0 the guard's serving trace
  # with --split-layers (no cache: its programs differ), GPU 1 the same trace stacked (.jitcache carried: the
  # baseline in the same run), GPU 2 a cold start with --split-layers and a long --after-ready (item 2's ratio
  # with the background done), GPU 3 cold then warm starts with --split-layers (item 1); .whl carried
  nvidia-smi -L
  export PIN=1
  [ -e .jitcache/jitcache.part00 ] && python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jc_stacked
  server_wheels || return 1
  mkdir -p $OUT/split
  local t=$((LIMIT - 20)) sizes="--max-adapters-on-device 64 --max-lora-rank 16 --max-num-seqs 256 \
--max-num-batched-tokens 2048 --max-model-len 1024 --split-layers"
  job guard_split 0 $t python3 bench/regress.py --only serve --out-dir $OUT/split/g_split --compile-cache /tmp/jc_split \
      --serve-args="--split-layers"
  job guard_stacked 1 $t python3 bench/regress.py --only serve --out-dir $OUT/split/g_stacked --compile-cache /tmp/jc_stacked
  job cold_long 2 $t python3 bench/cold_start.py --runs cold --after-ready 400 --deadline $((t - 15)) \
      --out $OUT/split/cold_start_split_after_ready.json --server-args "$sizes"
  job cold_warm 3 $t python3 bench/cold_start.py --runs cold warm --after-ready 20 --deadline $((t - 15)) \
      --out $OUT/split/cold_start_split.json --server-args "$sizes"
  wait
  rm -f $OUT/split/*/regress_serve.png $OUT/split/*/regress_log.txt
  collect_logs split_x4
  tar czf $OUT/split_x4.tgz -C $OUT split && rm -rf $OUT/split
}

split_final() {  # 4 x H200, one call, pinned (PIN=1), issue 35 with split layers after the one-jit-a-layer
  # lowering and 16 compile threads: GPU 0 cold then warm with a long --after-ready (the cold run serves
  # until 30 s past its background compile: item 2's steady reference), GPU 1 cold then warm (item 1),
  # GPU 2 the stacked engine cold then warm (the baseline in the same run), GPU 3 the guard's serving
  # trace with --split-layers; .whl carried
  nvidia-smi -L
  export PIN=1
  server_wheels || return 1
  mkdir -p $OUT/split
  local t=$((LIMIT - 20)) sizes="$README_SIZES"
  job cold_steady 0 $t python3 bench/cold_start.py --runs cold warm --after-ready 300 --deadline $((t - 15)) \
      --out $OUT/split/cold_start_split_steady.json --server-args "$sizes --split-layers"
  job cold_warm 1 $t python3 bench/cold_start.py --runs cold warm --after-ready 30 --deadline $((t - 15)) \
      --out $OUT/split/cold_start_split.json --server-args "$sizes --split-layers"
  job cold_stacked 2 $t python3 bench/cold_start.py --runs cold warm --after-ready 30 --deadline $((t - 15)) \
      --out $OUT/split/cold_start_stacked.json --server-args "$sizes"
  job guard_split 3 $t python3 bench/regress.py --only serve --out-dir $OUT/split/g_split --compile-cache /tmp/jc_split \
      --serve-args="--split-layers"
  wait
  rm -f $OUT/split/*/regress_serve.png $OUT/split/*/regress_log.txt $OUT/split/*_server.log
  collect_logs split_final
  tar czf $OUT/split_final.tgz -C $OUT split && rm -rf $OUT/split
}

split_fill() {  # 4 x H200, one call, pinned (PIN=1), issue 35: the warm start with split layers (the weights
  # written into the engine's arrays while the programs load; Handover.ZEROS remakes the placeholder side by
  # side): GPU 0 split cold then warm; GPU 1 split cold with a long --after-ready (item 2's steady reference)
  # then warm (the cache listed before it: the twelfth session's warm miss); GPU 2 the stacked engine cold then
  # warm (the baseline in the same run); GPU 3 the guard's serving trace with --split-layers; .whl carried
  nvidia-smi -L
  export PIN=1
  server_wheels || return 1
  mkdir -p $OUT/fill
  local t=$((LIMIT - 20)) sizes="$README_SIZES"
  job split 0 $t python3 bench/cold_start.py --runs cold warm --after-ready 30 --deadline $((t - 15)) \
      --out $OUT/fill/cold_start_split.json --server-args "$sizes --split-layers"
  job split_steady 1 $t python3 bench/cold_start.py --runs cold warm --after-ready 300 --deadline $((t - 15)) \
      --out $OUT/fill/cold_start_split_steady.json --server-args "$sizes --split-layers"
  job stacked 2 $t python3 bench/cold_start.py --runs cold warm --after-ready 30 --deadline $((t - 15)) \
      --out $OUT/fill/cold_start_stacked.json --server-args "$sizes"
  job guard_split 3 $t python3 bench/regress.py --only serve --out-dir $OUT/fill/g_split --compile-cache /tmp/jc_split \
      --serve-args="--split-layers"
  wait
  rm -f $OUT/fill/*/regress_serve.png $OUT/fill/*/regress_log.txt
  collect_logs split_fill
  tar czf $OUT/split_fill.tgz -C $OUT fill && rm -rf $OUT/fill
}

split_cold3() {  # 4 x H200, one call, pinned (PIN=1), issue 35 item 1: three split-layers cold+warm starts (GPUs 0-2;
  # the spread of the cold figure) beside the stacked engine's (GPU 3, the baseline in the same run); .whl carried
  nvidia-smi -L
  export PIN=1
  server_wheels || return 1
  mkdir -p $OUT/cold3
  local t=$((LIMIT - 20)) sizes="$README_SIZES"
  for g in 0 1 2; do
    job split$g $g $t python3 bench/cold_start.py --runs cold warm --after-ready 30 --deadline $((t - 15)) \
        --out $OUT/cold3/cold_start_split_$g.json --server-args "$sizes --split-layers"
  done
  job stacked 3 $t python3 bench/cold_start.py --runs cold warm --after-ready 30 --deadline $((t - 15)) \
      --out $OUT/cold3/cold_start_stacked.json --server-args "$sizes"
  wait
  collect_logs split_cold3
  tar czf $OUT/split_cold3.tgz -C $OUT cold3 && rm -rf $OUT/cold3
}

stacked_steady() {  # one H200, issue 35 item 2 for the default (stacked) engine: a cold start's first 30 s after
  # ready, then the same cache with every program compiled before ready (cold_start.py's "steady" run,
  # --background-compile off): its latency is the steady reference (`first_window_vs_steady`); .whl carried
  nvidia-smi -L
  server_wheels || return 1
  timeout $((LIMIT - SECONDS - 10)) python3 bench/cold_start.py --runs cold steady --after-ready 30 \
      --deadline $((LIMIT - SECONDS - 25)) --timeout 520 --out $OUT/cold_start_stacked_steady.json \
      --server-args "--max-adapters-on-device 64 --max-lora-rank 16 --max-num-seqs 256 --max-num-batched-tokens 2048 \
--max-model-len 1024" 2>&1 | grep -v "cuda_timer\|hlo_remat" | tail -n 30
}

packed_check() {  # one H200, issue 34 item 3: the guard (`guard`: .jitcache and .whl carried), then the decode
  # steps' per-kernel profile, base vs hybrid (did the packed BGMV expand take the 5 slice copies a layer out?)
  guard
  timeout $((LIMIT - SECONDS - 10)) python3 bench/serve.py --profile --lora-backend hybrid --profile-windows \
      --profile-steps decode32 decode64 --compile-cache /tmp/jaxlora_serve_jit_cache \
      --out "$OUT/serve_profile_packed_h200.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 40
  rm -rf "$OUT/serve_profile_traces"
}

stream_probe() {  # one H200, issue 34 item 3: the decode LoRA kernels in line, in one launch a group, and on a
  # second CUDA stream beside the base GEMMs (bench/lora_stream_probe.py; 32 and 64 rows on distinct adapters), ~2 min.
  # XLA_FLAGS="--xla_gpu_enable_command_buffer=" for the side stream without CUDA graphs (00:30 UTC 11-29)
  nvidia-smi -L
  timeout $((LIMIT - SECONDS - 5)) python3 bench/lora_stream_probe.py --layers 8 --rows 32 64 --profile ${PROBE_ARGS:-} \
      --out "$OUT/lora_stream_probe_h200.json" 2>&1 | tail -n 40
}

window_profile() {  # one H200, issue 34 item 3: per-kernel profile of the adapter window's decode32 step (rows on 1
  # and on 8 adapters of the window) against base and base+window: where a one-adapter step's +1.0 ms goes
  nvidia-smi -L
  server_wheels
  timeout $((LIMIT - SECONDS - 10)) python3 bench/serve.py --profile --lora-backend hybrid --profile-windows 1 8 \
      --profile-steps decode32 --profile-variants base base+window window1 window8 \
      --out "$OUT/serve_profile_window_h200.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 40
  rm -rf "$OUT/serve_profile_traces"
}

window_mask_probe() {  # one H200, issue 34 item 3: the adapter window's shrink mask as a select, a per-layer
  # multiply and a per-step multiply, against the window-less GEMMs (bench/window_mask_probe.py), ~3 min
  nvidia-smi -L
  server_wheels
  timeout $((LIMIT - SECONDS - 5)) python3 bench/window_mask_probe.py ${PROBE_ARGS:-} \
      --out "$OUT/window_mask_probe_h200.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 40
  rm -rf /tmp/window_mask_probe
}

decode_gemm_probe() {  # one H200, issue 34 item 3: a Pallas (Triton) decode GEMM against XLA's at the 8B projections'
  # shapes, 32 and 64 rows (bench/decode_gemm_probe.py), ~3 min
  nvidia-smi -L
  timeout $((LIMIT - SECONDS - 5)) python3 bench/decode_gemm_probe.py ${PROBE_ARGS:-} --out "$OUT/decode_gemm_probe_h200.json" \
      2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 40
}

fused_decode_probe() {  # one H200, issue 34 item 3: a projection group's GEMM and its rows' LoRA in one Pallas kernel
  # against XLA's GEMM + the in-line BGMV kernels (bench/fused_decode_probe.py), 32 and 64 distinct rows, ~2 min
  nvidia-smi -L
  timeout $((LIMIT - SECONDS - 5)) python3 bench/fused_decode_probe.py ${PROBE_ARGS:-} \
      --out "$OUT/fused_decode_probe_h200.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 40
}

serve100() {  # one H200, alone, issue 34 item 4: the 100-request distinct trace (more adapters than the 64 slots),
  # base and LoRA, with the guard's compile cache (.jitcache and .whl carried); ~4 min
  nvidia-smi -L
  local cache=/tmp/jaxlora_serve_jit_cache
  if [ -e .jitcache/jitcache.part00 ]; then python3 bench/jit_cache.py unpack .jitcache/jitcache $cache; fi
  server_wheels || return 1
  timeout $((LIMIT - SECONDS - 5)) python3 bench/serve.py --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 \
      --prefill-chunk 2048 --requests 100 --cases punica:distinct --compile-cache $cache \
      --out "$OUT/serve100_h200.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 30
  rm -f "$OUT"/*.png
}

guard() {  # one H200: the regression guard's serving trace (bench/regress.py --only serve; .jitcache and .whl
  # carried), alone on the machine; then, with the time left, the disk-read benchmark (CPU work beside no engine)
  nvidia-smi -L
  local cache=/tmp/jaxlora_serve_jit_cache
  if [ -e .jitcache/jitcache.part00 ]; then python3 bench/jit_cache.py unpack .jitcache/jitcache $cache; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  local spare=25  # seconds kept for the cache's pack (~70 MB: ~60 s) when none was carried
  if [ ! -e .jitcache/jitcache.part00 ]; then spare=95; fi
  timeout $((LIMIT - SECONDS - spare)) python3 bench/regress.py --only serve --out-dir "$OUT" --compile-cache $cache 2>&1 \
      | grep -v "cuda_timer\|Warning\|^W11" | tail -n 40
  rm -f "$OUT"/regress_serve.png
  if [ ! -e .jitcache/jitcache.part00 ]; then timeout 90 python3 bench/jit_cache.py pack $cache "$OUT/jitcache"; fi
}

vision_serve() {  # one GPU, issue 39 item 4: bench/vision_serve.py (LLaVA-1.5 layout, ViT-L/14-336 + Llama-3.1-8B
  # shape, random bf16) serving one image+text trace on the base model and over 1, 8 and 64 adapters at the README's
  # engine sizes; ~5-6 min from an empty compile cache on an H200. Its compile cache comes back as jitcache_vision.partNN:
  # copy them into .jitcache/ and carry it to skip the compile next time. TAG names the JSON (default h200)
  nvidia-smi -L
  local cache=/tmp/jaxlora_vision_jit_cache
  if [ -e .jitcache/jitcache_vision.part00 ]; then
    python3 bench/jit_cache.py unpack .jitcache/jitcache_vision $cache
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl  # gguf, fastapi, ...
  PYTHONPATH=$PYTHONPATH:/tmp/site timeout $((LIMIT - SECONDS - 40)) python3 bench/vision_serve.py --compile-cache $cache \
      --time-budget $((LIMIT - SECONDS - 70)) --out "$OUT/vision_serve_${TAG:-h200}.json" ${VISION_ARGS:-} 2>&1 \
      | grep -v "cuda_timer\\|Warning" | tail -n 30
  timeout 30 python3 bench/jit_cache.py pack $cache "$OUT/jitcache_vision"
}

two_gpus() {  # 2 GPUs: TP=2 serving vs one GPU, then PP=2 training vs one GPU
  nvidia-smi -L
  timeout 270 python3 bench/tp_serve.py --out "$OUT/tp_serve_2xh200.json" 2>&1 | tail -n 15
  timeout $((LIMIT - SECONDS - 5)) python3 bench/pipeline.py --stages 2 1 --workloads xsum mixed --batches 2 \
      --out "$OUT/pipeline_2xh200.json" 2>&1 | tail -n 15
}

"$@"

slora_profile() {  # one H200, issue 34 item 5: slora_disk n=2000 (a=1, 400 requests, throughput; the guard's
  # settings) with engine steps 600-699 of the disk and one-adapter runs under the profiler: device busy ms against
  # the host loop's ms a step (which of the two paces the disk tier's trace), kernels by category. The compile
  # cache comes back packed when none was carried (.jitcache)
  nvidia-smi -L
  local cache=/tmp/jaxlora_serve_jit_cache
  if [ -e .jitcache/jitcache.part00 ]; then python3 bench/jit_cache.py unpack .jitcache/jitcache $cache; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  python3 bench/slora_disk.py ${TINY:+--tiny} --adapters ${ADAPTERS:-2000} --dir /tmp/slora_dirs --write-only 2>&1 | tail -n 1
  timeout $((LIMIT - SECONDS - 25)) python3 bench/slora_disk.py ${TINY:+--tiny} --adapters ${ADAPTERS:-2000} \
      --dir /tmp/slora_dirs --cases "slora:n=${ADAPTERS:-2000},alpha=1" --runs disk one --mode throughput \
      --requests ${REQUESTS:-400} --profile-steps ${PROFILE:-600 100} --compile-cache $cache \
      --out "$OUT/slora_profile.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 12
  rm -rf "$OUT"/slora_trace_*
  if [ ! -e .jitcache/jitcache.part00 ]; then timeout 90 python3 bench/jit_cache.py pack $cache "$OUT/jitcache"; fi
}

gpu_setup() {  # a fresh one-GPU machine: the carried compile cache (.jitcache) into $JIT_CACHE, the server's
  # wheels (.whl) on PYTHONPATH; once per call
  [ -n "${GPU_SETUP_DONE:-}" ] && return
  nvidia-smi -L
  if [ -e .jitcache/jitcache.part00 ]; then python3 bench/jit_cache.py unpack .jitcache/jitcache $JIT_CACHE; fi
  if [ -e .jitcache_slora/jitcache_slora.part00 ]; then  # slora_disk's programs (`slora_first` packs them; carried
    python3 bench/jit_cache.py unpack .jitcache_slora/jitcache_slora $JIT_CACHE  # apart: both pass the 64 MiB)
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site GPU_SETUP_DONE=1
}

slora_regress() {  # the guard's slora_disk part (n=2000, alpha 1 and 0.3, 400 requests, disk and one) on one H200,
  # .jitcache and the wheels set up first; keeps $1 seconds of LIMIT for what follows
  gpu_setup
  timeout $((LIMIT - SECONDS - $1)) python3 bench/regress.py ${TINY:+--tiny} --only slora_disk --out-dir "$OUT" \
      --adapter-dir /tmp/slora_adapters --compile-cache $JIT_CACHE 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 16
  rm -f "$OUT"/regress_*.png
}

slora_check() {  # one H200, issue 34 item 5: `slora_regress`, then with the time left the alpha=1 disk run again
  # with steps 600-699 under the profiler
  slora_regress 25
  [ $((LIMIT - SECONDS)) -gt 120 ] && timeout $((LIMIT - SECONDS - 10)) python3 bench/slora_disk.py ${TINY:+--tiny} \
      --adapters ${ADAPTERS:-2000} --dir /tmp/slora_adapters --cases "slora:n=${ADAPTERS:-2000},alpha=1" --runs disk --mode throughput \
      --requests ${REQUESTS:-400} --profile-steps ${PROFILE:-600 100} --compile-cache $JIT_CACHE \
      --out "$OUT/slora_profile.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 4
  rm -rf "$OUT"/slora_trace_*
}

slora_startup() {  # one H200 (.whl and .jitcache_slora carried), issue 34 item 5: where the disk trace's first
  # steps go (steps 0-3 took 0.4-0.7 s together, 3-4% of the run, on 11-29/30: commit and prefetch of the first
  # ~60 adapters): the alpha=1 disk run with steps 0-7 under the profiler, then with steps 300-329 (steady
  # state), host time thread by thread (`host_threads`)
  gpu_setup
  python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters --write-only 2>&1 | tail -n 1
  local w
  for w in "0 8" "300 30"; do
    [ $((LIMIT - SECONDS)) -gt 60 ] && timeout $((LIMIT - SECONDS - 10)) python3 bench/slora_disk.py --adapters 2000 \
        --dir /tmp/slora_adapters --cases "slora:n=2000,alpha=1" --runs disk --mode throughput --requests 400 \
        --profile-steps $w --compile-cache $JIT_CACHE --out "$OUT/slora_profile_${w%% *}.json" 2>&1 \
        | grep -v "cuda_timer\|Warning\|^W11" | tail -n 12
  done
  rm -rf "$OUT"/slora_trace_*
}

slora_flags() {  # one H200, issue 34 item 5: `slora_regress`, then the alpha=1 disk run again with $FLAGS as
  # XLA_FLAGS (default: XLA's command buffers off), same machine: whether the step's CUDA-graph updates
  # (`command_buffer::update` in the host trace) pace the disk tier's steps
  slora_regress 200
  XLA_FLAGS="${FLAGS:---xla_gpu_enable_command_buffer=}" timeout $((LIMIT - SECONDS - 10)) python3 bench/slora_disk.py \
      ${TINY:+--tiny} --adapters ${ADAPTERS:-2000} --dir /tmp/slora_adapters --cases "slora:n=${ADAPTERS:-2000},alpha=1" \
      --runs disk --mode throughput --requests ${REQUESTS:-400} --compile-cache $JIT_CACHE \
      --out "$OUT/slora_flags.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 3
}

guard_inputs() {  # one H200: the regression guard's serving trace with stable step inputs off (the default),
  # then on (`--stable-step-inputs`, serve/step_inputs.py), one machine, one compile cache (.jitcache: the
  # guard's programs, which the option does not change)
  gpu_setup
  mkdir -p "$OUT/off" "$OUT/on"
  timeout $(((LIMIT - SECONDS - 10) / 2)) python3 bench/regress.py --only serve --out-dir "$OUT/off" \
      --compile-cache $JIT_CACHE 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 28
  timeout $((LIMIT - SECONDS - 10)) python3 bench/regress.py --only serve --out-dir "$OUT/on" \
      --compile-cache $JIT_CACHE --serve-args=--stable-step-inputs 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 28
  rm -f "$OUT"/*/regress_*.png
}

guard_ab() {  # one H200: the regression guard's serving trace on old.tar (the tree before a change, untracked:
  # `git archive REV jaxlora serve pallas_kernels bench train Makefile pyproject.toml README.md -o old.tar`)
  # and then on this tree, one machine, one compile cache (the second run's programs hit it); the cache packed last
  nvidia-smi -L
  local cache=/tmp/jaxlora_serve_jit_cache
  if [ -e .jitcache/jitcache.part00 ]; then python3 bench/jit_cache.py unpack .jitcache/jitcache $cache; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p /tmp/old "$OUT/old" "$OUT/new" && tar xf old.tar -C /tmp/old
  (cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/site timeout $((LIMIT * 6 / 10)) python3 bench/regress.py --only serve \
      --out-dir "$OUT/old" --compile-cache $cache 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 28)
  PYTHONPATH=$PYTHONPATH:/tmp/site timeout $((LIMIT - SECONDS - 30)) python3 bench/regress.py --only serve \
      --out-dir "$OUT/new" --compile-cache $cache 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 28
  rm -f "$OUT"/*/regress_*.png
  timeout 90 python3 bench/jit_cache.py pack $cache "$OUT/jitcache"
}

issue34_x4() {  # 4 x H200, one call, pinned (PIN=1), issue 34: GPU 0 the guard's serving trace (the default),
  # GPU 1 the same with stable step inputs (--stable-step-inputs), GPU 2 the guard's slora_disk part (n=2000, alpha
  # 1 and 0.3; host phases by step kind), GPU 3 Compress-then-Serve on its 1000-adapter collection (single,
  # compressed and uncompressed; item 5). .jitcache (the guard's programs) and .whl carried; each job its own
  # copy of the cache; results as issue34_x4.tgz
  nvidia-smi -L
  export PIN=1
  gpu_setup
  local work=/tmp/issue34 t=$((LIMIT - 25))
  mkdir -p $work/off $work/on $work/slora $work/compress
  for g in 0 1 2 3; do cp -r $JIT_CACHE /tmp/jc$g; done
  job guard_off 0 $t python3 bench/regress.py --only serve --out-dir $work/off --compile-cache /tmp/jc0
  job guard_on 1 $t python3 bench/regress.py --only serve --out-dir $work/on --compile-cache /tmp/jc1 \
      --serve-args=--stable-step-inputs
  job slora 2 $t python3 bench/regress.py --only slora_disk --out-dir $work/slora --adapter-dir /tmp/slora_adapters \
      --compile-cache /tmp/jc2
  job compress 3 $t python3 bench/compress_serve.py --requests 300 --cases "slora:n=1000,alpha=1,cv=1,mode=throughput" \
      --compile-cache /tmp/jc3 --out $work/compress/compress_serve_h200.json
  wait
  rm -f $work/*/regress_*.png
  mv "$OUT"/log_*.txt $work/ 2>/dev/null
  for f in $work/log_*.txt; do grep -v "cuda_timer\|Warning\|^W11" "$f" | tail -n 30; done
  tar czf "$OUT/issue34_x4.tgz" -C $work .
}

slora_first() {  # one H200, issue 34 item 5: the disk run (n=2000, alpha 1, 400 requests, throughput) with its
  # first steps under the profiler (PROFILE, default "0 12": the start-up burst of slow steps, 2.4 s of a 20.7 s
  # run at 13:45), host events by self time; the slora programs' compile cache packed as jitcache_slora
  gpu_setup
  local cache=/tmp/jc_slora
  [ -e .jitcache_slora/jitcache_slora.part00 ] && python3 bench/jit_cache.py unpack .jitcache_slora/jitcache_slora $cache
  python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters --write-only 2>&1 | tail -n 1
  timeout $((LIMIT - SECONDS - 70)) python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters \
      --cases "slora:n=2000,alpha=1" --runs ${RUNS:-disk} --mode throughput --requests 400 --profile-steps ${PROFILE:-0 12} \
      --compile-cache $cache --out "$OUT/slora_first.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 4
  rm -rf "$OUT"/slora_trace_*
  [ -e .jitcache_slora/jitcache_slora.part00 ] || timeout 60 python3 bench/jit_cache.py pack $cache "$OUT/jitcache_slora"
}

slora_then_guard() {  # one H200: the guard's slora_disk part (`slora_regress`), then its serving trace, one machine;
  # .jitcache carried (the guard's programs and slora_disk's: jitcache_slora)
  slora_regress 130
  mkdir -p "$OUT/g"
  timeout $((LIMIT - SECONDS - 5)) python3 bench/regress.py --only serve --out-dir "$OUT/g" --compile-cache $JIT_CACHE 2>&1 \
      | grep -v "cuda_timer\|Warning\|^W11" | tail -n 28
  rm -f "$OUT"/g/regress_serve.png
}

compress_cached() {  # one H200, issue 34 item 5: Compress-then-Serve (1000 adapters: single, compressed and
  # uncompressed side by side), its compile cache unpacked first when carried (.jitcache_compress) and packed at
  # the end when not, whatever the run reached: the compressed engine's programs compile for > 2 min (one
  # 256-token forward 2m9s on 11-29), so a first call fills the cache and a second (carrying it) runs all three
  gpu_setup
  local cache=/tmp/jc_compress
  [ -e .jitcache_compress/jitcache_compress.part00 ] && python3 bench/jit_cache.py unpack \
      .jitcache_compress/jitcache_compress $cache
  timeout $((LIMIT - SECONDS - 75)) python3 bench/compress_serve.py --requests 300 \
      --cases "slora:n=1000,alpha=1,cv=1,mode=throughput" --compile-cache $cache --out "$OUT/compress_serve_h200.json" \
      2>&1 | grep -v "cuda_timer\|Warning\|^W11\|slow_operation\|\*\*\*\|Very slow\|^$" | tail -n 12
  [ -e .jitcache_compress/jitcache_compress.part00 ] || timeout 70 python3 bench/jit_cache.py pack $cache \
      "$OUT/jitcache_compress"
}

cold_caches() {  # 2 or 4 x H200, one call, pinned (PIN=1): every figure of issue 34 that this tree can change, from
  # empty compile caches (a change that alters the step programs' lowered text, e.g. `next/pool-committed`), and the
  # caches packed for the next calls: GPU 0 the guard's serving trace (-> jitcache.partNN, for .jitcache), GPU 1
  # its slora_disk part (-> jitcache_slora.partNN, for .jitcache_slora); on 4 GPUs also GPU 2 Compress-then-Serve's
  # first pass (-> jitcache_compress.partNN, for .jitcache_compress; `compress_cached` then runs all three) and
  # GPU 3 the 100-request distinct trace (item 4). .whl carried, no cache
  nvidia-smi -L
  export PIN=1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  local work=/tmp/cold t=$((LIMIT - 110)) gpus
  gpus=$(nvidia-smi -L | wc -l)
  mkdir -p $work/guard $work/slora $work/compress $work/serve100
  job guard 0 $t python3 bench/regress.py --only serve --out-dir $work/guard --compile-cache /tmp/jc_guard
  job slora 1 $t python3 bench/regress.py --only slora_disk --out-dir $work/slora --adapter-dir /tmp/slora_adapters \
      --compile-cache /tmp/jc_slora
  if [ "$gpus" -ge 4 ]; then
    job compress 2 $t python3 bench/compress_serve.py --requests 300 --cases "slora:n=1000,alpha=1,cv=1,mode=throughput" \
        --compile-cache /tmp/jc_compress --out $work/compress/compress_serve_h200.json
    job serve100 3 $t python3 bench/serve.py --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 \
        --prefill-chunk 2048 --requests 100 --cases punica:distinct --compile-cache /tmp/jc_100 \
        --out $work/serve100/serve100_h200.json
  fi
  wait
  rm -f $work/*/regress_*.png $work/serve100/*.png
  mv "$OUT"/log_*.txt $work/ 2>/dev/null
  for f in $work/log_*.txt; do grep -v "cuda_timer\|Warning\|^W11\|slow_operation\|\*\*\*\|Very slow\|^$" "$f" | tail -n 30; done
  tar czf "$OUT/cold_caches.tgz" -C $work .
  python3 bench/jit_cache.py pack /tmp/jc_guard "$OUT/jitcache" &
  python3 bench/jit_cache.py pack /tmp/jc_slora "$OUT/jitcache_slora" &
  [ -d /tmp/jc_compress ] && python3 bench/jit_cache.py pack /tmp/jc_compress "$OUT/jitcache_compress" &
  wait
}

slora_alpha1() {  # one H200, short: the slora_disk n=2000 alpha=1 case alone (disk and one, 400 requests), with
  # slora_disk's compile cache (.jitcache_slora) carried; ~80 s
  gpu_setup
  python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters --write-only 2>&1 | tail -n 1
  timeout $((LIMIT - SECONDS - 5)) python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters \
      --cases "slora:n=2000,alpha=1" --runs disk one --mode throughput --requests 400 --compile-cache $JIT_CACHE \
      --out "$OUT/slora_alpha1.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 3
  python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['results']:
    for run in ('disk', 'one'):
        for s in r[run]['slowest_steps'][:8]:
            print(run, s['step'], s['kind'], s['tokens'], round(s['ms'], 1),
                  {k: round(v, 1) for k, v in s.get('phases_ms', {}).items() if v >= 1})" "$OUT/slora_alpha1.json"
}

slora_then_compress() {  # one H200: slora_alpha1 (the slowest steps with their host phases), then
  # compress_cached in the time left (its first pass packs the compile cache); .whl and .jitcache_slora carried
  slora_alpha1
  compress_cached
}

prefetch_ab_x2() {  # 2 x H200, pinned: GPU 0 Compress-then-Serve (its cache .jitcache_compress carried, packed
  # again at the end), GPU 1 the slora_disk n=2000 alpha=1 disk run with prefetch over the whole queue
  # (--prefetch-steps 0), then the guard's slora part on the default (then 2 steps; now 0) — the
  # A/B of the prefetch lookahead (issue 34 item 5); .whl, .jitcache_slora and .jitcache_compress carried
  gpu_setup
  export PIN=1
  local work=/tmp/ab t=$((LIMIT - SECONDS - 40))
  mkdir -p $work
  [ -e .jitcache_compress/jitcache_compress.part00 ] && python3 bench/jit_cache.py unpack \
      .jitcache_compress/jitcache_compress /tmp/jc_compress
  job compress 0 $t python3 bench/compress_serve.py --requests 300 --cases "slora:n=1000,alpha=1,cv=1,mode=throughput" \
      --compile-cache /tmp/jc_compress --out $work/compress_serve_h200.json
  job slora 1 $t bash -c "python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters --cases slora:n=2000,alpha=1 \
      --runs disk --mode throughput --requests 400 --prefetch-steps 0 --compile-cache $JIT_CACHE \
      --out $work/slora_prefetch0.json; python3 bench/regress.py --only slora_disk --out-dir $work/slora \
      --adapter-dir /tmp/slora_adapters --compile-cache $JIT_CACHE"
  wait
  mv "$OUT"/log_*.txt $work/ 2>/dev/null
  rm -f $work/slora/regress_*.png
  for f in $work/log_*.txt; do echo "== $f"; grep -v "cuda_timer\|Warning\|^W11\|slow_operation\|\*\*\*\|Very slow\|^$" "$f" | tail -n 30; done
  for f in $work/slora_prefetch0.json $work/slora/regress_slora_disk.json; do python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['results']:
    x = r['disk']
    print(sys.argv[1].split('/')[-1], r['case'], round(x['tokens_per_s']), [(s['step'], s['kind'], round(s['ms'], 1),
          {k: round(v, 1) for k, v in s.get('phases_ms', {}).items() if v >= 2}) for s in x['slowest_steps'][:5]])" $f; done
  tar czf "$OUT/prefetch_ab_x2.tgz" -C $work .
  [ -e .jitcache_compress/jitcache_compress.part00 ] && timeout 60 python3 bench/jit_cache.py pack /tmp/jc_compress \
      "$OUT/jitcache_compress"
}

load_probe() {  # one H200, ~1-2 min: the host's cost of one adapter load on the engine's path (prefetch issue,
  # slot write; alone, in a burst, beside a busy device; one flat array for comparison), for the 8B adapters of
  # the serving traces (all seven projections, 84 MB) and of the disk trace (q/v, ~8 MB); .whl carried
  gpu_setup
  python3 bench/load_probe.py --targets all --out "$OUT/load_probe_all_h200.json" 2>&1 | grep -v "cuda_timer\|Warning" | tail -n 8
  python3 bench/load_probe.py --targets qv --out "$OUT/load_probe_qv_h200.json" 2>&1 | grep -v "cuda_timer\|Warning" | tail -n 8
}

xla_lora_check() {  # one H200, ~8 min: issue 34 item 3's next questions in one call (.whl and .jitcache carried):
  # (1) the decode LoRA in elementwise form against the kernel pair on the 8-layer chain (lora_stream_probe
  # --variants inline xla, kernels a call counted), (2) the host's cost of a load (load_probe), (3) the guard's
  # distinct trace with hybrid and hybrid_xla in one run (bench/serve.py, 64 requests, the README's sizes)
  gpu_setup
  timeout 200 python3 bench/lora_stream_probe.py --layers 8 --rows 32 64 --profile --variants inline xla \
      --out "$OUT/lora_stream_probe_xla_h200.json" 2>&1 | grep -v "cuda_timer\|Warning" | tail -n 4
  timeout 120 python3 bench/load_probe.py --targets all --out "$OUT/load_probe_all_h200.json" 2>&1 \
      | grep -v "cuda_timer\|Warning" | tail -n 8
  timeout $((LIMIT - SECONDS - 10)) python3 bench/serve.py --lora-backend hybrid hybrid_xla --max-num-seqs 256 \
      --token-budget 2048 --prefill-chunk 2048 --requests 64 --cases punica:distinct --compile-cache $JIT_CACHE \
      --out "$OUT/serve_xla_ab_h200.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 8
}

xla_lora_disk() {  # one H200, ~8 min: the disk trace (n=2000, alpha 1, 400 requests, disk run only) with hybrid
  # and with hybrid_xla (the same mixed steps, the decode steps' LoRA as kernels / in elementwise form over the
  # paged rows); .whl carried (neither backend's programs are in .jitcache_slora: both compile)
  gpu_setup
  python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters --write-only 2>&1 | tail -n 1
  for backend in hybrid hybrid_xla; do
    timeout $(((LIMIT - SECONDS - 10) / 2)) python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_adapters \
        --cases "slora:n=2000,alpha=1" --runs disk --mode throughput --requests 400 --lora-backend $backend \
        --compile-cache $JIT_CACHE --out "$OUT/slora_disk_$backend.json" 2>&1 | grep -v "cuda_timer\|Warning\|^W11" | tail -n 2
  done
}

uncompressed_check() {  # one H200, ~5 min from an empty cache: Compress-then-Serve's single and uncompressed runs
  # alone (--skip-compressed: nothing compressed), the run that paid ~11 ms a load for host zeros before
  # AdapterPool._zeros (issue 34 item 5); .whl carried (.jitcache_compress, 59 MB, no longer fits the carry)
  gpu_setup
  timeout $((LIMIT - SECONDS - 5)) python3 bench/compress_serve.py --requests 300 --skip-compressed \
      --cases "slora:n=1000,alpha=1,cv=1,mode=throughput" --out "$OUT/compress_serve_uncompressed_h200.json" 2>&1 \
      | grep -v "cuda_timer\|Warning\|^W11\|slow_operation\|\*\*\*\|Very slow\|^$" | tail -n 8
}

_disk_job() {  # _disk_job NAME GPU SECONDS PREFIX ARGS...: a background job on GPU (job, PIN as set) writing
  # 2000 adapter folders of its own, then the disk trace (n=2000, alpha 1, 400 requests, disk and one) with
  # ARGS added -> $OUT/slora_NAME.json; PREFIX: the shell commands before it (the caller's setup)
  local name=$1 gpu=$2 t=$3 prefix=$4
  shift 4
  job $name $gpu $t bash -c "$prefix; python3 bench/slora_disk.py --adapters 2000 --dir /tmp/slora_$gpu --write-only \
      2>&1 | tail -n 1; timeout \$(($t - 10 - \$SECONDS)) python3 bench/slora_disk.py --adapters 2000 \
      --dir /tmp/slora_$gpu --cases 'slora:n=2000,alpha=1' --runs disk one --mode throughput --requests 400 \
      $* --compile-cache $JIT_CACHE --out $OUT/slora_$name.json 2>&1 | grep -v 'cuda_timer\|Warning\|^W11' | tail -n 4"
}

xla_x4() {  # 4 x H200, one call, pinned (PIN=1), issue 34 items 3 and 5: GPU 0 xla_lora_check (.jitcache carried);
  # GPU 1 uncompressed_check; GPUs 2 and 3 the disk trace (n=2000, alpha 1, 400 requests) with hybrid and with
  # hybrid_xla side by side (each its own adapter folders; both compile: .jitcache_slora is not carried)
  nvidia-smi -L
  export PIN=1 OUT
  gpu_setup >/dev/null
  local t=$((LIMIT - 15)) src="source bench/device_runs.sh; export GPU_SETUP_DONE=1 PYTHONPATH=$PYTHONPATH"
  job xla 0 $t bash -c "$src; LIMIT=$t xla_lora_check"
  job uncompressed 1 $t bash -c "$src; LIMIT=$t uncompressed_check"
  _disk_job disk_hybrid 2 $t "$src" --lora-backend hybrid
  _disk_job disk_hybrid_xla 3 $t "$src" --lora-backend hybrid_xla
  wait
  collect_logs xla_x4
}

_lof_setup() {  # lof_x2a / lof_x2b: the carried cache and wheels once, the job command's prefix and log filter
  nvidia-smi -L
  export PIN=1 OUT
  gpu_setup >/dev/null
  T=$((LIMIT - 15)) SRC="source bench/device_runs.sh; export GPU_SETUP_DONE=1 PYTHONPATH=$PYTHONPATH"
  FILTER="grep -v 'cuda_timer\|Warning\|^W11\|slow_operation\|\*\*\*\|Very slow\|^\$'"
  COMPRESS="python3 bench/compress_serve.py --requests 300 --cases 'slora:n=1000,alpha=1,cv=1,mode=throughput'"
}

_serve100() {  # _serve100 POLICY: the 100-request distinct trace (base and LoRA) with that queue order
  echo "timeout 270 python3 bench/serve.py --lora-backend hybrid --max-num-seqs 256 --token-budget 2048 \
      --prefill-chunk 2048 --requests 100 --cases punica:distinct --schedule-policy $1 --compile-cache $JIT_CACHE \
      --out $OUT/serve100_$1_h200.json 2>&1 | $FILTER | tail -n 6"
}

lof_x2a() {  # 2 x H200, one call, pinned (PIN=1), issue 34 items 4-5 (.whl and .jitcache carried): the 100-request
  # distinct trace with the fcfs (GPU 0) and the lof queue (GPU 1), each with its own base run; then on GPU 0
  # Compress-then-Serve's single and uncompressed runs (pools of the adapters' q/v only)
  _lof_setup
  job serve100_fcfs_uncompressed 0 $T bash -c "$SRC; $(_serve100 fcfs); timeout \$(($T - 5 - \$SECONDS)) $COMPRESS \
      --skip-compressed --out $OUT/compress_serve_uncompressed_qv_h200.json 2>&1 | $FILTER | tail -n 6"
  job serve100_lof 1 $T bash -c "$SRC; $(_serve100 lof)"
  wait
  rm -f "$OUT"/*.png
  collect_logs lof_x2a
}

lof_x2b() {  # 2 x H200, one call, pinned (PIN=1), issue 34 items 2 and 5 (.whl and .jitcache carried): GPU 0 the
  # guard's serving trace; GPU 1 Compress-then-Serve's single and compressed runs (pools of q/v only)
  _lof_setup
  job guard 0 $T bash -c "$SRC; mkdir -p $OUT/guard; timeout $((T - 5)) python3 bench/regress.py --only serve \
      --out-dir $OUT/guard --compile-cache $JIT_CACHE 2>&1 | $FILTER | tail -n 40"
  job compressed 1 $T bash -c "$SRC; timeout $((T - 5)) $COMPRESS --skip-uncompressed \
      --out $OUT/compress_serve_compressed_qv_h200.json 2>&1 | $FILTER | tail -n 6"
  wait
  rm -f "$OUT"/*.png "$OUT"/guard/*.png
  collect_logs lof_x2b
}

compress_full() {  # one H200, ~5-6 min from an empty cache (.whl carried), issue 34 item 5: Compress-then-Serve's
  # single, compressed and uncompressed runs (S-LoRA n=1000, 300 requests; distinct prompts, q/v pools); both
  # engines' programs compiled first, 16 threads at a time, then the collection made and compressed
  gpu_setup
  timeout $((LIMIT - SECONDS - 5)) python3 bench/compress_serve.py --requests 300 \
      --cases "slora:n=1000,alpha=1,cv=1,mode=throughput" --out "$OUT/compress_serve_h200.json" 2>&1 \
      | grep -v "cuda_timer\|Warning\|^W11\|slow_operation\|\*\*\*\|Very slow\|^$" | tail -n 10
}

compress_x2() {  # 2 x H200, one call, pinned (PIN=1), issue 34 item 5 (.whl carried): GPU 1 compiles both engines'
  # programs into the shared cache (`compress_serve.py --compile-only`: the compressed engine's took minutes a
  # program on the H200, 11-29) while GPU 0 makes and compresses the collection (`--make-only --collection`);
  # then GPU 0 runs single, compressed and uncompressed from the saved collection and the shared cache
  nvidia-smi -L
  export PIN=1 OUT
  gpu_setup >/dev/null
  local t=$((LIMIT - 15)) filter="grep -v 'cuda_timer\|Warning\|^W11\|slow_operation\|\*\*\*\|Very slow\|^\$'"
  local src="source bench/device_runs.sh; export GPU_SETUP_DONE=1 PYTHONPATH=$PYTHONPATH"
  local run="python3 bench/compress_serve.py --requests 300 --cases 'slora:n=1000,alpha=1,cv=1,mode=throughput'"
  rm -f /tmp/compile_done
  job compile 1 $t bash -c "$src; timeout $((t - 5)) $run --compile-only 2>&1 | $filter | tail -n 3; touch /tmp/compile_done"
  job compress 0 $t bash -c "$src; $run --make-only --collection /tmp/collection 2>&1 | $filter | tail -n 2;
      while [ ! -e /tmp/compile_done ]; do sleep 2; done;
      timeout \$(($t - 5 - \$SECONDS)) $run --collection /tmp/collection --out $OUT/compress_serve_h200.json 2>&1 \
      | $filter | tail -n 8"
  wait
  collect_logs compress_x2
}

slora_lof_x2() {  # 2 x H200, one call, pinned (PIN=1), issue 34 item 5 (.whl and .jitcache_slora carried): the disk
  # trace (n=2000, alpha 1, 400 requests, disk and one) with the fcfs (GPU 0) and the lof queue (GPU 1), each
  # with its own adapter folders and one-adapter run
  nvidia-smi -L
  export PIN=1 OUT
  gpu_setup >/dev/null
  local t=$((LIMIT - 15)) src="source bench/device_runs.sh; export GPU_SETUP_DONE=1 PYTHONPATH=$PYTHONPATH"
  _disk_job disk_fcfs 0 $t "$src" --schedule-policy fcfs
  _disk_job disk_lof 1 $t "$src" --schedule-policy lof
  wait
  collect_logs slora_lof_x2
}
