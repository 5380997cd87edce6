"""The request boundary (serve/request_check.py): every bad field is refused with its name, good values
are normalised so nothing after submit can overflow or consume them (top_k 2**40, a numpy prompt)."""

import numpy as np
import pytest

from dspark_jax.serve.request_check import Request, RequestError, check_request, choose_coupling

VOCAB, MAXLEN = 100, 64


def _check(**kw):
    return check_request(Request(**{"prompt": [1, 2, 3], **kw}), vocab=VOCAB, max_len=MAXLEN, max_stop_tokens=4)


BAD = [  # (fields, the field the error must name)
    ({"prompt": []}, "prompt"),
    ({"prompt": "hello"}, "prompt"),
    ({"prompt": (t for t in [1, 2])}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": [1, 2.0]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": list(range(1, 64))}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"coupling": "exact"}, "coupling"),
    ({"coupling": None}, "coupling"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1e10}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2 ** 32}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"stop_tokens": [1, 2, 3, 4, 5]}, "stop_tokens"),
    ({"stop_tokens": [VOCAB]}, "stop_tokens"),
    ({"stop_tokens": 7}, "stop_tokens"),
]


@pytest.mark.parametrize("fields,name", BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_a_bad_field_is_refused_naming_it(fields, name):
    with pytest.raises(RequestError, match=f"request '{name}'") as info:
        _check(**fields)
    assert info.value.field == name


def test_not_a_request_is_refused():
    with pytest.raises(RequestError, match="expected a dspark_jax.serve.engine.Request, got dict"):
        check_request({"prompt": [1]}, vocab=VOCAB, max_len=MAXLEN, max_stop_tokens=4)


def test_good_values_are_normalised_to_what_the_device_rows_hold():
    got = _check(prompt=np.array([4, 5], np.int64), top_k=2 ** 40, max_tokens=2 ** 40, seed=np.uint32(7),
                 temperature=np.float32(0.5), stop_tokens=[np.int32(3)], id="x")
    assert got.prompt == (4, 5) and all(type(t) is int for t in got.prompt)
    assert got.top_k == 0  # k >= vocab keeps every token: the same as off
    assert got.max_tokens == MAXLEN  # no request emits more than the cache holds
    assert got.seed == 7 and type(got.seed) is int and got.temperature == 0.5 and type(got.temperature) is float
    assert got.stop_tokens == (3,) and got.id == "x"
    assert _check(top_k=VOCAB - 1).top_k == VOCAB - 1


# One prompts-JSONL line (`prompt_record`, shared by `dspark generate` and evaluation.read_prompts).
from dspark_jax.errors import UserError  # noqa: E402
from dspark_jax.serve.request_check import PROMPT_LINE_KEYS, prompt_record  # noqa: E402

BAD_LINES = [  # (raw line, what the message must say)
    (b'{"prompt": "\xff"}', "not UTF-8 text (byte 12)"),
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"id": 1}', "expected a 'prompt' (text) or 'tokens' (ids) field"),
    ('{"tokens": [1], "prompt": "x"}', "give 'tokens' or 'prompt', not both"),
    ('{"tokens": "1 2"}', "'tokens': expected a list"),
    ('{"prompt": 5}', "'prompt': expected a string"),
    ('{"tokens": [1], "temprature": 1.0}', "unknown key 'temprature' (did you mean 'temperature'?)"),
]


@pytest.mark.parametrize("raw,needle", BAD_LINES, ids=[n.split(" (")[0][:24] for _, n in BAD_LINES])
def test_a_bad_prompt_line_says_what_is_wrong(raw, needle):
    with pytest.raises(UserError) as info:
        prompt_record(raw, PROMPT_LINE_KEYS)
    assert needle in str(info.value)


def test_good_prompt_lines_and_metadata_keys():
    assert prompt_record("  \n", PROMPT_LINE_KEYS) is None
    assert prompt_record(b'{"tokens": [1, 2], "stop": [3]}', PROMPT_LINE_KEYS) == {"tokens": [1, 2], "stop": [3]}
    # Without `keys` (the held-out prompt files) other keys are metadata, kept as they are.
    assert prompt_record('{"prompt": "def f():", "path": "a.py"}') == {"prompt": "def f():", "path": "a.py"}


def test_the_python_api_refuses_a_misspelled_field_too():
    # The Request dataclass is the API's counterpart of a prompt line's keys: a typo is an error there as well.
    with pytest.raises(TypeError, match="temprature"):
        Request(prompt=[1, 2], temprature=1.0)


def test_auto_coupling_gives_seeded_requests_the_invariant_one():
    assert choose_coupling("auto", seeded=True) == "invariant"
    assert choose_coupling("auto", seeded=False) == "optimal"
    for setting in ("invariant", "optimal"):
        assert choose_coupling(setting, seeded=True) == choose_coupling(setting, seeded=False) == setting
    with pytest.raises(ValueError, match="coupling.*'exact'"):
        choose_coupling("exact", seeded=True)
