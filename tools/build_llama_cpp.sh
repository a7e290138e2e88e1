#!/usr/bin/env bash
# Build llama.cpp's llama-bench, the CPU peer of scripts/bench_cpu.py (issue 47), from the
# llama.cpp source vendored in llama-cpp-python 0.3.36's sdist (a pinned llama.cpp, fetched
# from PyPI with pip). Nothing is written into this repository: the source and the build go to
# DIR (default ./llama-cpp, created).
#
#   tools/build_llama_cpp.sh [DIR]
#   python scripts/bench_cpu.py --checkpoint FILE.gguf \
#       --llama-bench DIR/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench
#
# Needs python with pip (network access to PyPI), cmake and a C++ compiler (g++ or clang++);
# a missing one is one `error:` line and exit status 2. The build is native (-DGGML_NATIVE=ON:
# the CPU's own instructions), Release, without curl, tests or the server; about 10-30 minutes
# on 2 cores. The last line printed is the path of llama-bench.
set -euo pipefail

VERSION=0.3.36
DIR=${1:-llama-cpp}
PYTHON=${PYTHON:-python3}

for tool in "$PYTHON" cmake; do
    command -v "$tool" >/dev/null 2>&1 || {
        echo "error: $tool not found (building llama.cpp needs python with pip, cmake and a C++ compiler)" >&2
        exit 2
    }
done
if ! command -v "${CXX:-c++}" >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 \
        && ! command -v clang++ >/dev/null 2>&1; then
    echo "error: no C++ compiler found (c++, g++ or clang++; or set CXX)" >&2
    exit 2
fi
"$PYTHON" -m pip --version >/dev/null 2>&1 || {
    echo "error: $PYTHON has no pip (pip downloads the llama-cpp-python sdist)" >&2
    exit 2
}

mkdir -p "$DIR"
cd "$DIR"
"$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
tar xzf "llama_cpp_python-$VERSION.tar.gz"
cd "llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
cmake --build build --target llama-bench -j
echo "$PWD/build/bin/llama-bench"
