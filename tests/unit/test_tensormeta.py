"""The tensor meta codec (seed 002's int64 vector) and the meta caches."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from pdps.core.errors import BadRequest, MetaError, error_classes
from pdps.core.tensormeta import (
    DTYPE_NUMBERS,
    MAX_DIMS,
    MAX_ELEMENTS,
    MAX_TENSORS,
    MAX_VALUES,
    MetaCache,
    ReceivedMetas,
    TensorMeta,
    decode_meta,
    describe,
    encode_meta,
)

#: The seed's own example: two tensors, float32[32, 64] taking gradient, float64[16, 32, 64] not.
SEED_VECTOR = [1, 2, 2, 32, 64, 1, 0, 3, 16, 32, 64, 2, 1]

shapes = st.lists(st.integers(0, 40), max_size=MAX_DIMS).map(tuple).filter(lambda s: math.prod(s) <= MAX_ELEMENTS)
metas_st = st.builds(TensorMeta, shape=shapes, dtype=st.sampled_from(sorted(DTYPE_NUMBERS.values())), stop_gradient=st.booleans())
messages = st.lists(metas_st, min_size=1, max_size=8)


def test_dtype_numbers_are_the_seeds():
    assert dict(DTYPE_NUMBERS) == {"float16": 0, "float32": 1, "float64": 2, "int32": 3, "int64": 4, "bfloat16": 5, "bool": 6}


def test_the_seeds_example_decodes_to_the_seeds_shapes():
    metas, several = decode_meta(SEED_VECTOR)
    assert several is True
    assert metas == (TensorMeta((32, 64), 1, False), TensorMeta((16, 32, 64), 2, True))
    assert [m.nbytes for m in metas] == [32 * 64 * 4, 16 * 32 * 64 * 8]
    assert encode_meta(metas) == SEED_VECTOR
    assert describe(metas) == "float32[32, 64] (takes gradient), float64[16, 32, 64]"


def test_one_tensor_is_type_0_unless_forced():
    m = TensorMeta((3, 4), DTYPE_NUMBERS["bfloat16"], True)
    assert encode_meta([m]) == [0, 2, 3, 4, 5, 1]
    assert encode_meta([m], several=True) == [1, 1, 2, 3, 4, 5, 1]
    assert decode_meta([0, 2, 3, 4, 5, 1]) == ((m,), False)
    assert decode_meta([1, 1, 2, 3, 4, 5, 1]) == ((m,), True)
    assert decode_meta([0, 0, 6, 0]) == ((TensorMeta((), 6, False),), False)  # a scalar: no dimension


@settings(max_examples=200, deadline=None)
@given(messages, st.sampled_from([None, True, False]))
def test_round_trip_for_every_dtype_and_1_to_8_tensors(metas, several):
    if several is False and len(metas) > 1:
        with pytest.raises(MetaError, match="cannot be written as one tensor"):
            encode_meta(metas, several=False)
        return
    vector = encode_meta(metas, several=several)
    assert all(type(v) is int for v in vector)
    expect_several = len(metas) > 1 if several is None else several
    assert vector[0] == int(expect_several)
    assert decode_meta(vector) == (tuple(metas), expect_several)
    assert decode_meta(np.array(vector, dtype=np.int64)) == (tuple(metas), expect_several)  # numpy ints are ints


@settings(max_examples=100, deadline=None)
@given(messages, st.data())
def test_a_truncated_vector_is_refused_where_it_ends(metas, data):
    vector = encode_meta(metas)
    cut = data.draw(st.integers(0, len(vector) - 1))
    with pytest.raises(MetaError, match=rf"ends at position {cut}\b"):
        decode_meta(vector[:cut])


@settings(max_examples=100, deadline=None)
@given(messages, st.lists(st.integers(-5, 5), min_size=1, max_size=4))
def test_values_left_over_are_refused(metas, extra):
    vector = encode_meta(metas)
    with pytest.raises(MetaError, match=rf"{len(extra)} values left over from position {len(vector)} on"):
        decode_meta(vector + extra)


@settings(max_examples=100, deadline=None)
@given(messages, st.data(), st.sampled_from(["3", 1.0, None, True, [1], 2.5]))
def test_a_value_that_is_not_an_int_is_refused_at_its_position(metas, data, bad):
    vector: list = encode_meta(metas)
    pos = data.draw(st.integers(0, len(vector) - 1))
    vector[pos] = bad
    with pytest.raises(MetaError, match=rf"position {pos} holds .*not an int"):
        decode_meta(vector)


@pytest.mark.parametrize(
    "vector, message",
    [
        ([2, 0, 1, 0], r"position 0 \(type\) is 2: 0 \(one tensor\) or 1 \(several\)"),
        ([-1], r"position 0 \(type\) is -1"),
        ([1, 0], r"position 1 \(tensor count\) is 0: 1 to 64"),
        ([1, MAX_TENSORS + 1], rf"position 1 \(tensor count\) is {MAX_TENSORS + 1}: 1 to {MAX_TENSORS}"),
        ([1, -3], r"position 1 \(tensor count\) is -3"),
        ([0, -1, 1, 0], r"position 1 \(tensor 0's shape_len\) is -1: 0 to 8"),
        ([0, MAX_DIMS + 1] + [1] * (MAX_DIMS + 3), rf"position 1 \(tensor 0's shape_len\) is {MAX_DIMS + 1}: 0 to {MAX_DIMS}"),
        ([1, 2, 1, 4, 1, 0, 9, 1, 0], r"position 6 \(tensor 1's shape_len\) is 9"),
        ([0, 2, 4, -1, 1, 0], r"position 3 \(tensor 0's dimension 1\) is -1: dimensions are 0 to"),
        ([0, 1, 1 << 40, 1, 0], r"position 2 \(tensor 0's dimension 0\) is 1099511627776"),
        ([0, 2, 1 << 20, 1 << 20, 1, 0], r"tensor 0's shape \[1048576, 1048576\] \(positions 2 to 3\) has 1099511627776 elements, more than 17179869184"),
        ([0, 1, 4, 7, 0], r"position 3 \(tensor 0's dtype number\) is 7: known are"),
        ([0, 1, 4, -1, 0], r"position 3 \(tensor 0's dtype number\) is -1"),
        ([0, 1, 4, 1, 2], r"position 4 \(tensor 0's stop_gradient\) is 2: 0 or 1"),
        ([1, 2, 0, 1, 1, 0, 6, -1], r"position 7 \(tensor 1's stop_gradient\) is -1"),
        ([], r"ends at position 0, before the type"),
        ([1], r"ends at position 1, before the tensor count"),
        ([1, 2, 1, 4, 1, 0], r"ends at position 6, before tensor 1's shape_len"),
        ([0, 2, 4], r"ends at position 3, before tensor 0's dimension 1"),
        ([0, 1, 4, 1, 0, 0], r"1 values left over from position 5 on"),
        ([0, 1, 4, "1", 0], r"position 3 holds '1' \(str\), not an int"),
        ([0, 1, 4, 1, False], r"position 4 holds False \(bool\), not an int"),
        ([0, 1, 4.0, 1, 0], r"position 2 holds 4.0 \(float\), not an int"),
        ([0] * (MAX_VALUES + 1), rf"{MAX_VALUES + 1} values: a valid one has at most {MAX_VALUES}"),
        ("0,1,4,1,0", r"must be a list of ints, got str"),
        ({"type": 0}, r"must be a list of ints, got dict"),
    ],
)
def test_malformed_vectors_are_refused_naming_the_position(vector, message):
    with pytest.raises(MetaError, match=message) as caught:
        decode_meta(vector)
    assert isinstance(caught.value, BadRequest)


def test_the_largest_valid_vector_decodes():
    metas = [TensorMeta((1,) * MAX_DIMS, 4, True)] * MAX_TENSORS
    vector = encode_meta(metas)
    assert len(vector) == MAX_VALUES
    assert decode_meta(vector) == (tuple(metas), True)
    one = TensorMeta((1 << 17, 1 << 17), 6, True)  # exactly MAX_ELEMENTS
    assert one.numel == MAX_ELEMENTS and decode_meta(encode_meta([one]))[0] == (one,)


@pytest.mark.parametrize(
    "metas, kwargs, message",
    [
        ([], {}, r"0 tensors: a message carries 1 to 64"),
        ([TensorMeta((1,), 1, True)] * (MAX_TENSORS + 1), {}, r"65 tensors"),
        ([TensorMeta((1,), 1, True)] * 2, {"several": False}, r"cannot be written as one tensor"),
        ([TensorMeta((1,) * 9, 1, True)], {}, r"tensor 0 has 9 dimensions"),
        ([TensorMeta((2, -1), 1, True)], {}, r"tensor 0 has shape \[2, -1\]"),
        ([TensorMeta((1 << 20, 1 << 20), 1, True)], {}, r"more than 17179869184"),
        ([TensorMeta((1,), 1, True), TensorMeta((1,), 9, True)], {}, r"tensor 1 has dtype number 9"),
        ([TensorMeta((1,), 1, 1)], {}, r"stop_gradient 1: True or False"),
    ],
)
def test_encode_refuses_what_decode_would(metas, kwargs, message):
    with pytest.raises(MetaError, match=message):
        encode_meta(metas, **kwargs)


def test_meta_cache_sends_each_signature_once_per_peer():
    cache = MetaCache()
    a = cache.signature([TensorMeta((4, 8), 1, False)])
    b = cache.signature([TensorMeta((2, 8), 1, False)])
    assert cache.ident(1, a) == (0, True)
    assert cache.ident(1, a) == (0, False)
    assert cache.ident(1, b) == (1, True)
    assert cache.ident(2, a) == (0, True)  # another peer has not seen it
    cache.forget(1)  # peer 1 restarted: everything travels again, under new ids
    assert cache.ident(1, a) == (2, True)
    cache.forget_id(1, 2)
    assert cache.ident(1, a) == (3, True)
    assert cache.ident(1, a) == (3, False)


def test_meta_cache_starts_a_full_table_over_with_new_ids():
    cache = MetaCache(limit=2)
    sigs = [cache.signature([TensorMeta((n,), 1, True)]) for n in range(3)]
    assert [cache.ident(0, s) for s in sigs] == [(0, True), (1, True), (2, True)]
    assert cache.ident(0, sigs[0]) == (3, True)  # the table started over at sigs[2]
    assert cache.ident(0, sigs[2]) == (2, False)


def test_received_metas_per_sender_incarnation():
    book = ReceivedMetas(limit=2)
    m = (TensorMeta((4,), 1, True),)
    book.learn(0, "s1", 0, m)
    assert book.get(0, "s1", 0) == m
    assert book.get(0, "s1", 1) is None
    assert book.get(1, "s1", 0) is None
    assert book.get(0, "s2", 0) is None  # a restarted sender's id 0 means nothing yet
    book.learn(0, "s2", 0, m)
    assert book.get(0, "s1", 0) is None  # the old incarnation is dropped
    book.learn(0, "s2", 1, m)
    book.learn(0, "s2", 2, m)
    assert book.get(0, "s2", 0) is None and book.get(0, "s2", 2) == m  # keeps the highest ids


def test_meta_error_is_a_bad_request_with_its_own_code():
    assert issubclass(MetaError, BadRequest) and MetaError.code == "meta"
    assert error_classes()["meta"] is MetaError  # what a transport rebuilds it from
