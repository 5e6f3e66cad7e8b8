# pyflashattn: kernel_src/ -> per-arch SASS cubins under cubins/, plus cubins/manifest.json.
#
#   make                      build each variant for its archs among ARCHS (parallel, incremental)
#   make ARCHS=sm_90a         one arch;  make TUNE=1 adds the tile alternatives the tuner compares
#   make test                 CPU tests (what CI runs);  make gpu-check  build for this GPU + GPU tests + bench
#   make demo                 build for this GPU, run attention, check it, time it next to torch SDPA
#   make wheel                a wheel with the cubins inside the package (pip install . builds them too)
#   make sass / make ptxas-report   disassembly and register/spill report of the built cubins
#
# Parallel by default: -j<cores> unless a -j is given (make -j1 for a serial build; JOBS=n).
# nvcc: $(NVCC) if given, else nvcc on PATH, else the pinned pip toolchain (CUDA 13.0, the one
# that matches the test GPUs' driver; pins in build_tools/toolchain-requirements.txt) that make
# installs into .toolchain/ on first use (~330 MB download, once; offline afterwards).
# make test: $(PYTHON) if given; else python3 when it has the test deps, else a project venv
# .venv/ (created on first use: pip install -e .[test]).

SHELL     := /bin/bash
PYTHON    ?= python3
ARCHS     ?= sm_80 sm_89 sm_90a
TUNE      ?= 0
TOOLCHAIN := .toolchain
TOOLCHAIN_REQS := build_tools/toolchain-requirements.txt
PIP_NVCC  := $(TOOLCHAIN)/bin/nvcc
NVCC      ?= $(or $(shell command -v nvcc 2>/dev/null),$(PIP_NVCC))
OUT       ?= bench_out
# gpu-check's concurrent pytest processes (build_tools/pytest_groups.py: whole files a group)
TEST_JOBS ?= 5
VENV      := .venv

# Parallel without being told: -j<cores> at the top level when no -j was given (a command-line
# -jN wins; sub-makes share the top level's job slots).
JOBS      ?= $(shell nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
ifeq ($(MAKELEVEL),0)
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(JOBS)
endif
endif

GEN_FLAGS := $(if $(filter 1,$(TUNE)),--tune,)
# Generate first (cheap; rewrites only files whose text changed): the sources and
# kernel_src/generated/kernels.mk, which lists per arch the kernels built for it (KERNELS_<arch>:
# a variant is built only where it can run and be routed, see build_tools/variants.py).
GEN_OK    := $(shell $(PYTHON) build_tools/gen_params.py >/dev/null && \
                     $(PYTHON) build_tools/gen_kernels.py $(GEN_FLAGS) >/dev/null && echo ok)
$(if $(GEN_OK),,$(error build_tools/gen_params.py or gen_kernels.py failed (see above)))
include kernel_src/generated/kernels.mk
$(foreach a,$(ARCHS),$(if $(filter $(a),$(KERNEL_ARCHS)),,$(error no kernels for $(a): variants.py builds for $(KERNEL_ARCHS))))
HEADERS   := $(shell find kernel_src/include -name '*.cuh' -o -name '*.h')
CUBINS    := $(foreach a,$(ARCHS),$(foreach k,$(KERNELS_$(a)),cubins/$(a)/$(k).cubin))
MANIFEST  := cubins/manifest.json
# What the manifest lists beyond its cubins' contents (ARCHS, TUNE): rewritten only when it
# changes, so the manifest is rebuilt when the arch set changes but not on a repeated make.
BUILD_CONFIG := cubins/.build_config
BUILD_CONFIG_TEXT := ARCHS=$(ARCHS) TUNE=$(TUNE)
$(shell mkdir -p cubins && [ "$$(cat $(BUILD_CONFIG) 2>/dev/null)" = "$(BUILD_CONFIG_TEXT)" ] || \
        echo "$(BUILD_CONFIG_TEXT)" > $(BUILD_CONFIG))

# --diag-error=174: "expression has no effect" fails the build (a Python-style `a, b = x, y` is a
# C++ comma expression that assigns only the last: it hung a kernel once, NOTES.md session 29).
# LINEINFO=0 leaves out the line tables (the same SASS, cubins ~4.6x smaller: an sm_90a build of
# ~14 MB fits a device call's carry, so it can be built here instead of on the GPU machine);
# switching it does not rebuild existing cubins (make clean first).
LINEINFO  ?= 1
NVCC_FLAGS := -std=c++17 -O3 -cubin -Ikernel_src/include -Xptxas=--warn-on-spills $(if $(filter 1,$(LINEINFO)),-lineinfo) \
              --expt-relaxed-constexpr -Wno-deprecated-gpu-targets --diag-error=174
# sm_90a needs the -gencode form: the -arch shorthand also runs a plain sm_90 pass.
gencode = -gencode=arch=compute_$(subst sm_,,$(1)),code=$(1)

.PHONY: all cubins manifest test venv demo gpu-check bench wheel sass ptxas-report clean toolchain
all: manifest

cubins: $(CUBINS)

# The pinned toolchain: every nvidia-* component pinned (build_tools/toolchain-requirements.txt).
# .toolchain/bin/nvcc is a wrapper that execs nvcc by its real path: nvcc finds its headers,
# cicc and ptxas relative to its own location (a symlink would make it look in .toolchain/).
# Written last, atomically: an interrupted fetch is redone by the next make.
$(PIP_NVCC): $(TOOLCHAIN_REQS)
	@echo "fetching the pinned CUDA toolchain into $(TOOLCHAIN)/ (no nvcc on PATH; ~330 MB, once)"
	rm -f $@
	env -u PYTHONPATH -u PYTHONNOUSERSITE $(PYTHON) -m venv $(TOOLCHAIN)/venv
	env -u PYTHONPATH -u PYTHONNOUSERSITE $(TOOLCHAIN)/venv/bin/python -m pip install -q \
	    --disable-pip-version-check -r $(TOOLCHAIN_REQS)
	@real=$$(ls $(TOOLCHAIN)/venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc | head -1) && \
	  [ -x "$$real" ] || { echo "$(TOOLCHAIN): no nvcc in the installed wheels" >&2; exit 1; }; \
	  mkdir -p $(@D) && \
	  printf '#!/bin/sh\n# the pinned nvcc (%s), run by its real path\nexec "$$(dirname "$$0")/../%s" "$$@"\n' \
	    "$(TOOLCHAIN_REQS)" "$${real#$(TOOLCHAIN)/}" > $@.tmp && chmod +x $@.tmp && \
	  $@.tmp --version | tail -1 && mv $@.tmp $@
toolchain: $(PIP_NVCC)

# Only the pip toolchain is a file make can build; a PATH/$(NVCC) compiler is used as is.
NVCC_DEP := $(if $(filter $(PIP_NVCC),$(NVCC)),$(PIP_NVCC),)

define arch_rule
cubins/$(1)/%.cubin: kernel_src/generated/%.cu $(HEADERS) $(NVCC_DEP)
	@mkdir -p $$(@D)
	sh build_tools/nvcc_guard.sh $(NVCC) $(NVCC_FLAGS) $(call gencode,$(1)) -o $$@ $$<
endef
$(foreach a,$(ARCHS),$(eval $(call arch_rule,$(a))))

manifest: $(MANIFEST)
# A real file: rewritten when a cubin, the variant table, the params header or the build config
# changed (make_manifest.py writes it atomically).
$(MANIFEST): $(CUBINS) build_tools/variants.py build_tools/make_manifest.py \
             $(wildcard kernel_src/include/pfa/attention/params.h) $(BUILD_CONFIG)
	$(PYTHON) build_tools/make_manifest.py --nvcc "$(NVCC)" $(GEN_FLAGS) $(ARCHS)

# The tests' python: $(PYTHON) when given (command line or environment) or when it has the test
# deps, else the project venv (created, as a prerequisite, while the kernels build).
TEST_IMPORTS := import numpy, cuda.bindings, pytest, hypothesis
ifneq ($(filter test,$(MAKECMDGOALS)),)
ifeq ($(origin PYTHON),file)
ifeq ($(shell $(PYTHON) -c '$(TEST_IMPORTS)' >/dev/null 2>&1 && echo ok),)
TEST_PYTHON := $(VENV)/bin/python
TEST_VENV   := $(VENV)/.installed
endif
endif
endif
TEST_PYTHON ?= $(PYTHON)

test: $(TEST_VENV) all
	$(TEST_PYTHON) -m pytest -q tests

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@echo "$(PYTHON) lacks the test dependencies: installing them into $(VENV)/ (pip install -e .[test])"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

# This GPU's build arch into $$arch (python -m pyflashattn.bench.demo --arch); without a CUDA GPU,
# the one line that says why, and the recipe fails.
LOCAL_ARCH_SH = e=$$(mktemp); arch=$$($(PYTHON) -m pyflashattn.bench.demo --arch 2>$$e); rc=$$?; \
  if [ $$rc -ne 0 ] || [ -z "$$arch" ]; then msg=$$(tail -n1 $$e); rm -f $$e; \
    case "$$msg" in "pyflashattn"*) ;; *) msg="pyflashattn: cannot find this machine's GPU arch \
      ($(PYTHON) -m pyflashattn.bench.demo --arch failed$${msg:+: $$msg})";; esac; echo "$$msg" >&2; exit 1; fi; \
  cat $$e >&2; rm -f $$e
LOCAL_ARCH = $(shell $(PYTHON) -m pyflashattn.bench.demo --arch 2>/dev/null)

# The main job: build for this GPU if needed, run attention, check it, time it next to SDPA.
demo:
	@$(LOCAL_ARCH_SH); echo "$(MAKE) ARCHS='$$arch'"; $(MAKE) ARCHS="$$arch"
	$(PYTHON) -m pyflashattn.bench.demo

# One command for the GPU machine: build for the local arch, the cp.async check over every cubin
# (nvcc_guard.sh --check: cubins built on a machine without cuobjdump skipped it), every test
# (TEST_JOBS pytest processes side by side), the quick benchmarks.
gpu-check:
	@mkdir -p $(OUT)
	@$(LOCAL_ARCH_SH); echo "$(MAKE) ARCHS='$$arch' TUNE=$(TUNE)"; $(MAKE) ARCHS="$$arch" TUNE=$(TUNE) 2>&1 | tee $(OUT)/build.log
	NVCC="$(NVCC)" sh build_tools/nvcc_guard.sh --check cubins/*/*.cubin
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) build_tools/pytest_groups.py --jobs $(TEST_JOBS) --log-dir $(OUT) tests 2>&1 | tee $(OUT)/tests.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench prefill --quick --json $(OUT)/bench.json 2>&1 | tee $(OUT)/bench.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench batch --quick --json $(OUT)/bench_batch.json 2>&1 | tee $(OUT)/bench_batch.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench decode --quick --json $(OUT)/bench_decode.json 2>&1 | tee $(OUT)/bench_decode.log

bench:
	$(PYTHON) -m pyflashattn.bench prefill --json $(OUT)/bench.json

# setup.py runs make itself (a no-op here): told the same archs, tune flag and nvcc. Without
# build isolation when $(PYTHON) has setuptools and wheel (offline), else pip fetches them.
wheel: manifest
	PFA_ARCHS="$(ARCHS)" PFA_TUNE=$(TUNE) NVCC="$(NVCC)" $(PYTHON) -m pip wheel --no-deps -w dist \
	  $(if $(shell $(PYTHON) -c 'import setuptools, wheel' 2>/dev/null && echo y),--no-build-isolation) .

sass:
	@for f in $(CUBINS); do echo "== $$f"; cuobjdump --dump-sass $$f; done

ptxas-report:
	@$(foreach a,$(ARCHS),for k in $(KERNELS_$(a)); do f=kernel_src/generated/$$k.cu; \
	  echo "== $(a) $$f"; $(NVCC) $(NVCC_FLAGS) $(call gencode,$(a)) -Xptxas -v -o /dev/null $$f 2>&1 | grep -E 'registers|spill'; \
	done;)

clean:
	rm -rf cubins build dist
