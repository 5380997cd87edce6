"""Shared test helpers: `import helpers` / `from helpers import ...` from any test module (pyproject's
pytest `pythonpath` holds tests/). Test modules never import each other; what two of them share lives here.

    paths            REPO, CONFIGS, TESTS, FIXTURES, TINY_TRAIN_JSONL
    oracles          plain numpy oracles (fp8 E4M3 rounding, RMSNorm, RoPE, mHC mixes, sampling probabilities,
                     the Markov head variants)
    spec             the oracle draft, prompts, plain greedy decoding, the tiny V4.1 draft with each backbone
                     family, `assert_within_one_fp8_step`
    oracle_v41       an independent numpy emulation of the official V4.1 forward (SPEC 2, 3)
    official_writer  an independent writer of V4.1 checkpoints in the official layout (SPEC 3)
    checkpoint       bit-layout oracles, a safetensors writer and the V4.1 layout / tree spelled out (SPEC 3)
    deepspec         a DeepSpec checkpoint written in its own layout and a numpy oracle of the family
    backbones        shared set-up of the backbone tests (Qwen3 vs transformers, the mHC backbone)
    v41              the tiny V4.1 draft with non-trivial parameters
    kernels          Mosaic-TPU lowering at the V4.1-Flash shapes
    train            run configs, model files, trainers and batches of the trainer tests
The modules below `spec` import on first use (`from helpers.deepspec import ...`).
"""

from helpers.oracles import (e4m3_grid, np_fp8_round_rows, np_hc_mixes, np_markov_step, np_rms_norm, np_rope,
                             np_round_e4m3, np_sinkhorn, reference_probs)
from helpers.paths import CONFIGS, FIXTURES, REPO, TESTS, TINY_TRAIN_JSONL
from helpers.spec import (assert_within_one_fp8_step, backbone_greedy_drafts, fp8_step, oracle_propose,
                          oracle_propose_varied, padded, plain_greedy_tokens, random_prompts)

__all__ = [
    "CONFIGS", "FIXTURES", "REPO", "TESTS", "TINY_TRAIN_JSONL", "assert_within_one_fp8_step", "backbone_greedy_drafts",
    "e4m3_grid", "fp8_step", "np_fp8_round_rows", "np_hc_mixes", "np_markov_step", "np_rms_norm", "np_rope", "np_round_e4m3",
    "np_sinkhorn", "oracle_propose", "oracle_propose_varied", "padded", "plain_greedy_tokens", "random_prompts",
    "reference_probs",
]
