"""A real pserver over grpc://, fed well-framed but hostile pushes.

``test_grpc_fuzz.py`` attacks the framing; this attacks what a frame may say. The
pserver (real ``Pserver``, real ``GrpcTransport`` with a token, initialized by a real
trainer's ``attach``) gets pushes derived from a valid one by hypothesis-chosen
mutations — a tensor dropped or added, a shape, dtype or value changed (NaN, inf),
blocks renamed, reordered or missing, meta fields absent or of the wrong type, calls
to pserver methods that do not exist. Each is refused with a clear error, the
pserver keeps serving, and its parameters are bit-for-bit unchanged; the valid push
itself changes them (so the test can fail).
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdps
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.core.errors import PdpsError
from pdps.ports.transport import Message
from tests.integration.jobkit import grpc_pserver, pull, valid_push

pytestmark = pytest.mark.integration

TOKEN = "hostile"
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def job():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with grpc_pserver(model, token=TOKEN, name="hostile", optimizer="SGD", optimizer_args={"lr": 0.1}, min_block=16) as served:
        yield served


def bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.int32) for t in tensors]


MUTATIONS = [
    "drop_tensor", "extra_tensor", "shape", "dtype", "nan", "inf", "rename_block", "reorder_blocks", "drop_block_name",
    "no_blocks", "blocks_not_a_list", "no_trainer", "version_text", "no_version", "future_version", "negative_version",
    "unknown_method", "version_as_text", "samples_negative", "samples_text",
]  # fmt: skip


def mutate(kind: str, meta: dict, grads: list[torch.Tensor], where: int) -> tuple[str, dict, list[torch.Tensor]]:
    meta, grads = dict(meta), list(grads)
    i = where % len(grads)
    if kind == "drop_tensor":
        del grads[i]
    elif kind == "extra_tensor":
        grads.insert(i, torch.zeros(3))
    elif kind == "shape":
        grads[i] = torch.zeros(grads[i].numel() + 1)
    elif kind == "dtype":
        grads[i] = grads[i].to(torch.float64)
    elif kind in ("nan", "inf"):
        grads[i] = grads[i].clone()
        grads[i].view(-1)[where % grads[i].numel()] = float(kind)
    elif kind == "rename_block":
        meta["blocks"] = [*meta["blocks"]]
        meta["blocks"][i % len(meta["blocks"])] = "no.such.param@0"
    elif kind == "reorder_blocks":
        meta["blocks"] = list(reversed(meta["blocks"]))
    elif kind == "drop_block_name":
        meta["blocks"] = meta["blocks"][:-1]
    elif kind == "no_blocks":
        del meta["blocks"]
    elif kind == "blocks_not_a_list":
        meta["blocks"] = "everything"
    elif kind == "no_trainer":
        del meta["trainer"]
    elif kind == "version_text":
        meta["updates"] = "latest"
    elif kind == "no_version":
        del meta["updates"]
    elif kind == "future_version":
        meta["updates"] += 1 + where  # no pserver served it: the push is not from this job's past
    elif kind == "negative_version":
        meta["updates"] = -1 - where
    elif kind == "version_as_text":
        meta["updates"] = str(meta["updates"])
    elif kind == "samples_negative":
        meta["samples"] = -1 - where
    elif kind == "samples_text":
        meta["samples"] = "64"
    elif kind == "unknown_method":
        return "apply_directly", meta, grads
    return "push", meta, grads


def test_the_valid_push_changes_the_parameters(job):
    ps, channel, part = job
    assert len(part.blocks) >= 2  # the mutations that reorder or drop block names need two
    before = pull(channel)
    meta, grads = valid_push(channel, part)
    channel.call("push", Message(meta, grads), timeout=10)
    after = pull(channel)
    assert all(torch.allclose(a, b - 0.05) for a, b in zip(after, before))  # SGD, lr 0.1, gradient 0.5


@FUZZ
@given(st.sampled_from(MUTATIONS), st.integers(0, 10_000))
def test_a_hostile_push_is_refused_and_changes_nothing(job, kind, where):
    ps, channel, part = job
    meta, grads = valid_push(channel, part)
    before = pull(channel)
    version = ps.version
    method, meta, grads = mutate(kind, meta, grads, where)
    with pytest.raises(PdpsError) as info:
        channel.call(method, Message(meta, grads), timeout=10)
    assert str(info.value)  # says what was wrong
    assert ps.version == version
    assert all(torch.equal(a, b) for a, b in zip(bits(pull(channel)), bits(before)))


def test_a_push_without_the_token_is_refused(job):
    ps, channel, part = job
    meta, grads = valid_push(channel, part)
    before = pull(channel)
    stranger = GrpcTransport().connect(channel.address)
    with pytest.raises(pdps.TransportError, match="(?i)auth|token"):
        stranger.call("push", Message(meta, grads), timeout=10)
    stranger.close()
    assert all(torch.equal(a, b) for a, b in zip(bits(pull(channel)), bits(before)))
