"""Domains: registries, the arith family, site modules named in config, and the code domains
judged by the real sandbox (multi-step: wrong attempt, feedback, fixed attempt)."""

from __future__ import annotations

import textwrap

import pytest

from hpcrl.core.config import DomainConfig, load_config
from hpcrl.rl.common.registry import DuplicateName, Registry, UnknownName
from hpcrl.rl.domains import (
    DOMAIN_FAMILIES,
    REWARDS,
    Domain,
    DomainError,
    PromptDomain,
    get_domain,
    load_domains,
    load_site_domain,
)
from hpcrl.rl.domains.base import EVAL_BASE
from hpcrl.rl.domains.code import END_MARK, extract_code
from hpcrl.rl.domains.problems import REPAIR_HELDOUT, REPAIR_PROBLEMS, SYNTH_HELDOUT, SYNTH_PROBLEMS


def test_registry_rejects_duplicates_and_lists_known_names():
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    with pytest.raises(DuplicateName, match="widget 'a' is already registered"):
        reg.register("a", 2)
    with pytest.raises(UnknownName, match=r"unknown widget 'b'.*registered: a"):
        reg.get("b")
    with pytest.raises(ValueError, match="without '/'"):
        reg.register("x/y", 3)
    with pytest.raises(DuplicateName):
        DOMAIN_FAMILIES.register("arith", lambda v: None)
    assert {"exact", "prefix", "tests_passed", "all_tests"} <= set(REWARDS.names())


def test_unknown_family_and_variant_say_what_exists():
    with pytest.raises(
        DomainError,
        match=r"unknown domain family 'arihm' \(did you mean 'arith'\?\); "
        r"registered: arith, c-repair, code-repair, humaneval, libcall, session-repair, stdlib-repair, synth",
    ):
        get_domain("arihm/copy")
    with pytest.raises(DomainError, match=r"arith: unknown variant 'add-mod11'; variants: copy, add<k>-mod<m>"):
        get_domain("arith/add-mod11")
    with pytest.raises(DomainError, match="needs a variant"):
        get_domain("arith")
    with pytest.raises(DomainError, match="unknown problem 'nope'; problems: sum-two"):
        get_domain("synth/nope")


@pytest.mark.parametrize(
    "variant", ["copy", "add3-mod10", "add1-mod7", "add-mod10", "add-mod4", "max2", "max5", "min3"]
)
def test_arith_answers_are_right_and_tasks_deterministic(variant):
    d = get_domain(f"arith/{variant}")
    assert d.action.max_tokens == 1
    for i in range(50):
        t = d.task(i)
        assert t == d.task(i) and t.id == str(i)
        a = int(t.data["answer"])
        p = t.prompt
        if variant == "copy":
            assert p == f"copy {a}:"
        elif variant.startswith("add") and "-mod" in variant:
            lhs, mod = p[:-1].split(" mod ")
            x, y = map(int, lhs.split("+"))
            assert a == (x + y) % int(mod) and 0 <= x < int(mod)
        else:
            op, *xs = p[:-1].split()
            assert a == (max if op == "max" else min)(map(int, xs)) and len(xs) == int(variant[3:])
        env = d.make_env(t)
        assert env.reset() == p
        _obs, reward, done, _info = env.step(str(a))
        assert (reward, done) == (1.0, True)
    assert len({d.task(i).prompt for i in range(200)}) > 5  # not one prompt over and over


def test_arith_retry_is_multi_step():
    d = get_domain("arith/max3-retry3")
    t = d.task(0)
    wrong = str((int(t.data["answer"]) + 1) % 10)
    env = d.make_env(t)
    env.reset()
    first = env.step(wrong)
    assert first.done is False and first.reward == 0.0 and first.observation == f" no\n{t.prompt}"
    second = env.step(t.data["answer"])
    assert second.done and second.reward == pytest.approx(0.5)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("1")
    env = d.make_env(t)
    env.reset()
    assert [env.step(wrong).done for _ in range(3)] == [False, False, True]


def test_hundreds_of_domains_from_one_config(tmp_path):
    names = [f"arith/add{k}-mod{m}" for k in range(1, 10) for m in range(2, 11)]
    names += [f"arith/{op}{n}-retry{t}" for op in ("max", "min") for n in range(2, 7) for t in range(2, 10)]
    assert len(names) >= 150
    lines = "\n".join(f"  - {{name: {n}, weight: {1 + i % 3}}}" for i, n in enumerate(names))
    (tmp_path / "c.yaml").write_text(f"domains:\n{lines}\n")
    cfg = load_config(tmp_path / "c.yaml")
    domains = load_domains(cfg.domains)
    assert list(domains) == names
    assert all(isinstance(d, Domain) and d.name == n for n, d in domains.items())


SITE_MODULE = textwrap.dedent("""
    from hpcrl.rl.domains import PromptDomain

    PAIRS = [("capital of France?", "Paris"), ("2*3=", "6")]

    def make_domain(name):
        return PromptDomain(name, PAIRS, reward="exact", max_tokens=8)

    def reward_len(action, task, feedback=None):
        return min(1.0, len(action) / 10)

    def make_custom_reward(name):
        return PromptDomain(name, PAIRS, reward=reward_len)

    INSTANCE = PromptDomain("whatever", PAIRS)
    NOT_A_DOMAIN = 42

    def wrong_type(name):
        return "nope"
""")


def test_site_domain_from_config_module(tmp_path):
    (tmp_path / "my_site_tasks.py").write_text(SITE_MODULE)
    (tmp_path / "c.yaml").write_text(
        "domains:\n"
        "  - {name: quiz, module: 'my_site_tasks:make_domain', weight: 2}\n"
        "  - {name: long, module: 'my_site_tasks:make_custom_reward'}\n"
        "  - {name: inst, module: 'my_site_tasks:INSTANCE'}\n"
        "  - {name: arith/copy}\n"
    )
    cfg = load_config(tmp_path / "c.yaml")
    domains = load_domains(cfg.domains, search_path=[str(tmp_path)])
    assert [d.name for d in domains.values()] == ["quiz", "long", "inst", "arith/copy"]
    quiz = domains["quiz"]
    assert isinstance(quiz, PromptDomain) and quiz.action.max_tokens == 8
    env = quiz.make_env(quiz.task(0))
    assert env.reset() == "capital of France?"
    assert env.step(" Paris\n") == ("", 1.0, True, {})
    env = domains["long"].make_env(domains["long"].task(1))
    env.reset()
    assert env.step("12345").reward == 0.5

    for module, fragment in [
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("my_site_tasks:missing", "has no attribute 'missing'; it has: INSTANCE, NOT_A_DOMAIN, PAIRS"),
        ("my_site_tasks:NOT_A_DOMAIN", "is a int; expected a Domain"),
        ("my_site_tasks:wrong_type", "returned a str, not a hpcrl.rl.domains.Domain"),
    ]:
        with pytest.raises(DomainError, match=fragment):
            load_site_domain("x", module, [str(tmp_path)])
    with pytest.raises(DomainError, match=r"domains\.1: domain 'arith/zzz'"):
        load_domains([DomainConfig(name="arith/copy"), DomainConfig(name="arith/zzz")])


def test_extract_code():
    assert extract_code(f"print(1)\n{END_MARK}\ngarbage") == "print(1)\n"
    assert extract_code("Here:\n```python\nx = 2\n```\nbye") == "x = 2\n"


# -- code domains through the real sandbox ------------------------------------------------


def test_synth_judges_by_stdin_stdout_and_gives_feedback(judge):
    d = get_domain("synth")
    assert d.needs_executor and len(d.problems) == len(SYNTH_PROBLEMS)
    for i, p in enumerate(SYNTH_PROBLEMS):
        t = d.task(i)
        assert t.data["problem"] == p.name and t.id == f"{p.name}-{i}"
        env = d.make_env(t, judge)
        assert p.statement in env.reset()
        obs, reward, done, info = env.step("print('nope')\n" + END_MARK)
        assert not done and reward == 0.0
        fb = info["feedback"]
        assert fb.passed == 0 and fb.total == len(p.cases) and "expected" in fb.message and fb.status == "ok"
        assert "A test failed" in obs and "Try again" in obs
        obs, reward, done, info = env.step(f"```python\n{p.reference}```")
        assert done and reward == 1.0 and info["feedback"].all_passed, info["feedback"]
        assert info["feedback"].total == len(p.hidden)  # the reward counts the hidden cases


def test_synth_shows_feedback_cases_and_rewards_hidden_ones(judge):
    d = get_domain("synth/sum-two")
    p = SYNTH_PROBLEMS[0]
    env = d.make_env(d.task(0), judge)
    env.reset()
    # Right for "1 2" only: the first feedback case passes, the second fails and is shown.
    obs, _, _, info = env.step("print(3)\n")
    assert (info["feedback"].passed, info["feedback"].total) == (1, len(p.cases))
    assert repr(p.cases[1][0]) in obs and repr(p.cases[1][1]) in obs
    # A program written for the shown cases passes them; the hidden ones decide, never shown.
    lookup = "print({'1 2': 3, '-5 5': 0, '100 23': 123}.get(input().strip(), 15))\n"
    env = d.make_env(d.task(0), judge)
    env.reset()
    obs, reward, done, info = env.step(lookup)
    assert not done and reward == 0.0 and "The shown tests pass; a hidden test fails" in obs, obs
    assert not any(i.strip() in obs or o.strip() in obs for i, o in p.hidden), obs
    _, reward, done, info = env.step(lookup)  # the last turn: partial credit on the hidden cases
    assert done and reward == pytest.approx(1 / len(p.hidden)) and info["feedback"].total == len(p.hidden)
    env = d.make_env(d.task(0), judge)
    env.reset()
    env.step("print(3)\n")
    _, reward, done, info = env.step("raise SystemExit(3)\n")
    assert done and reward == 0.0  # two turns, both wrong
    assert info["feedback"].status == "error" and info["feedback"].exit_code == 3


def test_code_domains_keep_held_out_problems_for_evaluation():
    for family, train, held in (
        ("synth", SYNTH_PROBLEMS, SYNTH_HELDOUT),
        ("code-repair", REPAIR_PROBLEMS, REPAIR_HELDOUT),
    ):
        d = get_domain(family)
        assert d.has_heldout and d.heldout_size == len(held) and not {p.name for p in train} & {p.name for p in held}
        seen = {d.task(i).data["problem"] for i in range(5 * len(train))}
        assert seen == {p.name for p in train}  # training indices never reach a held-out problem
        assert [d.task(i).data["problem"] for i in d.eval_indices()] == [p.name for p in held]
        assert d.eval_indices()[0] == EVAL_BASE
        one = get_domain(f"{family}/{held[0].name}")  # a held-out problem by name: a domain of its own
        assert one.task(0).data["problem"] == held[0].name and not one.has_heldout


def test_code_repair_shows_the_real_failure_then_accepts_a_fix(judge):
    d = get_domain("code-repair")
    for i, p in enumerate(REPAIR_PROBLEMS):
        env = d.make_env(d.task(i), judge)
        first = env.reset()
        assert p.buggy in first and "# Test result: failed" in first, first
        obs, reward, done, info = env.step(p.buggy)  # resubmitting the bug fails again
        assert not done and reward == 0.0 and info["feedback"].total == 1 and "failed" in obs
        obs, reward, done, info = env.step(p.reference + END_MARK)
        assert done and reward == 1.0, info["feedback"]


def test_code_domains_refuse_to_run_without_a_sandbox():
    d = get_domain("code-repair/name-error")
    with pytest.raises(ValueError, match="needs a sandbox"):
        d.make_env(d.task(0))


def test_sampler_visits_a_finite_task_list_in_a_seeded_order_per_pass():
    from hpcrl.rl.coordinator.tasks import TaskSampler

    def indices(sampler, n):
        return [sampler.next_group()[0].task_index for _ in range(n)]

    s = TaskSampler({"d": 1.0}, group_size=2, seed=3, sizes={"d": 10})
    first, second = indices(s, 10), indices(s, 10)
    assert sorted(first) == list(range(10)) and first != list(range(10))  # a permutation, shuffled
    assert sorted(second) == list(range(10, 20)) and [i - 10 for i in second] != first  # next pass, new order
    again = TaskSampler({"d": 1.0}, group_size=2, seed=3, sizes={"d": 10})
    assert indices(again, 20) == first + second  # a pure function of (seed, domain, pass)
    # resumed mid-pass from its saved state: the same order goes on
    a = TaskSampler({"d": 1.0}, group_size=2, seed=3, sizes={"d": 10})
    indices(a, 7)
    b = TaskSampler({"d": 1.0}, group_size=2, seed=3, sizes={"d": 10})
    b.restore(a.state())
    assert indices(b, 13) == (first + second)[7:]
    assert indices(TaskSampler({"d": 1.0}, 2, seed=4, sizes={"d": 10}), 10) != first  # the seed matters
    assert indices(TaskSampler({"d": 1.0}, 2, seed=3), 5) == [0, 1, 2, 3, 4]  # no size: plain counter
    # the domain maps the index back onto its list
    d = PromptDomain("q", [(f"{i}?", str(i)) for i in range(10)])
    assert d.size == 10 and d.task(first[0] + 10).prompt == f"{first[0]}?"


def test_charset_auto_is_the_domains_alphabet():
    from hpcrl.rl.model.alphabet import domain_charset, resolve_charset
    from hpcrl.rl.model.policy import Policy

    sums = PromptDomain("sum", [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)])
    assert sums.alphabet == "+0123456789="
    arith = load_domains([DomainConfig(name="arith/copy"), DomainConfig(name="arith/max3-retry2")])
    cfg = resolve_charset(load_config(None), arith)
    assert cfg.policy.tiny.charset == "\n 0123456789:acmnopxy"
    policy = Policy.load(cfg.policy, seed=0, build_model=False)
    assert len(policy.tokenizer) == 4 + 21
    for d in arith.values():  # every prompt and feedback is in the vocabulary
        for i in range(200):
            assert policy.tokenizer.unk_token_id not in policy.encode(d.task(i).prompt + " no\n")
    # a domain without an alphabet (code, free text) keeps printable ASCII; explicit charsets stay
    assert domain_charset({"sum": sums, "synth": get_domain("synth")}) == "printable"
    assert resolve_charset(load_config(None, ["policy.tiny.charset=0123+="]), arith).policy.tiny.charset == "0123+="
    # a stop string's characters are tokens too, or the stop could never be sampled
    assert domain_charset({"s": PromptDomain("s", [("1=", "1")], stop=(";",))}) == "1;="
    assert len(Policy.load(load_config(None).policy, 0, build_model=False).tokenizer) == 4 + 97  # unresolved auto
