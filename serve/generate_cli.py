"""`dspark generate`: prompts JSONL in, outputs JSONL out.

Input lines: {"prompt": "text"} (needs the bundle's tokenizer) or {"tokens": [ids]}, optionally with
"id", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop" (token ids). A malformed line is
answered with an error line; the other requests are served.
Output lines: {"id", "tokens", "text" (with a tokenizer), "finish_reason", "error", "rounds",
"accepted", "tau"}; a metrics summary goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_jax.serve.cli_common import add_model_arguments, load_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompts", required=True, help="input JSONL")
    parser.add_argument("--out", default="-", help="output JSONL (default stdout)")
    parser.add_argument("--mode", default="off", choices=("off", "fixed", "sync", "async", "plain"))
    parser.add_argument("--num-verify", type=int, default=None, help="drafts verified per round in mode fixed")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="default per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="default per request")
    parser.add_argument("--cost-table", help="cost table JSON for modes sync/async (default: the bundle's)")
    parser.add_argument("--mesh", default=None,
                        help="serve on a device mesh, e.g. data=2,expert=4 (axes data, fsdp, expert, tensor): "
                             "slots over data/fsdp, the draft's experts over expert")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() first (multi-host TPU slices; see README)")


def parse_requests(lines, tokenizer, defaults) -> tuple[list, dict]:
    """-> (requests, {index: error}) for lines that could not even be turned into a request."""
    from dspark_jax.serve.engine import Request

    reqs, errors = [], {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("expected a JSON object")
            if "tokens" in rec:
                tokens = rec["tokens"]
            elif "prompt" in rec:
                if tokenizer is None:
                    raise ValueError("'prompt' text needs a tokenizer; this model has none (give 'tokens')")
                tokens = tokenizer.encode(rec["prompt"]).ids
            else:
                raise ValueError("expected a 'prompt' (text) or 'tokens' (ids) field")
            reqs.append(Request(tokens, max_tokens=rec.get("max_tokens", defaults["max_tokens"]),
                                temperature=rec.get("temperature", defaults["temperature"]),
                                top_k=rec.get("top_k", 0), top_p=rec.get("top_p", 1.0), seed=rec.get("seed", i),
                                stop_tokens=tuple(rec.get("stop", ())), id=rec.get("id", i)))
        except (ValueError, TypeError) as err:
            errors[i] = f"line {i + 1}: {err}"
    return reqs, errors


def _mesh(args):
    """The --mesh (after --distributed's jax.distributed.initialize, which must come before any device use)."""
    import jax

    from dspark_jax.parallel import make_mesh, parse_mesh_spec

    if args.distributed:
        jax.distributed.initialize()
    if not args.mesh:
        return None
    try:
        return make_mesh(**parse_mesh_spec(args.mesh))
    except ValueError as e:
        raise SystemExit(f"--mesh: {e}") from None


def run(args: argparse.Namespace) -> int:
    from dspark_jax.serve.engine import Engine, EngineConfig

    from dspark_jax.schedule import CostTable

    mesh = _mesh(args)
    bundle = load_model(args)
    table = CostTable.from_json(args.cost_table) if args.cost_table else bundle.cost_table
    with open(args.prompts) as f:
        reqs, errors = parse_requests(f.readlines(), bundle.tokenizer,
                                      {"max_tokens": args.max_tokens, "temperature": args.temperature})
    engine = Engine(bundle.model, bundle.weights,
                    EngineConfig(max_slots=args.slots, max_len=args.max_len, mode=args.mode,
                                 num_verify=args.num_verify),
                    cost_table=table, mesh=mesh)
    results = engine.generate(reqs)
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    for idx, err in errors.items():
        out.write(json.dumps({"id": idx, "tokens": [], "finish_reason": "error", "error": err}) + "\n")
    for r in results:
        rec = {"id": r.id, "tokens": r.tokens, "finish_reason": r.finish_reason, "error": r.error,
               "rounds": r.rounds, "accepted": r.accepted, "tau": len(r.tokens) / max(r.rounds, 1)}
        if bundle.tokenizer is not None and r.tokens:
            rec["text"] = bundle.tokenizer.decode(r.tokens)
        out.write(json.dumps(rec) + "\n")
    if out is not sys.stdout:
        out.close()
    print(json.dumps(engine.metrics.summary()), file=sys.stderr)
    return 0
