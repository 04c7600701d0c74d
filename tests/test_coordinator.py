"""The coordinator's bookkeeping, driven through its request handler: weighted hand-out, leases
and re-issue when a generator goes silent or a sandbox vanishes, flow control against the
learner, status.json / metrics.jsonl, and a restart that re-issues what was in flight."""

from __future__ import annotations

import collections
import json
import time

import pytest

from hpcrl.core.config import CoordinatorConfig
from hpcrl.rl.coordinator.coordinator import Coordinator
from hpcrl.rl.coordinator.report import read_status
from hpcrl.rl.coordinator.tasks import ticket_from_row


def make(tmp_path, **cfg) -> Coordinator:
    c = CoordinatorConfig(**{"lease_s": 0.2, "max_attempts": 3, **cfg})
    return Coordinator(
        tmp_path,
        {"arith/copy": 3.0, "code-repair": 1.0},
        group_size=4,
        batch_groups=2,
        max_staleness=2,
        max_steps=5,
        seed=0,
        cfg=c,
    )


def sync(c, gen, want=0, done=(), failed=(), released=(), life=None):
    body = {
        "generator": gen,
        "want": want,
        "done": list(done),
        "failed": [list(f) for f in failed],
        "released": list(released),
        "stats": {"busy_fraction": 0.5},
    }
    r = c.handle("sync", body if life is None else {**body, "life": life})
    return [ticket_from_row(t) for t in r["tickets"]], r


def test_groups_by_weight_and_flow_control(tmp_path):
    c = make(tmp_path)
    tickets, _ = sync(c, "g0", want=100)
    # window: max(1, max_staleness) x batch_groups = 4 groups of 4 ahead of the learner
    assert len(tickets) == 16 and c.groups_issued == 4
    groups = collections.defaultdict(list)
    for t in tickets:
        groups[t.group].append(t)
    assert all(len(g) == 4 and len({(t.domain, t.task_index) for t in g}) == 1 for g in groups.values())
    assert len({t.episode for t in tickets}) == 16
    assert sync(c, "g0", want=100)[0] == []  # nothing more until the learner consumes
    c.handle("learner", {"step": 1, "version": 1, "reward": 0.1, "trained_groups": 2, "dropped_groups": 0})
    assert len(sync(c, "g0", want=100)[0]) == 8
    c.handle("progress", {"trained_groups": 2, "dropped_groups": 2})  # dropped as stale, no step
    assert len(sync(c, "g0", want=100)[0]) == 8
    # over many groups the domains follow their weights (3:1)
    big = make(tmp_path / "big", max_groups_ahead=10_000)
    domains = collections.Counter(t.domain for t in sync(big, "g", want=4000)[0])
    assert 2.4 < domains["arith/copy"] / domains["code-repair"] < 3.7


def test_silent_generator_loses_its_leases(tmp_path):
    c = make(tmp_path)
    a, _ = sync(c, "gen-a", want=8)
    b, _ = sync(c, "gen-b", want=4)
    sync(c, "gen-a", done=[t.episode for t in a[:2]])  # a finished two, then goes silent
    deadline = time.monotonic() + 0.15
    while time.monotonic() < deadline:  # b keeps syncing: its leases stay
        sync(c, "gen-b")
        time.sleep(0.02)
    time.sleep(0.1)
    sync(c, "gen-b")
    assert c.expire() == 6
    again, _ = sync(c, "gen-b", want=6)
    assert sorted(t.episode for t in again) == sorted(t.episode for t in a[2:])
    assert all(t.attempt == 1 for t in again)
    assert c.generators["gen-a"]["lost"] and c.counts["reissued"] == 6
    assert not any(t.episode in {x.episode for x in b} for t in again)


def test_a_restarted_generator_does_not_keep_its_predecessors_leases(tmp_path):
    """A generator process killed holding leases and restarted under its name by the supervisor:
    the new process's syncs used to renew the dead one's leases for ever, so those episodes were
    never issued again and their groups held places in the window for the rest of the run."""
    from hpcrl.rl.coordinator.events import LEASES_NAME, read_jsonl

    c = make(tmp_path, lease_s=60)
    held, _ = sync(c, "gen-0", want=8, life="first")
    sync(c, "gen-0", done=[held[0].episode], life="first")
    sync(c, "gen-0", life="first")  # the same process again: nothing changes
    assert len(c.leases) == 7
    again, _ = sync(c, "gen-0", want=7, life="second")  # re-issues come first
    assert sorted(t.episode for t in again) == sorted(t.episode for t in held[1:])
    assert all(t.attempt == 1 for t in again) and c.counts["reissued"] == 7
    assert {ep: lease.generator for ep, lease in c.leases.items()} == {t.episode: "gen-0" for t in again}
    orphaned = [r for r in read_jsonl(tmp_path / LEASES_NAME) if "orphaned" in r]
    assert [(r["g"], sorted(r["orphaned"])) for r in orphaned] == [("gen-0", sorted(t.episode for t in held[1:]))]
    # A coordinator that restarted knows no life yet: the first sync it sees orphans nothing.
    c2 = make(tmp_path / "c2", lease_s=60)
    sync(c2, "gen-0", want=4, life="a")
    assert len(c2.leases) == 4 and c2.counts["reissued"] == 0


def test_failed_episodes_are_reissued_then_abandoned(tmp_path):
    c = make(tmp_path, lease_s=60)
    (t, *_), _ = sync(c, "g", want=4)
    for attempt in range(3):
        got, _ = sync(c, "g", failed=[(t.episode, "sandbox-0: no reply")], want=1)
        if attempt < 2:
            assert got[0].episode == t.episode and got[0].attempt == attempt + 1
    # Its group's other episodes still reach the learner, which reports the group consumed when
    # it drops it as stale: the coordinator does not count it too.
    assert c.counts["abandoned"] == 1 and t.group not in c.abandoned_groups
    # released (generator stopping): issued again without counting an attempt
    (u, *_), _ = sync(c, "g", want=1)
    got, _ = sync(c, "g", released=[u.episode], want=1)
    assert got[0] == u


def test_a_permanent_failure_is_abandoned_at_once(tmp_path):
    c = make(tmp_path, lease_s=60)  # max_attempts 3
    (t, u, *_), _ = sync(c, "g", want=4)
    got, _ = sync(c, "g", failed=[(t.episode, "prompt of 900 tokens does not fit max_context 512", True)], want=1)
    assert c.counts["abandoned"] == 1 and t.episode not in {g.episode for g in got}
    # a transient one (a two-element report, as older generators send) is still retried
    got, _ = sync(c, "g", failed=[(u.episode, "sandbox-0: no reply")], want=1)
    assert c.counts["abandoned"] == 1 and got[0].episode == u.episode and got[0].attempt == 1


def test_a_group_with_a_given_up_episode_is_named_to_the_learner_which_counts_it_consumed(tmp_path):
    """A group one of whose episodes was given up can never be complete; the learner never
    drops an incomplete group for its age (a member still running may be fresh), so the
    coordinator names such groups in its replies, and the learner closes them and reports them
    consumed (once; counted here too, the window would grow)."""
    c = make(tmp_path, lease_s=60, max_attempts=1)
    tickets, _ = sync(c, "g", want=100)  # the window: 4 groups of 4
    assert len(tickets) == 16 and sync(c, "g", want=1)[0] == []
    group = tickets[0].group
    sync(c, "g", failed=[(tickets[0].episode, "broken task")], done=[t.episode for t in tickets[1:4]])
    assert c.counts["abandoned"] == 1 and c._consumed() == 0  # still outstanding: the learner's to close
    assert c.handle("progress", {"trained_groups": 0, "dropped_groups": 0})["abandoned"] == [group]
    r = c.handle("learner", {"step": 1, "version": 1, "reward": 0.0, "trained_groups": 2, "dropped_groups": 1})
    assert r["abandoned"] == [group] and not r["stop"]
    assert len(sync(c, "g", want=100)[0]) == 12  # two trained, one closed: three groups' room
    c._save()  # (once a second in a run)
    again = make(tmp_path, lease_s=60, max_attempts=1)  # and after a restart
    assert again.handle("progress", {"trained_groups": 2, "dropped_groups": 1})["abandoned"] == [group]


def test_a_restarted_coordinator_knows_what_the_learner_consumed(tmp_path):
    """Its flow control counts groups issued against groups consumed. A successor that forgot
    the consumption issued nothing until the learner reported again, and a learner waiting for
    data reports only when its counts change: a run stalled for 8 minutes."""
    c = make(tmp_path, lease_s=60)
    issued, _ = sync(c, "g", want=100)
    assert len(issued) == 16 and sync(c, "g", want=100)[0] == []  # the window (4 groups) is full
    sync(c, "g", done=[t.episode for t in issued])
    c.handle("learner", {"step": 1, "version": 1, "reward": 0.1, "trained_groups": 2, "dropped_groups": 0})
    c.handle("progress", {"trained_groups": 2, "dropped_groups": 2})
    c._save()
    again = make(tmp_path, lease_s=60)  # no learner report since
    assert len(sync(again, "g", want=100)[0]) == 16


def test_status_metrics_stop_and_restart(tmp_path):
    c = make(tmp_path, lease_s=60)
    issued, _ = sync(c, "g", want=12)
    sync(c, "g", done=[t.episode for t in issued[:4]])
    for step in range(1, 6):
        r = c.handle(
            "learner",
            {
                "step": step,
                "version": step,
                "reward": step / 10,
                "trained_groups": step,
                "dropped_groups": 0,
                "reward_by_domain": {"arith/copy": step / 10},
            },
        )
    assert r["stop"] is True  # max_steps reached: generators are told at their next sync
    assert sync(c, "g", want=4)[1]["stop"] is True
    c.write_status()
    c._save()
    status = read_status(tmp_path)
    assert status["state"] == "stopping" and status["learner"]["step"] == 5 and status["counts"]["completed"] == 4
    assert status["reward_by_domain"] == {"arith/copy": 0.5} and "traj_per_s" in status and "busy" in status
    c.write_status(final=True)  # what the coordinator leaves behind when it exits
    assert read_status(tmp_path)["state"] == "finished"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all("traj_per_s" in r for r in rows)

    # A new coordinator on the same run directory re-issues the 8 leased episodes and
    # continues the sampler: no task instance or episode number is handed out twice.
    d = make(tmp_path, lease_s=60, max_groups_ahead=100)
    again, _ = sync(d, "g2", want=8)
    assert sorted(t.episode for t in again) == sorted(t.episode for t in issued[4:])
    fresh, _ = sync(d, "g2", want=8)
    assert min(t.episode for t in fresh) > max(t.episode for t in issued)
    assert not {(t.domain, t.task_index) for t in fresh} & {(t.domain, t.task_index) for t in issued}


def test_per_domain_issued_trained_and_dropped_in_status_and_metrics(tmp_path):
    """status.json's and each metrics.jsonl line's `domains`: episodes issued (the sampler's) beside
    the learner's counts of what arrived, was trained and dropped, with lengths and shares."""
    c = make(tmp_path, lease_s=60)
    issued, _ = sync(c, "g", want=100)
    learner = {
        "arith/copy": {"arrived": 8, "arrived_turns": 8, "arrived_tokens": 80, "trained": 4, "trained_turns": 4,
                       "trained_tokens": 40, "dropped_stale": 4},
        "code-repair": {"arrived": 4, "arrived_turns": 12, "arrived_tokens": 400, "trained": 4, "trained_turns": 12,
                        "trained_tokens": 400, "dropped_duplicate": 1},
    }  # fmt: skip
    c.handle("learner", {"step": 1, "version": 1, "reward": 0.5, "trained_groups": 2, "dropped_groups": 1,
                         "domains": learner})  # fmt: skip
    c.write_status()
    by_issue = collections.Counter(t.domain for t in issued)
    for where in (read_status(tmp_path)["domains"], json.loads((tmp_path / "metrics.jsonl").read_text())["domains"]):
        copy, code = where["arith/copy"], where["code-repair"]
        assert (copy["issued"], copy["trained"], copy["dropped_stale"], copy["dropped"]) == (
            by_issue["arith/copy"],
            4,
            4,
            4,
        )
        assert (code["issued"], code["trained"], code["dropped"]) == (by_issue["code-repair"], 4, 0)  # copies aside
        assert code["trained_turns_mean"] == code["started_turns_mean"] == 3.0 and code["trained_tokens_mean"] == 100
        assert copy["trained_share"] == code["trained_share"] == 0.5
        assert copy["issued_share"] == pytest.approx(by_issue["arith/copy"] / len(issued))
    assert "domains" not in read_status(tmp_path)["learner"]
    assert c.metrics()["domain_trained_total:domain"] == {"arith/copy": 4, "code-repair": 4}


def test_unknown_request_kind():
    c = Coordinator.__new__(Coordinator)
    import threading

    c._lock = threading.Lock()
    with pytest.raises(ValueError, match="unknown request 'hello'; known: sync, learner, progress, stop"):
        c.handle("hello", {})


def test_reports_for_a_lease_another_generator_holds_are_ignored(tmp_path):
    c = make(tmp_path)
    mine, _ = sync(c, "g0", want=4)
    eps = [t.episode for t in mine]
    # g1 (a stale copy, or a holder of the run's keys pretending) reports g0's episodes.
    sync(c, "g1", done=eps[:1], failed=[(eps[1], "boom")], released=eps[2:3])
    assert set(c.leases) == set(eps) and all(c.leases[e].generator == "g0" for e in eps)
    assert c.counts["completed"] == 0 and c.counts["foreign_reports"] == 3 and not c.queue
    sync(c, "g0", done=eps)
    assert c.counts["completed"] == 4 and not c.leases


def _serving(c: Coordinator, run):
    """`c.serve` over the run's real transport in a thread; returns its stop event and thread."""
    import threading

    from hpcrl.core.transport import Node
    from hpcrl.core.wire import WireLimits

    stop = threading.Event()

    def body():
        with Node(run, "coordinator", WireLimits(), bind_host="127.0.0.1") as node:
            c.serve(node, stop)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return stop, t


def test_a_parked_sync_is_answered_when_the_coordinator_stops_serving(tmp_path):
    """A generator parked on a full window is answered (empty) as the coordinator stops, not
    left to its hour-long wait; "stop" stays false because the run is not over (the
    coordinator may be stopping for a restart, which generators wait out)."""
    from hpcrl.core.rpc import RequestClient
    from hpcrl.core.transport import Node

    run = tmp_path / "run"
    c = make(run, sync_wait_s=3600.0, lease_s=600)
    stop, thread = _serving(c, run)
    body = {"generator": "g0", "want": 100, "done": [], "failed": [], "released": [], "stats": {}, "life": "a"}
    try:
        with Node(run, "gen-0") as gnode:
            gen = RequestClient(gnode, "coordinator", timeout_s=3600.0, retries=0)
            assert len(gen.request("sync", body).body["tickets"]) == 16  # the window is now full
            pending = gen.start("sync", body)
            assert pending.poll(0.3) is None  # parked
            leases_before = set(c.leases)
            stop.set()
            reply = pending.poll(60.0)
            assert reply is not None and reply.body["tickets"] == [] and reply.body["stop"] is False
            assert set(c.leases) == leases_before
    finally:
        stop.set()
        thread.join(30)


def test_a_sync_that_finds_no_work_waits_for_the_learner_instead_of_polling(tmp_path):
    """Long poll (coordinator.sync_wait_s): a generator asking while the window is full is
    answered when the learner's report opens it, not at the end of its wait; one asking for
    nothing, or waiting past sync_wait_s, is answered empty; a parked ask from a process that
    was replaced meanwhile leases nothing."""
    from hpcrl.core.rpc import RequestClient
    from hpcrl.core.transport import Node

    run = tmp_path / "run"
    # An hour's wait: an answer before it can only come from the window opening, whatever
    # the machine's speed.
    c = make(run, sync_wait_s=3600.0, lease_s=600)
    stop, thread = _serving(c, run)

    def body(want, life="a"):
        return {"generator": "g0", "want": want, "done": [], "failed": [], "released": [], "stats": {}, "life": life}

    try:
        with Node(run, "gen-0") as gnode, Node(run, "learner") as lnode:
            gen = RequestClient(gnode, "coordinator", timeout_s=3600.0, retries=0)
            learner = RequestClient(lnode, "coordinator", timeout_s=60.0)
            assert len(gen.request("sync", body(100)).body["tickets"]) == 16  # the window: 4 groups
            assert gen.request("sync", body(0)).body["tickets"] == []  # wants nothing: answered at once
            pending = gen.start("sync", body(100))
            assert pending.poll(0.3) is None  # parked
            learner.request("learner", {"step": 1, "version": 1, "trained_groups": 2, "dropped_groups": 0})
            reply = pending.poll(60.0)
            assert reply is not None and len(reply.body["tickets"]) == 8

            # Parked again; meanwhile a new process takes the name (it died, was restarted):
            # the old ask is answered empty when the window opens, and leases nothing.
            stale = gen.start("sync", body(100, life="a"))
            assert stale.poll(0.3) is None
            with Node(run, "gen-0b") as node2:
                RequestClient(node2, "coordinator", timeout_s=60.0).request("sync", body(0, life="b"))
            leases_before = set(c.leases)
            learner.request("learner", {"step": 2, "version": 2, "trained_groups": 4, "dropped_groups": 0})
            reply = stale.poll(60.0)
            assert reply is not None and reply.body["tickets"] == [] and set(c.leases) == leases_before
    finally:
        stop.set()
        thread.join(30)

    # A short wait that nothing ends: answered empty once it is over.
    run2 = tmp_path / "run2"
    c2 = make(run2, sync_wait_s=0.05)
    stop, thread = _serving(c2, run2)
    try:
        with Node(run2, "gen-0") as gnode:
            gen = RequestClient(gnode, "coordinator", timeout_s=60.0)
            assert len(gen.request("sync", body(100)).body["tickets"]) == 16
            assert gen.request("sync", body(100)).body["tickets"] == []
    finally:
        stop.set()
        thread.join(30)
