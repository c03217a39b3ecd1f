"""benchmarks/tools_rq.py reads the demo's printed summary, not some other row or number."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = """\
                       summary: 829 sessions in 20.3s
┃ workload ┃ done ┃ failed ┃ output tokens ┃  tok/s ┃ cached tokens ┃ p50 latency ┃
│     rlvr │  471 │      0 │       414,532 │ 20,448 │        56,672 │       5.97s │
│      all │  829 │      3 │       521,948 │ 25,746 │       415,760 │       5.79s │
"""


def load_bench():
    return load_script(ROOT / "benchmarks" / "tools_rq.py")


def test_the_summary_row_of_all_workloads_is_what_counts():
    bench = load_bench()
    live_frame = "│      all │ 1,000 │ 0 │ 1 │ 1 │\n"  # a live frame before the summary
    got = bench.parse_summary(live_frame + SUMMARY)
    assert got == {"sessions": 829, "seconds": 20.3, "done": 829, "failed": 3,
                   "output_tokens": 521_948, "tokens_per_s": 25_746}
    with pytest.raises(ValueError, match="no summary"):
        bench.parse_summary(live_frame)
