"""The tiny model learns from the sandbox's feedback: `hpcrl run` of examples/feedback.yaml
(libcall/names8-retry2, every component a process, every attempt run in the bwrap sandbox),
shortened, then read back from its HDF5 store by bench/feedback_learning.py's own function: the
second attempt, which sees the first one's error line, ends well above the first, which cannot
know the name (at best 1/8)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conftest import require_bwrap

ROOT = Path(__file__).resolve().parents[1]
UID = 62540  # the run's sandbox server slots, apart from the other sandbox tests'
STEPS = 50
WINDOW = 10


@pytest.fixture(scope="module")
def bench():
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))  # its `from loadavg import`
    spec = importlib.util.spec_from_file_location("feedback_learning", ROOT / "bench" / "feedback_learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.undo()
    return mod


def test_attempt_windows_on_hand_made_episodes(bench):
    from types import SimpleNamespace as NS

    def ep(version: int, *rewards: float, truncation: str = "none"):
        steps = tuple(NS(policy_version=version, reward=r) for r in rewards)
        return NS(domain="libcall/names8-retry2", steps=steps, truncation=truncation)

    eps = [ep(0, 1.0), ep(1, 0.0, 0.5), ep(2, 0.0, 0.0), ep(9, 0.0, 0.5), ep(10, 0.0, 0.5), ep(3, truncation="aborted")]
    eps += [ep(11, 0.0, 0.5, truncation="max_steps")]
    w = bench.attempt_windows(eps, 10)
    assert [r["first_version"] for r in w] == [0, 10]
    assert (w[0]["episodes"], w[0]["first"], w[0]["second"], w[0]["second_given_first_failed"]) == (4, 0.25, 3, 2 / 3)
    assert (w[1]["episodes"], w[1]["first"], w[1]["second_given_first_failed"]) == (1, 0.0, 1.0)
    assert bench.summary(w)["end"] == {"versions": 10, "first": 0.0, "second": 1.0}


@pytest.mark.slow
def test_the_second_attempt_learns_to_read_the_first_ones_error(tmp_path, bench):
    require_bwrap(UID)
    run = bench.train(bench.CONFIG, 0, tmp_path, [f"sandbox.uid_base={UID}", f"learner.max_steps={STEPS}"])
    windows = run["windows"] = bench.read_run(Path(run["run_dir"]), WINDOW)
    print(bench.report(run, WINDOW))
    assert [w["first_version"] for w in windows][:1] == [0] and len(windows) >= STEPS // WINDOW
    # The last full window (one after it may hold the tail of the last step, or not).
    start, end = windows[0], next(w for w in windows if w["first_version"] == STEPS - WINDOW)
    # Untrained: a character of ~40 on either attempt.
    assert start["first"] < 0.15 and start["second_given_first_failed"] < 0.3, start
    # Trained: attempt 1 still cannot know the name (1/8 in expectation; 0.3 is far above its
    # noise), attempt 2 reads it: above what avoiding the first guess alone gives (1/7), and far
    # above attempt 1.
    assert end["first"] < 0.3, end
    assert end["second_given_first_failed"] > 0.45, end
    assert end["second_given_first_failed"] > end["first"] + 0.3, end
