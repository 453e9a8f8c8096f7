"""Training: the data-parallel train step, run configs, the loop, and three rooms.

`step` is the train step every run uses; `config` describes a run as data;
`loop.train` runs one; `plans` gives it its layer grouping; `distributed` starts
`jax.distributed`. The rooms: `persistence` (checkpoints, resume, resharding,
the workdir, preemption), `outputs` (what a run writes and tells its user) and
`bench` (timing a run's step: `benchmark`, `compare`, `breakdown`).
"""

from dlgs_jax.training.step import (StepState, check_replicas_identical, evaluate_dataset,
                                    init_train_state, make_eval_fn, make_fingerprint_fn,
                                    make_train_step, train_state_from_variables)
