"""The "peer" half of `dspark bench decode`: the same Qwen3 backbone in Hugging Face transformers.

`to_transformers` copies our `Qwen3Backbone` params into a `transformers.Qwen3ForCausalLM` (the inverse
of `dspark_jax.checkpoint.qwen3_hf.load_qwen3_hf`, driven by the same `hf_layer_map` table), and
`greedy_generate` decodes a batch with HF's own `generate` (greedy, static KV cache, optionally
torch.compile'd), so the bench can print transformers tokens/s next to ours for identical weights.

torch and transformers are optional (test-only) dependencies: nothing here imports them at module
level; `available()` says whether they can be used.

Compiled runs: HF's `generate` compiles only the decode step (`model.get_compiled_call`, static shapes,
`dynamic=False`); its prefill stays eager. transformers auto-compiles on accelerators only, so the
CompileConfig is flagged `_compile_all_devices`. On CPU "reduce-overhead" has no CUDA graphs to capture
and amounts to inductor's "default"; it works (torch 2.13 / transformers 5.24), "default" is the fallback.
Inductor's C++ kernels bake in the thread count of their compile (`#pragma omp parallel num_threads(n)`),
so every compiled call drops the previous compile and recompiles under its own `threads` (tens of
seconds per batch shape on a 2-core box; untimed).

Timing: `greedy_generate` runs one untimed warm-up `generate` of the same shapes first (it is where
torch.compile compiles), then times one full `generate` call, prefill included, exactly
`max_new_tokens` new tokens per row (no EOS stop). tokens/s = batch * max_new_tokens / seconds.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax import kernels as pallas_kernels
from dspark_jax.backbones import qwen3 as qwen3_lib
from dspark_jax.checkpoint import qwen3_hf

# The attention kernel of the converted model. "sdpa" is transformers' default (what a user of HF gets, and
# the fastest on CPU); left padding is exact with it (checked by tests/bench/test_peer.py). Change it on a model
# with `model.set_attn_implementation("eager")`.
ATTN_IMPLEMENTATION = "sdpa"

# torch.compile modes tried in order: "reduce-overhead" (CUDA graphs) is what transformers' CompileConfig
# defaults to; on CPU there are no CUDA graphs and inductor compiles it like "default".
COMPILE_MODES = ("reduce-overhead", "default")

TORCH_DTYPES = ("float32", "bfloat16")

# Our -> HF transform for each HF -> ours transform `hf_layer_map` uses (both are their own inverse).
_INVERSE = {qwen3_hf.transposed: qwen3_hf.transposed, qwen3_hf.unchanged: qwen3_hf.unchanged}


def shadowed_kernels_package() -> str | None:
    """The folder that hides the installed `kernels` distribution, or None.

    transformers >= 5 imports the `kernels` distribution (Hugging Face hub kernels) when it loads a
    model. Run with this repository's root first on sys.path (`python -m ...` from the root), Python
    finds the root's kernels/ folder (our Pallas kernels, installed as dspark_jax.kernels) instead, and
    the import fails deep inside transformers."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None  # nothing to hide: transformers does not import it then
    spec = importlib.util.find_spec("kernels")
    if spec is None or not spec.origin:
        return None
    found = Path(spec.origin).resolve().parent
    # Ours, or another checkout's kernels/ folder (the same files): not the distribution.
    ours = found == Path(pallas_kernels.__file__).resolve().parent or (found / "markov_sampler.py").is_file()
    return str(found) if ours else None


def available() -> str | None:
    """None when torch and transformers import; else a one-line reason (the bench prints it and skips)."""
    try:
        import torch  # noqa: F401
    except Exception as err:  # ImportError, or a broken install raising anything at import
        return f"torch is not importable ({type(err).__name__}: {err})"
    hidden_by = shadowed_kernels_package()
    if hidden_by is not None:
        return (f"the folder {hidden_by} (this project's Pallas kernels) hides the installed `kernels` package "
                "that transformers imports; run from another directory than the repository root")
    try:
        import transformers
    except Exception as err:
        return f"transformers is not importable ({type(err).__name__}: {err})"
    try:  # a lazy attribute: this imports the model's modules
        has_qwen3 = hasattr(transformers, "Qwen3ForCausalLM")
    except Exception as err:
        return f"transformers cannot load Qwen3ForCausalLM ({type(err).__name__}: {err})"
    return None if has_qwen3 else f"transformers {transformers.__version__} has no Qwen3ForCausalLM (needs >= 4.51)"


def _require():
    reason = available()
    if reason is not None:
        raise RuntimeError(f"the transformers peer is unavailable: {reason}")
    import torch
    import transformers

    return torch, transformers


# ---------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------


def hf_tensor_table(cfg: qwen3_lib.Qwen3Config) -> list[tuple[str, tuple[str, ...], tuple[int, ...], Any]]:
    """Every HF parameter of a Qwen3ForCausalLM of this config:
    (HF name, path in our params tree, HF shape, ours -> HF transform of one slice).

    Per-layer rows come from `hf_layer_map` (our leaf is stacked on a leading layers axis; the path ends
    with the layer index). With tied embeddings HF has no separate `lm_head.weight` parameter."""
    v, d = cfg.vocab_size, cfg.hidden_size
    same = qwen3_hf.unchanged
    rows = [("model.embed_tokens.weight", ("embed",), (v, d), same),
            ("model.norm.weight", ("norm", "scale"), (d,), same)]
    if not cfg.tie_word_embeddings:
        rows.append(("lm_head.weight", ("lm_head",), (v, d), same))
    for i in range(cfg.num_hidden_layers):
        for suffix, (mod, leaf), shape, to_ours in qwen3_hf.hf_layer_map(cfg):
            if to_ours not in _INVERSE:
                raise NotImplementedError(f"peer: no inverse registered for the transform of '{suffix}' "
                                          f"({to_ours!r}); add it to _INVERSE")
            rows.append((f"model.layers.{i}.{suffix}", ("layers", mod, leaf, i), shape, _INVERSE[to_ours]))
    return rows


def hf_config_dict(cfg: qwen3_lib.Qwen3Config) -> dict[str, Any]:
    """`transformers.Qwen3Config(**d)` kwargs for our config (our own dtype fields dropped)."""
    d = cfg.to_hf_dict()
    for key in ("param_dtype", "compute_dtype"):
        d.pop(key, None)
    return d


def _leaf(params, path: tuple, name: str) -> np.ndarray:
    node = params
    for depth, key in enumerate(path):
        if isinstance(key, int):
            node = np.asarray(node)
            if node.ndim == 0 or node.shape[0] <= key:
                raise ValueError(f"to_transformers: tensor '{name}': our leaf {'/'.join(map(str, path[:-1]))} "
                                 f"has shape {list(node.shape)}, expected a leading layers axis > {key}")
            node = node[key]
        else:
            if not isinstance(node, dict) or key not in node:
                raise ValueError(f"to_transformers: tensor '{name}': our params have no "
                                 f"'{'/'.join(map(str, path[:depth + 1]))}'")
            node = node[key]
    return np.asarray(node, np.float32)


def to_transformers(backbone, params, *, dtype="float32"):
    """Our Qwen3Backbone (dspark_jax.backbones.qwen3) + its params pytree -> an eval() transformers.Qwen3ForCausalLM
    with identical weights (strict: every HF parameter filled, shapes checked; error names the tensor)."""
    torch, transformers = _require()
    if not isinstance(backbone, qwen3_lib.Qwen3Backbone):
        raise TypeError(f"to_transformers: needs a Qwen3Backbone, got {type(backbone).__name__}")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"to_transformers: 'dtype' must be one of {TORCH_DTYPES}, got {dtype!r}")
    cfg = backbone.cfg
    _check_params_tree(backbone, params)
    import jax

    params = jax.tree.map(np.asarray, params)  # to host once (not once per layer slice)

    hf_cfg = transformers.Qwen3Config(**hf_config_dict(cfg))
    hf_cfg._attn_implementation = ATTN_IMPLEMENTATION
    model = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.float32).eval()
    hf_params = dict(model.named_parameters())  # tied lm_head shares the embedding, listed once
    table = hf_tensor_table(cfg)
    names = [name for name, *_ in table]
    missing = sorted(set(hf_params) - set(names))
    extra = sorted(set(names) - set(hf_params))
    if missing or extra:  # our table and this transformers version disagree on the architecture
        raise ValueError(f"to_transformers: HF Qwen3ForCausalLM parameters not in our table: {missing[:5]}; "
                         f"table entries HF does not have: {extra[:5]}")
    with torch.no_grad():
        for name, path, shape, to_hf in table:
            w = np.array(to_hf(_leaf(params, path, name)), np.float32, order="C")  # a writable copy
            target = hf_params[name]
            if tuple(w.shape) != tuple(shape) or tuple(target.shape) != tuple(shape):
                raise ValueError(f"to_transformers: tensor '{name}' (our {'/'.join(map(str, path))}) converts to "
                                 f"shape {list(w.shape)}; expected {list(shape)}, HF has {list(target.shape)}")
            target.copy_(torch.from_numpy(w))
    if cfg.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise AssertionError("to_transformers: tie_word_embeddings=true but HF's lm_head is not the embedding")
    return model.to(getattr(torch, dtype)).eval()


def _check_params_tree(backbone, params) -> None:
    """The params must have exactly the module's tree and shapes (so nothing of ours goes unused)."""
    import jax

    abstract = backbone.abstract_params()
    got, want = jax.tree.structure(params), jax.tree.structure(abstract)
    if got != want:
        raise ValueError(f"to_transformers: params tree does not match the backbone's:\n{got}\nvs\n{want}")
    for (path, leaf), ref in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(abstract)):
        if tuple(np.shape(leaf)) != tuple(ref.shape):
            raise ValueError(f"to_transformers: our param '{jax.tree_util.keystr(path)}' has shape "
                             f"{list(np.shape(leaf))}, the backbone expects {list(ref.shape)}")


# ---------------------------------------------------------------------------------------------------
# Greedy generation
# ---------------------------------------------------------------------------------------------------


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """-> (ids i64[B, P], attention mask i64[B, P]), each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, p in enumerate(prompts):
        if p:
            ids[row, width - len(p):] = p
            mask[row, width - len(p):] = 1
    return ids, mask


def _generation_config(transformers, n: int, compile_mode: str | None):
    kw = dict(do_sample=False, num_beams=1, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
              bos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None,
              cache_implementation="static", return_dict_in_generate=False)
    if compile_mode is None:
        kw["disable_compile"] = True
    else:
        cc = transformers.CompileConfig(mode=compile_mode, dynamic=False, fullgraph=False)
        cc._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
        kw["compile_config"] = cc
    return transformers.GenerationConfig(**kw)


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, *, compiled: bool = False,
                    threads: int | None = None) -> tuple[list[list[int]], float]:
    """Greedy decode of a batch (all prompts in ONE batch, left padding with attention mask so every row
    is exact), exactly max_new_tokens new tokens per row (no eos stop), with a static KV cache.
    compiled=True wraps the forward in torch.compile (mode 'reduce-overhead' or 'default', whichever works on CPU;
    warm-up/compile happens in a first untimed call). Returns (new tokens per prompt, seconds of the timed run)."""
    torch, transformers = _require()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate: needs at least one prompt, each with at least one token")
    if not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
        raise ValueError(f"greedy_generate: 'max_new_tokens' must be a positive integer, got {max_new_tokens!r}")
    vocab = model.config.vocab_size
    bad = [t for p in prompts for t in p if not (0 <= int(t) < vocab)]
    if bad:
        raise ValueError(f"greedy_generate: token ids must lie in [0, {vocab}), got e.g. {bad[:3]}")
    if threads is not None and not (isinstance(threads, int) and threads > 0):
        raise ValueError(f"greedy_generate: 'threads' must be a positive integer or None, got {threads!r}")

    ids, mask = left_pad(prompts)
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    width = ids.shape[1]
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if compiled:
            _forget_compiled(model, torch)
        modes = COMPILE_MODES if compiled else (None,)
        errors = []
        for mode in modes:
            gen_cfg = _generation_config(transformers, max_new_tokens, mode)

            def run():
                with torch.inference_mode():
                    return model.generate(input_ids=ids_t, attention_mask=mask_t, generation_config=gen_cfg)

            try:
                run()  # warm-up: torch.compile compiles here, the static cache is allocated here
            except Exception as err:  # a mode inductor cannot do on this machine: try the next one
                if mode is None:
                    raise
                errors.append(f"{mode}: {type(err).__name__}: {err}")
                _forget_compiled(model, torch)
                continue
            t0 = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - t0
            model.peer_compile_mode = mode  # which torch.compile mode ran (None: eager), for the bench to print
            break
        else:
            raise RuntimeError("greedy_generate: torch.compile failed in every mode: " + " | ".join(errors))
    finally:
        torch.set_num_threads(old_threads)
    new = out[:, width:].cpu().numpy()
    if new.shape != (len(prompts), max_new_tokens):
        raise AssertionError(f"greedy_generate: generate returned {new.shape[1]} new tokens per row, "
                             f"expected {max_new_tokens}")
    return [row.tolist() for row in new], seconds


def _forget_compiled(model, torch) -> None:
    """Drop transformers' cached compiled forward and dynamo's caches: inductor's CPU kernels bake in the
    thread count of the compile, so every compiled run recompiles under its own `threads`."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    torch._dynamo.reset()
