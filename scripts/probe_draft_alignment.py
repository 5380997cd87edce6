#!/usr/bin/env python
"""Where do a bundle's greedy draft tokens land? A diagnostic for low greedy acceptance past slot 1.

For held-out prompts (greedy, verify-all rounds), compare each draft slot k's token with the backbone's
greedy token at every verify slot j of the same round: entry [k, j] = P(draft_k == argmax target_j).
A well-trained block draft has its mass on the diagonal j = k - 1 (slot k predicts the token k after
the anchor); a draft whose later slots have not learned their offsets shows a column j = 0 instead
(every slot guesses the next token).

    python scripts/probe_draft_alignment.py [--bundle dspark_jax/assets/default] [--rounds 25]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None) -> int:
    from dspark_jax import sampling
    from dspark_jax import spec_round as sr
    from dspark_jax.bundle import load_bundle
    from dspark_jax.evaluation import make_requests, read_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dspark_jax/assets/default")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args(argv)

    b = load_bundle(args.bundle, impl="xla")
    model, w, k = b.model, b.weights, b.model.block_size
    reqs = make_requests(read_prompts(f"{args.bundle}/prompts.jsonl", args.prompts), b.tokenizer, max_tokens=64,
                         temperature=0.0, max_prompt_tokens=96)
    prompts = [r.prompt for r in reqs]
    n, t = len(prompts), max(map(len, prompts))
    prompt = jnp.asarray([p + [0] * (t - len(p)) for p in prompts], jnp.int32)
    sp, seeds, active = sampling.SamplingParams.greedy(n), jnp.arange(n, dtype=jnp.uint32), jnp.ones(n, bool)
    state, _ = sr.start(model, w, sr.init_state(model, n, 512), prompt, jnp.asarray([len(p) for p in prompts]),
                        active, sp, seeds)

    @jax.jit
    def drafts_and_targets(state):
        out = sr.draft_propose(model, w, state, sp, seeds, True)
        bo = sr._forward(model, w.backbone, state.cache, jnp.concatenate([state.anchor[:, None], out.tokens], 1))
        return out.tokens, jnp.argmax(bo.logits, -1)

    step = jax.jit(lambda s: sr.spec_round(model, w, s, sp, seeds, active, width=k + 1, mode="fixed",
                                           num_verify=jnp.full(n, k))[0])
    hits = np.zeros((k, k + 1))
    for _ in range(args.rounds):
        d, tgt = map(np.asarray, drafts_and_targets(state))
        hits += (d[:, :, None] == tgt[:, None, :]).sum(0)
        state = step(state)
    frac = hits / (args.rounds * n)
    print(f"{args.bundle}: P(draft slot k == backbone greedy token at verify slot j), {args.rounds} greedy rounds "
          f"x {n} prompts; the aligned entry is j = k - 1 (marked *)")
    print("  k  " + " ".join(f"  j={j}" for j in range(k + 1)))
    for i in range(k):
        print(f"{i + 1:3d}  " + " ".join(f"{v:5.3f}{'*' if j == i else ' '}" for j, v in enumerate(frac[i])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
