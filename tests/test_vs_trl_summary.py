"""bench/vs_trl.py's summary of a reward curve: the value at each checkpoint, and the level over the
last fifth before it, on a hand-made curve whose one bad step falls on a checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))  # its `from loadavg import`
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.undo()
    return mod


def test_a_checkpoint_on_one_bad_step_is_read_beside_the_level_before_it(vs_trl):
    # One step per 0.1 s: reward 0.5 before 240 s, then 1.0, except a step of 0.0 at exactly 300 s.
    points = [(i, i / 10, 256 * i, 0.0 if i == 3000 else 0.5 if i < 2400 else 1.0) for i in range(1, 6001)]
    got = vs_trl.summarize(points, minutes=10)
    assert got["ma_at_s"]["300"] == pytest.approx(0.95)  # the window of 20 holds the bad step
    assert got["ma_at_s"]["150"] == 0.5
    # 240-300 s holds 601 moving averages: 19 rising from 0.5 to 1.0, then 1.0, the last 0.95.
    assert got["ma_trailing_s"]["300"] == {"median": 1.0, "p10": 1.0}
    assert got["ma_trailing_s"]["150"] == {"median": 0.5, "p10": 0.5}
    assert got["ma_trailing_s"]["600"] == {"median": 1.0, "p10": 1.0}
    table = vs_trl.table([{**got, "system": "hpcrl", "load": {"mean": 1.0, "max": 1.0}}])
    assert "1.000 (1.000)" in table


def test_the_trailing_level_is_none_where_the_run_did_not_get(vs_trl):
    points = [(i, i / 10, 256 * i, 0.5) for i in range(1, 1001)]  # 100 s of training
    got = vs_trl.summarize(points, minutes=10)
    assert got["ma_trailing_s"]["60"] == {"median": 0.5, "p10": 0.5}
    assert got["ma_trailing_s"]["150"] is None and got["ma_at_s"]["150"] is None


def test_a_half_written_last_metrics_line_is_not_read(vs_trl, tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 5.0}\n{"step": 2, "time": 6.0}\n{"step": 3, "ti')
    assert [r["step"] for r in vs_trl._rows(path)] == [1, 2]
    assert vs_trl._last_row(path) == {"step": 2, "time": 6.0}
    path.write_text('{"step": 1, "time": 5.0}\n')
    assert [r["step"] for r in vs_trl._rows(path)] == [1]
    assert vs_trl._last_row(path) == {"step": 1, "time": 5.0}
    assert vs_trl._last_row(tmp_path / "absent.jsonl") is None
