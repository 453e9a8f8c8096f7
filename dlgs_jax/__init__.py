"""dlgs_jax: communication-efficient synchronous data-parallel training in JAX.

The core is `dlgs`, dynamic layer-wise gradient sparsification with reused
thresholds and planned layer merging (Ju et al., J. Xi'an Jiaotong Univ. 58(9),
2024), next to the methods it is compared with: `dense`, `topk`, `lags`,
`gtopk`, `dgc` (Deep Gradient Compression) and `terngrad`.
"""

from dlgs_jax.compress.collectives import (dense_mean, gtopk_indices, gtopk_mean, ring_allreduce,
                                  sparse_allgather_mean, sparse_allgather_means)
from dlgs_jax.compress.deep_gradient_compression import dgc
from dlgs_jax.compress.grouping import backward_order, leaf_paths, output_layer
from dlgs_jax.compress.state import (CommStats, DenseState, DGCState, DLGSState, MessageGroups,
                                     SparseState, TernGradState, comm_report, comm_stats,
                                     comm_stats_by_path, stats_summary, total_bytes)
from dlgs_jax.compress.hierarchical import TwoLevelState, two_level
from dlgs_jax.compress.schedule import DensityScheduleState, density_schedule
from dlgs_jax.compress.ternary import terngrad
from dlgs_jax.compress.transforms import dense, dlgs, gtopk, lags, topk
from dlgs_jax.compress import wire
from dlgs_jax.workload.parallel import (data_mesh, fetch, init_per_worker, place_state, replicate,
                                        shard_batch, squeeze_state, stack_per_worker, state_specs,
                                        unsqueeze_state)
from dlgs_jax.workload.sharded_step import DataParallel, StepState, data_parallel

__version__ = "0.1.0"

__all__ = [
    "CommStats", "DGCState", "DLGSState", "DataParallel", "DenseState", "DensityScheduleState",
    "MessageGroups", "SparseState", "StepState", "TernGradState", "TwoLevelState",
    "backward_order", "comm_report", "comm_stats", "comm_stats_by_path", "data_mesh",
    "data_parallel", "dense", "dense_mean", "density_schedule", "dgc", "dlgs", "fetch", "gtopk",
    "gtopk_indices", "gtopk_mean", "init_per_worker", "lags", "leaf_paths", "output_layer",
    "place_state", "replicate", "ring_allreduce", "shard_batch", "sparse_allgather_mean",
    "sparse_allgather_means", "squeeze_state", "stack_per_worker", "state_specs", "stats_summary",
    "terngrad", "topk", "total_bytes", "two_level", "unsqueeze_state", "wire",
]
