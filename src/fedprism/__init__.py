"""fedprism: personalized federated learning under non-IID data.

Fed-PRISM (global + K cluster models, soft top-m assignment, personalized ensembles) and its
baselines, on flat parameter vectors, with a vectorized engine and a SQLite results store.
"""

from fedprism._alloc import tune_allocator

__version__ = "0.1.0"

tune_allocator()

__all__ = ["__version__"]
