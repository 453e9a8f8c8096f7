"""Command lines: each turns flags into a config and calls the layer below.

``dlgs-train`` (`train`), ``dlgs-plan`` (`plan`), ``dlgs-launch`` (`launch`),
``dlgs-demo`` (`demo`) and ``python -m dlgs_jax.cli.benchmark`` (`benchmark`).
"""
