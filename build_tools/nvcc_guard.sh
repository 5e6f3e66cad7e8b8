#!/bin/sh
# Runs an nvcc command line and fails it when ptxas serialised a kernel's wgmma ("wgmma.mma_async
# instructions are serialized": C7520, a wgmma operand defined on a data-dependent path; C7515,
# non-wgmma code defining accumulator registers inside a wgmma's pipeline stage; C7512, registers;
# each makes ptxas serialise EVERY wgmma of the kernel, a silent ~2x loss on the sm90 family). Only
# the skip-softmax twins (*_skip.cubin) are allowed it (their C7520).
# Also fails a cubin with the odd-descriptor cp.async below.
#   sh build_tools/nvcc_guard.sh --check CUBIN...   that cp.async check alone, over built cubins (make
#   gpu-check runs it: cubins built elsewhere, without cuobjdump, were never checked).

# A cp.async (LDGSTS) with a register + uniform register + immediate address and its L2-policy
# descriptor in an odd uniform register: ptxas 13.0 emitted `[R25+UR0+0x14000], desc[UR1]` for the
# fp8 paged run copies once and the GPU stopped there with an illegal instruction (NOTES.md, session
# 22; again for 16-bit page-run copies in session 39). The same descriptor beside an address
# without the immediate (`[R35+UR0], desc[UR1]`, in the fp8 ps rows) runs, so only the failing
# shape is refused. Needs a disassembler: cuobjdump (the GPU machine's toolkit; the pip toolchain
# has none) beside nvcc ($1), else on PATH; else nvdisasm ($NVDISASM, beside nvcc, or on PATH: the
# pip wheel nvidia-cuda-nvdisasm, 13.2 or later, reads these sm_90a cubins too).
odd_descriptor_copies() {
  case "$1" in
    *nvdisasm) "$1" -c "$2" ;;
    *) "$1" -sass "$2" ;;
  esac 2>/dev/null | grep -E 'LDGSTS[^[]*\[R[0-9]+\+UR[0-9]+\+0x[0-9a-f]+\], desc\[UR[0-9]*[13579]\]' | head -3
}
find_objdump() {
  for o in "$(dirname "$1")/cuobjdump" "$(command -v cuobjdump 2>/dev/null)" "${NVDISASM:-}" \
           "$(dirname "$1")/nvdisasm" "$(command -v nvdisasm 2>/dev/null)"; do
    if [ -n "$o" ] && [ -x "$o" ]; then echo "$o"; return; fi
  done
}
if [ "$1" = "--check" ]; then
  shift
  objdump=$(find_objdump "${NVCC:-$(command -v nvcc 2>/dev/null || echo nvcc)}")
  if [ -z "$objdump" ] || [ ! -x "$objdump" ]; then
    echo "nvcc_guard --check: no cuobjdump or nvdisasm here; the cp.async check did not run" >&2
    exit 0
  fi
  rc=0
  for f in "$@"; do
    bad=$(odd_descriptor_copies "$objdump" "$f")
    if [ -n "$bad" ]; then
      echo "nvcc_guard: $f has a cp.async of the shape that stopped the GPU (illegal instruction):" >&2
      echo "$bad" >&2
      rc=1
    fi
  done
  [ $rc -eq 0 ] && echo "nvcc_guard --check: $# cubins, no odd-descriptor cp.async"
  exit $rc
fi

log=$(mktemp) || exit 1
"$@" 2>"$log"
rc=$?
cat "$log" >&2
out=
prev=
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
if [ $rc -eq 0 ] && grep -q "wgmma.mma_async instructions are serialized" "$log"; then
  case "$out" in
    *_skip.cubin) ;;
    *) echo "nvcc_guard: ptxas serialised the wgmma of $out (above); see build_tools/nvcc_guard.sh" >&2
       rm -f "$out"; rc=1 ;;
  esac
fi
# The odd-descriptor cp.async (above) in the cubin just built.
objdump=$(find_objdump "$1")
if [ $rc -eq 0 ] && [ -n "$objdump" ] && [ -x "$objdump" ] && [ -f "$out" ]; then
  bad=$(odd_descriptor_copies "$objdump" "$out")
  if [ -n "$bad" ]; then
    echo "nvcc_guard: $out has a cp.async of the shape that stopped the GPU (illegal instruction):" >&2
    echo "$bad" >&2
    rm -f "$out"; rc=1
  fi
fi
rm -f "$log"
exit $rc
