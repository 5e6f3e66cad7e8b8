#!/bin/sh
# Runs an nvcc command line and fails it when ptxas serialised a kernel's wgmma (C7520: a wgmma
# operand defined on a data-dependent path makes ptxas serialise EVERY wgmma of the kernel, a
# silent ~2x loss on the sm90 family). Only the skip-softmax twins (*_skip.cubin) are allowed it.
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
rm -f "$log"
exit $rc
