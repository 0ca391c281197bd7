# `make test` and `make demo` do all set-up from nothing: a fresh machine needs only
# CPython 3.11, pip, gcc and make.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export RAY_DISABLE_DOCKER_CPU_WARNING := 1
# bytecode caches on (empty = unset for Python), whatever the shell set: with
# PYTHONDONTWRITEBYTECODE=1 (these machines' default) every pytest process rewrites and
# compiles all test modules again (collecting the fast suite: 19 s, 8 s from the caches)
# and every daemon the tests start compiles the project's modules again
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install test test-tools test-fast test-slow lint demo demo-mesh compose-demo wan-demo bench clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or run: make PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU build that lies on disk; installing it first keeps pip
# from resolving a multi-GB CUDA build for anything that depends on torch.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check proto fabricd worker scheduler fedpilot fedcore tests bench
	$(VENV)/bin/mypy

# the optional tests' tools (chromium, prometheus, docker-compose), best effort: installed
# as root with apt-get, else one line names the tests that skip and how to bring them in
test-tools:
	@.ci/test-tools

# pytest-xdist: two workers, a test file each at a time (each has its own ports, temp
# dirs, session mesh and Ray: conftest.py). `make test-fast` uses them. `make test` (CI)
# runs in one process until the whole suite is shown stable on two workers; to try:
# make test XDIST="$(TWO)". Two runs so far, both on a machine at load 16-58, had failures:
# the second (issue 35) 1076 passed, 1 failed in 58 min - test_transfer_memory hit its
# 600 s timeout while its sender saw clusters leave and come back 53 times (starved of CPU;
# the test itself asked that sender for its status ~50 times a second, now 5: ed10b74; and
# a peer back mid-exchange could be cut by its old link's auth deadline until 0a0cf57).
# The third (issue 35, after both fixes; load 10-47): 1082 passed, 2 failed in 41 min -
# test_security_preauth's forged certificates (a stream reset mid-hello) and
# test_faults_restart (the loss counted in round 4, not 3); at load 12-25 the slow tests
# alone took as long in one process (136 passed in 41 min).
TWO := -n 2 --dist loadfile
XDIST ?=

test: install lint test-tools
	$(VENV)/bin/pytest -q -ra --durations=15 $(XDIST)

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow" $(TWO)
	@.ci/test-tools --note

test-slow: install
	$(VENV)/bin/pytest -q -m slow $(XDIST)

# the embedded multi-cluster job: 3 fabricd daemons + a scheduler daemon on 127.0.0.1,
# each cluster with its own embedded Ray; results in runs/digits-demo/
demo: install
	$(VENV)/bin/fedpilot-scheduler submit deploy/examples/digits.toml --local 3

# the same job in real containers: docker-compose testbed (certs, clusters a, b, c - each a
# Ray head + fabricd - and the scheduler); results in runs/compose-demo/ (docs/deploy.md)
compose-demo:
	deploy/compose-demo.sh $(COMPOSE_DEMO_ARGS)

# the same job with every cluster behind a NAT of its own, joined through the gateway's relay:
# network namespaces + NAT routers (root; deploy/netns-testbed.sh up --wan); results in
# runs/wan-demo/, and where the bytes went (docs/deploy.md)
wan-demo: install
	deploy/wan-demo.sh $(WAN_DEMO_ARGS)

# just the mesh: three daemons, their status and a probe between them
demo-mesh: install
	$(PY) -m fabricd.demo

bench: install
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache runs
