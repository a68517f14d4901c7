#!/usr/bin/env bash
# Build llama.cpp's own server (the CPU peer that bench/peers.py compares against) from the
# source that the llama-cpp-python 0.3.36 sdist vendors. Builds the C++ binaries only: far
# faster than `pip install llama-cpp-python`, and llama-server batches requests (-np N).
#
# Result: $LLAMA_DIR/build/bin/{llama-server,llama-bench,llama-perplexity} (idempotent: a
# second run with the binaries present does nothing).
#
# AMX is compiled out: some VMs report the AMX cpuid flags but fault on the first tile
# instruction, so a -march=native build would crash there.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
LLAMA_DIR="${LLAMA_DIR:-$HOME/.cache/pdserve/llama.cpp}"
JOBS="${JOBS:-2}"
PY="${PY:-python3}"
TARGETS=(llama-server llama-bench llama-perplexity)

have_all() {
  for t in "${TARGETS[@]}"; do [[ -x "$LLAMA_DIR/build/bin/$t" ]] || return 1; done
}
if have_all; then
  echo "llama.cpp already built in $LLAMA_DIR/build/bin"
  exit 0
fi

for tool in cmake ninja; do
  if ! command -v "$tool" >/dev/null; then
    echo "installing $tool with pip" >&2
    "$PY" -m pip install -q "$tool"
  fi
done

mkdir -p "$LLAMA_DIR"
dl="$LLAMA_DIR/sdist"
src="$LLAMA_DIR/src"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
  mkdir -p "$dl"
  "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$dl"
  tarball="$(ls "$dl"/llama_cpp_python-"$VERSION".tar.gz)"
  rm -rf "$dl/unpacked" && mkdir -p "$dl/unpacked"
  tar xzf "$tarball" -C "$dl/unpacked"
  rm -rf "$src"
  mv "$dl/unpacked/llama_cpp_python-$VERSION/vendor/llama.cpp" "$src"
  rm -rf "$dl/unpacked"
fi

noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$LLAMA_DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx"
# nice: the build shares the machine with other work (tests, servers).
nice -n 10 ninja -C "$LLAMA_DIR/build" -j "$JOBS" "${TARGETS[@]}"
have_all
echo "llama.cpp built: $LLAMA_DIR/build/bin"
