"""TPU pod readiness (lowering only, nothing materialised): the serving programs lower for TPU at
V4.1-Flash size on an 8-chip abstract mesh, experts over `expert` and the batch over `data`; the Pallas
kernels run inside shard_map there and dispatch for the platform lowered for, not the host's."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import lowering
from dspark_jax.kernels import _common
from dspark_jax.kernels.markov_sampler import markov_sample
from dspark_jax.kernels.window_attention import window_attention

MESH = lowering.pod_mesh(data=2, expert=4)
PROGRAMS = {"admit", "spec_round/fixed", "spec_round/sync", "spec_round/async", "plain_round", "catch_up", "evict",
            "propose", "verify_and_accept"}
# Mosaic calls per program with impl "pallas": one window attention per draft layer (3) and the Markov
# sampler's two passes; programs without a draft proposal have none.
KERNEL_CALLS = {"spec_round/fixed": 5, "spec_round/sync": 5, "spec_round/async": 5, "propose": 5}


@pytest.fixture(scope="module", params=["pallas", "xla"])
def lowered(request):
    return request.param, lowering.lower_serving_programs(lowering.flash_pair(request.param), MESH, platform="tpu")


def test_every_serving_program_lowers_for_an_8_chip_tpu_mesh(lowered):
    impl, out = lowered
    assert set(out) == PROGRAMS
    for name, exp in out.items():
        assert exp.platforms == ("tpu",) and exp.nr_devices == 8, name
        text = exp.mlir_module()
        want = KERNEL_CALLS.get(name, 0) if impl == "pallas" else 0
        assert text.count("tpu_custom_call") == want, (impl, name)
        if want:  # each kernel inside a manual (shard_map) region, not left to the partitioner
            assert "sdy.manual_computation" in text or "SPMDFullToShardShape" in text, name


def test_flash_draft_parameters_are_sharded_as_the_engine_places_them():
    pair = lowering.flash_pair("xla")
    weights = lowering.sharded_weights(pair, MESH)
    flat = jax.tree_util.tree_flatten_with_path(weights.draft)[0]
    experts = [(p, x) for p, x in flat if "experts" in jax.tree_util.keystr(p)]
    assert len(experts) == 3 * 3  # w1, w3, w2 of 3 stages
    for path, x in experts:
        assert x.shape[0] == 128 and x.sharding.spec[0] == "expert", jax.tree_util.keystr(path)
        assert x.sharding.shard_shape(x.shape)[0] == 32
    state = lowering.sharded_state(pair, MESH)
    assert state.slots.seeds.sharding.shard_shape((8,)) == (4,)  # slots over data=2


def test_dispatch_follows_the_platform_in_the_impl_not_the_host():
    assert jax.default_backend() == "cpu"
    assert _common.for_platform("pallas", "tpu") == "pallas@tpu"
    assert _common.resolve_impl("pallas@tpu", name="k", supported=True) == ("pallas", False)
    assert _common.resolve_impl("auto@tpu", name="k", supported=True) == ("pallas", False)
    assert _common.resolve_impl("auto@tpu", name="k", supported=False) == ("xla", False)
    assert _common.resolve_impl("pallas", name="k", supported=True) == ("pallas", True)  # the host: CPU
    assert _common.resolve_impl("auto", name="k", supported=True) == ("xla", False)
    assert _common.resolve_impl("pallas@cpu", name="k", supported=True) == ("pallas", True)
    with pytest.raises(ValueError, match="unknown platform 'tpuu'"):
        _common.resolve_impl("pallas@tpuu", name="k", supported=True)
    with pytest.raises(ValueError, match="'impl' must be one of"):
        _common.resolve_impl("mosaic", name="k", supported=True)


def _attention_inputs(b=4, k=3, h=4, hd=128, w=16):
    ks = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(ks[0], (b, k, h, hd)), jax.random.normal(ks[1], (b, w, hd)),
            jnp.array([3, 16, 20, 1][:b], jnp.int32), jax.random.normal(ks[2], (b, k, hd)),
            jax.random.normal(ks[3], (h,)))


def _sampler_inputs(b=4, k=3, v=300, r=16):
    ks = jax.random.split(jax.random.key(1), 4)
    return (jax.random.normal(ks[0], (b, k, v)), jnp.arange(1, b + 1, dtype=jnp.int32),
            0.1 * jax.random.normal(ks[1], (v, r)), 0.1 * jax.random.normal(ks[2], (v, r)),
            jnp.array([0.0, 1.0, 0.5, 1.0][:b]), jax.random.gumbel(ks[3], (b, k, v)))


def test_kernels_under_a_real_mesh_run_per_device_and_match_the_reference():
    """On 8 CPU devices (data 2 x fsdp 2 x tensor 2) the interpreted kernels run inside shard_map (batch
    over data x fsdp, heads over tensor) and give the reference's values."""
    from dspark_jax.parallel import make_mesh

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    attn = lambda impl: (lambda *a: window_attention(*a, scale=0.1, impl=impl))  # noqa: E731
    samp = lambda impl: (lambda *a: markov_sample(*a, impl=impl))  # noqa: E731
    a_in, s_in = _attention_inputs(), _sampler_inputs()
    want_a, want_s = attn("xla")(*a_in), samp("xla")(*s_in)
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(attn("pallas"))(*a_in))
        got_a = jax.jit(attn("pallas"))(*a_in)
        got_s = jax.jit(samp("pallas"))(*s_in)
    np.testing.assert_allclose(np.asarray(got_a), np.asarray(want_a), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_s[0]), np.asarray(want_s[0]))  # tokens
    for got, want in zip(got_s[1:], want_s[1:]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_batch_the_mesh_does_not_divide_is_split_where_it_can_be():
    mesh = lowering.pod_mesh(data=2, fsdp=4)
    assert _common._divisible_axes(mesh, ("data", "fsdp"), 16) == ("data", "fsdp")
    assert _common._divisible_axes(mesh, ("data", "fsdp"), 4) == ("data",)
    assert _common._divisible_axes(mesh, ("data", "fsdp"), 3) == ()


def _main_signature(exported) -> str:
    return next(line for line in exported.mlir_module().splitlines() if "func.func public @main" in line)


def test_lowered_programs_carry_the_mesh_shardings_of_their_arguments(lowered):
    """The round's arguments arrive sharded: the draft's experts over `expert`, the slots over `data`."""
    _, out = lowered
    sig = _main_signature(out["spec_round/async"])
    assert re.search(r'tensor<128x5120x2304xbf16> \{sdy.sharding = #sdy.sharding<@mesh, \[\{"expert"\}, \{\}, \{\}\]>\} '
                     r'loc\("weights.draft\[.blocks_0.\]\[.ffn.\]\[.experts.\]\[.w1.\]"\)', sig)
    assert re.search(r'tensor<8xui32> \{jax.buffer_donor = true, sdy.sharding = #sdy.sharding<@mesh, \[\{"data"\}\]>\} '
                     r'loc\("state.slots.seeds"\)', sig)  # the slots over data, and the state donated


def test_without_shard_map_the_kernels_do_not_partition(monkeypatch):
    """Why the kernels run inside shard_map: left to the partitioner, Mosaic refuses."""
    from dspark_jax.kernels import markov_sampler, window_attention as wa_module

    def direct(kernel, args, *_, **__):
        return kernel(*args)

    monkeypatch.setattr(wa_module, "shard_kernel", direct)
    monkeypatch.setattr(markov_sampler, "shard_kernel", direct)
    with pytest.raises(NotImplementedError, match="Mosaic kernels cannot be automatically partitioned"):
        lowering.lower_serving_programs(lowering.flash_pair("pallas"), MESH, platform="tpu", only={"propose"})


def test_round_outputs_are_replicated_for_every_host(lowered):
    """The Delta a program returns (7 leaves: tokens, counts, confidences, capacity) is constrained to
    be replicated, so each host of a multi-host slice can read it whole."""
    _, out = lowered
    for name, leaves in (("spec_round/async", 7), ("plain_round", 7), ("admit", 6)):  # admit's capacity: a constant
        replicated = re.findall(r"sdy.sharding_constraint %\S+ <@mesh, \[(?:\{\}(?:, )?)+\]>", out[name].mlir_module())
        assert len(replicated) >= leaves, name


def test_memory_bench_counts_checkpoint_and_per_chip_bytes():
    """`dspark bench memory`'s accounting at V4.1-Flash size: the official checkpoint's draft tensors
    (SPEC 3: ~7.9 GB), the packed tree within 1.1x of them, the dequantised one ~3.6x, and a chip's share
    of the experts on expert=4."""
    from dspark_jax.bench import memory
    from dspark_jax.checkpoint import v41
    from dspark_jax.nn.packed import nbytes

    cfg = lowering.flash_config()
    ckpt = memory.checkpoint_bytes(cfg)
    assert 7.8e9 < ckpt < 8.0e9
    packed = lowering.flash_pair("xla", draft_params=v41.abstract_packed_params(cfg))
    plain = lowering.flash_pair("xla")
    packed_bytes, plain_bytes = (nbytes(p.weights.draft) for p in (packed, plain))
    assert packed_bytes <= 1.1 * ckpt and 3.4 < plain_bytes / ckpt < 3.8
    per_chip = memory.tree_bytes_per_chip(lowering.sharded_weights(packed, MESH).draft)
    assert packed_bytes / 4 < per_chip < packed_bytes / 2  # the experts (most bytes) split 4 ways
