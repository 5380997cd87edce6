"""`dspark generate`: prompts JSONL in, outputs JSONL out.

Input lines: {"prompt": "text"} (needs the bundle's tokenizer) or {"tokens": [ids]}, optionally with
"id", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop" (as the server takes it: a string, a
token id, or a list of them; stop strings need a tokenizer, cut "text" before the string and end the
request with finish_reason "stop"). A malformed line (bad JSON, not UTF-8, a bad field, an unknown key,
both "prompt" and "tokens") is answered with an error line naming the line; the others are served.
Output lines, in finishing order: {"line" (1-based input line), "id", "tokens", "text" (with a
tokenizer), "finish_reason", "error", "rounds", "accepted", "tau"}. They are written and flushed as each
request finishes into a temporary file beside --out, renamed over --out when the run completes
(`output_files`): a run that fails leaves an earlier --out as it was, and what it had done in
`<out>.partial`. The temporary file is created before the model loads (a folder that cannot be written
fails at once), and --out naming an input is refused. A metrics summary goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from dspark_jax.errors import UserError
from dspark_jax.output_files import check_not_an_input, replaced_on_success
from dspark_jax.serve.cli_common import (add_compile_argument, add_compile_cache_argument, add_model_arguments,
                                         compile_option, enable_compile_cache, load_model)
from dspark_jax.serve.request_check import (COUPLING_SETTINGS, PROMPT_LINE_KEYS, check_length_and_temperature,
                                            choose_coupling, prompt_record)
from dspark_jax.validation import check_int_flags, flag_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_compile_argument(parser)
    add_compile_cache_argument(parser)
    parser.add_argument("--prompts", required=True, help="input JSONL")
    parser.add_argument("--out", default="-", help="output JSONL (default stdout)")
    parser.add_argument("--mode", default="off", choices=("off", "fixed", "sync", "async", "plain"))
    parser.add_argument("--num-verify", type=int, default=None, help="drafts verified per round in mode fixed")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="default per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="default per request")
    parser.add_argument("--coupling", default="auto", choices=COUPLING_SETTINGS,
                        help="how drafts are accepted: invariant (a line's seed gives the tokens plain decoding "
                             "gives), optimal (the most accepted drafts, exact in distribution), auto (invariant "
                             "for lines that set a seed, optimal for the others)")
    parser.add_argument("--cost-table", help="cost table JSON for modes sync/async (default: the bundle's)")
    parser.add_argument("--mesh", default=None,
                        help="serve on a device mesh, e.g. data=2,expert=4 (axes data, fsdp, expert, tensor): "
                             "slots over data/fsdp, the draft's experts over expert")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() first (multi-host TPU slices; see README)")


def parse_requests(lines, tokenizer, defaults, *, vocab: int, max_stop_tokens: int) -> tuple[list, dict, dict]:
    """Raw input lines (bytes or str) -> (requests, {line index: error}, {request index: stop strings}); the
    errors are for lines that could not even be turned into a request (`result_record` adds the line number
    to every error). Request i carries id (line index, its own "id") so results map back to their lines."""
    from dspark_jax.serve.engine import Request
    from dspark_jax.serve.openai_api import ApiError, parse_stop

    reqs, errors, stop_strings = [], {}, {}
    for i, raw in enumerate(lines):
        try:
            rec = prompt_record(raw, PROMPT_LINE_KEYS)
            if rec is None:
                continue
            if "tokens" in rec:
                tokens = rec["tokens"]
            elif tokenizer is None:
                raise ValueError("'prompt' text needs a tokenizer; this model has none (give 'tokens')")
            else:
                tokens = tokenizer.encode(rec["prompt"]).ids
            try:  # the server's rules and messages: one request format
                strings, stop = parse_stop(rec.get("stop"), vocab, max_stop_tokens)
            except ApiError as err:
                raise ValueError(err.message) from None
            if strings and tokenizer is None:
                raise ValueError("'stop': stop strings need a tokenizer; this model has none (give token ids)")
            if strings:
                stop_strings[len(reqs)] = strings
            reqs.append(Request(tokens, max_tokens=rec.get("max_tokens", defaults["max_tokens"]),
                                temperature=rec.get("temperature", defaults["temperature"]),
                                top_k=rec.get("top_k", 0), top_p=rec.get("top_p", 1.0), seed=rec.get("seed", i),
                                stop_tokens=tuple(stop), id=(i, rec.get("id", i)),
                                coupling=choose_coupling(defaults.get("coupling", "auto"), "seed" in rec)))
        except (ValueError, TypeError) as err:
            errors[i] = str(err)
    return reqs, errors, stop_strings


def result_record(index: int, rid, result, tokenizer, text=None) -> dict:
    """One output line (`index` is the 0-based input line); `text`: the request's TextStream when it has
    stop strings (its text is cut before the first one)."""
    rec = {"line": index + 1, "id": rid, "tokens": result.tokens, "finish_reason": result.finish_reason,
           "error": f"line {index + 1}: {result.error}" if result.error else result.error,
           "rounds": result.rounds, "accepted": result.accepted, "tau": len(result.tokens) / max(result.rounds, 1)}
    if text is not None:
        rec["text"] = text.text if text.stopped else tokenizer.decode(result.tokens)
    elif tokenizer is not None and result.tokens:
        rec["text"] = tokenizer.decode(result.tokens)
    return rec


def output_stream(args: argparse.Namespace):
    """A context giving the output stream: stdout for "-", else a file replacing --out on success."""
    if args.out == "-":
        return contextlib.nullcontext(sys.stdout)
    check_not_an_input(args.out, [("--prompts", args.prompts), ("--cost-table", args.cost_table)])
    return replaced_on_success(args.out, keep_partial=True)


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
        raise UserError(f"--mesh: {e}") from None


def check_defaults(args: argparse.Namespace) -> None:
    """The per-request defaults are checked once, up front: a bad one would make every line an error; the
    engine's sizes too, before the model loads."""
    check_length_and_temperature(args.max_tokens, args.temperature,
                                 error=lambda field, message: UserError(f"{flag_name(field)}: {message}"))
    check_int_flags(args, "slots", "max_len")
    check_int_flags(args, "num_verify", minimum=0)


def run(args: argparse.Namespace) -> int:
    from dspark_jax.schedule import CostTable
    from dspark_jax.serve.engine import Engine, EngineConfig, Result
    from dspark_jax.serve.openai_api import TextStream

    check_defaults(args)
    with open(args.prompts, "rb") as f:
        lines = f.read().splitlines()
    enable_compile_cache(args)  # an unusable folder is refused before anything is written
    with output_stream(args) as out:
        mesh = _mesh(args)
        bundle = load_model(args)
        table = CostTable.from_json(args.cost_table) if args.cost_table else bundle.cost_table
        config = EngineConfig(max_slots=args.slots, max_len=args.max_len, mode=args.mode,
                              num_verify=args.num_verify, **compile_option(args))
        reqs, errors, stops = parse_requests(lines, bundle.tokenizer,
                                             {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                              "coupling": args.coupling},
                                             vocab=bundle.model.backbone.vocab_size,
                                             max_stop_tokens=config.max_stop_tokens)
        texts = {i: TextStream(bundle.tokenizer, strings) for i, strings in stops.items()}

        def write(index: int, rid, result, text=None) -> None:
            out.write(json.dumps(result_record(index, rid, result, bundle.tokenizer, text)) + "\n")
            out.flush()

        def stop_string_hit(i: int, tokens: list[int]) -> bool:
            text = texts.get(i)
            if text is None:
                return False
            text.push(tokens)
            return text.stopped

        for idx, err in errors.items():
            write(idx, idx, Result(idx, [], "error", err))
        engine = Engine(bundle.model, bundle.weights, config, cost_table=table, mesh=mesh)
        engine.generate(reqs, on_result=lambda i, r: write(*reqs[i].id, r, texts.get(i)), on_tokens=stop_string_hit)
    print(json.dumps(engine.metrics.summary()), file=sys.stderr)
    return 0
