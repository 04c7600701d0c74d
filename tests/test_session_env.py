"""Session episodes: the tool-call syntax, and `session-repair` environments driven
by scripted policies against a real sandbox server (bwrap sandboxes, the CURVE transport):
a fix earns reward 1, 50+ operations keep their files without re-sending the workspace,
malformed actions are answered, and a lost server is the infrastructure's failure, not the model's.

The server tests need bubblewrap and root; they skip without, fail with HPCRL_REQUIRE_SANDBOX=1 (CI).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.core.config import GeneratorConfig, PolicyConfig, TinyModelConfig, load_config
from hpcrl.rl.coordinator.tasks import LocalTaskSource, TaskSampler
from hpcrl.rl.domains import DomainError, get_domain
from hpcrl.rl.domains.session_env import SessionEnv
from hpcrl.rl.domains.session_repair import SessionRepairDomain
from hpcrl.rl.domains.session_tasks import SESSION_PROBLEMS
from hpcrl.rl.domains.toolcalls import MAX_CALLS, ListFiles, Read, Run, Submit, Write, parse_action
from hpcrl.rl.model.policy import Policy
from hpcrl.rl.rollout.generator import Generator
from hpcrl.sandbox.result import SandboxError

from conftest import require_bwrap, sandbox_client, session_server

UID = 61280  # apart from test_sandbox_session's slot uids
SESSION_DIR = "/var/tmp/hpcrl-sessions-envtest"

# -- the syntax -------------------------------------------------------------------------------


def test_parse_calls_of_every_tool_several_per_action_prose_ignored():
    text = (
        "Let me look first, since a < b here.\n"
        '<read path="stats/core.py"/> <list/>\n'
        '<write path="stats/core.py">\ndef f():\n    return "<b>"\n</write>\n'
        "<run>python3 -m unittest -q</run>\n"
        "<run timeout=\"20\">python3 -c 'print(1 + 1)'</run>\n"
        "<submit/>"
    )
    p = parse_action(text)
    assert p.error is None
    assert p.calls == (
        Read("stats/core.py"),
        ListFiles(),
        Write("stats/core.py", 'def f():\n    return "<b>"\n'),  # the newline after the tag is layout
        Run(("python3", "-m", "unittest", "-q")),
        Run(("python3", "-c", "print(1 + 1)"), 20.0),
        Submit(),
    )
    assert parse_action('<write path="a.py"></write>').calls == (Write("a.py", ""),)


@pytest.mark.parametrize(
    "text, says",
    [
        ("I would fix it by sorting.", "no tool call"),
        ('<delete path="a.py"/>', "unknown tool <delete>"),
        ("<read/>", 'needs path="..."'),
        ('<read path="a.py" mode="r"/>', "no attribute 'mode'"),
        ("<read path='a.py'/>", "malformed attributes"),
        ('<read path="a.py"></read>', "takes no body"),
        ('<write path="a.py">print(1)', "unterminated <write>"),
        ("<run/>", "needs a body"),
        ("<run>  </run>", "has no command"),
        ('<run>python3 -c "print(1)</run>', "cannot be split"),
        ('<run timeout="soon">ls</run>', "positive number of seconds"),
        ('<read path="../etc/passwd"/>', "contains '..'"),
        ('<write path="/etc/passwd">x</write>', "is absolute"),
        ('<write path="a.py"\nprint(1)</write>', "malformed tool tag"),
        ("</run>", "closes nothing"),
        ('<submit/><read path="a.py"/>', "must be the last"),
        ("<list/>" * (MAX_CALLS + 1), f"more than {MAX_CALLS} tool calls"),
    ],
)
def test_malformed_actions_give_one_line_reasons(text, says):
    p = parse_action(text)
    assert p.calls == () and p.error is not None
    assert says in p.error and "\n" not in p.error, p.error


def test_the_domain_is_registered_and_the_default_config_does_not_use_it():
    d = get_domain("session-repair")
    assert d.size == 5 and d.needs_executor and d.action.stop == ("<submit/>",)
    assert get_domain("session-repair/rle").size == 1
    with pytest.raises(DomainError, match="unknown problem 'nope'"):
        get_domain("session-repair/nope")
    t = d.task(7)
    assert t.id == "cart-total-7" and "<submit/>" in t.prompt
    assert t.data["hidden"] not in t.prompt and "18" not in t.prompt  # a hidden expected value
    assert all(not dc.name.startswith("session-repair") for dc in load_config(None).domains)
    with pytest.raises(ValueError, match="need a sandbox server"):
        d.make_env(t, object())


# -- against a real sandbox server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bwrap_ok():
    require_bwrap(UID)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


def server(run_dir: Path):
    return session_server(run_dir, UID, f"sandbox.session_dir={SESSION_DIR}")


def executor(run_dir: Path):
    """What a generator hands the domains: a sandbox client of the run."""
    return sandbox_client(run_dir)


FIXES = {p.name: p.reference[0] for p in SESSION_PROBLEMS}
VISIBLE = "<run>python3 -m unittest -q</run>"


def test_a_scripted_policy_reads_runs_fixes_and_submits_for_reward_1(bwrap_ok, run_dir):
    domain = get_domain("session-repair")
    with server(run_dir) as srv, executor(run_dir) as ex:
        for i, p in enumerate(domain.problems):
            env = domain.make_env(domain.task(i), ex)
            assert env.reset().startswith("Fix the bug")
            path, fixed = FIXES[p.name]
            obs, r, done, info = env.step(f'<read path="{path}"/>{VISIBLE}')
            assert not done and r == 0 and f"[read {path}]" in obs
            assert "FAILED" in obs and info["feedback"].status == "error", obs  # the seeded bug shows
            obs, r, done, info = env.step(f'<write path="{path}">\n{fixed}</write>{VISIBLE}')
            assert "OK" in obs and info["feedback"].status == "ok" and info["feedback"].exit_code == 0, obs
            obs, r, done, info = env.step("Tests pass.\n<submit/>")
            assert (obs, r, done) == ("", 1.0, True), (p.name, info)
            assert info["feedback"].all_passed and info["feedback"].message == "hidden tests passed"
            assert env.session is None  # closed when the episode ended
            env.close()
        assert len(srv.sessions) == 0


def test_the_buggy_code_or_a_cheat_gets_reward_0_and_never_sees_hidden_values(bwrap_ok, run_dir):
    domain = get_domain("session-repair/median")
    hidden_values = ("3.5", "[5, 3, 1, 4]")
    with server(run_dir) as srv, executor(run_dir) as ex:
        env = domain.make_env(domain.task(0), ex)
        env.reset()
        obs, r, done, info = env.step("<submit/>")
        assert (obs, r, done) == ("", 0.0, True) and info["feedback"].passed == 0
        assert info["feedback"].message == "hidden tests failed"
        assert not any(v in info["feedback"].message for v in hidden_values)
        # Exiting 0 at import, before the checks run, does not pass: no answer reaches the checker.
        env = domain.make_env(domain.task(0), ex)
        env.reset()
        cheat = "import os\nprint('ok')\nos._exit(0)\n"
        env.step(f'<write path="stats/__init__.py">{cheat}</write>')
        _, r, done, _ = env.step("<submit/>")
        assert (r, done) == (0.0, True)
        assert len(srv.sessions) == 0


def test_a_60_operation_episode_keeps_its_files_and_never_resends_the_workspace(bwrap_ok, run_dir):
    domain = SessionRepairDomain("median", max_ops=60)
    with server(run_dir) as srv, executor(run_dir) as ex:
        env = domain.make_env(domain.task(0), ex)
        env.reset()
        setup = dict(srv.sessions.ops)
        assert setup == {"open": 1, "write": 3} and srv.sessions.bytes_written == env.sent_bytes
        model_bytes = 0
        for k in range(1, 20):
            note = f"note {k}\n"
            obs, _, done, _ = env.step(
                f'<write path="notes/{k}.txt">{note}</write><read path="notes/{k}.txt"/>'
                "<run>python3 -c \"import os; print(len(os.listdir('notes')))\"</run>"
            )
            model_bytes += len(note)
            assert not done and f"[read notes/{k}.txt]\n{note}" in obs and f"\n{k}\n" in obs, obs
        assert env.ops == 57
        obs, _, done, _ = env.step('<list/><read path="stats/core.py"/>')
        assert not done and all(f"notes/{k}.txt" in obs for k in range(1, 20)) and "def median" in obs
        ops = srv.sessions.ops
        assert ops["write"] == 3 + 19 and ops["read"] == 20 and ops["run"] == 19 and ops["list"] == 1
        # Only what the model wrote travelled after the setup: the project was sent once.
        assert srv.sessions.bytes_written == env.sent_bytes == setup_bytes(domain) + model_bytes
        # The 60th operation is the last: the episode ends, unscored, truncated.
        obs, r, done, info = env.step('<read path="a"/><read path="b"/><list/>')
        assert (obs, r, done, info["truncation"]) == ("", 0.0, True, "max_steps") and env.ops == 60
        assert len(srv.sessions) == 0 and srv.sessions.ops["close"] == 1


def setup_bytes(domain: SessionRepairDomain) -> int:
    return sum(len(c.encode()) for _, c in domain.problems[0].files)


def test_malformed_actions_and_refused_operations_are_observations(bwrap_ok, run_dir):
    domain = SessionRepairDomain("slugify", max_ops=8)
    with server(run_dir) as srv, executor(run_dir) as ex:
        env = domain.make_env(domain.task(0), ex)
        env.reset()
        obs, r, done, info = env.step("the bug is in slug.py")
        assert obs.startswith("[error] no tool call") and (r, done) == (0.0, False) and "feedback" not in info
        obs, _, done, _ = env.step('<write path="../x.py">1</write>')
        assert obs.startswith("[error] tool call 1: <write> path '../x.py' contains '..'") and not done
        # What parses but the server refuses: a missing file, a symlink the sandboxed code made.
        obs, _, done, _ = env.step('<read path="nope.py"/><run>ln -s /etc/passwd link</run><read path="link"/>')
        assert "[read nope.py] error: read 'nope.py': no such file" in obs and "root:" not in obs
        assert "[read link] error: read 'link': it is a symlink" in obs
        assert not done and env.ops == 5
        obs, _, done, _ = env.step("<run>no-such-program</run>")
        assert "[run no-such-program]" in obs and not done
        assert srv.sessions.ops["write"] == 3  # the task's three files; nothing malformed was sent


def test_a_lost_server_is_an_infrastructure_error_not_the_models_failure(bwrap_ok, run_dir):
    domain = get_domain("session-repair/rle")
    with executor(run_dir) as ex:
        with server(run_dir):
            env = domain.make_env(domain.task(0), ex)
            env.on_fault = "reissue"
            env.reset()
            assert not env.step(VISIBLE).done
        # A restarted server (same run, new instance) does not hold the session: its work is gone.
        with server(run_dir):
            with pytest.raises(SandboxError, match="no open session"):
                env.step(VISIBLE)
            assert env.done and env.session is None
        # With on_fault resume (the default) the step runs again on a session restored from the
        # good steps' writes: the model's fix is there, the faulted step's reward is its own.
        path, fix = FIXES["rle"]
        # A file a run made (a build output, an edit by a command) is there too: runs are replayed.
        made = "<run>python3 -c \"open('made.txt', 'w').write('by a run')\"</run>"
        with server(run_dir):
            env = domain.make_env(domain.task(0), ex)
            env.reset()
            assert not env.step(f'<write path="{path}">{fix}</write>{made}').done
        with server(run_dir):
            obs, _, _, info = env.step(f'{VISIBLE}<read path="made.txt"/>')
            assert info["resumes"] == 1 and "no open session" in info["fault"] and "exit code 0" in obs
            assert "[read made.txt]\nby a run" in obs
            assert env.step("<submit/>").reward == 1.0
        # No server at all: the request times out (a short budget; nothing answers however long).
        env = SessionEnv(domain.task(0), ex, max_ops=8, client_timeout_s=2.0)
        with server(run_dir):
            env.reset()
        with pytest.raises(SandboxError, match="RequestTimeout"):
            env.step('<write path="codec/rle.py">pass\n</write>')
        env.close()


class _Recording(LocalTaskSource):
    """The local task source, keeping the reasons episodes failed for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reasons: list[str] = []

    def failed(self, ticket, reason, permanent=False):
        self.reasons.append(reason)
        super().failed(ticket, reason, permanent)


def test_the_generator_runs_session_episodes_and_fails_them_without_a_server(bwrap_ok, run_dir):
    tiny = PolicyConfig(
        tiny=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_context=2048),
        device="cpu",
    )
    policy = Policy.load(tiny, seed=0)
    domains = {"session-repair": SessionRepairDomain(client_timeout_s=5.0)}
    cfg = GeneratorConfig(episodes_in_flight=4, env_threads=2, max_turns=3, max_new_tokens=64)
    sampler = TaskSampler({"session-repair": 1.0}, group_size=2, seed=0)
    with executor(run_dir) as ex:
        with server(run_dir) as srv:
            gen = Generator(cfg, policy, domains, run="r", name="g0", seed=0, executor=ex)
            source, out = _Recording(sampler), []
            gen.run(source, out.append, stop=lambda: len(out) >= 2)
            # An untrained policy writes no valid call: each action is answered, none crashes.
            for t in out:
                assert t.final_reward == 0 and t.truncation in ("max_steps", "max_tokens") and t.steps
            assert not source.reasons
            gen.close()
            assert srv.sessions.ops["open"] >= 2 and len(srv.sessions) == 0  # abandoned episodes closed theirs
        # The server is gone: episodes fail as the infrastructure's (and are issued again); none
        # is scored as the model's reward 0.
        gen = Generator(cfg, policy, domains, run="r", name="g1", seed=0, executor=ex)
        source, out = _Recording(sampler, max_attempts=10), []
        gen.run(source, out.append, stop=lambda: source.reasons)
        gen.close()
        assert out == [] and source.reasons
        assert all(r.startswith("reset: SandboxError") and "RequestTimeout" in r for r in source.reasons)


@pytest.mark.slow
def test_hpcrl_run_trains_on_session_repair_through_a_sandbox_server(bwrap_ok, tmp_path):
    """The whole run: the generator job's environments open sessions on the sandbox server job."""
    from hpcrl.rl.coordinator.report import read_status
    from hpcrl.rl.store.reader import StoreReader

    from conftest import RUN_GUARD_S
    from test_run import finish, hpcrl, no_processes_left

    proc = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path}",
        "domains=[{name: session-repair}]",
        "learner.max_steps=2",
        "learner.batch_groups=4",
        "learner.group_size=4",
        "generators.max_new_tokens=48",
        "generators.episodes_in_flight=16",
        "--run-id",
        "sessions",
    )
    out = finish(proc, RUN_GUARD_S)
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "sessions"
    trajs = [t for t in StoreReader(run_dir) if t.domain == "session-repair"]
    assert len(trajs) >= 16
    # An untrained model writes no valid tool call: every action is answered until the episode
    # runs out of turns or context, none is scored as a pass, none fails the run.
    assert all(t.final_reward == 0 and t.truncation in ("max_steps", "max_tokens") for t in trajs)
    assert any(len(t.steps) > 1 for t in trajs)
    assert read_status(run_dir)["completed_by_domain"].get("session-repair", 0) > 0
    no_processes_left(run_dir)
