"""Simulators of communication schedules (plain Python, no JAX)."""
