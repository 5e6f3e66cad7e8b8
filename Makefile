# pyflashattn: kernel_src/ -> per-arch SASS cubins under cubins/, plus cubins/manifest.json.
#
#   make                      build each variant for its archs among ARCHS (parallel with -j, incremental)
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
# demo / gpu-check build on the GPU machine with its 16 cores
GPU_JOBS  ?= 16

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

manifest: $(MANIFEST)
# A real file: rewritten when a cubin, the variant table, the params header or the build config
# changed (make_manifest.py writes it atomically).
$(MANIFEST): $(CUBINS) build_tools/variants.py build_tools/make_manifest.py \
             $(wildcard kernel_src/include/pfa/attention/params.h) $(BUILD_CONFIG)
	$(PYTHON) build_tools/make_manifest.py --nvcc "$(NVCC)" $(GEN_FLAGS) $(ARCHS)

test: all
	$(PYTHON) -m pytest -q tests

# The main job: build for this GPU if needed, run attention, check it, time it next to SDPA.
demo:
	$(MAKE) ARCHS=$(LOCAL_ARCH) -j$(GPU_JOBS)
	$(PYTHON) -m pyflashattn.bench.demo

# One command for the GPU machine: build for the local arch, GPU tests, a short benchmark.
LOCAL_ARCH = $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | \
               awk -F. '{ a=$$1$$2; if (a=="90") print "sm_90a"; else if (a=="89") print "sm_89"; else print "sm_80" }')
gpu-check:
	@mkdir -p $(OUT)
	$(MAKE) ARCHS=$(LOCAL_ARCH) TUNE=$(TUNE) -j$(GPU_JOBS) 2>&1 | tee $(OUT)/build.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pytest -q -rs tests 2>&1 | tee $(OUT)/tests.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench prefill --quick --json $(OUT)/bench.json 2>&1 | tee $(OUT)/bench.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench batch --quick --json $(OUT)/bench_batch.json 2>&1 | tee $(OUT)/bench_batch.log
	set -o pipefail; PYTHONUNBUFFERED=1 $(PYTHON) -m pyflashattn.bench decode --quick --json $(OUT)/bench_decode.json 2>&1 | tee $(OUT)/bench_decode.log

bench:
	$(PYTHON) -m pyflashattn.bench prefill --json $(OUT)/bench.json

wheel: manifest
	$(PYTHON) -m pip wheel --no-deps --no-build-isolation -w dist .

sass:
	@for f in $(CUBINS); do echo "== $$f"; cuobjdump --dump-sass $$f; done

ptxas-report:
	@$(foreach a,$(ARCHS),for k in $(KERNELS_$(a)); do f=kernel_src/generated/$$k.cu; \
	  echo "== $(a) $$f"; $(NVCC) $(NVCC_FLAGS) $(call gencode,$(a)) -Xptxas -v -o /dev/null $$f 2>&1 | grep -E 'registers|spill'; \
	done;)

clean:
	rm -rf cubins build dist
