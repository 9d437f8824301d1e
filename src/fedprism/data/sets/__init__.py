"""The built-in datasets, one module each: module ``NAME.py`` declares the ``DatasetSpec`` of dataset
``NAME`` and registers it on :data:`fedprism.data.base.DATASETS`, which imports a module only when its
dataset is used. docs/adding-a-dataset.md shows how to add one (here, or as a plugin of another package).
"""
