#!/usr/bin/env bash
# The Markov head variants of the embedded default's DSpark draft (issue 19, SPEC 4.1): the gated and the
# recurrent head, trained with the DSpark draft's own data (configs/default_train_draft_{gated,rnn}.yaml differ
# from default_train_draft_dspark.yaml in the draft config's markov_head_type and in steps: 600, issue 19's
# equal budget, where the vanilla draft has trained for 1200 since issue 16; set 1200 there to compare at
# equal budget again), added to
# dspark_jax/assets/default/variants/{gated,rnn}, then compared with the vanilla head on held-out prompts:
#   bash scripts/build_head_variants.sh          # ~1.5 h on 2 cores (see BENCHMARKS.md)
# It keeps the committed backbone and regenerates the same on-policy data as scripts/build_default.sh
# (same prompts, seeds and settings). Logs and intermediates go to build/default_model/.
set -euo pipefail
cd "$(dirname "$0")/.."
B=build/default_model
mkdir -p "$B/logs"
log() { echo "[$(date +%H:%M:%S)] $*"; }
log "1/5 corpus and the committed backbone"
python scripts/make_corpus.py --out "$B/corpus" 2>&1 | tee "$B/logs/corpus.log"
python scripts/unpack_default_backbone.py --family mhc 2>&1 | tee "$B/logs/unpack.log"
python scripts/train_drafts.py --prepare-only 2>&1 | tee "$B/logs/drafts_prepare.log"
log "2/5 on-policy draft data (as scripts/build_default.sh step 5)"
[ -s "$B/regen.jsonl" ] || dspark regenerate --train-config configs/default_train_draft_dspark.yaml \
  --tokenizer "$B/tokenizer.json" --data "$B/corpus/train.jsonl" --out "$B/regen.jsonl" \
  --num-prompts "${REGEN_PROMPTS:-4096}" --prompt-len 64 --max-tokens 192 --temperatures 0,1 --slots 64 \
  2>&1 | tee "$B/logs/regenerate.log"
log "3/5 the gated and the recurrent head drafts, side by side"
PIDS=()
for n in gated rnn; do
  python scripts/train_drafts.py --names "$n" --skip-prepare > "$B/logs/draft_$n.log" 2>&1 &
  PIDS+=($!)
done
for p in "${PIDS[@]}"; do wait "$p"; done
log "4/5 add them to dspark_jax/assets/default/variants/"
python scripts/assemble_default.py --build "$B" --add-variants gated rnn 2>&1 | tee "$B/logs/assemble_heads.log"
log "5/5 vanilla / gated / recurrent on held-out prompts"
dspark bench acceptance --variants dspark gated rnn --json "$B/acceptance_heads.json" \
  --plot "$B/acceptance_heads.png" 2>&1 | tee "$B/logs/bench_acceptance_heads.log"
log "done"
