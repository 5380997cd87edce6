"""The roofline's measuring instrument (dspark_jax.bench.hlo_cost): matmul flops and bytes of compiled XLA:CPU
programs, loops counted their trip count times (XLA's cost_analysis counts a loop body once), attributed to
the Python functions that produced them; equal to cost_analysis on programs without loops."""

import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.bench import hlo_cost
from dspark_jax.bench.hlo_cost import analyze, shape_bytes, top_sources

HERE = Path(__file__).resolve()


def _compile(f, *args):
    return jax.jit(f).lower(*args).compile()


def _xla(compiled) -> dict:
    """cost_analysis() as one dict (older jax returned a list of one dict per program)."""
    ca = compiled.cost_analysis()
    return ca[0] if isinstance(ca, (list, tuple)) else ca


def _matmul_flops(m, k, n):
    return 2 * m * k * n


# Module-level helpers for the attribution tests: their names must show up in the labels.
def big_matmul(x, w):
    return x @ w


def small_matmul(x, w):
    return x @ w


def two_matmuls(x, w_big, w_small):
    return jnp.sum(big_matmul(x, w_big)) + jnp.sum(small_matmul(x, w_small))


# ------------------------------------------------------------------------------------- flops

def test_single_matmul_flops_exact_and_equal_to_xla():
    m, k, n = 16, 32, 24
    c = _compile(lambda a, b: a @ b, jnp.ones((m, k)), jnp.ones((k, n)))
    cost = analyze(c.as_text())
    assert cost.flops == _matmul_flops(m, k, n)
    # XLA's "flops" adds elementwise work; this program has none, so the two counts are comparable as a whole.
    assert cost.elementwise_flops == 0
    assert _xla(c)["flops"] == cost.flops
    assert cost.unknown_trip_loops == 0


def test_scan_multiplies_the_body_by_its_trip_count():
    m, k = 8, 64
    f = lambda w, x: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=7)[0]  # noqa: E731
    c = _compile(f, jnp.ones((k, k), jnp.bfloat16), jnp.ones((m, k), jnp.bfloat16))
    cost = analyze(c.as_text())
    one = _matmul_flops(m, k, k)
    assert cost.flops == 7 * one
    assert cost.transcendentals == 7 * m * k  # the tanh, once per step
    xla = _xla(c)
    # why this module exists: XLA counts the loop body once (its flops are one matmul plus a few converts)
    assert one <= xla["flops"] < 2 * one
    assert xla["transcendentals"] == m * k


def test_nested_scans_multiply():
    m, k = 4, 16

    def nested(w, x):
        def outer(c, _):
            def inner(c2, _):
                return jnp.tanh(c2 @ w), None
            return jax.lax.scan(inner, c, None, length=5)[0], None
        return jax.lax.scan(outer, x, None, length=3)[0]

    c = _compile(nested, jnp.ones((k, k)), jnp.ones((m, k)))
    cost = analyze(c.as_text())
    assert cost.flops == 15 * _matmul_flops(m, k, k)
    assert _xla(c)["flops"] < 2 * _matmul_flops(m, k, k)


def test_trip_count_derived_from_the_condition_when_xla_does_not_state_it():
    m, k = 8, 32
    f = lambda w, x: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=7)[0]  # noqa: E731
    text = _compile(f, jnp.ones((k, k)), jnp.ones((m, k))).as_text()
    stripped = re.sub(r',"known_trip_count":\{"n":"\d+"\}', "", text)
    assert stripped != text and "known_trip_count" not in stripped
    derived = analyze(stripped)
    assert derived.flops == 7 * _matmul_flops(m, k, k)
    assert derived.unknown_trip_loops == 0
    # a condition it cannot read (i != 7): the body counts once and the loop is reported
    unknown = analyze(stripped.replace("direction=LT", "direction=NE"))
    assert unknown.flops == _matmul_flops(m, k, k)
    assert unknown.unknown_trip_loops == 1


def test_dynamic_trip_count_is_reported_unknown():
    f = lambda w, x, n: jax.lax.fori_loop(0, n, lambda i, c: c @ w, x)  # noqa: E731
    cost = analyze(_compile(f, jnp.ones((16, 16)), jnp.ones((4, 16)), 5).as_text())
    assert cost.unknown_trip_loops == 1
    assert cost.flops == _matmul_flops(4, 16, 16)


def test_convolution_flops_equal_xla_padding_and_strides_included():
    for stride, padding, dil in (((1, 1), "VALID", (1, 1)), ((2, 2), "SAME", (2, 1))):
        f = lambda x, k: jax.lax.conv_general_dilated(x, k, stride, padding, rhs_dilation=dil)  # noqa: B023,E731
        c = _compile(f, jnp.ones((2, 3, 11, 10)), jnp.ones((4, 3, 3, 3)))
        cost = analyze(c.as_text())
        assert cost.flops > 0
        assert cost.flops + cost.elementwise_flops == _xla(c)["flops"]
    # VALID, stride 1: 2 x output elements x kernel taps per output feature
    c = _compile(lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "VALID"),
                 jnp.ones((2, 3, 10, 10)), jnp.ones((4, 3, 3, 3)))
    assert analyze(c.as_text()).flops == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)


def test_conditional_counts_the_most_expensive_branch():
    def f(p, x, w):
        return jax.lax.cond(p, lambda x: x @ w, lambda x: jnp.sum(x) * x[:, :16], x)

    cost = analyze(_compile(f, True, jnp.ones((8, 32)), jnp.ones((32, 16))).as_text())
    assert cost.flops == _matmul_flops(8, 32, 16)


# ------------------------------------------------------------------------------------- bytes

def test_plain_matmul_bytes_are_operands_plus_result():
    m, k, n = 16, 32, 24
    c = _compile(lambda a, b: a @ b, jnp.ones((m, k)), jnp.ones((k, n)))
    cost = analyze(c.as_text())
    assert cost.bytes == 4 * (m * k + k * n + m * n)
    assert cost.bytes == _xla(c)["bytes accessed"]


@pytest.mark.parametrize("name", ["mlp", "dynamic_slice", "dynamic_update_slice", "scatter", "argmax"])
def test_equal_to_xla_on_programs_without_loops(name):
    """Loop-free, tuple-free programs: XLA's own rules (fusion boundaries, slices read what they output,
    in-place updates write the update), so bytes, flops and transcendentals equal cost_analysis()."""
    big = jnp.ones((1000, 256))
    programs = {
        "mlp": (lambda a, b: jnp.sum(jnp.tanh(a @ b).astype(jnp.bfloat16), axis=1),
                jnp.ones((16, 32)), jnp.ones((32, 24))),
        "dynamic_slice": (lambda a, i: jax.lax.dynamic_slice_in_dim(a, i, 1, 0) * 2, big, 3),
        "dynamic_update_slice": (lambda a, u, i: jax.lax.dynamic_update_slice_in_dim(a, u, i, 0),
                                 big, jnp.ones((1, 256)), 3),
        "scatter": (lambda a, i, u: a.at[i].add(u), big, jnp.arange(5), jnp.ones((5, 256))),
        "argmax": (lambda a: jnp.argmax(a, axis=1), jnp.ones((64, 256))),
    }
    f, *args = programs[name]
    c = _compile(f, *args)
    cost, xla = analyze(c.as_text()), _xla(c)
    assert cost.bytes == xla["bytes accessed"]
    assert cost.flops + cost.elementwise_flops == xla["flops"]
    assert cost.transcendentals == xla.get("transcendentals", 0.0)


@pytest.mark.parametrize("view", [False, True])
def test_a_fused_gather_reads_the_rows_it_gathers_not_its_whole_operand(view):
    """Our one departure from XLA's byte rules that changes a measured program: XLA charges a fusion the
    whole operand of a gather inside it (here 1 MB for 5 rows of 1 KB); the rows are what is read. Also
    through a same-width view (bf16 read as uint16, as the MoE reads its expert stacks)."""
    big = jnp.ones((1000, 256), jnp.bfloat16 if view else jnp.float32)

    def f(a, i):
        if view:
            bits = jax.lax.bitcast_convert_type(a, jnp.uint16)[i]
            return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32) * 2
        return a[i] * 2

    c = _compile(f, big, jnp.arange(5))
    cost, xla = analyze(c.as_text()), _xla(c)
    rows = 5 * 256 * big.dtype.itemsize
    assert cost.bytes == rows + 5 * 256 * 4 + 5 * 4  # the rows read, the f32 output written, the indices
    assert xla["bytes accessed"] > 100 * rows  # XLA: the whole [1000, 256] operand


def test_dynamic_slice_in_a_loop_reads_the_row_not_the_array():
    rows, width, steps = 1000, 256, 10
    row, array = width * 4, rows * width * 4

    def f(big):
        def body(c, i):
            return c + jax.lax.dynamic_slice_in_dim(big, i, 1, 0)[0], None
        return jax.lax.scan(body, jnp.zeros(width), jnp.arange(steps))[0]

    c = _compile(f, jnp.ones((rows, width)))
    cost = analyze(c.as_text())
    # every step reads one row and the carry and writes the carry: at least 3 rows a step ...
    assert cost.bytes >= steps * 3 * row
    # ... and nowhere near the whole array a step (which would be >= 10 MB)
    assert cost.bytes < array / 10
    # XLA's figure is one step's
    assert _xla(c)["bytes accessed"] < cost.bytes / 5


def test_dynamic_update_slice_in_a_loop_writes_the_row_not_the_array():
    rows, width, steps = 1000, 256, 10

    def f(buf, x):
        def body(b, i):
            return jax.lax.dynamic_update_slice_in_dim(b, (x * i)[None], i, 0), None
        return jax.lax.scan(body, buf, jnp.arange(steps))[0]

    cost = analyze(_compile(f, jnp.zeros((rows, width)), jnp.ones(width)).as_text())
    # the loop body's writes (labelled `body`): the row read and written each step, not the whole array
    (loop,) = [b for label, (_, b) in cost.by_source.items() if label.endswith(".<locals>.body")]
    assert steps * 2 * width * 4 <= loop < rows * width * 4 / 10
    # outside the loop, the one copy of the argument (not donated) into the loop's buffer: read + write
    assert cost.bytes - loop < 2 * rows * width * 4 + 1000


# ------------------------------------------------------------------------------------- attribution

def _check_two_matmuls(cost, big_label, small_label, m, k, nb, ns):
    assert cost.by_source[big_label][0] == _matmul_flops(m, k, nb)
    assert cost.by_source[small_label][0] == _matmul_flops(m, k, ns)
    # the dots' fusions carry the helpers' labels, so their operand and result bytes go there too
    assert cost.by_source[big_label][1] >= 4 * (m * k + k * nb + m * nb)
    assert cost.flops == sum(f for f, _ in cost.by_source.values())
    assert cost.bytes == sum(b for _, b in cost.by_source.values())


def test_by_source_names_the_helper_functions():
    m, k, nb, ns = 8, 64, 256, 16
    c = _compile(two_matmuls, jnp.ones((m, k)), jnp.ones((k, nb)), jnp.ones((k, ns)))
    cost = analyze(c.as_text())
    big, small = "test_hlo_cost.py:big_matmul", "test_hlo_cost.py:small_matmul"
    _check_two_matmuls(cost, big, small, m, k, nb, ns)
    top = top_sources(cost, n=5, key="flops")
    assert [label for label, _, _ in top] == [big, small]
    assert top[0][1] == _matmul_flops(m, k, nb)
    assert top[0][2] == pytest.approx(nb / (nb + ns))
    assert sum(share for _, _, share in top) == pytest.approx(1.0)
    by_bytes = top_sources(cost, n=1, key="bytes")
    assert len(by_bytes) == 1 and by_bytes[0][0] == big
    # paths relative to source_root
    rooted = analyze(c.as_text(), source_root=str(HERE.parents[1]))
    assert rooted.by_source[f"bench{os.sep}test_hlo_cost.py:big_matmul"] == cost.by_source[big]
    with pytest.raises(ValueError):
        top_sources(cost, key="time")


def test_by_source_without_full_tracebacks_reads_the_function_from_the_file():
    """With jax_include_full_tracebacks_in_locations off the recorded function name is a scope ("jit(..)"),
    not the Python function: the label still names the helpers, read from the source file."""
    m, k, nb, ns = 8, 32, 64, 16
    before = jax.config.jax_include_full_tracebacks_in_locations
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    try:
        text = _compile(lambda x, a, b: two_matmuls(x, a, b) * 2,
                        jnp.ones((m, k)), jnp.ones((k, nb)), jnp.ones((k, ns))).as_text()
    finally:
        jax.config.update("jax_include_full_tracebacks_in_locations", before)
    assert '"jit(' in text.split("FileLocations")[0]  # the recorded names are scopes here
    cost = analyze(text)
    _check_two_matmuls(cost, "test_hlo_cost.py:big_matmul", "test_hlo_cost.py:small_matmul", m, k, nb, ns)


def test_nested_functions_are_labelled_with_their_qualified_name():
    f = lambda w, x: jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=3)[0]  # noqa: E731
    cost = analyze(_compile(f, jnp.ones((16, 16)), jnp.ones((4, 16))).as_text())
    label = ("test_hlo_cost.py:test_nested_functions_are_labelled_with_their_qualified_name"
             ".<locals>.<lambda>.<locals>.<lambda>")
    assert cost.by_source[label][0] == 3 * _matmul_flops(4, 16, 16)


# ------------------------------------------------------------------------------------- text format

_OLD_FORMAT = """HloModule m, entry_computation_layout={(f32[4,8]{1,0}, f32[8,2]{1,0})->f32[4,2]{1,0}}

ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0), metadata={op_name="a"}
  %b = f32[8,2]{1,0} parameter(1)
  %dot.1 = f32[4,2]{1,0} dot(f32[4,8]{1,0} %a, f32[8,2]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general" source_file="FILE" source_line=LINE}
  %copy.1 = f32[4,2]{1,0} copy(f32[4,2]{1,0} %dot.1), metadata={op_name="jit(f)/copy" source_file="/nonexistent/dir/model.py" source_line=12}
  ROOT %copy.2 = f32[4,2]{1,0} copy(f32[4,2]{1,0} %copy.1)
}
"""


def test_source_file_metadata_and_fallbacks():
    """Older jax writes source_file / source_line (and operand types inline); a file that cannot be read
    gives file:line; no source at all gives "(no source)"."""
    line = big_matmul.__code__.co_firstlineno + 1
    cost = analyze(_OLD_FORMAT.replace("FILE", str(HERE)).replace("LINE", str(line)))
    assert cost.flops == 2 * 4 * 8 * 2
    assert cost.by_source == {
        "test_hlo_cost.py:big_matmul": (2 * 4 * 8 * 2, 4 * (32 + 16 + 8)),
        "model.py:12": (0.0, 2 * 4 * 8),
        hlo_cost.NO_SOURCE: (0.0, 2 * 4 * 8),
    }


_TUPLE_TYPES = """HloModule m

FileNames
1 "<string>"

FunctionNames
1 "quantize"

FileLocations
1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=4 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main (p0: f4e2m1fn[64,32], p1: f8e4m3fn[16]) -> (f32[2], s32[], pred[3], bf16[4,4], u8[5], f4e2m1fn[64,32], f8e8m0fnu[8]) {
  %p0 = f4e2m1fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[16]{0} parameter(1)
  ROOT %cc = (f32[2]{0}, s32[], pred[3]{0}, bf16[4,4]{1,0}, u8[5]{0}, /*index=5*/f4e2m1fn[64,32]{1,0}, f8e8m0fnu[8]{0}) custom-call(%p0, %p1), custom_call_target="quant", metadata={op_name="quantize" stack_frame_id=1}
}
"""


def test_tuple_types_with_index_comments_and_narrow_floats():
    assert shape_bytes("f4e2m1fn[64,32]{1,0}") == 64 * 32 // 2
    assert shape_bytes("f8e4m3fn[16]{0}") == 16
    assert shape_bytes("f4e2m1fn[3]") == 2  # sub-byte arrays round up
    assert shape_bytes("bf16[128,5120,2304]{2,1,0}") == 2 * 128 * 5120 * 2304
    assert shape_bytes("f32[]") == 4
    assert shape_bytes("(f32[2], s32[])") == 12
    out = 8 + 4 + 3 + 32 + 5 + 64 * 32 // 2 + 8
    assert shape_bytes("(f32[2]{0}, s32[], pred[3]{0}, bf16[4,4]{1,0}, u8[5]{0}, /*index=5*/f4e2m1fn[64,32]{1,0}, "
                       "f8e8m0fnu[8]{0})") == out
    with pytest.raises(ValueError):
        shape_bytes("q7[3]")
    cost = analyze(_TUPLE_TYPES)
    # a custom-call moves its operands and its results (XLA reports it as unknown, -1); the file "<string>"
    # cannot be read, so the label takes the recorded function name
    assert cost.bytes == 64 * 32 // 2 + 16 + out
    assert cost.by_source == {"<string>:quantize": (0.0, cost.bytes)}


_UNFUSED_SLICES = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (t: (s32[], f32[1000,256])) -> (s32[], f32[1000,256]) {
  %t = (s32[], f32[1000,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %a = f32[1000,256]{1,0} get-tuple-element(%t), index=1
  %z = s32[] constant(0)
  %row = f32[1,256]{1,0} dynamic-slice(%a, %i, %z), dynamic_slice_sizes={1,256}
  %row2 = f32[1,256]{1,0} multiply(%row, %row)
  %a2 = f32[1000,256]{1,0} dynamic-update-slice(%a, %row2, %i, %z)
  %idx = s32[5,1]{1,0} broadcast(%i), dimensions={}
  %upd = f32[5,256]{1,0} broadcast(%row2), dimensions={}
  %a3 = f32[1000,256]{1,0} scatter(%a2, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[1000,256]{1,0}) tuple(%i2, %a3)
}

%cond (t: (s32[], f32[1000,256])) -> pred[] {
  %t = (s32[], f32[1000,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p: f32[1000,256]) -> f32[1000,256] {
  %p = f32[1000,256]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1000,256]{1,0}) tuple(%zero, %p)
  %w = (s32[], f32[1000,256]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1000,256]{1,0} get-tuple-element(%w), index=1
}
"""


def test_unfused_slices_and_updates_touch_only_the_slice():
    """XLA:CPU wraps every slice in a fusion; the rules for bare instructions (XLA's HandleDynamicSlice,
    HandleDynamicUpdateSlice, HandleScatter), and a trip count read from a bare compare, on hand-written HLO."""
    row = 256 * 4
    step = (
        2 * row + 4  # dynamic-slice: the row read and written, one index
        + 3 * row  # multiply: two operands, one result
        + 2 * row + 4  # dynamic-update-slice: the update read and written, one index
        + 5 * 4 + 4  # broadcast of the index
        + 5 * row + row  # broadcast of the row
        + 3 * 5 * row + 5 * 4  # scatter: updates x 3, indices
        + 3 * 4  # add
    )
    cost = analyze(_UNFUSED_SLICES)
    assert cost.unknown_trip_loops == 0
    assert cost.bytes == 4 * step + 5 * (4 + 4 + 1)  # the condition's compare runs 5 times
    assert cost.by_source == {hlo_cost.NO_SOURCE: (0.0, cost.bytes)}
