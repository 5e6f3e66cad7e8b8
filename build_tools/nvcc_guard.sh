#!/bin/sh
# Runs an nvcc command line and fails it when ptxas serialised a kernel's wgmma (C7520: a wgmma
# operand defined on a data-dependent path makes ptxas serialise EVERY wgmma of the kernel, a
# silent ~2x loss on the sm90 family). Only the skip-softmax twins (*_skip.cubin) are allowed it.
# Also fails a cubin with the odd-descriptor cp.async below.
log=$(mktemp) || exit 1
"$@" 2>"$log"
rc=$?
cat "$log" >&2
out=
prev=
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
if [ $rc -eq 0 ] && grep -q C7520 "$log"; then
  case "$out" in
    *_skip.cubin) ;;
    *) echo "nvcc_guard: ptxas serialised the wgmma of $out (C7520 above); see build_tools/nvcc_guard.sh" >&2
       rm -f "$out"; rc=1 ;;
  esac
fi
# A cp.async (LDGSTS) whose L2-policy descriptor sits in an odd uniform register: ptxas 13.0 emitted
# that for the fp8 paged copies once (`desc[UR1]` beside a [R + UR0 + imm] address) and the GPU
# stopped on it with an illegal instruction (NOTES.md, session 22). Checked where cuobjdump sits
# beside nvcc or on PATH (the GPU machine's toolkit; the pip toolchain has none).
nvcc_bin=$1
objdump=$(dirname "$nvcc_bin")/cuobjdump
[ -x "$objdump" ] || objdump=$(command -v cuobjdump 2>/dev/null)
if [ $rc -eq 0 ] && [ -n "$objdump" ] && [ -x "$objdump" ] && [ -f "$out" ]; then
  bad=$("$objdump" -sass "$out" 2>/dev/null | grep -E 'LDGSTS.*desc\[UR[0-9]*[13579]\]' | head -3)
  if [ -n "$bad" ]; then
    echo "nvcc_guard: $out has cp.async with an odd descriptor register (illegal on the GPU):" >&2
    echo "$bad" >&2
    rm -f "$out"; rc=1
  fi
fi
rm -f "$log"
exit $rc
