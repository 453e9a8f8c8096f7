"""What is trained and where: Flax models, datasets, meshes and placement.

Imports only `dlgs_jax.compress` (leaf paths). The profiler measures these models;
the train loop trains them.
"""
