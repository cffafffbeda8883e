# The README's two commands. Each sets up ./.venv itself (scripts/bootstrap.sh), then runs.
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= report

.PHONY: report test setup
setup:
	bash scripts/bootstrap.sh $(VENV)

# The main job: `tilefuse report` on whatever device is here (GPU: timed; CPU: interpreter accuracy).
report: setup
	$(PY) -m tilefuse report --out $(OUT) $(ARGS)

# The tests: the real Triton kernels, in the interpreter on a CPU, compiled on a GPU.
test: setup
	$(PY) -m pytest -q -n 2 --dist worksteal $(ARGS)
