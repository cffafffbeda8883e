# The README's two commands. Each sets up ./.venv first (scripts/bootstrap.sh), and again only when
# pyproject.toml or the bootstrap script changed since (the stamp below): the package is installed editable,
# so source changes need no reinstall.
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= report
STAMP := $(VENV)/.tilefuse-setup

.PHONY: report test setup
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)
	touch $@

# The main job: `tilefuse report` on whatever device is here (GPU: timed; CPU: interpreter accuracy).
report: $(STAMP)
	$(PY) -m tilefuse report --out $(OUT) $(ARGS)

# The tests: the real Triton kernels, in the interpreter on a CPU, compiled on a GPU.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal $(ARGS)
