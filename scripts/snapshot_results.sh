#!/bin/bash
# Stage the committed results: the live store results/fedprism.db as a dump (results/store.json,
# results/runs/<run id>.json.gz, results/sweeps/<sweep>.json; `fedprism store dump`, docs/reproducibility.md)
# and the reports rendered from it, while sweeps may still be writing to the store. The dump reads the
# store read-only in one read transaction (a consistent snapshot) and writes only the files whose content
# changed, so a commit grows by the runs it adds. The reports are rendered from a store built from the
# dump itself (`fedprism store load`), i.e. from exactly what is committed. The report commands are the
# ones in results/README.md (and REPORTS in tests/test_committed_results.py): change all three together.
#   bash scripts/snapshot_results.sh && git commit -m "results: ..."
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/fedprism store dump --db results/fedprism.db --out results/
.venv/bin/fedprism store load results/ --db "$tmp/render.db" > /dev/null
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
rm -rf results/baselines_fmnist
.venv/bin/fedprism report --db "$tmp/render.db" --sweep paper_fmnist_dir01 --sweep paper_fmnist_dir01_pfl \
    --sweep paper_fmnist_dir01_pfl_more --sweep baselines_fmnist_dir01 --no-plots --out results/baselines_fmnist > /dev/null
rm -rf results/participation_gap
.venv/bin/fedprism report --db "$tmp/render.db" --sweep participation_gap --no-plots --out results/participation_gap > /dev/null
# the dump's own paths only (a removed run's file is staged as removed too); the store itself is not in git
git add -A -- results/store.json results/runs results/sweeps
git add results/paper_fmnist results/fedsub results/pfpl_mixed results/fedprism_ablations results/clust_psi_pfl_fmnist \
    results/clust_psi_pfl_fmnist_lenet5 results/fedprism_gate results/baselines_fmnist results/participation_gap
echo "staged the dump (results/store.json, results/runs/, results/sweeps/) and results/paper_fmnist/, results/fedsub/,"
echo "results/pfpl_mixed/, results/fedprism_ablations/, results/clust_psi_pfl_fmnist/, results/clust_psi_pfl_fmnist_lenet5/"
echo "results/fedprism_gate/, results/baselines_fmnist/ and results/participation_gap/; \`git diff --cached --stat\`"
echo "shows what the commit adds"
