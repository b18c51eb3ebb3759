# The two commands of the README. Both are idempotent.
export DAGSTER_HOME := $(CURDIR)/.dagster

.PHONY: setup setup-test demo test soak test-compile test-variants dev
setup:       ## the project and torch in .venv (what `make demo` and `make dev` need)
	./scripts/setup.sh

setup-test:  ## setup, plus the test and scale extras and the real Qwen2 tokenizer of the template tests
	./scripts/setup.sh test

demo: setup   ## tiny model + demo data, then materialize every stage; prints the LoRA and video paths
	.venv/bin/loraflow demo

# The suite in TEST_WORKERS pytest-xdist processes, a test file to a worker (a file's module fixtures are built once);
# half of the suite waits on subprocesses and servers. The 15 slowest tests are listed at the end of each run.
TEST_WORKERS ?= 2
test: setup-test   ## the whole test suite
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

soak: setup-test   ## the soak tests: many kill -9 of CLI runs at random moments, then a run must finish (minutes)
	.venv/bin/python -m pytest -q -m soak $(PYTEST_ARGS)

test-compile: setup-test  ## the torch.compile tests: inductor builds C++ kernels on the CPU (4-6 minutes on 2 cores)
	.venv/bin/python -m pytest -q -m compile $(PYTEST_ARGS)

test-variants: setup-test  ## the suite under each CPU variant (ATen AVX2, one thread, both, MKL's AMD kernels)
	./scripts/test_variants.sh $(PYTEST_ARGS)

dev: setup    ## the Dagster UI on http://127.0.0.1:3000 (loopback only)
	.venv/bin/dagster dev -h 127.0.0.1 -p 3000
