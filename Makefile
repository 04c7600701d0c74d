# hpcrl developer entry points. `make run` runs the default experiment locally; `make test`
# installs everything (system packages when root), starts the dev Slurm cluster, runs every test.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
DEVCLUSTER := $(PY) -m hpcrl.slurm.devcluster

# Debian packages the tests need: Slurm with accounting (slurmdbd on MariaDB), munge,
# bubblewrap for the sandbox, Open MPI for mpi4py, a C/C++ toolchain for sandboxed code.
APT_PACKAGES := slurm-wlm slurmdbd mariadb-server munge bubblewrap openmpi-bin libopenmpi-dev \
                g++ gcc make nodejs procps util-linux

.PHONY: help run test test-fast lint fmt venv sysdeps devcluster devcluster-down devcluster-status devcluster-env bench clean

help:
	@echo "make run              venv + install + the default experiment (config.yaml) on this machine"
	@echo "make test             system packages (apt, when root) + venv + dev Slurm cluster + every test"
	@echo "make devcluster       start the single-machine Slurm dev cluster (idempotent)"
	@echo "make devcluster-down  stop it (cancels jobs first)"
	@echo "eval \"\$$(make -s devcluster-env)\"  point sbatch/squeue/sacct at it"

$(VENV)/.installed: pyproject.toml requirements/ci-constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU torch wheel first: a looser requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install -q -c requirements/ci-constraints.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

sysdeps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then \
	    echo "apt-get install:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	  fi; \
	else echo "sysdeps: not root or no apt-get; make sure these are installed: $(APT_PACKAGES)"; fi

devcluster: venv
	$(DEVCLUSTER) up

devcluster-down: venv
	$(DEVCLUSTER) down

devcluster-status: venv
	$(DEVCLUSTER) status

# No venv prerequisite: an install step's output must never end up in `eval "$(make -s devcluster-env)"`.
devcluster-env:
	@test -x $(PY) || { echo "devcluster-env: no $(PY) yet; run make venv first" >&2; exit 1; }
	@$(DEVCLUSTER) env

run: venv
	$(VENV)/bin/hpcrl run config.yaml

test: sysdeps venv devcluster lint
	HPCRL_REQUIRE_SLURM=1 HPCRL_REQUIRE_SANDBOX=1 $(PY) -m pytest -q

# ruff's lint and format checks (config in pyproject.toml); `make fmt` applies them.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Everything but the real-cluster tests, for a quick loop while editing.
test-fast: venv
	$(PY) -m pytest -q -m "not slurm and not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
