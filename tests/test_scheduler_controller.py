"""Batch-size controller and learning-rate schedule (arXiv 2110.07029 §III-C, DESIGN.md §4.4)."""

from __future__ import annotations

import pytest

from xmc_engine.scheduler.controller import BatchSizeController, learning_rate


def test_warmup_ramp_then_decay():
    assert learning_rate(1.0, 0.25, warmup_epochs=1) == pytest.approx(0.25)
    assert learning_rate(1.0, 1.0, warmup_epochs=1, decay=0.5) == pytest.approx(1.0)
    assert learning_rate(1.0, 1.5, warmup_epochs=1, decay=0.5) == pytest.approx(1.0)
    # a period ending at progress 3.0 runs in epoch 2 (the third), one epoch after warm-up
    assert learning_rate(1.0, 3.0, warmup_epochs=1, decay=0.5) == pytest.approx(1.0 / 1.5)
    assert learning_rate(1.0, 3.25, warmup_epochs=1, decay=0.5) == pytest.approx(0.5)
    # no warm-up: epoch 0's periods, its last one (ending at 1.0) included, get lr0
    assert learning_rate(1.0, 1.0, decay=1.0) == pytest.approx(1.0)
    assert learning_rate(1.0, 1.01, decay=1.0) == pytest.approx(0.5)
    assert learning_rate(0.1, 7.0, decay=0.0) == pytest.approx(0.1)


def test_step_rule_directions_and_bounds():
    c = BatchSizeController(3, 64, b_min=32, b_max=96, delta_b=32, rule="step", deadband=0)
    assert c.update(1.0, [10, 5, 6], [1, 1, 1], [1, 1, 1]) == [96, 32, 32]
    assert c.update(1.0, [10, 5, 6], [1, 1, 1], [1, 1, 1]) == [96, 32, 32]  # clipped
    assert c.learning_rates(0.1) == pytest.approx([0.15, 0.05, 0.05])
    assert c.learning_rates(0.1, "sqrt") == pytest.approx([0.1 * 1.5 ** 0.5, 0.1 * 0.5 ** 0.5,
                                                           0.1 * 0.5 ** 0.5])
    assert c.learning_rates(0.1, "none") == pytest.approx([0.1] * 3)
    with pytest.raises(ValueError, match="choose one of linear, sqrt, none"):
        c.learning_rates(0.1, "cubic")


def test_step_rule_deadband_and_warmup():
    c = BatchSizeController(2, 64, rule="step", warmup_epochs=2, deadband=0.05)
    assert c.update(1.0, [10, 5], [1, 1], [1, 1]) == [64, 64]   # still warming up
    assert c.update(2.0, [5, 4], [1, 1], [1, 1]) == [64, 64]    # within half an update
    assert c.update(2.0, [41, 39], [1, 1], [1, 1]) == [64, 64]  # within 5 % of the mean
    assert c.update(2.0, [6, 4], [1, 1], [1, 1]) == [96, 32]
    assert c.update(2.0, [43, 37], [1, 1], [1, 1]) == [128, 32]


def test_proportional_rule_keeps_total_and_scales_with_speed():
    c = BatchSizeController(3, 100, b_min=1, b_max=1000, rule="proportional")
    new = c.update(1.0, [1, 1, 1], [300, 200, 100], [1.0, 1.0, 1.0])
    assert sum(new) == 300 and new == [150, 100, 50]
    c2 = BatchSizeController(2, 100, b_min=60, b_max=1000, rule="proportional")
    assert c2.update(1.0, [1, 1], [900, 100], [1.0, 1.0]) == [180, 60]  # clipped


def test_fixed_and_bad_rule():
    c = BatchSizeController(2, 64, rule="fixed")
    assert c.update(5.0, [9, 1], [1, 1], [1, 1]) == [64, 64]
    with pytest.raises(ValueError):
        BatchSizeController(2, 64, rule="magic")
