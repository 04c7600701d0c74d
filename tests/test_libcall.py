"""The `libcall` family: the program runs in the real bwrap sandbox, a wrong name comes back as
the program's own error line, the right one scores 1/attempt, and the episode ends after its
attempts. The whole one-character action space against the run's submit path is in
tests/test_reward_forgery.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from hpcrl.rl.domains import DomainError, SandboxJudge, get_domain
from hpcrl.rl.domains.libcall import PROMPT, LibCallEnv

from conftest import require_bwrap

UID = 62520  # apart from the other sandbox tests' slot uids


@pytest.fixture(scope="module")
def judge():
    from hpcrl.core.config import load_config
    from hpcrl.sandbox.auto import make_backend

    require_bwrap(UID)
    return SandboxJudge(make_backend(load_config(None, [f"sandbox.uid_base={UID}"]).sandbox))


def test_variants_tasks_and_alphabet():
    d = get_domain("libcall/names8-retry2")
    assert (d.turns, d.names, d.size, d.multi_step, d.needs_executor) == (2, "abcdefgh", 80, True, True)
    assert d.action.max_tokens == 1 and d.languages == ("python",)
    one = get_domain("libcall/names3")
    assert (one.turns, one.names, one.multi_step) == (1, "abc", False)
    tasks = [d.task(i) for i in range(d.size)]
    assert {(t.data["name"], t.data["x"]) for t in tasks} == {(n, x) for n in "abcdefgh" for x in range(10)}
    assert all(t.prompt == PROMPT and t.data["expected"] == str(3 * t.data["x"] + 1) for t in tasks)
    assert d.task(5) == d.task(5) and d.task(5 + d.size).data == d.task(5).data
    assert set(PROMPT) | set(d.names) <= set(d.alphabet)
    assert set(get_domain("libcall/names26").alphabet) >= set("abcdefghijklmnopqrstuvwxyz")
    assert d.task_names()[:3] == ["a0", "b0", "c0"] and d.named_task("h9").data["name"] == "h"
    for bad in ("names1", "names27", "names8-retry1", "nope"):
        with pytest.raises(DomainError, match=r"libcall: unknown variant .*; variants: names<K>"):
            get_domain(f"libcall/{bad}")
    with pytest.raises(DomainError, match=r"needs a variant, e\.g\. libcall/names8-retry2"):
        get_domain("libcall")


def test_the_right_name_scores_1_and_a_wrong_one_gets_the_error_line_then_a_second_try(judge):
    d = get_domain("libcall/names8-retry2")
    task = d.task(4)  # name 'e', x 0
    assert task.data["name"] == "e"
    env = d.make_env(task, judge)
    assert env.reset() == PROMPT
    obs, reward, done, info = env.step("e")
    assert (obs, reward, done, info["turn"]) == ("", 1.0, True, 1) and info["feedback"].all_passed
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("e")

    env.reset()
    obs, reward, done, info = env.step("c")
    assert (reward, done, info["feedback"].status) == (0.0, False, "error")
    # Python's own last line of the traceback
    assert obs == "\nAttributeError: lib has no c, only e"
    obs, reward, done, info = env.step("e")
    assert (obs, reward, done, info["turn"]) == ("", 0.5, True, 2)

    env.reset()
    obs, _, done, _ = env.step(")")
    assert not done and obs == "\nSyntaxError: unmatched ')'"
    obs, reward, done, info = env.step("a")  # the last attempt: wrong, the episode is over
    assert (obs, reward, done, info["turn"]) == ("", 0.0, True, 2)


def test_every_observation_stays_in_the_alphabet(judge):
    """The alphabet is closed: whatever character of it the model writes (or none, an eos), the
    error line is made of its characters, so `policy.tiny.charset: auto` reads every observation."""
    d = get_domain("libcall/names8-retry2")
    task = d.task(4)

    def observe(action: str) -> str:
        return LibCallEnv(task, judge, 2).step(action).observation

    with ThreadPoolExecutor(4) as pool:
        seen = dict(zip(["", *d.alphabet], pool.map(observe, ["", *d.alphabet])))
    for action, obs in seen.items():
        assert set(obs) <= set(d.alphabet), (action, obs, set(obs) - set(d.alphabet))
    assert seen["e"] == "" and seen[""] == "\nSyntaxError: invalid syntax"
    assert seen["E"] == "\nAttributeError: lib has no E, only e. Did you mean: 'e'?"  # Python's own hint


def test_submit_judges_the_name_file_as_a_first_attempt(judge):
    d = get_domain("libcall/names4-retry2")
    task = d.named_task("b7")
    assert d.workspace(task) == {"name.txt": ""} and d.reference(task) == {"name.txt": "b\n"}
    ok = d.submit(task, d.reference(task), judge)
    assert (ok.reward, ok.done) == (1.0, True)
    wrong = d.submit(task, {"name.txt": "a\n"}, judge)
    assert wrong.reward == 0.0 and "lib has no a, only b" in wrong.info["reason"]
    assert d.submit(task, d.workspace(task), judge).reward == 0.0
    # Tools take what an episode could write, a name: not an expression that finds the function
    with pytest.raises(ValueError, match="not a Python name"):
        d.submit(task, {"name.txt": "__dict__[lib.__all__[0]]"}, judge)
    with pytest.raises(ValueError, match="no name.txt"):
        d.submit(task, {"main.py": "print(22)\n"}, judge)
