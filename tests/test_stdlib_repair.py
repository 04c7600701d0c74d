"""`stdlib-repair`: seeded AST mutants of stdlib modules, kept when the module's
own tests catch them in the real bwrap sandbox, played as session episodes on a real sandbox
server. A scripted "model" that restores the original earns 1; the unchanged mutant, a model
that guts the test file, and one that exits 0 at import all earn 0.

The mutator tests run anywhere; the sandbox tests need bubblewrap and root (skip without, fail
with HPCRL_REQUIRE_SANDBOX=1). They build a small task list (two modules, a few mutants each)
into a temporary cache, never the user's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hpcrl.rl.domains.base import EVAL_BASE
from hpcrl.rl.domains.mutate import KINDS, Mutation, apply, mutation_sites, sample_sites
from hpcrl.rl.domains.stdlib_repair import StdlibRepairDomain, mutants_of

from conftest import require_bwrap, sandbox_client, session_server

UID = 61440  # apart from the other sandbox tests' slot uids
SESSION_DIR = "/var/tmp/hpcrl-sessions-stdlibtest"
MODULES = ("getopt", "shlex")  # fast suites (well under a second in the sandbox)

SAMPLE = '''\
"""A docstring is never mutated."""
__all__ = ["f"]


def f(xs: list[int], flag=True) -> int:
    total = 0
    for i in range(1, len(xs)):
        total += xs[i] * 2
    if total < 10 and flag:
        return total
    name = "abc"
    return total - len(name)  # a comment
'''


# -- the mutator -----------------------------------------------------------------------------------


def test_every_kind_is_found_and_each_mutant_is_one_edit_that_parses():
    sites = mutation_sites(SAMPLE)
    assert {s.kind for s in sites} == set(KINDS)
    descriptions = {s.description for s in sites}
    assert {"'+=' -> '-='", "'*' -> '//'", "'and' -> 'or'", "'<' -> '<='", "1 -> 2", "2 -> 1", "True -> False"} <= (
        descriptions
    )
    assert "deleted 'total = 0'" in descriptions and "\"abc\" -> 'ab'" in descriptions
    for s in sites:
        out = apply(SAMPLE, s)
        ast.parse(out)
        assert out != SAMPLE and '"""A docstring is never mutated."""' in out and '__all__ = ["f"]' in out
        assert "list[int]" in out and "-> int" in out  # annotations are left alone
        assert "# a comment" in out  # a text edit keeps the layout
    with pytest.raises(ValueError, match="expected"):
        apply(SAMPLE.replace("total", "t0tal"), next(s for s in sites if s.kind == "deleted-line"))


def test_sampling_is_deterministic_spread_over_kinds_and_round_trips_through_json():
    import shlex

    sites = mutation_sites(Path(shlex.__file__).read_text())
    a, b = sample_sites(sites, seed=3, n=10), sample_sites(sites, seed=3, n=10)
    assert a == b and len(a) == 10 and sample_sites(sites, seed=4, n=10) != a
    assert len({s.kind for s in a}) == len(KINDS)  # round-robin over the kinds
    assert [Mutation.from_json(json.loads(json.dumps(s.to_json()))) for s in a] == a


# -- in the sandbox ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    require_bwrap(UID)
    from hpcrl.core.config import load_config
    from hpcrl.rl.domains.stdlib_build import build

    out = tmp_path_factory.mktemp("stdlib-cache")
    cfg = load_config(None, [f"sandbox.uid_base={UID}"]).sandbox
    m = build(out, modules=MODULES, seed=0, per_module=6, sandbox=cfg, jobs=2, log=lambda _: None)
    return out / "manifest.json", m


def test_the_build_keeps_mutants_the_tests_catch_and_records_why(manifest):
    _, m = manifest
    assert m["python"].startswith("3.") and Path(m["stdlib"], "shlex.py").is_file()
    for name in MODULES:
        info = m["modules"][name]
        assert info["status"] == "ok", info
        assert info["tried"] == 6 and 0 < info["kept"] == sum(1 for e in m["mutants"] if e["module"] == name)
        assert info["kept"] == info["outcomes"].get("fail", 0) and info["timeout_s"] >= 5.0
    # Deterministic: the same seed picks the same mutants (the sandbox's verdicts then agree).
    src = Path(m["modules"]["shlex"]["source"]).read_text()
    from hpcrl.rl.domains.stdlib_build import _seed

    picked = sample_sites(mutation_sites(src), seed=_seed(0, "shlex"), n=6)
    kept = [Mutation.from_json(e) for e in m["mutants"] if e["module"] == "shlex"]
    assert set(kept) <= set(picked)


def test_a_kept_mutant_fails_its_tests_and_the_original_passes(manifest):
    from hpcrl.core.config import load_config
    from hpcrl.rl.domains.stdlib_build import _check
    from hpcrl.sandbox.auto import make_backend

    _, m = manifest
    backend = make_backend(load_config(None, [f"sandbox.uid_base={UID + 10}"]).sandbox)
    try:
        mut = mutants_of(m)[0]
        src = Path(mut.source_path).read_text()
        assert _check(backend, src, mut.test_text(), mut.module, mut.test_name, 30.0)[0] == "pass"
        assert _check(backend, mut.files()[0][1], mut.test_text(), mut.module, mut.test_name, 30.0)[0] == "fail"
    finally:
        backend.close()


def test_the_domain_splits_by_module_and_prompts_with_the_test_command(manifest):
    path, m = manifest
    d = StdlibRepairDomain(manifest=path)
    assert d.size + (d.heldout_size or 0) == len(m["mutants"]) and d.multi_step and d.languages == ("python",)
    assert not {x.module for x in d.mutants} & set(d.eval_modules)
    if d.heldout_size:
        assert d.task(EVAL_BASE).data["module"] in d.eval_modules
    one = StdlibRepairDomain("shlex", manifest=path)
    assert one.heldout_size is None and {x.module for x in one.mutants} == {"shlex"}
    t = one.task(0)
    assert "python3 -m unittest -q test_shlex" in t.prompt and [f for f, _ in t.data["files"]] == [
        "shlex.py",
        "test_shlex.py",
    ]
    with pytest.raises(ValueError, match="no module or mutant 'nope'"):
        StdlibRepairDomain("nope", manifest=path)
    with pytest.raises(ValueError, match="hpcrl domains build stdlib-repair"):
        StdlibRepairDomain(manifest=path.parent / "missing.json")


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


def _episode(domain, ex, actions):
    env = domain.make_env(domain.task(0), ex)
    obs = env.reset()
    assert "has one bug" in obs
    r = done = None
    for a in actions:
        obs, r, done, _ = env.step(a)
    env.close()
    return obs, r, done


def test_episodes_restore_earns_1_and_unchanged_gutted_tests_or_exit_0_earn_0(manifest, run_dir):
    path, m = manifest
    mut = mutants_of(m)[0]
    domain = StdlibRepairDomain(mut.id, manifest=path)
    original = Path(mut.source_path).read_text()
    test_file = f"{mut.test_name}.py"
    run = f"<run>python3 -m unittest -q {mut.test_name}</run>"
    with session_server(run_dir, UID + 20, f"sandbox.session_dir={SESSION_DIR}") as srv, sandbox_client(run_dir) as ex:
        # The model runs the tests (they fail), restores the module, runs them again, submits.
        env = domain.make_env(domain.task(0), ex)
        env.reset()
        obs, r, done, info = env.step(run)
        assert not done and ("FAILED" in obs or "Error" in obs) and info["feedback"].exit_code != 0, obs
        obs, r, done, info = env.step(f'<write path="{mut.module}.py">{original}</write>{run}')
        assert not done and "OK" in obs and info["feedback"].exit_code == 0, obs[-2000:]
        obs, r, done, info = env.step("<submit/>")
        assert (r, done) == (1.0, True) and info["feedback"].message == "tests passed"
        env.close()
        # Unchanged: the tests catch the mutant.
        assert _episode(domain, ex, ["<submit/>"])[1:] == (0.0, True)
        # Gutting the visible test file changes nothing: submit runs an untouched copy.
        gutted = "import unittest\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
        obs, r, done = _episode(domain, ex, [f'<write path="{test_file}">{gutted}</write>{run}', "<submit/>"])
        assert (r, done) == (0.0, True)
        # Exiting 0 (and printing OK) when the module is imported does not pass: no nonce.
        cheat = "import os\nprint('OK')\nos._exit(0)\n"
        assert _episode(domain, ex, [f'<write path="{mut.module}.py">{cheat}</write><submit/>'])[1:] == (0.0, True)
        assert len(srv.sessions) == 0
