"""Extending a run: the steps taken keep their learning rate, or the fix is named."""

import re
from pathlib import Path

import pytest

from dlgs_jax.training.config import ScheduleConfig
from dlgs_jax.training.persistence.resume import extension_refusal

DOCS = Path(__file__).resolve().parents[3] / "docs" / "checkpoints.md"


def saved(epochs=30, steps=None, drops=None, spe=390):
  total = ScheduleConfig(epochs=epochs, steps=steps).total_steps(spe)
  return {"schedule.epochs": epochs, "schedule.steps": steps, "schedule.lr_decay_epochs": drops,
          "total_steps": total}


def test_explicit_drops_extend_past_the_last_one():
  assert extension_refusal(saved(drops=(10, 20)), 11700,
                           ScheduleConfig(epochs=60, lr_decay_epochs=(10, 20, 50)), 390,
                           23400) is None
  # A stopped run whose drops are all ahead may change them freely.
  assert extension_refusal(saved(), 3000, ScheduleConfig(epochs=60), 390, 23400) is None


@pytest.mark.parametrize("spe,epochs,step", [(390, 30, 11700), (59, 5, 295), (7, 3, 20),
                                             (1563, 140, 218820)])
def test_the_suggested_epochs_keep_every_drop_taken(spe, epochs, step):
  new_total = 2 * epochs * spe
  why = extension_refusal(saved(epochs, spe=spe), step, ScheduleConfig(epochs=2 * epochs), spe,
                          new_total)
  kept = [float(e) for e in re.search(r"--lr-decay-epochs ([0-9.,]+),<", why).group(1).split(",")]
  taken = ScheduleConfig(epochs=epochs).decay_boundaries(spe, epochs * spe)
  assert ScheduleConfig(lr_decay_epochs=kept).decay_boundaries(spe, new_total) == taken
  fixed = ScheduleConfig(epochs=2 * epochs, lr_decay_epochs=(*kept, 1.5 * epochs))
  assert extension_refusal(saved(epochs, spe=spe), step, fixed, spe, new_total) is None


def test_a_checkpoint_at_or_past_the_end_is_refused():
  for total in (11700, 9000):
    why = extension_refusal(saved(), 11700, ScheduleConfig(steps=total), 390, total)
    assert f"the checkpoint is at step 11700, and this run has {total} steps" in why


def test_a_drop_added_before_the_step_reached_is_refused():
  why = extension_refusal(saved(drops=(25,)), 5000, ScheduleConfig(epochs=60,
                          lr_decay_epochs=(5, 25)), 390, 23400)
  assert "they dropped at steps none, this run drops at [1950, 9750]" in why
  assert why.endswith("give --lr-decay-epochs with drops after epoch 12.82")


def test_the_docs_quote_the_message_the_code_gives():
  text = " ".join(DOCS.read_text().split())
  why = extension_refusal(saved(), 11700, ScheduleConfig(epochs=60), 390, 23400)
  assert f"dlgs-train: refusing to resume: {why}" in text
  assert "--lr-decay-epochs 17.144,25.715,50" in text
