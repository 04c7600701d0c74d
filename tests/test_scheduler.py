"""The duration estimates (slurm/backfill/estimates.py) a rollout job leases by: nearest-rank
quantiles over a domain's recent history, the pooled history for thin domains, a prior before any."""

from __future__ import annotations

import math

import pytest

from hpcrl.slurm.backfill.estimates import DurationEstimator


def test_quantiles_are_nearest_rank_over_the_recent_window():
    est = DurationEstimator(history=10, min_samples=3, prior_s=42.0)
    assert est.quantile("a", 0.9) == 42.0  # nothing known yet
    for x in range(1, 21):  # only the last 10 (11..20) are kept
        est.record("a", float(x))
    assert est.samples("a") == 10
    assert est.quantile("a", 0.5) == 15.0 and est.quantile("a", 0.9) == 19.0 and est.quantile("a", 1.0) == 20.0
    assert est.domains() == ["a"]


def test_thin_domains_borrow_the_pooled_history():
    est = DurationEstimator(history=50, min_samples=5, prior_s=1.0)
    for x in range(100):
        est.record(f"busy{x % 3}", 10.0 + x % 10)
    est.record("rare", 1000.0)  # one sample is not enough to trust
    assert 10.0 <= est.quantile("rare", 0.5) <= 20.0
    with pytest.raises(ValueError, match="finite"):
        est.record("a", math.nan)
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\]"):
        est.quantile("a", 0.0)
