#!/usr/bin/env bash
# Rebuild the second embedded default (dspark_jax/assets/default_qwen3/) end to end on CPU: a tiny Qwen3
# target and a DeepSpec-family ("qwen3") DSpark draft, assembled through `dspark convert --to bundle` exactly
# as a released Qwen3 DSpark draft would be, with its pure-parallel and one-token comparison drafts.
#   DRAFTS_PARALLEL=1 bash scripts/build_default_qwen3.sh                 # ~50 min on 2 cores
#   DRAFTS_ONLY=1 DRAFTS_PARALLEL=1 bash scripts/build_default_qwen3.sh   # keep the committed target: ~25 min
# (the three drafts one after another instead: ~30 min more; longer on a loaded machine)
# Environment: BACKBONE_MINUTES (default 22) is the target's wall-clock budget; REGEN_PROMPTS (4096) how many
# training prompts the target continues for the draft's on-policy data; DRAFT_STEPS overrides the draft's
# steps (configs/default_qwen3_train_draft.yaml, 1600: ~20 min each alone) for the DSpark draft and its two
# comparison drafts (configs/default_qwen3_train_draft_{parallel,onetoken}.yaml: same data, seed and budget;
# DRAFTS_PARALLEL=1 trains the three at the same time); DRAFTS_ONLY=1 unpacks the committed target
# (scripts/unpack_default_backbone.py) instead of training one. The corpus, tokenizer and held-out prompts
# are the first default's (build/default_model, made by scripts/build_default.sh's first steps, which run
# here too when missing). Logs and intermediates go to build/default_qwen3/.
set -euo pipefail
cd "$(dirname "$0")/.."
S=build/default_model
B=build/default_qwen3
mkdir -p "$B/logs"
log() { echo "[$(date +%H:%M:%S)] $*"; }

log "1/8 shared corpus, tokenizer and prompts (reused from $S when present)"
[ -f "$S/corpus/train.jsonl" ] || python scripts/make_corpus.py --out "$S/corpus" 2>&1 | tee "$B/logs/corpus.log"
if [ "${DRAFTS_ONLY:-0}" = 1 ]; then  # the committed tokenizer (the one the committed target was trained with)
  [ -f "$S/tokenizer.json" ] || cp dspark_jax/assets/default_qwen3/tokenizer.json "$S/tokenizer.json"
else  # the token streams too (train.bin: the target trainer's data)
  [ -f "$S/corpus/train.bin" ] || python scripts/train_tokenizer.py --corpus "$S/corpus" --vocab 4096 \
    --out "$S/tokenizer.json" 2>&1 | tee "$B/logs/tokenizer.log"
fi
[ -f "$S/prompts.jsonl" ] || python scripts/make_prompts.py --corpus "$S/corpus" --eval-out "$S/prompts.jsonl" \
  --calib-out "$S/calib_prompts.jsonl"
if [ "${DRAFTS_ONLY:-0}" = 1 ]; then
  log "2/8 DRAFTS_ONLY: the committed Qwen3 target -> $B/backbone (scripts/unpack_default_backbone.py)"
  python scripts/unpack_default_backbone.py --family qwen3 2>&1 | tee "$B/logs/unpack.log"
else
  log "2/8 Qwen3 target (configs/default_qwen3_backbone.json), ${BACKBONE_MINUTES:-22} min budget; log: $B/logs/backbone.log"
  python scripts/train_backbone_qwen3.py --config configs/default_qwen3_backbone.json --data "$S/corpus" \
    --out "$B/backbone" --minutes "${BACKBONE_MINUTES:-22}" --eval-every 100 --ckpt-every 200 \
    > "$B/logs/backbone.log" 2>&1
  tail -n 1 "$B/logs/backbone.log"
fi
log "3/8 on-policy draft data: the target continues ${REGEN_PROMPTS:-4096} training prompts (dspark regenerate, T = 0 and 1)"
dspark regenerate --train-config configs/default_qwen3_train_draft.yaml --tokenizer "$S/tokenizer.json" \
  --data "$S/corpus/train.jsonl" --out "$B/regen.jsonl" --num-prompts "${REGEN_PROMPTS:-4096}" --prompt-len 64 \
  --max-tokens 192 --temperatures 0,1 --slots 64 --no-progress 2>&1 | tee "$B/logs/regenerate.log"
log "4/8 DeepSpec drafts: DSpark, pure parallel, one-token (configs/default_qwen3_train_draft*.yaml); logs: $B/logs/draft*.log"
STEPS=()
[ -n "${DRAFT_STEPS:-}" ] && STEPS=(--steps "$DRAFT_STEPS")
train_draft() {  # train_draft SUFFIX: "" (DSpark), _parallel or _onetoken
  python -m dspark_jax train --config "configs/default_qwen3_train_draft$1.yaml" --no-progress "${STEPS[@]}" \
    > "$B/logs/draft$1.log" 2>&1
}
if [ "${DRAFTS_PARALLEL:-0}" = 1 ]; then
  pids=()
  for n in "" _parallel _onetoken; do train_draft "$n" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p"; done
else
  for n in "" _parallel _onetoken; do train_draft "$n"; done
fi
for n in "" _parallel _onetoken; do tail -n 1 "$B/logs/draft$n.log"; done
log "5/8 assemble dspark_jax/assets/default_qwen3 (DeepSpec layout -> dspark convert --to bundle; the comparison drafts as variants/)"
python scripts/assemble_default_qwen3.py --build "$B" 2>&1 | tee "$B/logs/assemble.log"
log "6/8 STS calibration on held-out rounds (calibration prompts, T = 1)"
python scripts/fit_calibration.py --bundle dspark_jax/assets/default_qwen3 --prompts "$S/calib_prompts.jsonl" \
  --records-dir "$B" --variants dspark parallel onetoken --slots 8 --max-tokens 64 2>&1 | tee "$B/logs/calibration.log"
log "7/8 dspark bench acceptance on the held-out evaluation prompts"
dspark bench acceptance --bundle dspark_jax/assets/default_qwen3 --variants dspark parallel onetoken --no-progress \
  --json "$B/acceptance.json" --plot "$B/acceptance.png" 2>&1 | tee "$B/logs/bench_acceptance.log"
log "8/8 README.md and logs/ (training logs, calibration summary, benchmark numbers) into the assets"
python scripts/assemble_default_qwen3.py --build "$B" --docs-only
log "done: dspark_jax/assets/default_qwen3 ($(du -sh dspark_jax/assets/default_qwen3 | cut -f1))"
