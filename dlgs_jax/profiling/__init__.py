"""Measured profiles for the planner: compute, update costs, collectives, overlap.

`profile_model` measures everything the timeline model needs on the machine and mesh in
use; the modules measure one thing each.
"""

from dlgs_jax.profiling.timing import fit_linear, median_interval, median_seconds
from dlgs_jax.profiling.compute import COMPUTE_TOTAL_REPEATS, layer_backward_times, measure_compute, model_gradients
from dlgs_jax.profiling.update import PER_LEAF_METHODS, UPDATE_BATCHES, UPDATE_METHODS, dlgs_timed_states, dlgs_warmup_steps, fit_per_leaf, fit_update, measure_update, suffix_groups, training_optimizer, update_grid, warm_state
from dlgs_jax.profiling.in_step import IN_STEP_RESOLUTION, IN_STEP_ROUNDS, PROFILE_TRAIN_STEPS, in_step_factors, local_training, measure_refresh, measure_update_in_step, scale_update_costs, train_locally, whole_model_update
from dlgs_jax.profiling.comm import COMM_KINDS, OVERLAP_PROGRAMS, collective_schedule, measure_comm, measure_overlap, overlap_hidden, overlap_programs
from dlgs_jax.profiling.profile import comm_grid, profile_model, refit_profile
