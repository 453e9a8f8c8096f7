"""A Gantt chart of simulated timelines: compute and communication streams per planner."""

from __future__ import annotations


def draw_gantt(profile, timelines, path, title=""):
  """One panel per planner: compute stream (forward, backward, sparsify) and comm stream."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.6 * len(timelines) + 0.8),
                           sharex=True, squeeze=False)
  colors = plt.get_cmap("tab20")
  for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
    ax.broken_barh([(0, profile.t_forward * 1e3)], (10, 8), facecolors="0.6")
    for g, group in enumerate(tl.groups):
      color = colors(g % 20)
      bars = [(tl.backward_start[i] * 1e3, profile.t_backward[i] * 1e3) for i in group]
      ax.broken_barh(bars, (10, 8), facecolors=color, edgecolor="white", linewidth=0.3)
      ax.broken_barh([(tl.sparsify_start[g] * 1e3, tl.sparsify_time[g] * 1e3)], (10, 8),
                     facecolors="black")
      ax.broken_barh([(tl.comm_start[g] * 1e3, tl.comm_time[g] * 1e3)], (0, 8),
                     facecolors=color, edgecolor="black", linewidth=0.3)
    ax.set_yticks([4, 14], ["comm", "compute"])
    ax.set_title(f"{name}: {len(tl.groups)} groups, {tl.t_iter * 1e3:.2f} ms", fontsize=9,
                 loc="left")
  axes[-1, 0].set_xlabel("time (ms); grey: forward, colour: backward / message per group, "
                         "black: sparsification")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

