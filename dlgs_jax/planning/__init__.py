"""The timeline model, the planners that merge layers into messages, and predictions.

Imports only `dlgs_jax.compress`.
"""
