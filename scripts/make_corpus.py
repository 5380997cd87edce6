#!/usr/bin/env python
"""Build the default model's text corpus from the Python standard library that ships with the interpreter.

Every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages excluded) becomes one JSONL
record `{"path": <relative path>, "text": <source>}`. The split is BY FILE and deterministic: a file is
held out when `sha256(relative path) % 100 < --heldout-pct` (default 5), so the same interpreter always
gives the same split, and no held-out file shares text with a training file.

    python scripts/make_corpus.py --out build/default_model/corpus

writes train.jsonl, heldout.jsonl and manifest.json (python version, counts, bytes, a digest of the lists).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

from tqdm import tqdm

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def is_heldout(rel: str, pct: int) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < pct


def stdlib_files(root: Path, max_bytes: int) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts):
            continue
        try:
            if not p.is_file() or p.stat().st_size == 0 or p.stat().st_size > max_bytes:
                continue
        except OSError:
            continue
        out.append(p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/default_model/corpus", help="output folder")
    ap.add_argument("--heldout-pct", type=int, default=5, help="percent of files held out (by path hash)")
    ap.add_argument("--max-file-bytes", type=int, default=400_000, help="skip larger files (generated tables)")
    args = ap.parse_args(argv)

    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(root, args.max_file_bytes)
    stats = {"train": [0, 0], "heldout": [0, 0]}
    digest = {"train": hashlib.sha256(), "heldout": hashlib.sha256()}
    with open(out / "train.jsonl", "w") as ftr, open(out / "heldout.jsonl", "w") as fho:
        for p in tqdm(files, desc="corpus", unit="file"):
            rel = p.relative_to(root).as_posix()
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            split = "heldout" if is_heldout(rel, args.heldout_pct) else "train"
            (fho if split == "heldout" else ftr).write(json.dumps({"path": rel, "text": text}) + "\n")
            stats[split][0] += 1
            stats[split][1] += len(text.encode())
            digest[split].update(rel.encode() + b"\0")
    manifest = {"python": sys.version.split()[0], "stdlib": str(root), "heldout_pct": args.heldout_pct,
                **{f"{k}_files": v[0] for k, v in stats.items()}, **{f"{k}_bytes": v[1] for k, v in stats.items()},
                **{f"{k}_paths_sha256": d.hexdigest() for k, d in digest.items()}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
