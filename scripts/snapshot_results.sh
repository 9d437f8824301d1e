#!/bin/bash
# Stage a consistent snapshot of the live results database and the report rendered from it, while
# sweeps may still be writing to results/fedprism.db. The snapshot goes into git's index directly
# (git hash-object + update-index), so the live file is never read half-written; the live file is
# then marked skip-worktree so that `git add -A` does not stage it by accident. The report command is
# the one in results/README.md (and REPORTS in tests/test_committed_results.py): change all three together.
#   bash scripts/snapshot_results.sh && git commit -m "results: ..."
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
.venv/bin/python - "$tmp/snap.db" <<'PY'
import sqlite3, sys
src = sqlite3.connect("file:results/fedprism.db?mode=ro", uri=True)
dst = sqlite3.connect(sys.argv[1])
src.backup(dst)
dst.execute("PRAGMA journal_mode=DELETE")
assert dst.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
dst.execute("VACUUM")
dst.close()
PY
cp "$tmp/snap.db" "$tmp/render.db"
rm -rf results/paper_fmnist
.venv/bin/fedprism report --db "$tmp/render.db" --sweep paper_fmnist_dir01 --sweep paper_fmnist_dir03 \
    --sweep paper_fmnist_dir05 --sweep fedprism_ablation_temperature --sweep fedamp_ablation_mu \
    --sweep paper_fmnist_dir01_pfl --sweep fedamp_mu_validation --sweep fedprism_validation \
    --sweep fedprism_ablation_inference_weight --sweep paper_fmnist_dir01_pfl_more \
    --reference fedprism-paper-fmnist \
    --out results/paper_fmnist > /dev/null
rm -rf results/fedsub
.venv/bin/fedprism report --db "$tmp/render.db" --sweep fedsub_static --sweep fedsub_dynamic \
    --sweep fedsub_prototypes --out results/fedsub > /dev/null
rm -rf results/fedprism_ablations
.venv/bin/fedprism report --db "$tmp/render.db" --sweep fedprism_ablation_components --sweep fedprism_ablation_alpha \
    --reference fedprism-paper-fmnist --out results/fedprism_ablations > /dev/null
rm -rf results/pfpl_mixed
.venv/bin/fedprism report --db "$tmp/render.db" --sweep pfpl_mixed --out results/pfpl_mixed > /dev/null
rm -rf results/clust_psi_pfl_fmnist
.venv/bin/fedprism report --db "$tmp/render.db" --sweep clust_psi_pfl_fmnist --out results/clust_psi_pfl_fmnist > /dev/null
rm -rf results/clust_psi_pfl_fmnist_lenet5
.venv/bin/fedprism report --db "$tmp/render.db" --sweep clust_psi_pfl_fmnist_lenet5 \
    --out results/clust_psi_pfl_fmnist_lenet5 > /dev/null
rm -rf results/fedprism_gate
.venv/bin/fedprism report --db "$tmp/render.db" --sweep fedprism_gate --out results/fedprism_gate > /dev/null
git update-index --no-skip-worktree results/fedprism.db 2>/dev/null || true
blob=$(git hash-object -w "$tmp/snap.db")
git update-index --add --cacheinfo "100644,$blob,results/fedprism.db"
git update-index --skip-worktree results/fedprism.db
git add results/paper_fmnist results/fedsub results/pfpl_mixed results/fedprism_ablations results/clust_psi_pfl_fmnist \
    results/clust_psi_pfl_fmnist_lenet5 results/fedprism_gate
rm -rf "$tmp"
echo "staged results/fedprism.db ($blob), results/paper_fmnist/, results/fedsub/, results/pfpl_mixed/,"
echo "results/fedprism_ablations/, results/clust_psi_pfl_fmnist/, results/clust_psi_pfl_fmnist_lenet5/ and results/fedprism_gate/"
