"""Latency quantiles from the bucket counters finish.lua keeps (pure)."""

from __future__ import annotations

import math
import random

import pytest

from broker import latency


def test_quantiles_are_within_a_bucket_of_the_exact_ones():
    rng = random.Random(7)
    samples = [rng.lognormvariate(3.0, 1.0) for _ in range(5000)]
    buckets: dict[int, int] = {}
    for x in samples:
        buckets[latency.bucket_of(x)] = buckets.get(latency.bucket_of(x), 0) + 1
    got = latency.quantiles(buckets, (0.5, 0.95, 0.99))
    ordered = sorted(samples)
    for q, g in zip((0.5, 0.95, 0.99), got):
        exact = ordered[int(q * len(ordered)) - 1]
        assert exact / math.sqrt(2) <= g <= exact * math.sqrt(2), (q, g, exact)


def test_quantiles_of_nothing_and_of_the_edges():
    assert latency.quantiles({}, (0.5,)) is None
    assert latency.quantiles({latency.MIN_BUCKET: 4}, (0.5,)) == [pytest.approx(2 ** -8)]
    assert latency.quantiles({latency.OVERFLOW: 1}, (0.99,)) == [2.0 ** 12]  # its lower bound
    # all ten in (1, √2]: the median halfway through that bucket
    assert latency.quantiles({1: 10}, (0.5,)) == [pytest.approx((1 + math.sqrt(2)) / 2)]


def test_counters_parse_by_workload():
    fields = {"lat:rlvr:3": "2", "lat:rlvr:-14": "1", "n:rlvr": "3", "lat:agentic:10": "0"}
    counts = latency.parse_counters(fields)
    assert counts == {"rlvr:3": 2, "rlvr:-14": 1, "agentic:10": 0}
    assert latency.by_workload(counts) == {"rlvr": {3: 2, -14: 1}}


def test_prometheus_buckets_are_cumulative_at_powers_of_two():
    rows = latency.cumulative_at_powers_of_two({-3: 1, 0: 2, 1: 3, 5: 1, latency.OVERFLOW: 4})
    le = dict(rows)
    assert le[0.5] == 1 and le[1.0] == 3 and le[2.0] == 6 and le[4.0] == 6 and le[8.0] == 7
    assert le[2.0 ** 12] == 7 and rows[-1] == (math.inf, 11)
    assert [b for b, _ in rows[:-1]] == [2.0 ** k for k in range(-7, 13)]
