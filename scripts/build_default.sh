#!/usr/bin/env bash
# Rebuild the embedded default model (dspark_jax/assets/default/) end to end on CPU.
#   DRAFTS_PARALLEL=1 bash scripts/build_default.sh                 # ~5.1 h on 2 cores (see BENCHMARKS.md)
#   DRAFTS_ONLY=1 DRAFTS_PARALLEL=1 bash scripts/build_default.sh   # keep the committed backbone: ~4.1 h
# Environment: BACKBONE_MINUTES (default 60) is the backbone's wall-clock budget; REGEN_PROMPTS (4096) how
# many training prompts the backbone continues for the drafts' on-policy data; DRAFT_STEPS overrides the
# drafts' steps (configs/default_train_draft_*.yaml: 1200 for dspark, parallel, onetoken); CONTINUE_STEPS
# (default 1200, 0 = none) continues each draft for that many more steps, RESTARTS (default 3) times (warm
# restarts, scripts/train_drafts.py);
# DRAFTS_PARALLEL=1 trains the three drafts at the same time (default: one after another); DRAFTS_ONLY=1 skips the tokenizer and backbone
# training and unpacks the committed backbone instead (scripts/unpack_default_backbone.py).
# Logs and intermediates go to build/default_model/.
set -euo pipefail
cd "$(dirname "$0")/.."
B=build/default_model
mkdir -p "$B/logs"
log() { echo "[$(date +%H:%M:%S)] $*"; }

log "1/8 corpus (python stdlib sources, split by file)"
python scripts/make_corpus.py --out "$B/corpus" 2>&1 | tee "$B/logs/corpus.log"
if [ "${DRAFTS_ONLY:-0}" = 1 ]; then
  log "2-4/8 DRAFTS_ONLY: the committed backbone, tokenizer and prompts -> $B (scripts/unpack_default_backbone.py)"
  python scripts/unpack_default_backbone.py --family mhc 2>&1 | tee "$B/logs/unpack.log"
  python scripts/make_prompts.py --corpus "$B/corpus" --eval-out "$B/prompts.jsonl" --calib-out "$B/calib_prompts.jsonl"
else
  log "2/8 tokenizer (byte-level BPE, vocab 4096) + token streams"
  python scripts/train_tokenizer.py --corpus "$B/corpus" --vocab 4096 --out "$B/tokenizer.json" 2>&1 | tee "$B/logs/tokenizer.log"
  log "3/8 held-out prompts (evaluation + calibration sets)"
  python scripts/make_prompts.py --corpus "$B/corpus" --eval-out "$B/prompts.jsonl" --calib-out "$B/calib_prompts.jsonl"
  log "4/8 backbone (mhc, configs/default_backbone.json), ${BACKBONE_MINUTES:-60} min budget; log: $B/backbone/train.log"
  mkdir -p "$B/backbone"
  python scripts/train_backbone.py --config configs/default_backbone.json --data "$B/corpus" --out "$B/backbone" \
    --batch 8 --seq-len 256 --minutes "${BACKBONE_MINUTES:-60}" --eval-every 50 --ckpt-every 25 --eval-batches 4 \
    2>&1 | tee "$B/backbone/train.log"
fi
log "5/8 on-policy draft data: the backbone continues ${REGEN_PROMPTS:-4096} training prompts (dspark regenerate, T = 0 and 1)"
python scripts/train_drafts.py --prepare-only 2>&1 | tee "$B/logs/drafts_prepare.log"
dspark regenerate --train-config configs/default_train_draft_dspark.yaml --tokenizer "$B/tokenizer.json" \
  --data "$B/corpus/train.jsonl" --out "$B/regen.jsonl" --num-prompts "${REGEN_PROMPTS:-4096}" --prompt-len 64 \
  --max-tokens 192 --temperatures 0,1 --slots 64 2>&1 | tee "$B/logs/regenerate.log"
log "6/8 drafts (dspark train x3: block 7 + Markov head, block 7 pure parallel, block 1), then the warm restarts"
STEPS=()
[ -n "${DRAFT_STEPS:-}" ] && STEPS=(--steps "$DRAFT_STEPS")
# train_drafts ARGS...: the three drafts with these arguments, side by side (DRAFTS_PARALLEL=1) or in turn.
train_drafts() {
  if [ "${DRAFTS_PARALLEL:-0}" = 1 ]; then
    local pids=() n
    for n in dspark parallel onetoken; do
      python scripts/train_drafts.py --names "$n" --skip-prepare "$@" >> "$B/logs/draft_$n.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
  else
    python scripts/train_drafts.py --skip-prepare "$@" 2>&1 | tee -a "$B/logs/drafts.log"
  fi
}
train_drafts "${STEPS[@]}"
# Warm restarts (RESTARTS stages of CONTINUE_STEPS each, 0 = none): the curves still rise at the end of a
# stage, so each draft goes on from its exported weights with the same schedule again (warm-up, cosine to
# zero), the optimizer state fresh, in <run_dir>/stage2/, stage3/, ... (a rerun resumes or skips each stage).
if [ "${CONTINUE_STEPS:-1200}" -gt 0 ]; then
  for k in $(seq 2 $((1 + ${RESTARTS:-3}))); do
    train_drafts --continue-steps "${CONTINUE_STEPS:-1200}" --stage "$k"
  done
fi
log "7/8 assemble dspark_jax/assets/default (bf16 weights) + STS calibration on held-out rounds"
python scripts/assemble_default.py --build "$B" --dest dspark_jax/assets/default 2>&1 | tee "$B/logs/assemble.log"
python scripts/fit_calibration.py --bundle dspark_jax/assets/default --prompts "$B/calib_prompts.jsonl" \
  --records-dir "$B" 2>&1 | tee "$B/logs/calibration.log"
log "8/8 check: the benchmark table and the demo"
dspark bench acceptance --json "$B/acceptance.json" --plot "$B/acceptance.png" 2>&1 | tee "$B/logs/bench_acceptance.log"
dspark demo --plot "$B/dspark_demo.png" 2>&1 | tee "$B/logs/demo.log"
log "done: dspark_jax/assets/default ($(du -sh dspark_jax/assets/default | cut -f1))"
