"""Bad requests of the wire protocol, made field by field from a valid one.

Each mutation is derived from the request class itself (:mod:`pdps.core.wire`): a
value of another JSON kind for any field, a required field left out, a value of the
right kind out of the field's range, and for requests that carry tensors one too
few, one too many, or one of the wrong shape. Every one must be refused.
"""

from __future__ import annotations

from typing import Any

import attrs

from pdps.core import wire

#: values of every JSON kind: each field is sent those that are not of its kind
OTHER_KINDS: tuple[Any, ...] = ("text", 1.5, 7, True, [1], ["x"], {"a": 1})
#: values of the right kind that some field's range refuses
OUT_OF_RANGE: tuple[Any, ...] = (-1, 0, -1.0, 0.0, "", ["a@0", "a@0"])
#: row sections (``tables``, ``created``) that are malformed whatever the request: a
#: pair that is no [table, n], an empty name, n < 0, a table named twice, or a section
#: whose tensors the request does not carry
BAD_SECTIONS: tuple[Any, ...] = (
    [["emb"]], [["emb", 1, 2]], [[3, 0]], [["", 0]], [["emb", -1]], [["emb", 1.5]], [["emb", True]], ["emb"],
    [["emb", 0], ["emb", 0]], [["emb", 2], ["other", 1]], [["zzz", 0], ["emb", 2], ["zzz", 0]],
)
#: mutations that span fields, per class: (field, key, value). A request with a row
#: section in its valid form (a pull's) has table "emb" of 2 ids.
SPANNING: dict[type, list[tuple[str, Any]]] = {
    wire.PushRequest: [("samples", -3), ("records", [0, 1, 1, 5, 2]), ("records", [0, 1]), ("first", True), ("final", True)]
    + [("tables", v) for v in BAD_SECTIONS],
    wire.ReplicateRequest: [("tables", v) for v in BAD_SECTIONS] + [("created", v) for v in BAD_SECTIONS]
    + [("steps", v) for v in ([["emb"]], [["emb", 0]], [["", 3]], [["emb", 1.5]], [["emb", True]], ["emb"], [[3, 1]], [["emb", 1, 2]])],
    wire.PullRequest: [("tables", v) for v in BAD_SECTIONS] + [("tables", [["emb", 3]]), ("tables", [["emb", 1]]), ("tables", [])]
    + [("dump", v) for v in (["emb", 0, 0, 10], ["emb", -1, 0, 10], ["emb", 0, -1, 10], ["emb", 0, 0, 0], ["", 0, 0, 1], ["emb", 0, 0], ["emb", "0", 0, 1])],
    wire.MigrateRequest: [("row_offset", 0)],
    wire.GetTaskRequest: [("holding", [-1])],
}


@attrs.frozen
class Mutation:
    field: str  # the meta key (or "tensors") the refusal must name
    how: str  # "kind", "missing", "range" or "shape"
    value: Any = None  # the new value (a kind or range mutation)

    def apply(self, meta: dict, tensors: list) -> tuple[dict, list]:
        meta, tensors = dict(meta), list(tensors)
        if self.how == "missing":
            del meta[self.field]
        elif self.how == "shape":
            if self.value == "drop":
                tensors.pop()
            elif self.value == "extra":
                tensors.append(tensors[-1].clone())
            else:
                tensors[0] = tensors[0].reshape(-1)[:-1].clone() if tensors[0].numel() > 1 else tensors[0].reshape(1, 1, -1).clone()
        else:
            if self.field in ("first", "final"):
                meta["part"] = False
            meta[self.field] = self.value
        return meta, tensors


def mutations(cls: type[wire.Request]) -> list[Mutation]:
    """Every bad version of a valid request of ``cls`` this module knows how to make."""
    out: list[Mutation] = []
    for a, key, spec in cls._specs():
        if key is None or spec is None:
            out += [Mutation("tensors", "shape", v) for v in ("drop", "extra", "reshape")]
            continue
        kind = spec.kind
        out += [Mutation(key, "kind", v) for v in OTHER_KINDS if not wire._is(kind, v) or (spec.item is not None and not all(wire._is(spec.item, x) for x in v))]
        if a.default is attrs.NOTHING:
            out.append(Mutation(key, "missing"))
        if spec.check is not None:
            out += [Mutation(key, "range", v) for v in OUT_OF_RANGE if wire._is(kind, v) and spec.check(tuple(v) if isinstance(v, list) else v)]
    out += [Mutation(field, "range", v) for field, v in SPANNING.get(cls, [])]
    return out
