#!/bin/bash
# session 16 GPU call 1: TMA tail tile
set -x
nvidia-smi --query-gpu=name --format=csv,noheader
(time make ARCHS=sm_90a TUNE=1 -j16 >/tmp/build.log 2>&1) 2>&1 | tail -3; tail -3 /tmp/build.log
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_batch_tma.py 2>&1 | tail -15
PFA_SM90_KV_LOAD=tma timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_batch_prefill.py -k "ragged or paged" -x 2>&1 | tail -5
timeout 120 python3 build_tools/tune_prefill.py --batch --page-sizes 16,64 2>&1 | tail -20
timeout 100 python3 build_tools/tune_prefill.py --head-dims 128 --seqs 4096,16384 2>&1 | grep -v "^$" | tail -20
