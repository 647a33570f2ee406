"""The off-policy study's robust measure (benchmarks/gain.py) on hand-made held-out curves: time to
90% of sync's reward gain, read on a trailing running mean over 3 checkpoints, per seed, with the
spread over seeds."""

from __future__ import annotations

import pytest

from benchmarks.gain import (
    gain_threshold,
    running_mean,
    smoothed,
    sync_final_smoothed,
    time_to_gain,
    time_to_threshold,
)


def test_running_mean_is_trailing_and_shorter_at_the_start() -> None:
    assert running_mean([0.0, 3.0, 6.0, 3.0, 0.0]) == pytest.approx([0.0, 1.5, 3.0, 4.0, 3.0])
    assert running_mean([1.0, 2.0], window=1) == [1.0, 2.0]
    assert running_mean([]) == []
    with pytest.raises(ValueError, match="window"):
        running_mean([1.0], window=0)


def test_the_threshold_is_ninety_percent_of_syncs_gain_and_none_without_a_gain() -> None:
    assert gain_threshold(0.1, 0.3) == pytest.approx(0.28)
    assert gain_threshold(0.1, 0.3, share=0.5) == pytest.approx(0.2)
    assert gain_threshold(0.2, 0.2) is None and gain_threshold(0.2, 0.1) is None


def test_an_early_spike_does_not_count_but_a_sustained_rise_does() -> None:
    """The old figure counted the first checkpoint at or above sync's final; one noisy checkpoint
    did it. Smoothed over 3 checkpoints the spike at 5 s is diluted, the rise from 15 s is not."""
    spiky = [(0.0, 0.1), (5.0, 0.4), (10.0, 0.1), (15.0, 0.3), (20.0, 0.32), (25.0, 0.33)]
    assert [r for _, r in smoothed(spiky)] == pytest.approx([0.1, 0.25, 0.2, 0.8 / 3, 0.24, 0.95 / 3])
    assert time_to_threshold(spiky, 0.28) == 25.0
    assert time_to_threshold(spiky, 0.28, window=1) == 5.0  # unsmoothed: the spike counts
    assert time_to_threshold(spiky, 0.4) is None


def test_seeds_give_a_mean_a_spread_and_a_count_of_those_that_reached_it() -> None:
    initial = 0.1
    sync = [
        [(0.0, 0.1), (10.0, 0.2), (20.0, 0.3), (30.0, 0.35)],
        [(0.0, 0.1), (10.0, 0.25), (20.0, 0.3), (30.0, 0.3)],
    ]
    final = sync_final_smoothed(sync)  # (0.2+0.3+0.35)/3 and (0.25+0.3+0.3)/3
    assert final == pytest.approx((0.85 / 3 + 0.85 / 3) / 2)
    threshold = gain_threshold(initial, final)
    assert threshold == pytest.approx(0.1 + 0.9 * (0.85 / 3 - 0.1))  # 0.265
    arm = [
        [(0.0, 0.1), (8.0, 0.3), (16.0, 0.35), (24.0, 0.4)],  # smoothed 0.1, 0.2, 0.25, 0.35: 24 s
        [(0.0, 0.1), (8.0, 0.35), (16.0, 0.35), (24.0, 0.35)],  # 0.1, 0.225, 0.267: 16 s
        [(0.0, 0.1), (8.0, 0.12), (16.0, 0.15), (24.0, 0.2)],  # never
    ]
    t = time_to_gain(arm, threshold)
    assert t.times == [24.0, 16.0, None]
    assert t.reached == 2
    assert t.mean_s == pytest.approx(20.0) and t.std_s == pytest.approx(5.656854, rel=1e-6)  # sample std
    assert t.text() == "20.0 ± 5.7 s (2/3)"
    sync_t = time_to_gain(sync, threshold)
    assert sync_t.times == [30.0, 30.0] and sync_t.std_s == 0.0
    assert time_to_gain(arm[2:], threshold).text() == "not reached (0/1)"
    assert time_to_gain(arm, None).times == [None, None, None]  # sync gained nothing: no threshold
