#!/usr/bin/env python
"""Cut prompt snippets from the HELD-OUT split of the corpus (files the backbone and drafts never saw).

A prompt is up to `--context-chars` characters of source ending with a complete `def ...:` line, without
its newline (cut at a line start), so the model's job is to continue a function body. Files are visited in sha256(path) order,
at most `--per-file` prompts per file, defs at least 40% into the context window apart. The first
`--eval` prompts (whole files, by that order) go to the evaluation set (committed, used by `dspark demo`
and `dspark bench acceptance`); the next `--calib` prompts, from OTHER files, to the calibration set
(scripts/fit_calibration.py). Deterministic given the corpus.

    python scripts/make_prompts.py --corpus build/default_model/corpus \
        --eval-out dspark_jax/assets/default/prompts.jsonl --calib-out build/default_model/calib_prompts.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

DEF = re.compile(r"^[ \t]*(async[ \t]+)?def[ \t]+\w+\(.*\):[ \t]*$", re.M)


def snippets(text: str, context: int, per_file: int) -> list[str]:
    out, last_end = [], -10 ** 9
    for m in DEF.finditer(text):
        end = m.end()  # up to the ':' of the def line: the model writes the newline + indentation itself
        # (byte-level BPE merges "\n" with the next line's indentation; a prompt ending in a bare "\n" would
        # sit on a token boundary that training text almost never has, and invites blank lines)
        if end > len(text) or end - last_end < int(0.4 * context) or m.start() < context // 3:
            continue
        start = text.rfind("\n", 0, max(0, end - context)) + 1  # line start (0 when none)
        snippet = text[start:end]
        if len(snippet) < context // 3:
            continue
        out.append(snippet)
        last_end = end
        if len(out) >= per_file:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="build/default_model/corpus")
    ap.add_argument("--eval-out", default="dspark_jax/assets/default/prompts.jsonl")
    ap.add_argument("--calib-out", default="build/default_model/calib_prompts.jsonl")
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--calib", type=int, default=48)
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--context-chars", type=int, default=600)
    args = ap.parse_args(argv)

    docs = [json.loads(line) for line in open(Path(args.corpus) / "heldout.jsonl")]
    docs.sort(key=lambda d: hashlib.sha256(d["path"].encode()).hexdigest())
    ev, cal = [], []
    for d in docs:
        target = ev if len(ev) < args.eval else cal
        if target is cal and len(cal) >= args.calib:
            break
        for i, s in enumerate(snippets(d["text"], args.context_chars, args.per_file)):
            target.append({"id": f"{d['path']}#{i}", "path": d["path"], "prompt": s})
    ev, cal = ev[:args.eval], cal[:args.calib]
    for path, recs in ((args.eval_out, ev), (args.calib_out, cal)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        print(f"{len(recs)} prompts from {len({r['path'] for r in recs})} held-out files -> {path}")
    assert not {r["path"] for r in ev} & {r["path"] for r in cal}
    return 0


if __name__ == "__main__":
    sys.exit(main())
