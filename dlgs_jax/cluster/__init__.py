"""Where processes run: local multi-process launches and the emulated cluster.

`launch` starts N local processes joined by `jax.distributed`; `netns` builds
worker network namespaces joined by bandwidth-shaped links
(``python -m dlgs_jax.cluster``).
"""
