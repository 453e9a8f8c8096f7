"""Gradient compression: selection, collectives and the optax transforms.

The lowest layer: it imports nothing else from the package. `methods` declares
every method once (its factory, options and how the planner prices it).
"""
