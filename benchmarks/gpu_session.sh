#!/usr/bin/env bash
# Every GPU measurement and GPU-only check of graphattn in one run, for a short lease on a CUDA
# machine, the measurements of the three goals first:
#   1. benchmarks/gpu.py in fp32 on every graph: the 1M-edge graphs first (the speed goal's,
#      and two window graphs whose tiles are 26% and 89% full; seconds each), the 10M-edge
#      one (the memory goal's, where PyG's layers still fit) and the citation graphs, then the
#      50M-edge ones (the window graph of the block-sparse kernels before the others; the
#      table is written after each graph, so a step cut short keeps what it measured), with a
#      host-side profile of the fused op on the graphs of <= 1M edges (its device check,
#      fused vs reference, eager and compiled, runs before any timing);
#   2. the block-sparse kernels' forward on the 50M-edge window graph in fp32 with TF32
#      products (--tf32: on tensor cores, where full fp32 products run on the FMA units), for
#      the bandwidth goal; in the same table, on the 1M-edge random graph, the fused op
#      training with attention dropout, its mask drawn in the kernels from a seed against one
#      read from memory, and without dropout (--only dropout), and the dot and gatv2 scores
#      soft-capped and not (--only softcap) (the CSR kernels, which TF32 does not touch);
#   3. the Triton kernel tests compiled on the GPU (GRAPHATTN_TRITON_DEVICE=cuda) instead of in
#      the interpreter, the block-sparse kernels' too (bf16 among them, which the interpreter
#      cannot check) and the soft cap's (the tests that run the interpreter skip themselves
#      there: a process that ran it cannot compile afterwards), and the CUDA-only tests;
#   4. if time is left, the 50M-edge window and random graphs again in bf16;
#   5. if time is left, benchmarks/triton_tuning.py: the kernels' tiles (launch_tiles) against
#      the defaults, the row-block kernels (block_n > 1) and the block-sparse kernels' tiles
#      and warps among them, on the 1M-edge and the 50M-edge graphs, then PubMed;
#   6. if time is left, the graphs of <= 1M edges again with --no-graph-cache (every call sorts
#      the edges and reads their bounds back, as before those caches): the A/B of the caches;
#   7. if time is left, benchmarks/gpu_density.py: the fused kernels against the dense path
#      over graph density, the crossover that backend="auto" needs on CUDA;
#   8. if time is left, benchmarks/batched_global.py: global attention over mini-batches of
#      graphs, the fused kernels' sparse route against padded and grouped SDPA.
# TEARDOWN_CUPTI=1: the profile of step 1 detaches the CUDA profiling hooks when it ends (left
# attached, they slow every later kernel launch, PyG's many launches most; pytorch#144455).
# Each step has its own time limit inside the budget, so a slow step still leaves the others
# their turn. Tables go to $OUT (default: benchmarks/results/gpu_session/), the log of every
# step to $OUT/session.log: 8 files at most, what the device tool brings back (a test counts
# them). gpu.py's figures are drawn afterwards from its tables, off the device:
#   python benchmarks/gpu.py --replot benchmarks/results/gpu.md
#
# Usage: bash benchmarks/gpu_session.sh [budget in seconds, default 560]
# The Planetoid files under datasets/ are ignored by git: on a machine that gets a copy of the
# working tree, carry datasets/Cora and datasets/PubMed, or cora and pubmed are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_session}
mkdir -p "$OUT"
BUDGET=${1:-560}
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TEARDOWN_CUPTI=1
left() { echo $((BUDGET - SECONDS)); }
# a time limit of at least 1 s (timeout 0 would mean none, a negative one is refused), with
# SIGKILL 10 s after SIGTERM for what does not stop
limit() { echo "-k 10 $(($1 > 1 ? $1 : 1))"; }
LOG="$OUT/session.log"

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  "$PY" -c "import platform, torch, triton, torch_geometric as pyg; print('python', \
platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'torch_geometric', pyg.__version__)"
  [ -d datasets/Cora/raw ] && [ -d datasets/PubMed/raw ] ||
    echo "warning: datasets/Cora/raw or datasets/PubMed/raw is missing: cora, pubmed are skipped"
} 2>&1 | tee "$LOG"

echo "== 1. benchmarks/gpu.py, fp32 ($(left) s left)" | tee -a "$LOG"
timeout $(limit $(($(left) - 200))) "$PY" benchmarks/gpu.py --no-plot --profile --repeats 10 --warmup 2 \
  --graphs random-1m,window-1m,window-wide-1m,random-10m,cora,pubmed,window-50m,random-50m,local-50m \
  --out "$OUT/gpu.md" 2>&1 |
  tee -a "$LOG"

if [ "$(left)" -gt 115 ]; then
  echo "== 2. benchmarks/gpu.py, fp32 with TF32 products, block-sparse forward, window-50m; dropout, softcap and sinks, random-1m ($(left) s left)" | tee -a "$LOG"
  timeout $(limit 95) "$PY" benchmarks/gpu.py --no-plot --no-check --tf32 --only "edge_attention triton, block-sparse" \
    --only dropout --only softcap --only sinks --repeats 10 --warmup 2 --graphs window-50m,random-1m --out "$OUT/gpu_tf32.md" 2>&1 | tee -a "$LOG"
else
  echo "== 2. skipped: $(left) s left" | tee -a "$LOG"
fi

echo "== 3. Triton kernel tests on the GPU ($(left) s left)" | tee -a "$LOG"
timeout $(limit $(($(left) > 240 ? 150 : $(left) - 60))) env GRAPHATTN_TRITON_DEVICE=cuda \
  "$PY" -m pytest -q -n 8 -p no:cacheprovider tests/functional/test_triton_kernels.py \
  tests/functional/test_triton_blocks.py tests/functional/test_softcap.py \
  tests/functional/test_softmax_sinks.py::test_triton_backend_matches_the_reference \
  tests/test_pe.py::test_laplacian_pe_random_sign_flip_with_a_cuda_generator \
  tests/test_tensor_cache.py::test_values_are_kept_per_cuda_stream \
  tests/nn/test_attention_layers.py::test_layer_captured_in_a_cuda_graph_replays_on_new_features \
  -k "not compile_for_sm90" \
  2>&1 | tee -a "$LOG" | tail -25

if [ "$(left)" -gt 90 ]; then
  echo "== 4. benchmarks/gpu.py, bf16, 50M-edge window and random graphs ($(left) s left)" | tee -a "$LOG"
  timeout $(limit $(($(left) > 150 ? $(left) - 60 : $(left) - 10))) "$PY" benchmarks/gpu.py \
    --no-plot --no-check --dtype bf16 --repeats 10 --warmup 2 --graphs window-50m,random-50m \
    --out "$OUT/gpu_bf16.md" 2>&1 | tee -a "$LOG"
else
  echo "== 4. skipped: $(left) s left" | tee -a "$LOG"
fi

if [ "$(left)" -gt 150 ]; then
  echo "== 5. benchmarks/triton_tuning.py, fp32 ($(left) s left)" | tee -a "$LOG"
  timeout $(limit $(($(left) > 240 ? 150 : $(left) - 90))) "$PY" benchmarks/triton_tuning.py \
    --out "$OUT/triton_tuning.md" 2>&1 | tee -a "$LOG"
else
  echo "== 5. skipped: $(left) s left" | tee -a "$LOG"
fi

if [ "$(left)" -gt 150 ]; then
  echo "== 6. benchmarks/gpu.py, fp32, the graphs of <= 1M edges without the graph caches ($(left) s left)" | tee -a "$LOG"
  timeout $(limit 90) "$PY" benchmarks/gpu.py --no-plot --no-check --no-graph-cache --repeats 10 --warmup 2 \
    --graphs random-1m,cora,pubmed --out "$OUT/gpu_no_graph_cache.md" 2>&1 |
    tee -a "$LOG"
else
  echo "== 6. skipped: $(left) s left" | tee -a "$LOG"
fi

if [ "$(left)" -gt 60 ]; then
  echo "== 7. benchmarks/gpu_density.py ($(left) s left)" | tee -a "$LOG"
  timeout $(limit $(($(left) > 150 ? 90 : $(left) - 40))) "$PY" benchmarks/gpu_density.py \
    --table-only --out "$OUT/gpu_density.md" 2>&1 | tee -a "$LOG"
else
  echo "== 7. skipped: $(left) s left" | tee -a "$LOG"
fi

if [ "$(left)" -gt 40 ]; then
  echo "== 8. benchmarks/batched_global.py on the GPU ($(left) s left)" | tee -a "$LOG"
  timeout $(limit $(($(left) - 10))) "$PY" benchmarks/batched_global.py --device cuda \
    --table-only --output "$OUT/batched_global_gpu.md" 2>&1 | tee -a "$LOG" | tail -25
else
  echo "== 8. skipped: $(left) s left" | tee -a "$LOG"
fi
echo "== done in ${SECONDS} s" | tee -a "$LOG"
