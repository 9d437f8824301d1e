#!/usr/bin/env bash
# One GPU session, as one script with a deadline, every part alone on the GPU in this order: the CUDA
# engine bench (bench), the FedPrism paper runs (paper: FedAvg, then fedprism_dual; paper configuration,
# seed 0), `bench/dual_cost.py --device cuda` (dualcost), the routing study on the final states of both
# seeds of sweeps/fedprism_validation.toml (routing: the runs kept in $OUT/val.db, the tables in
# $OUT/routing_study_final.md), and the Clust-PSI-PFL FMNIST sweep (sweep: one `--workers 4` sweep).
# PARTS chooses among "graphs oldgraphs convscale evalprofile bench paper dualcost routing sweep" (graphs:
# `bench/cuda_graphs.py` and the CUDA tests; oldgraphs: the same bench from the checkout in $OLD;
# convscale: `bench/conv_scaling.py`; evalprofile: `bench/eval_profile.py` for fedprism_dual and
# FedAvg). Every part is bounded by `timeout` and writes under $OUT; runs stopped by the deadline are
# interrupted cleanly (SIGINT) and resume on the next call or on any other machine.
#
#   OUT=gpu-out BUDGET=460 bash bench/gpu_session.sh      # needs CUDA and FMNIST ($FEDPRISM_DATA, or
#                                                         # the four .gz files in .gpu/data/fmnist/)
#   gunzip gpu-out/*.gz && fedprism merge gpu-out/sweep.db --db results/fedprism.db   # finished runs home
#
# The stores written here never hold final models (keep_final=false) so that they stay small. THREADS
# (default 8) is the torch thread count of each single run and of eval_profile.
set -u
OUT=${OUT:-gpu-out}
BUDGET=${BUDGET:-460}
START=$(date +%s)
mkdir -p "$OUT" "$OUT/logs"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
[ -d .gpu/data ] && export FEDPRISM_DATA="$PWD/.gpu/data"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
# torch's host threads for one run alone on the GPU (hashing rows for the evaluation caches, mixing models
# in float64): a share of the host's cores (the sweeps of several workers below pass 0: each worker
# keeps its share of the cores, `fedprism.experiment.sweep.worker_threads`)
THREADS=${THREADS:-8}
Q=${QUICK:+--quick}          # QUICK=1: the CI-size smoke version of every part
left() { echo $(( START + BUDGET - $(date +%s) )); }

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
  nproc --all
} > "$OUT/logs/machine.txt" 2>&1
cat "$OUT/logs/machine.txt"

PARTS=${PARTS:-graphs evalprofile bench paper dualcost sweep}   # which parts to run (routing: only when named)
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }

# 0. CUDA graphs: the CUDA tests (graphs: bit equality; the stream scorer's waits), then the same
#    training rounds with and without graphs
if has graphs; then
  timeout -s INT 150 $PY -m pytest -q -p no:cacheprovider tests/test_engine_equivalence.py \
    tests/test_fedprism_dual.py -k "graph or cuda" > "$OUT/cuda_graphs_tests.txt" 2>&1
  echo "graph tests rc=$? after $(( $(date +%s) - START )) s"; tail -3 "$OUT/cuda_graphs_tests.txt"
  timeout -s INT 150 $PY bench/cuda_graphs.py --device "$DEVICE" --rounds "${GRAPH_ROUNDS:-6}" --fused $Q \
    > "$OUT/cuda_graphs.txt" 2>&1
  echo "graphs bench rc=$? after $(( $(date +%s) - START )) s"; tail -6 "$OUT/cuda_graphs.txt"
fi

# 0b. the same bench with the code of another checkout ($OLD: a tree with its own src/ and bench/), for a
#     before/after comparison on one machine in one call
if has oldgraphs && [ -n "${OLD:-}" ]; then
  timeout -s INT 150 $PY "$OLD/bench/cuda_graphs.py" --device "$DEVICE" --rounds "${GRAPH_ROUNDS:-6}" \
    --fused $Q > "$OUT/cuda_graphs_old.txt" 2>&1
  echo "graphs bench ($OLD) rc=$? after $(( $(date +%s) - START )) s"; tail -6 "$OUT/cuda_graphs_old.txt"
fi
# 0c. how a step's cost grows with the models trained together: grouped convolution against unfold + GEMM
if has convscale; then
  timeout -s INT 120 $PY bench/conv_scaling.py --device "$DEVICE" $Q > "$OUT/conv_scaling.txt" 2>&1
  echo "conv scaling rc=$? after $(( $(date +%s) - START )) s"; tail -8 "$OUT/conv_scaling.txt"
fi

# 0d. where an evaluation goes: fedprism_dual's and FedAvg's, profiled (paper configuration, 4 rounds)
if has evalprofile; then
  for m in fedprism_dual fedavg; do
    timeout -s INT 150 $PY bench/eval_profile.py --device "$DEVICE" --method $m --threads "$THREADS" $Q \
      > "$OUT/eval_profile_$m.txt" 2>&1
    echo "eval profile $m rc=$? after $(( $(date +%s) - START )) s"; sed -n 2,3p "$OUT/eval_profile_$m.txt"
  done
fi

# 1. the engine bench, alone on the GPU
if has bench; then
  timeout -s INT 200 $PY bench/engine.py --device "$DEVICE" --rounds 3 $Q > "$OUT/bench_engine_cuda.txt" 2>&1
  echo "bench rc=$? after $(( $(date +%s) - START )) s"; tail -25 "$OUT/bench_engine_cuda.txt"
fi

# 2. the paper runs (paper configuration, seed 0, compile=auto), one after another, each alone on the GPU
#    (clean timings for the fedprism_dual / FedAvg cost ratio); then the dual-cost bench; then the
#    Clust-PSI-PFL sweep rows until the deadline (25 s kept for packing)
stop() { echo $(( $(left) - 25 )); }
run() {   # run NAME SWEEPFILE DB ARGS...
  local name=$1 file=$2 db=$3 s; shift 3; s=$(stop)
  [ "$s" -gt 10 ] || { echo "$name skipped: deadline" >> "$OUT/logs/done.txt"; return; }
  timeout -s INT "$s" $PY -m fedprism sweep "$file" --db "$db" --quiet $Q "$@" device="$DEVICE" \
    threads="$THREADS" \
    keep_final="${KEEP_FINAL:-false}" > "$OUT/logs/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - START )) s" >> "$OUT/logs/done.txt"
}
touch "$OUT/logs/done.txt"
if has paper; then
  run paper_fedavg sweeps/paper_fmnist_dir01.toml "$OUT/paper.db" --only FedAvg --seed 0
  run paper_dual sweeps/fmnist_dual_dir01.toml "$OUT/paper.db" --only FedPrism --seed 0
fi
if has dualcost && [ "$(stop)" -gt 60 ]; then
  timeout -s INT "$(stop)" $PY bench/dual_cost.py --device "$DEVICE" --rounds 4 $Q \
    --only "${DUALCOST:-dual own;dual own fused;dual specialist}" > "$OUT/dual_cost_cuda.txt" 2>&1
  echo "dualcost rc=$? at $(( $(date +%s) - START )) s" >> "$OUT/logs/done.txt"; tail -8 "$OUT/dual_cost_cuda.txt"
fi
# the routing study on final states: both seeds of the validation sweep (kept final states, on this
# machine only), then every rule of scripts/routing_study.py scored from them (tables under $OUT)
if has routing; then
  KEEP_FINAL=true THREADS=0 run routing_runs sweeps/fedprism_validation.toml "$OUT/val.db" --workers 2
  runs=$($PY -c "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); print(' '.join(r for (r,) in c.execute(
\"select run_id from runs where status = 'finished' and method = 'fedprism_dual' order by run_id\")))" "$OUT/val.db")
  if [ -n "$runs" ] && [ "$(stop)" -gt 30 ]; then
    timeout -s INT "$(stop)" $PY scripts/routing_study.py --db "$OUT/val.db" $runs --out "$OUT/routing_study_final.md" \
      > "$OUT/logs/routing_study.log" 2>&1
    echo "routing_study rc=$? at $(( $(date +%s) - START )) s" >> "$OUT/logs/done.txt"
  fi
fi
# the Clust-PSI-PFL rows: one sweep with a few workers (every worker holds its clients' models and
# optimiser states on the GPU; 14 processes at once ran out of the H100's 80 GiB)
has sweep && THREADS=0 run psi sweeps/clust_psi_pfl_fmnist.toml "$OUT/sweep.db" \
  --workers "${SWEEP_WORKERS:-4}" \
  compile=false
cat "$OUT/logs/done.txt"

# 3. pack: fold the WAL into each store, compress, keep the logs in one file
for db in "$OUT/paper.db" "$OUT/val.db" "$OUT/sweep.db"; do
  [ -f "$db" ] || continue
  $PY -c "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('pragma wal_checkpoint(TRUNCATE)'); \
c.execute('pragma journal_mode=delete'); print(sys.argv[1], c.execute('select status, count(*) from runs group by status').fetchall())" "$db"
  rm -rf "$db.ckpt" "$db.final" "$db-wal" "$db-shm"
  gzip -f "$db"
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
ls -la "$OUT"
