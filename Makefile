# pyflashattn: kernel_src/ -> per-arch SASS cubins under cubins/, plus cubins/manifest.json.
#
#   make                      build every variant for ARCHS (parallel with -j, incremental)
#   make ARCHS=sm_90a         one arch;  make TUNE=1 adds the tile alternatives the tuner compares
#   make test                 CPU tests (what CI runs);  make gpu-check  build for this GPU + GPU tests + bench
#   make wheel                a wheel with the cubins inside the package
#   make sass / make ptxas-report   disassembly and register/spill report of the built cubins
#
# nvcc: $(NVCC) if given, else nvcc on PATH, else a pinned pip toolchain installed into
# .toolchain/ (cuda-toolkit[nvcc,cccl]==13.0.2, the CUDA 13.0 that matches the test GPUs' driver).

SHELL     := /bin/bash
PYTHON    ?= python3
ARCHS     ?= sm_80 sm_89 sm_90a
TUNE      ?= 0
TOOLCHAIN := .toolchain
PIP_NVCC  := $(TOOLCHAIN)/bin/nvcc
NVCC      ?= $(or $(shell command -v nvcc 2>/dev/null),$(PIP_NVCC))
OUT       ?= bench_out

GEN_FLAGS := $(if $(filter 1,$(TUNE)),--tune,)
# Generate first (cheap; rewrites only files whose text changed), then list what exists.
$(shell $(PYTHON) build_tools/gen_params.py && $(PYTHON) build_tools/gen_kernels.py $(GEN_FLAGS) >/dev/null)
KERNELS   := $(basename $(notdir $(wildcard kernel_src/generated/*.cu)))
HEADERS   := $(shell find kernel_src/include -name '*.cuh' -o -name '*.h')
CUBINS    := $(foreach a,$(ARCHS),$(foreach k,$(KERNELS),cubins/$(a)/$(k).cubin))

NVCC_FLAGS := -std=c++17 -O3 -cubin -Ikernel_src/include -Xptxas=--warn-on-spills -lineinfo \
              --expt-relaxed-constexpr -Wno-deprecated-gpu-targets
# sm_90a needs the -gencode form: the -arch shorthand also runs a plain sm_90 pass.
gencode = -gencode=arch=compute_$(subst sm_,,$(1)),code=$(1)

.PHONY: all cubins manifest test demo gpu-check bench wheel sass ptxas-report clean toolchain
all: manifest

cubins: $(CUBINS)

$(PIP_NVCC):
	$(PYTHON) -m venv $(TOOLCHAIN)/venv
	$(TOOLCHAIN)/venv/bin/pip install -q "cuda-toolkit[nvcc,cccl]==13.0.2"
	mkdir -p $(TOOLCHAIN)/bin
	ln -sf $$(realpath $$(ls -d $(TOOLCHAIN)/venv/lib/python3*/site-packages/nvidia/cu13/bin))/nvcc $(PIP_NVCC)
toolchain: $(PIP_NVCC)

# Only the pip toolchain is a file make can build; a PATH/$(NVCC) compiler is used as is.
NVCC_DEP := $(if $(filter $(PIP_NVCC),$(NVCC)),$(PIP_NVCC),)

define arch_rule
cubins/$(1)/%.cubin: kernel_src/generated/%.cu $(HEADERS) $(NVCC_DEP)
	@mkdir -p $$(@D)
	$(NVCC) $(NVCC_FLAGS) $(call gencode,$(1)) -o $$@ $$<
endef
$(foreach a,$(ARCHS),$(eval $(call arch_rule,$(a))))

manifest: $(CUBINS)
	$(PYTHON) build_tools/make_manifest.py --nvcc "$(NVCC)" $(if $(filter 1,$(TUNE)),--tune,) $(ARCHS)

test: all
	$(PYTHON) -m pytest -q tests

# The main job: build for this GPU if needed, run attention, check it, time it next to SDPA.
demo:
	$(MAKE) ARCHS=$(LOCAL_ARCH) -j16
	$(PYTHON) -m pyflashattn.demo

# One command for the GPU machine: build for the local arch, GPU tests, a short benchmark.
LOCAL_ARCH = $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | \
               awk -F. '{ a=$$1$$2; if (a=="90") print "sm_90a"; else if (a=="89") print "sm_89"; else print "sm_80" }')
gpu-check:
	@mkdir -p $(OUT)
	$(MAKE) ARCHS=$(LOCAL_ARCH) TUNE=$(TUNE) -j16 2>&1 | tee $(OUT)/build.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pytest -q -rs tests 2>&1 | tee $(OUT)/tests.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench prefill --quick --json $(OUT)/bench.json 2>&1 | tee $(OUT)/bench.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench_batch --quick --json $(OUT)/bench_batch.json 2>&1 | tee $(OUT)/bench_batch.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench_decode --quick --json $(OUT)/bench_decode.json 2>&1 | tee $(OUT)/bench_decode.log

bench:
	$(PYTHON) -m pyflashattn.bench prefill --json $(OUT)/bench.json

wheel: manifest
	$(PYTHON) -m pip wheel --no-deps --no-build-isolation -w dist .

sass:
	@for f in $(CUBINS); do echo "== $$f"; cuobjdump --dump-sass $$f; done

ptxas-report:
	@for f in $(wildcard kernel_src/generated/*.cu); do for a in $(ARCHS); do \
	  echo "== $$a $$f"; $(NVCC) $(NVCC_FLAGS) $(call gencode,$$a) -Xptxas -v -o /dev/null $$f 2>&1 | grep -E 'registers|spill'; \
	done; done

clean:
	rm -rf cubins build dist
