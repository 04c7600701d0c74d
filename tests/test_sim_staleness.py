"""The simulator bounds staleness as the live learner does: by the policy version of an
episode's latest generated turn, not the one it started with, so a long multi-turn episode is
not dropped for having started long ago (and the episodes trained are as long as those started).
"""

from __future__ import annotations

from pathlib import Path

from hpcrl.slurm.sim.engine import DROPPED, TRAINED, Episode, TrainingLedger
from hpcrl.slurm.sim.run import simulate
from hpcrl.slurm.sim.trace import EpisodeSpec, load_trace

TRACES = Path(__file__).resolve().parents[1] / "slurm" / "sim" / "traces"


def _episode(index: int, started: int, newest: int, turns_left: int = 0) -> Episode:
    ep = Episode(EpisodeSpec(index, "d", (1.0, 1.0), (1.0, 1.0)), started)
    ep.newest = newest
    ep.turn = 2 - turns_left
    return ep


def test_an_episode_is_judged_by_its_latest_turn_and_a_running_one_never():
    ledger = TrainingLedger(batch_size=1, max_staleness=2)
    ledger.version = 6
    long_but_fresh = _episode(0, started=0, newest=5)
    finished_stale = _episode(1, started=3, newest=3)
    running = _episode(2, started=0, newest=0, turns_left=1)
    assert not ledger.doomed(long_but_fresh) and ledger.doomed(finished_stale) and not ledger.doomed(running)
    ledger.add(long_but_fresh)
    ledger.add(finished_stale)
    assert ledger.take_batch() == [long_but_fresh]
    assert (long_but_fresh.fate, finished_stale.fate, ledger.dropped) == (TRAINED, DROPPED, 1)
    assert ledger.staleness[1] == 1  # counted at the age of its latest turn, within the bound


def test_backfill_trains_the_long_episodes_of_the_sandbox_heavy_trace():
    result = simulate(load_trace(TRACES / "sandbox-heavy.yaml"), "backfill")
    assert result.max_trained_staleness <= result.max_staleness
    # Almost nothing is dropped, and what is trained is about as long as what was started
    # (under the start-version rule it was about half as long: the long ones were dropped).
    assert result.dropped_episodes <= 0.01 * result.trajectories, result.dropped_episodes
    assert result.trained_len.mean >= 0.8 * result.started_len.mean, (result.trained_len, result.started_len)
