"""Every test runs with 8 simulated CPU devices (set before JAX starts)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flags)

assert jax.device_count() == 8, jax.devices()
