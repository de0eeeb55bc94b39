# Two commands on a fresh machine: `make demo` (the main job on CPU) and `make test` (the whole suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean compat-megatron compat-deepspeed compat-verl

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the package metadata or the start-up hook that setup.py installs changes. --no-compile: pip
# would byte-compile every file of every package (torch's thousands) up front; Python compiles what is imported.
# torch==2.13.0 resolves to the CPU wheel on these machines; constraints.txt pins the versions the suite
# was verified with.
$(STAMP): $(PY) pyproject.toml setup.py l3plugin-autoload.pth constraints.txt
	$(PY) -m pip install --quiet --no-compile --upgrade pip
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e ".[test,plot,hf]"
	touch $(STAMP)

install: $(STAMP)

# PYTHONDONTWRITEBYTECODE unset for the runs (some images set it): the venv is installed without byte-compiling
# (--no-compile above), so with it every interpreter would compile torch, Megatron-Core and DeepSpeed from source
# again (23-27 s instead of 9-11 s for `import torch, megatron.core, deepspeed`, measured on a clean clone); without
# it the first import of a module caches its bytecode in the venv (written atomically: parallel ranks are safe).
RUN := env -u PYTHONDONTWRITEBYTECODE

demo: $(STAMP)
	$(RUN) $(VENV)/bin/l3plugin demo

test: $(STAMP)
	$(RUN) $(PY) -m pytest -q

# The Megatron tests against another Megatron-Core / Megatron-LM: TAG=core_v0.19.0 (a tag of NVIDIA/Megatron-LM),
# a checkout path, or TAG=pypi (the megatron-core of .venv, as CI). See compat/megatron.sh and docs/verified.md.
compat-megatron:
	@test -n "$(TAG)" || { echo "usage: make compat-megatron TAG=core_v0.19.0 (or a checkout path, or pypi)"; exit 2; }
	bash compat/megatron.sh $(TAG)

# The DeepSpeed / transformers / accelerate subset against each version set of compat/deepspeed_sets.txt (a venv
# per set under .compat/venvs): SETS="ds0.17-hf5.18" for some. See compat/deepspeed.sh and docs/verified.md.
compat-deepspeed:
	bash compat/deepspeed.sh $(SETS)

# verl 0.9.1's own Megatron engine (infer_batch, train_batch) with the flexible schedule switched on by environment
# variables only, against the same engine in one process (its venv: .compat/verl-venv). See compat/verl.sh and
# docs/verified.md ("verl as a client").
compat-verl:
	bash compat/verl.sh

clean:
	rm -rf $(VENV) results .pytest_cache .compat
