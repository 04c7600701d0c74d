"""Held-out evaluation: the pass@k estimator, every domain's eval split, `evaluate` over the real
generator, `hpcrl eval` on a run directory with published weights, and periodic evaluation in a
run (metrics.jsonl rows and the plot's eval.png)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.core.config import load_config, write_resolved
from hpcrl.jobs.cli import main
from hpcrl.rl.domains import PromptDomain, get_domain
from hpcrl.rl.domains.base import EVAL_BASE
from hpcrl.rl.model.policy import Policy, full_state_dict
from hpcrl.rl.rollout.evaluate import EvalError, PeriodicEvaluator, evaluate, pass_at_k
from hpcrl.rl.weights.shards import WeightStore

from conftest import RUN_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
UID = 61520  # the periodic-evaluation run's sandbox slot, apart from the other tests' (and `judge`'s 61000)
TINY = ["policy.tiny.charset=printable", "policy.device=cpu", "generators.max_new_tokens=16"]


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (5, 0, 1, 0.0),
        (5, 5, 3, 1.0),
        (5, 1, 1, 0.2),  # c / n
        (5, 1, 5, 1.0),  # every 5-subset holds the correct one
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 2, 3, 1.0),  # n - c < k
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(3, 4, 1), (3, 1, 4), (3, 1, 0)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


def test_every_domain_has_eval_indices_training_does_not_reach():
    arith = get_domain("arith/max2")  # every index its own task: fresh instances from EVAL_BASE on
    assert arith.has_heldout and arith.eval_indices(3) == [EVAL_BASE, EVAL_BASE + 1, EVAL_BASE + 2]
    assert len(arith.eval_indices()) == 100
    repair = get_domain("code-repair")  # held-out problems of its own
    assert repair.has_heldout and len(repair.eval_indices()) == repair.heldout_size
    session = get_domain("session-repair")  # a short list and no split: its training tasks, and it says so
    assert not session.has_heldout and len(session.eval_indices()) == session.size
    he = get_domain("humaneval")
    assert he.has_heldout and len(he.eval_indices()) == he.heldout_size and len(he.eval_indices(5)) == 5
    assert he.for_eval().turns == 1 and he.turns == 2  # pass@k is one attempt per sample


@pytest.fixture(scope="module")
def policy():
    return Policy.load(load_config(None, TINY).policy, seed=0)


def test_evaluate_counts_a_sample_correct_when_its_reward_reaches_1(policy):
    prompts = [(f"q{i}", "x") for i in range(6)]

    def by_task(action, task, feedback):  # tasks with an even index always pass, odd never
        return 1.0 if int(task.id) % 2 == 0 else 0.5

    dom = PromptDomain("parity", prompts, reward=by_task, max_tokens=2)
    with pytest.raises(EvalError, match="keeps no held-out tasks: evaluating it would reuse its training tasks"):
        evaluate(policy, dom, None, ks=(1, 2), samples=3, version=7)
    r = evaluate(policy, dom, None, ks=(1, 2), samples=3, version=7, allow_train=True)
    assert (r.tasks, r.samples, r.version, r.heldout) == (6, 3, 7, False)
    assert r.pass_at == {1: pytest.approx(0.5), 2: pytest.approx(0.5)}
    assert r.to_json() == {"domain": "parity", "version": 7, "n": 3, "pass@1": 0.5, "pass@2": 0.5}
    assert r.metrics() == {"eval/parity/pass@1": 0.5, "eval/parity/pass@2": 0.5, "eval/parity/version": 7}
    with pytest.raises(EvalError, match="k=4 needs at least that many samples"):
        evaluate(policy, dom, None, ks=(4,), samples=3, allow_train=True)
    # a prompt longer than the model's context (1024) cannot be answered: wrong samples, counted
    long = PromptDomain("long", [("q" * 1100, "x"), ("q", "x")], reward=lambda a, t, f: 1.0, max_tokens=2)
    r = evaluate(policy, long, None, ks=(1,), samples=2, allow_train=True)
    assert r.unfit == 2 and r.pass_at == {1: pytest.approx(0.5)}


@pytest.fixture()
def run_dir(tmp_path, policy):
    """A run directory as `hpcrl run` leaves one: its resolved config and published weights v3."""
    run = tmp_path / "r1"
    run.mkdir()
    write_resolved(load_config(None, TINY), run)
    WeightStore(run).publish(full_state_dict(policy.model), version=3)
    return run


def test_hpcrl_eval_json_on_humaneval(run_dir, capsys, judge):
    rc = main(["eval", str(run_dir), "--domain", "humaneval", "--k", "1,2", "--tasks", "3", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    got = json.loads(out)
    assert list(got) == ["domain", "version", "n", "pass@1", "pass@2"]
    assert got["domain"] == "humaneval" and got["version"] == 3 and got["n"] == 2
    assert 0.0 <= got["pass@1"] <= got["pass@2"] <= 1.0


def test_hpcrl_eval_text_and_errors(run_dir, capsys):
    assert main(["eval", str(run_dir), "--domain", "arith/max2", "--k", "1,5", "--tasks", "10"]) == 0
    assert capsys.readouterr().out.startswith("arith/max2 version 3: 10 tasks x 5 samples: pass@1 ")
    bad = [
        (["--domain", "nope"], "unknown domain family 'nope'"),
        (["--domain", "arith/max2", "--version", "9"], "no published weights of version 9; kept: [3]"),
        (["--domain", "arith/max2", "--k", "1,5", "--n", "2"], "--k 5 is more than --n 2"),
        (["--domain", "arith/max2", "--k", "0"], "--k '0': give positive integers"),
        (["--domain", "session-repair"], "keeps no held-out tasks: evaluating it would reuse its training tasks"),
    ]
    for args, message in bad:
        assert main(["eval", str(run_dir), *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["eval", str(run_dir / "missing"), "--domain", "arith/max2"]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_periodic_evaluator_waits_for_the_version_and_reports(run_dir, policy):
    cfg = load_config(None, [*TINY, "learner.eval.every_steps=2", "learner.eval.domains=[arith/max2]",
                             "learner.eval.k=[1,2]", "learner.eval.tasks=4"])  # fmt: skip
    ev = PeriodicEvaluator(run_dir, cfg.learner.eval, cfg.policy, lambda: None)
    try:
        assert not ev.due(3) and ev.due(4)
        ev.submit(4, 4)  # not written yet: the evaluator waits for its files
        WeightStore(run_dir).publish(full_state_dict(policy.model), version=4)
        assert ev.wait_idle(timeout_s=RUN_GUARD_S)
        got = ev.results()
        assert got["eval/step"] == 4 and got["eval/arith/max2/version"] == 4
        assert 0.0 <= got["eval/arith/max2/pass@1"] <= got["eval/arith/max2/pass@2"] <= 1.0
        assert ev.results() == {}  # handed over once
    finally:
        ev.close()


def test_periodic_evaluation_refuses_a_domain_without_held_out_tasks(run_dir):
    cfg = load_config(None, [*TINY, "learner.eval.every_steps=2", "learner.eval.domains=[session-repair]"])
    with pytest.raises(EvalError, match="learner.eval.domains: domain 'session-repair' keeps no held-out tasks"):
        PeriodicEvaluator(run_dir, cfg.learner.eval, cfg.policy, lambda: None)


@pytest.mark.slow
def test_a_run_evaluates_every_n_steps_into_metrics_and_the_plot(tmp_path):
    from hpcrl.jobs.plots import write_plots

    metrics = tmp_path / "m.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.rl.learner.inprocess", str(ROOT / "config.yaml"), "learner.max_steps=4",
         "learner.eval.every_steps=2", "learner.eval.domains=[arith/max2, humaneval]", "learner.eval.k=[1,2]",
         "learner.eval.tasks=3", "generators.max_new_tokens=16", f"sandbox.uid_base={UID}",
         "--run-dir", str(tmp_path / "run"), "--metrics", str(metrics)],
        capture_output=True, text=True, timeout=RUN_GUARD_S, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evaluated = {r["step"]: r for r in rows if "eval/step" in r}
    assert sorted(evaluated) == [2, 4]
    for step, r in evaluated.items():
        assert r["eval/step"] == step and r["eval/humaneval/version"] == step
        assert {"eval/arith/max2/pass@1", "eval/arith/max2/pass@2", "eval/humaneval/pass@2"} <= set(r)
    # hpcrl plot draws them: metrics.jsonl as the coordinator writes it (with report times)
    run = tmp_path / "run"
    with open(run / "metrics.jsonl", "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({**r, "time": 1000.0 + i}) + "\n")
    paths, _ = write_plots(run)
    assert run / "plots" / "eval.png" in paths and (run / "plots" / "eval.png").stat().st_size > 0
