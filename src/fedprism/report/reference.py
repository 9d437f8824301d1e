"""Published numbers to put next to ours (`fedprism report --reference NAME`).

Each reference maps a setting, spelt as the report's `setting_of` spells it (dataset, partition with its
parameters, clients N, rounds T), to method label -> (Glob, Loc) in %, as printed in the source. N and
T are the published protocol: a setting of ours with the same partition but another N or T (a 30-round
diagnostic, say) is not put next to the paper.
Labels are our sweep row labels (the paper's "FedCFL" is our "CFL").
"""

from __future__ import annotations

#: The FedPrism paper (FedPrism: Adaptive Personalized Federated Learning under Non-IID Data, arXiv
#: 2603.08252), FMNIST column of Tables 1 (Dirichlet 0.1), 6 (0.3) and 7 (0.5), and its FMNIST
#: ablations at Dirichlet 0.1 (Tables 9 and 11, appendix 8.5 and 8.7);
#: 100 clients, 100 rounds (section 4.5)
FEDPRISM_PAPER_FMNIST = {
    "fmnist dirichlet(alpha=0.1) N=100 T=100": {
        "FedPrism": (81.93, 95.66), "FedAvg": (84.35, 85.01), "IFCA": (35.52, 87.05),
        "FedClust": (10.00, 58.11), "FedAMP": (10.36, 55.58), "CFL": (10.00, 44.86), "Local": (30.51, 95.05),
        # Table 9 (components; the paper's Full FedPrism is its alpha 0.9 row) and Table 11 (initial alpha)
        "Pure Global": (84.81, 95.70), "Pure Cluster": (82.37, 95.54), "Global + Cluster": (84.21, 95.51),
        "Pure Private": (19.98, 95.15), "Full FedPrism": (84.83, 95.55),
        "alpha 0.1": (27.46, 95.19), "alpha 0.3": (34.95, 95.29), "alpha 0.5": (41.83, 95.20),
        "alpha 0.7": (63.62, 95.44), "alpha 0.9": (84.83, 95.55)},
    "fmnist dirichlet(alpha=0.3) N=100 T=100": {
        "FedPrism": (82.59, 90.53), "FedAvg": (87.10, 86.46), "IFCA": (52.5, 88.76),
        "FedClust": (78.73, 69.32), "FedAMP": (32.27, 89.83), "CFL": (14.13, 73.03), "Local": (47.38, 90.13)},
    "fmnist dirichlet(alpha=0.5) N=100 T=100": {
        "FedPrism": (88.12, 88.01), "FedAvg": (87.33, 87.24), "IFCA": (61.39, 88.51),
        "FedClust": (85.19, 81.09), "FedAMP": (48.66, 87.21), "CFL": (75.44, 80.55), "Local": (56.08, 87.11)},
}

REFERENCES = {"fedprism-paper-fmnist": FEDPRISM_PAPER_FMNIST}

#: a difference above this many points is flagged (and must be explained in results/README.md)
FLAG_POINTS = 3.0
