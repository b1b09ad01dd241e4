# Two commands for a new user: `make demo` (the main job) and `make test`.
# Both set up .venv first; torch is installed on its own, first, so pip never
# resolves a CUDA build for it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test lab browser prometheus bench clean

setup: $(VENV)/.installed

# constraints.txt: the versions the README names (tests/test_packaging.py keeps the three in step).
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[torch,trl,test,bench,ray,verl,prometheus,mcp,frameworks]'
	$(PIP) install -q -c constraints.txt --no-deps verl  # its own metadata would move transformers: see pyproject's verl extra
	$(PIP) install -q -c constraints.txt --no-deps openrlhf areal skyrl-gym  # their GPU-only deps stay out: see pyproject's frameworks extra
	$(PIP) install -q -c constraints.txt --no-deps --ignore-requires-python skyrl  # declares Python>=3.12; its CPU loss path runs on 3.11
	$(PIP) download -q --no-deps openrlhf==0.11.2 trl==1.15.0 -d $(VENV)/wheels  # read (never imported) by tests/test_frameworks.py, tests/test_trl_versions.py
	touch $@

browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian chromium for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
	  echo "installing Debian prometheus (server and promtool) for tests/test_prometheus.py"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

# make demo ARGS=--no-dashboard (or any `kldiag demo` option)
demo: setup
	$(VENV)/bin/kldiag demo $(ARGS)

lab: setup
	$(VENV)/bin/kldiag lab

# the suite on every core (pytest-xdist, at most 4 workers; each test file runs whole on one worker, its
# module fixtures built once), then the wheel built, installed outside the checkout and run
# (.ci/wheel_check.sh, 2-3 minutes). `make test JOBS=0`: the suite in this one process, in file order.
JOBS ?= auto
test: setup browser prometheus
	$(PY) -m pytest -q -n $(JOBS) --maxprocesses 4 --dist loadfile
	bash .ci/wheel_check.sh $(PY)

bench: setup
	$(PY) bench/recorder.py
	$(PY) bench/analyze.py

clean:
	rm -rf $(VENV) .pytest_cache build dist kldiag.egg-info
