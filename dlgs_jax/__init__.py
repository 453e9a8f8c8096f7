"""dlgs_jax: communication-efficient synchronous data-parallel training in JAX.

The core is `dlgs`, dynamic layer-wise gradient sparsification with reused
thresholds and planned layer merging (Ju et al., J. Xi'an Jiaotong Univ. 58(9),
2024), next to the methods it is compared with: `dense`, `topk`, `lags`,
`gtopk`, `dgc` (Deep Gradient Compression) and `terngrad`.

What a user writes is exported here; everything else (collectives, states,
placement, planning, profiling, training) is importable from its submodule.
"""

from dlgs_jax.compress.deep_gradient_compression import dgc
from dlgs_jax.compress.grouping import backward_order, output_layer
from dlgs_jax.compress.hierarchical import two_level
from dlgs_jax.compress.rules import AdaptedReuse, FixedReuse, RefreshReuse
from dlgs_jax.compress.schedule import density_schedule
from dlgs_jax.compress.state import comm_report
from dlgs_jax.compress.ternary import terngrad
from dlgs_jax.compress.transforms import dense, dlgs, gtopk, lags, topk
from dlgs_jax.workload.parallel import (data_mesh, fetch, init_per_worker, squeeze_state,
                                        state_specs, unsqueeze_state)
from dlgs_jax.workload.sharded_step import data_parallel

__version__ = "0.1.0"

__all__ = [
    # The transforms: optax GradientTransformations.
    "dense", "dgc", "dlgs", "gtopk", "lags", "terngrad", "topk", "two_level",
    "density_schedule",
    # DLGS's threshold rules: the paper's fixed reuse, the refresh rule, adapted reuse.
    "FixedReuse", "RefreshReuse", "AdaptedReuse",
    # A whole data-parallel step, and its mesh.
    "data_parallel", "data_mesh",
    # Statistics: bytes sent, values selected, exact thresholds, per transform.
    "comm_report",
    # A hand-written step's per-worker state, and reading results back.
    "init_per_worker", "state_specs", "squeeze_state", "unsqueeze_state", "fetch",
    # Leaf order for the planner and the classifier head.
    "backward_order", "output_layer",
]
