"""`hpcrl domains list [--json]` and `hpcrl domains build` argument errors.

The listing reads stdlib-repair's task list from $HPCRL_CACHE_DIR: here a manifest written by
the test from real files and real mutation sites (not sandbox-verified: this checks the listing,
tests/test_stdlib_repair.py checks the build), and an empty cache for the not-built case.
"""

from __future__ import annotations

import hashlib
import json
import shlex as shlex_module
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.jobs.cli import main
from hpcrl.rl.domains import get_domain
from hpcrl.rl.domains.mutate import mutation_sites, sample_sites
from hpcrl.rl.domains.stdlib_repair import cache_dir

KEYS = ["name", "family", "tasks", "multi_step", "languages"]


def _manifest(root: Path, n: int) -> None:
    test = pytest.importorskip("test")  # the interpreter's own Lib/test (pyenv and python.org builds)
    src, tests = Path(shlex_module.__file__), Path(test.__file__).parent / "test_shlex.py"
    if not tests.is_file():
        pytest.skip(f"{tests} missing")
    sha = {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in (("source", src), ("test", tests))}
    muts = sample_sites(mutation_sites(src.read_text()), seed=0, n=n)
    m = {
        "modules": {
            "shlex": {"status": "ok", "source": str(src), "test": str(tests)}
            | {f"{k}_sha256": v for k, v in sha.items()}
        },
        "mutants": [{"id": f"shlex-{i}", "module": "shlex", **x.to_json()} for i, x in enumerate(muts)],
    }
    out = cache_dir()
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps(m))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_json_gives_every_family_with_its_task_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HPCRL_CACHE_DIR", str(tmp_path))
    _manifest(tmp_path, 7)
    rc, out, _ = _run(capsys, "domains", "list", "--json")
    assert rc == 0
    rows = json.loads(out)
    assert all(list(r) == KEYS for r in rows)
    by = {r["name"]: r for r in rows}
    assert by["stdlib-repair"] == {**by["stdlib-repair"], "tasks": 7, "multi_step": True, "languages": ["python"]}
    assert by["c-repair"]["tasks"] == get_domain("c-repair").size and by["c-repair"]["languages"] == ["c"]
    assert by["session-repair"]["multi_step"] and by["session-repair"]["tasks"] == 5
    assert by["arith"]["tasks"] is None  # every index a task of its own
    assert all(r["name"] == r["family"] for r in rows)
    rc, out, _ = _run(capsys, "domains", "list")
    assert rc == 0 and out.splitlines()[0].split() == ["name", "tasks", "multi-step", "languages"]
    assert any(line.split()[:2] == ["stdlib-repair", "7"] for line in out.splitlines())


def test_list_without_a_built_task_list_says_how_to_build_it(tmp_path, capsys):
    # A fresh process: get_domain caches domains per name, and this one must not be built.
    env = {"HPCRL_CACHE_DIR": str(tmp_path / "empty"), "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", "domains", "list", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    row = next(r for r in json.loads(p.stdout) if r["name"] == "stdlib-repair")
    assert row["tasks"] is None and row["multi_step"] is True
    assert "hpcrl domains build stdlib-repair" in p.stderr


def test_build_refuses_modules_outside_the_allow_list(capsys):
    rc, _, err = _run(capsys, "domains", "build", "stdlib-repair", "--modules", "os,shlex")
    assert rc == 2 and "--modules: os not in the allow-list" in err and "\n" not in err.strip()
