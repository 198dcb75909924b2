#!/bin/bash
# Everything a lent GPU machine checks, in one device call, in order of value; each step bounded by its own
# timeout so the call ends inside its limit, results written to $OUT as they come (a few files: the device tool
# brings back at most 8).
#
# Here, once:   bash ../shared/gpu/make-kit.sh            # .gpukit/: fbgemm-gpu 1.6 for the machine's torch 2.11
#               bash bench/gpu_session.sh --extras        # .gpuextra/: nlohmann_json and OpenSSL for the C++ build
# The device:   run(command="bash bench/gpu_session.sh", carry=[".gpukit", ".gpuextra"], timeout_s=560)
# Steps to run: GPU_STEPS="kernels tests cpp bench suite" (the default; any subset, in that order).
set -u
if [ "${1:-}" = "--extras" ]; then
  # what the GPU machine's image lacks to build the C++ loader: nlohmann_json's headers and CMake package,
  # OpenSSL's headers and libraries (Debian 12's; the loader links libcrypto for sha256)
  rm -rf .gpuextra && mkdir -p .gpuextra/usr/include .gpuextra/usr/lib .gpuextra/usr/share/cmake
  grep -qx "/.gpuextra/" .git/info/exclude 2>/dev/null || echo "/.gpuextra/" >> .git/info/exclude
  cp -r /usr/include/nlohmann /usr/include/openssl .gpuextra/usr/include/
  cp /usr/include/x86_64-linux-gnu/openssl/* .gpuextra/usr/include/openssl/
  cp -r /usr/share/cmake/nlohmann_json .gpuextra/usr/share/cmake/
  cp /usr/lib/x86_64-linux-gnu/libssl.so.3 /usr/lib/x86_64-linux-gnu/libcrypto.so.3 .gpuextra/usr/lib/
  (cd .gpuextra/usr/lib && ln -sf libssl.so.3 libssl.so && ln -sf libcrypto.so.3 libcrypto.so)
  du -sh .gpuextra
  exit 0
fi

OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
STEPS=${GPU_STEPS:-kernels tests cpp bench suite}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
LOG="$OUT/session.log"

step() {  # step NAME SECONDS COMMAND...: run bounded, one JSON line per step in steps.jsonl
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" >> "$LOG"
  timeout -k 5 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - start))}" | tee -a "$OUT/steps.jsonl"
  tail -4 "$LOG"
}
wants() { [[ " $STEPS " == *" $1 "* ]]; }

PY=${PY:-python3}
if command -v nvidia-smi > /dev/null; then
  step setup 60 bash .gpukit/setup.sh
  export PYTHONPATH=/tmp/site:$PWD
  # The kit leaves fbgemm's training libraries out (2 GB). fbgemm_gpu_tbe_common.so (bounds_check_indices, which
  # the inference TBE calls) is in no list of fbgemm's __init__: a full install loads it as a dependency of
  # fbgemm_gpu_tbe_training_forward.so, which embserve's REQUIRED_LIBRARIES also names. An empty library of that
  # name, depending on tbe_common, stands in for it here (no training op is called by an inference model).
  fb=/tmp/site/fbgemm_gpu
  if [ ! -f $fb/fbgemm_gpu_tbe_training_forward.so ]; then
    echo 'void embserve_kit_training_forward_absent(void) {}' > /tmp/kit_stub.c
    gcc -shared -fPIC -o $fb/fbgemm_gpu_tbe_training_forward.so /tmp/kit_stub.c -Wl,--no-as-needed -L$fb \
      -l:fbgemm_gpu_tbe_common.so -Wl,-rpath,'$ORIGIN' >> "$LOG" 2>&1
  fi
  python3 -c "import torch, fbgemm_gpu; f = torch.ops.fbgemm; print('fbgemm ops:', \
    [hasattr(f, o) for o in ('bounds_check_indices', 'int_nbit_split_embedding_codegen_lookup_function')])" 2>&1 \
    | grep -v "^ \|WARNING" | tee -a "$LOG"
  nvidia-smi -L >> "$LOG" 2>&1
else  # a dry run of the script on a CPU machine (PY=.venv/bin/python): the gpu tests skip
  export PYTHONPATH=$PWD
fi
PYTEST="$PY -m pytest -q -p no:cacheprovider -W ignore::UserWarning"
TIMEOUT=$($PY -c "import pytest_timeout" 2> /dev/null && echo "--timeout 100")

if wants kernels; then  # which TBE configurations give wrong or irreproducible rows on this GPU
  step kernels 100 sh -c "$PY bench/cuda_kernel_check.py > $OUT/kernels.jsonl"
fi
if wants tests; then  # every gpu-marked test that needs no C++ build
  step gpu-tests 90 $PYTEST -m gpu -rs tests/quant tests/shard tests/server/test_serve_cuda.py
fi
if wants bench; then  # embserve against TorchRec's quantized EBC and fbgemm (device, UVM) on this GPU
  step bench 130 sh -c "$PY bench/lookup_cuda.py --rounds 30 --profile > $OUT/bench.jsonl"
fi
if wants cpp; then  # the C++ loader built against this machine's (CUDA) torch, embserve_run on CUDA artifacts
  step cpp-build 130 sh -c "cmake -S cpp_loader -B /tmp/cpp-gpu -DCMAKE_BUILD_TYPE=Release -DEMBSERVE_PYTHON=$PY \
    -DTorch_DIR=\$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch -DCMAKE_PREFIX_PATH=$PWD/.gpuextra/usr -DOPENSSL_ROOT_DIR=$PWD/.gpuextra/usr > /tmp/cmake.log 2>&1 \
    || { tail -40 /tmp/cmake.log; exit 1; }; cmake --build /tmp/cpp-gpu -j16 --target embserve_run > /tmp/build.log 2>&1; rc=\$?; grep -E \"error|Built target\" /tmp/build.log | head -40; exit \$rc"
  LD_LIBRARY_PATH=$PWD/.gpuextra/usr/lib EMBSERVE_RUN_BIN=/tmp/cpp-gpu/embserve_run \
    step cpp-tests 50 $PYTEST -m gpu -rs tests/cpp/test_cpp_cuda.py
fi
if wants suite; then  # the CPU suite's planner/quant/shard/artifact tests on torch 2.11 + fbgemm 1.6
  step suite 120 $PYTEST -n ${SUITE_WORKERS:-14} --dist loadfile -m "not gpu" --maxfail 40 $TIMEOUT \
    tests/quant tests/shard tests/planner tests/modules tests/artifact --ignore-glob='*pt2*'
fi
echo "done" >> "$LOG"
