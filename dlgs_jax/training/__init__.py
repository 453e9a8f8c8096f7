"""Training: the data-parallel train step, run configs, the loop, checkpoints, benchmarks.

`step` is the train step every run uses; `config` describes a run as data;
`loop.train` runs one; `plans` gives it its layer grouping; `checkpoint` and
`metrics` are what it writes; `distributed` starts `jax.distributed`;
`benchmark`, `breakdown` and `compare` time it.
"""

from dlgs_jax.training.step import (TrainState, check_replicas_identical, evaluate_dataset,
                                    init_train_state, make_eval_fn, make_fingerprint_fn,
                                    make_train_step, train_state_from_variables)
