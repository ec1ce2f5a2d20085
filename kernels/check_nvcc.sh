#!/usr/bin/env bash
# Compile-only check of the CUDA kernel source with nvcc (no GPU, no torch needed).
# Usage: bash kernels/check_nvcc.sh [OUT_DIR]   (default: a fresh temporary directory)
# Prints the path of the object file it produced; exits non-zero if nvcc fails.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out_dir="${1:-$(mktemp -d)}"
mkdir -p "$out_dir"
nvcc_bin="${NVCC:-nvcc}"
obj="$out_dir/swap_blocks_cuda.o"
"$nvcc_bin" -c -std=c++17 -O2 -Xcompiler -Wall,-Werror -o "$obj" "$here/swap_blocks_cuda.cu"
echo "$obj"
