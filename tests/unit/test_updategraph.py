"""The update-rule checker (pure): what it accepts, and hostile rules it refuses, naming why."""

from __future__ import annotations

import base64
import copy
import struct

import pytest

from pdps.core.errors import BadGraph, BadRequest, ConfigError
from pdps.core.updategraph import FORMAT, GraphBudget, Ref, check, digest


def sgd_momentum() -> dict:
    """A hand-written rule: buf = 0.9 * buf + grad; param = param - lr * buf (lr a constant)."""
    lr = base64.b64encode(struct.pack("<d", 0.1)).decode()
    return {
        "format": FORMAT,
        "dtype": "float64",
        "state": [{"name": "buf", "shape": "param", "dtype": "float64"}],
        "first": {
            "inputs": ["param", "grad"],
            "constants": {"lr": {"dtype": "float64", "shape": [], "data": lr}},
            "nodes": [
                {"name": "buf", "op": "clone.default", "args": [{"ref": "grad"}]},
                {"name": "upd", "op": "mul.Tensor", "args": [{"ref": "buf"}, {"ref": "lr"}]},
                {"name": "new", "op": "sub.Tensor", "args": [{"ref": "param"}, {"ref": "upd"}]},
            ],
            "outputs": [{"ref": "new"}, {"ref": "buf"}],
        },
        "step": {
            "inputs": ["param", "grad", "buf"],
            "constants": {"lr": {"dtype": "float64", "shape": [], "data": lr}},
            "nodes": [
                {"name": "b", "op": "add.Tensor", "args": [{"ref": "grad"}, {"ref": "buf"}], "kwargs": {"alpha": 0.9}},
                {"name": "new", "op": "sub.Tensor", "args": [{"ref": "param"}, {"ref": "b"}], "kwargs": {"alpha": 0.1}},
            ],
            "outputs": [{"ref": "new"}, {"ref": "b"}],
        },
    }


def refused(graph: dict, *words: str, budget: GraphBudget = GraphBudget()) -> BadGraph:
    with pytest.raises(BadGraph) as info:
        check(graph, budget)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    return info.value


def test_a_well_formed_rule_is_accepted_with_kinds_and_a_stable_digest():
    rule = check(sgd_momentum())
    assert [s.name for s in rule.state] == ["buf"]
    assert rule.step.kinds["b"] == "param" and rule.first.kinds["lr"] == "scalar"
    assert rule.step.nodes[0].args == (Ref("grad"), Ref("buf"))
    assert rule.digest == digest(copy.deepcopy(sgd_momentum())) == check(sgd_momentum()).digest


def test_bad_graph_is_both_a_bad_request_and_a_config_error():
    assert issubclass(BadGraph, BadRequest) and issubclass(BadGraph, ConfigError)


def test_an_unknown_operator_is_refused_naming_node_and_operator():
    g = sgd_momentum()
    g["step"]["nodes"][0]["op"] = "linalg_vector_norm.default"
    err = refused(g, "'b'", "linalg_vector_norm.default", "element-wise")
    assert err.node == "b" and err.operator == "linalg_vector_norm.default"


@pytest.mark.parametrize("op", ["add_.Tensor", "sum.default", "sort.default", "mm.default", "view.default", "_local_scalar_dense.default", "os.system"])
def test_operators_that_are_not_element_wise_or_write_in_place_are_refused(op):
    g = sgd_momentum()
    g["first"]["nodes"][1]["op"] = op
    refused(g, op, "not allowed")


def test_a_reference_to_a_missing_node_is_refused():
    g = sgd_momentum()
    g["step"]["nodes"][1]["args"][1] = {"ref": "nowhere"}
    refused(g, "'nowhere'", "no input, constant or node defined before it")


def test_a_cycle_is_refused_as_a_forward_reference():
    g = sgd_momentum()
    # b uses new, new uses b
    g["step"]["nodes"][0]["args"][1] = {"ref": "new"}
    refused(g, "node 'b'", "'new'", "cycle")


def test_a_node_using_itself_is_refused():
    g = sgd_momentum()
    g["step"]["nodes"][0]["args"][0] = {"ref": "b"}
    refused(g, "node 'b'", "'b'")


def test_a_name_defined_twice_is_refused():
    g = sgd_momentum()
    g["step"]["nodes"][1]["name"] = "b"
    refused(g, "'b' is taken")


def test_huge_shapes_are_refused_as_too_large():
    g = sgd_momentum()
    g["first"]["nodes"][0] = {"name": "buf", "op": "zeros.default", "args": [[1 << 20, 1 << 20]]}
    refused(g, "too large", "'buf'")
    g = sgd_momentum()
    g["first"]["constants"]["lr"]["shape"] = [1 << 40]
    refused(g, "too large", "'lr'")


def test_a_shape_that_is_not_0d_is_refused():
    g = sgd_momentum()
    g["first"]["nodes"][0] = {"name": "buf", "op": "ones.default", "args": [[3]]}
    refused(g, "not 0-d")


def test_constant_bytes_must_match_dtype_and_shape():
    g = sgd_momentum()
    g["step"]["constants"]["lr"]["data"] = base64.b64encode(b"\0" * 4).decode()
    refused(g, "'lr'", "4 bytes", "make 8")
    g["step"]["constants"]["lr"]["data"] = "not base64!"
    refused(g, "not base64")


@pytest.mark.parametrize("where", ["rule", "state", "constant", "argument"])
def test_unknown_dtypes_are_refused(where):
    g = sgd_momentum()
    if where == "rule":
        g["dtype"] = "object"
    elif where == "state":
        g["state"][0]["dtype"] = "complex128"
    elif where == "constant":
        g["first"]["constants"]["lr"]["dtype"] = "float128"
    else:
        g["first"]["nodes"][0] = {"name": "buf", "op": "_to_copy.default", "args": [{"ref": "grad"}], "kwargs": {"dtype": {"dtype": "str"}}}
    refused(g, "not one of the dtypes")


def test_too_many_nodes_or_constant_bytes_exceed_the_budget():
    g = sgd_momentum()
    g["step"]["nodes"] = [{"name": f"n{i}", "op": "neg.default", "args": [{"ref": "grad"}]} for i in range(20)] + g["step"]["nodes"]
    refused(g, "22 nodes", "budget of 10", budget=GraphBudget(max_nodes=10))
    refused(sgd_momentum(), "budget of 4 bytes", budget=GraphBudget(max_constant_bytes=4))


def test_outputs_must_match_the_parameter_and_its_state():
    g = sgd_momentum()
    g["step"]["outputs"] = [{"ref": "new"}]
    refused(g, "must output 2 values")
    g = sgd_momentum()
    g["step"]["outputs"][0] = {"ref": "lr"}  # a 0-d constant where the parameter goes
    refused(g, "output 0 (the parameter)", "0-d")
    g = sgd_momentum()
    g["state"][0]["shape"] = "scalar"
    refused(g, "state 'buf'", "the parameter's shape", "is 0-d")


def test_inputs_follow_the_convention_and_unknown_keys_are_refused():
    g = sgd_momentum()
    g["step"]["inputs"] = ["param", "grad"]
    refused(g, "takes inputs ['param', 'grad', 'buf']")
    g = sgd_momentum()
    g["step"]["nodes"][0]["kwargs"] = {"device": "cuda"}
    refused(g, "no keyword 'device'")
    g = sgd_momentum()
    g["format"] = "pickle"
    refused(g, "format")
    g = sgd_momentum()
    g["code"] = "import os"
    refused(g, "unknown fields")


@pytest.mark.parametrize("arg", [{"py": "eval"}, [[1]], "x" * 100, float("nan")])
def test_arguments_outside_the_json_vocabulary_are_refused(arg):
    g = sgd_momentum()
    g["step"]["nodes"][0]["args"].append(arg)
    refused(g, "node 'b'")
