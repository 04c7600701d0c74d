"""`hpcrl plot`'s timelines and `hpcrl traj trace`'s joins, on records written here by hand the way
the components write them; tests/test_run.py runs both commands on real finished runs."""

from __future__ import annotations

import json

import pytest

from hpcrl.jobs.plots import (
    COLOURS,
    GENERATOR_REST,
    GENERATOR_STATES,
    LEARNER_REST,
    LEARNER_STATES,
    binned,
    downtime,
    generator_intervals,
    learner_intervals,
    shares,
)
from hpcrl.rl.audit.trace import TraceError, parse_ident, trace
from hpcrl.rl.coordinator.events import LEASES_NAME, JsonLines, read_jsonl


def _close(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


def test_learner_timeline_accounts_every_second_between_reports():
    rows = [
        {"step": 1, "time": 110.0, "elapsed_s": 10.0, "wait_s": 2.0, "step_s": 1.0, "publish_s": 0.5, "life": 1},
        {"step": 2, "time": 112.0, "wait_s": 0.5, "step_s": 1.0, "checkpoint_s": 0.25, "life": 1},
        # The learner died after step 2 and its next life reported step 3 at 130 s.
        {"step": 3, "time": 130.0, "wait_s": 1.0, "step_s": 1.0, "life": 2},
    ]
    ivs = learner_intervals(rows)
    assert ivs[0].start == 100.0  # the first report reaches back to the run's start (time - elapsed_s)
    assert ivs[0].parts == {"waiting for data": 2.0, "training": 1.0, "syncing weights": 0.5, "starting": 6.5}
    assert ivs[1].parts == {"waiting for data": 0.5, "checkpointing": 0.25, "training": 1.0, LEARNER_REST: 0.25}
    # The new life's gap: what it spent on step 3 is at the end, the rest is down.
    assert (ivs[2].start, ivs[2].end, ivs[2].parts) == (112.0, 128.0, {"down": 16.0})
    assert ivs[3].parts == {"waiting for data": 1.0, "training": 1.0}
    for iv in ivs:
        assert _close(sum(iv.parts.values()), iv.end - iv.start)
    assert _close(sum(shares(ivs).values()), 1.0)


def test_learner_parts_never_exceed_their_interval():
    # Clock skew or a report written late: the parts are clipped, never negative time.
    rows = [{"step": 1, "time": 10.0, "elapsed_s": 1.0, "wait_s": 5.0, "step_s": 5.0}]
    (iv,) = learner_intervals(rows)
    assert iv.parts == {"waiting for data": 1.0}


def test_generator_timeline_from_cumulative_samples_with_a_restart():
    samples = [
        {"t": 20, "gens": {"gen-0": {"wall_s": 10, "busy_s": 4, "idle_s": 3, "seen": 20}}},
        {"t": 30, "gens": {"gen-0": {"wall_s": 20, "busy_s": 9, "idle_s": 3, "env_wait_s": 2, "seen": 30}}},
        {"t": 35, "gens": {"gen-0": {"wall_s": 20, "busy_s": 9, "idle_s": 3, "env_wait_s": 2, "seen": 30}}},
        # Restarted at ~46 s: its counters start again from 0.
        {"t": 50, "gens": {"gen-0": {"wall_s": 4, "busy_s": 1, "seen": 50}}},
        # A new life whose counters already passed the old one's at its first sample.
        {"t": 80, "gens": {"gen-0": {"wall_s": 6, "busy_s": 2, "seen": 80, "life": "b"}}},
        {"t": 60, "torn": True},
        "not a record",
    ]
    ivs = generator_intervals([s for s in samples if isinstance(s, dict)])["gen-0"]
    # The first sample reaches back to the loop's start; an unchanged `seen` adds nothing.
    assert [(iv.start, iv.end) for iv in ivs] == [(10, 20), (20, 30), (30, 46), (46, 50), (50, 74), (74, 80)]
    assert ivs[4].parts == {"down": 24} and ivs[5].parts == {"generating": 2, GENERATOR_REST: 4}
    ivs = ivs[:4]
    assert ivs[0].parts == {"generating": 4, "idle": 3, GENERATOR_REST: 3}
    assert ivs[1].parts == {"generating": 5, "waiting for sandbox": 2, GENERATOR_REST: 3}
    assert ivs[2].parts == {"down": 16} and ivs[3].parts == {"generating": 1, GENERATOR_REST: 3}
    frac = binned(ivs, ("generating", "waiting for sandbox", "idle", GENERATOR_REST, "down"), 10, 50, 4)
    assert all(_close(sum(f.values()), 1.0) for f in frac)  # every bin of [10, 50] is covered
    assert _close(frac[0]["generating"], 0.4) and _close(frac[3]["down"], 0.6) and _close(frac[3]["generating"], 0.1)


def test_every_state_has_a_colour_of_its_own_and_none_is_left_unnamed():
    states = set(LEARNER_STATES) | set(GENERATOR_STATES)
    assert set(COLOURS) == states and "other" not in states
    assert len(set(COLOURS.values())) == len(COLOURS), "two states share a colour"


def test_throughput_breaks_where_the_learner_was_down():
    rows = [{"step": k, "time": 100.0 + 2 * k, "life": 1} for k in range(1, 11)]
    rows += [{"step": 11, "time": 125.0, "life": 2}]  # restarted: a new life, however soon
    rows += [{"step": k, "time": 125.0 + 2 * (k - 11), "life": 2} for k in range(12, 15)]
    rows += [{"step": 15, "time": 400.0, "life": 2}]  # no report for 4.5 min where steps take 2 s
    assert downtime(rows) == [10, 14]
    assert downtime(rows[:10]) == []


def test_staleness_lines_never_hide_each_other(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcrl.jobs.plots import _staleness_fig

    rows = [{"step": k, "staleness_max": 0, "staleness_hist": {"0": 8}, "dropped_stale": 0} for k in range(1, 6)]
    fig = _staleness_fig(plt, "r", rows, 2)
    top, bottom = fig.axes
    lines = {ln.get_label(): ln for ln in top.get_lines()}
    oldest, newest, mean = (
        lines[k] for k in ("oldest trained step", "newest action of a group (bounded)", "mean, by oldest step")
    )
    # All fresh: the three lines coincide at 0, so each lower one is wider and paler, and 0 is above the axis.
    assert list(oldest.get_ydata()) == list(newest.get_ydata()) == list(mean.get_ydata()) == [0] * 5
    for under, over in ((oldest, newest), (newest, mean)):
        assert under.get_linewidth() >= 2 * over.get_linewidth() and under.get_alpha() < (over.get_alpha() or 1)
        assert under.get_zorder() < over.get_zorder()
    assert top.get_ylim()[0] < 0
    assert [ln.get_label() for ln in bottom.get_lines()] == ["dropped as stale (cumulative)"]  # a panel of its own
    plt.close(fig)


def test_binned_leaves_unrecorded_time_empty():
    ivs = learner_intervals([{"step": 1, "time": 20.0, "elapsed_s": 10.0, "step_s": 10.0}])
    frac = binned(ivs, ("training", "starting"), 0.0, 20.0, 2)
    assert _close(sum(frac[0].values()), 0.0) and _close(frac[1]["training"], 1.0)


@pytest.mark.parametrize(
    "ident,parsed",
    [("12", (12, None)), ("gen-0/12", (12, "gen-0/12")), ("r1/gen-0/12", (12, "r1/gen-0/12"))],
)
def test_parse_ident(ident, parsed):
    assert parse_ident(ident) == parsed


@pytest.mark.parametrize("ident", ["", "x", "r1/gen-0/x", "-3", "a/b/c/4", "r1//4"])
def test_parse_ident_refuses_what_is_no_id(ident):
    with pytest.raises(TraceError, match="is not a trajectory id"):
        parse_ident(ident)


def test_trace_joins_leases_and_the_audit_log(tmp_path):
    """An episode leased to gen-0, lost when gen-0 went silent, finished by gen-1 and trained in a
    step a later learner life redid: every event, in time order, the redone step marked."""
    log = JsonLines(tmp_path / LEASES_NAME)
    log.write({"t": 1.0, "g": "gen-0", "leased": [[7, 0], [8, 0]]})
    log.write({"t": 5.0, "expired": {"gen-0": [7, 8]}})
    log.write({"t": 6.0, "g": "gen-1", "leased": [[7, 1]]})
    log.write({"t": 7.0, "g": "gen-1", "done": [7], "released": [8]})
    log.close()
    (tmp_path / "learner").mkdir()
    audit = [
        {"life": 1, "resumed_step": 0, "version": 0, "time": 0.5},
        {"life": 1, "step": 1, "version": 1, "trained": ["r/gen-1/7"], "dropped": [], "time": 8.0},
        {"life": 2, "resumed_step": 0, "version": 1, "time": 9.0},
        {"life": 2, "step": 1, "version": 2, "trained": [], "dropped": ["r/gen-1/7"], "dropped_why": ["stale"]},
    ]
    (tmp_path / "learner" / "trained.jsonl").write_text("".join(json.dumps(a) + "\n" for a in audit))
    events, stored = trace(tmp_path, "7")
    assert stored == []  # no store in this run directory
    assert [e.what for e in events] == ["leased", "expired", "leased", "done", "trained", "dropped"]
    assert events[0].detail == "leased to gen-0 (attempt 0)" and events[2].generator == "gen-1"
    assert "superseded" in events[4].detail and events[4].data["superseded"]
    assert "stale: more than learner.max_staleness" in events[5].detail and not events[5].data["superseded"]
    assert events[5].time == 0.0  # an audit record without a time goes last
    # One trajectory id: gen-0's leases are another attempt's, not this trajectory's.
    events, _ = trace(tmp_path, "gen-1/7")
    assert [e.what for e in events] == ["leased", "done", "trained", "dropped"]
    assert [e.what for e in trace(tmp_path, "8")[0]] == ["leased", "expired", "released"]
    with pytest.raises(TraceError, match="no record of '9'"):
        trace(tmp_path, "9")


def test_a_torn_lease_line_is_skipped(tmp_path):
    path = tmp_path / LEASES_NAME
    path.parent.mkdir()
    path.write_text('{"t": 1, "g": "gen-0", "leased": [[1, 0]]}\n{"t": 2, "g": "gen-0", "do')
    assert list(read_jsonl(path)) == [{"t": 1, "g": "gen-0", "leased": [[1, 0]]}]
    assert [e.what for e in trace(tmp_path, "1")[0]] == ["leased"]
