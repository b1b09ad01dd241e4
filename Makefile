# Two commands for a new user: `make demo` (the main job) and `make test`.
# Both set up .venv first; torch is installed on its own, first, so pip never
# resolves a CUDA build for it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test lab browser prometheus bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[torch,trl,test,bench,ray,verl,prometheus,mcp,frameworks]'
	$(PIP) install -q --no-deps verl==0.9.1  # its own metadata would move transformers: see pyproject's verl extra
	$(PIP) install -q --no-deps openrlhf==0.11.2 areal==1.0.4 skyrl-gym==0.4.0  # their GPU-only deps stay out: see pyproject's frameworks extra
	$(PIP) install -q --no-deps --ignore-requires-python skyrl==0.4.0  # declares Python>=3.12; its CPU loss path runs on 3.11
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

demo: setup
	$(VENV)/bin/kldiag demo

lab: setup
	$(VENV)/bin/kldiag lab

test: setup browser prometheus
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/recorder.py
	$(PY) bench/analyze.py

clean:
	rm -rf $(VENV) .pytest_cache
