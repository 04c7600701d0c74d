"""`c-repair`: small C projects with a build step on a real sandbox session.

Compile errors reach the model as observations; every project's seeded bug fails the hidden
tests and its fix passes them; a library that exits 0 from a constructor does not pass (the
adversarial corpus, tests/test_reward_forgery.py, holds the other attempts).
Needs bubblewrap, root and gcc (skips without, fails with HPCRL_REQUIRE_SANDBOX=1).
"""

from __future__ import annotations

import pytest

from hpcrl.rl.domains import DomainError, get_domain
from hpcrl.rl.domains.c_repair import C_PROBLEMS, CRepairDomain

from conftest import require_bwrap, sandbox_client, session_server

UID = 61460  # apart from the other sandbox tests' slot uids
SESSION_DIR = "/var/tmp/hpcrl-sessions-ctest"


def test_the_family_is_registered_with_its_metadata():
    d = get_domain("c-repair")
    assert d.size == len(C_PROBLEMS) and d.multi_step and d.languages == ("c",)
    t = get_domain("c-repair/gcd").task(0)
    assert "make test" in t.prompt and "100, 75" not in t.prompt and t.data["hidden"] not in t.prompt
    with pytest.raises(DomainError, match="unknown problem 'nope'"):
        get_domain("c-repair/nope")


@pytest.fixture
def run_dir(tmp_path):
    require_bwrap(UID)
    d = tmp_path / "run"
    d.mkdir()
    return d


def _submit(domain, index, ex, actions=()):
    env = domain.make_env(domain.task(index), ex)
    env.reset()
    for a in actions:
        assert not env.step(a).done
    _, r, done, info = env.step("<submit/>")
    env.close()
    assert done
    return r, info["feedback"]


def test_a_compile_error_is_an_observation_and_the_fix_earns_1(run_dir):
    domain = CRepairDomain("count-words")
    with session_server(run_dir, UID, f"sandbox.session_dir={SESSION_DIR}"), sandbox_client(run_dir) as ex:
        env = domain.make_env(domain.task(0), ex)
        env.reset()
        obs, r, done, info = env.step("<run>make test</run>")
        assert not done and r == 0 and "error: expected ';'" in obs and info["feedback"].exit_code != 0, obs
        fixed = domain.problems[0].reference
        obs, r, done, info = env.step(f'<write path="src/lib.c">{fixed}</write><run>make test</run>')
        assert "all visible tests passed" in obs and info["feedback"].exit_code == 0, obs
        obs, r, done, info = env.step("<submit/>")
        assert (r, done) == (1.0, True) and info["feedback"].message == "hidden tests passed"
        env.close()


def test_every_seeded_bug_fails_the_hidden_tests_and_every_fix_passes(run_dir):
    domain = get_domain("c-repair")
    with session_server(run_dir, UID, f"sandbox.session_dir={SESSION_DIR}") as srv, sandbox_client(run_dir) as ex:
        for i, p in enumerate(domain.problems):
            r, fb = _submit(domain, i, ex)
            assert r == 0.0 and fb.message == "hidden tests failed", p.name
            r, fb = _submit(domain, i, ex, [f'<write path="src/lib.c">{p.reference}</write>'])
            assert r == 1.0, (p.name, fb)
        # A library that exits 0 (printing "ok") before main runs does not pass: no answer reaches the checker.
        cheat = (
            "#include <stdio.h>\n#include <stdlib.h>\n__attribute__((constructor)) static void c(void) "
            '{ puts("ok"); exit(0); }\nint gcd(int a, int b) { return a; }\n'
        )
        gcd = [p.name for p in domain.problems].index("gcd")
        assert _submit(domain, gcd, ex, [f'<write path="src/lib.c">{cheat}</write>'])[0] == 0.0
        assert len(srv.sessions) == 0
