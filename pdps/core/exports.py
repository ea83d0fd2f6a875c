"""Model exports for serving: the layout under an export URL, the manifest, the
``LATEST`` pointer, the writers' claims and which exports retention deletes.

Pure: the effects (listing, writing, hashing, the clock) are :mod:`pdps.runtime.exports`'.
Layout under the export root, one folder per export, named by its sequence number
zero-padded so that a listing sorts them::

    00000003/
        claim-<token>        the writer's claim on seq 3 (empty), written first
        model.safetensors    the tensors
        manifest.json        written after the model: the export is complete
    LATEST                   {"seq": 3}, moved only after a manifest is written

Rules:

* An export is *complete* when its folder holds ``manifest.json``; every other folder
  is a writer's unfinished work (killed, or still writing) and readers ignore it.
* A new export takes the number after the highest folder of any kind, so it never
  writes into an unfinished folder.
* Two writers that picked the same number both write a claim, then list the claims:
  a writer that sees another's claim gives the number up (at least one of two racing
  writers sees the other's claim), so no object of an export is ever written by two
  writers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import ConfigError, CorruptExport

MODEL = "model.safetensors"
MANIFEST = "manifest.json"
LATEST = "LATEST"
CLAIM_PREFIX = "claim-"
#: Width of the zero-padded folder names; numbers beyond it get longer names, which
#: still parse (a listing then stops sorting them, the numbers do).
SEQ_DIGITS = 8
#: The manifest's format version, so a later pdps can read older exports.
FORMAT = 1

_FOLDER = re.compile(r"[0-9]{%d,}" % SEQ_DIGITS)
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://.", re.IGNORECASE)


def folder(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}"


def seq_of(name: str) -> int | None:
    """The number a folder name stands for; None for names that are no export's."""
    return int(name) if _FOLDER.fullmatch(name) else None


def model_path(seq: int) -> str:
    return f"{folder(seq)}/{MODEL}"


def manifest_path(seq: int) -> str:
    return f"{folder(seq)}/{MANIFEST}"


def claim_path(seq: int, token: str) -> str:
    return f"{folder(seq)}/{CLAIM_PREFIX}{token}"


def folders(paths: Iterable[str]) -> dict[int, list[str]]:
    """The export folders among storage ``paths``: seq -> the paths inside it."""
    out: dict[int, list[str]] = {}
    for p in paths:
        head, slash, _ = p.partition("/")
        seq = seq_of(head) if slash else None
        if seq is not None:
            out.setdefault(seq, []).append(p)
    return out


def complete(paths: Iterable[str]) -> list[int]:
    """The seqs of complete exports (their folder holds a manifest), oldest first."""
    return sorted(seq for seq, inside in folders(paths).items() if manifest_path(seq) in inside)


def next_seq(paths: Iterable[str]) -> int:
    """The number a new export takes: one past the highest folder, complete or not."""
    return max(folders(paths), default=0) + 1


def rivals(claims: Iterable[str], seq: int, token: str) -> list[str]:
    """Claims on ``seq`` other than the one of ``token``: a writer that sees any gives
    the number up."""
    mine = claim_path(seq, token)
    return sorted(c for c in claims if c != mine)


def check_url(url: object) -> str:
    if not isinstance(url, str) or not _SCHEME.match(url):
        raise ConfigError(f"export URL must be a storage URL such as 'file:///srv/models' or 's3://bucket/prefix', got {url!r}")
    return url


def check_seq(seq: object) -> int:
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ConfigError(f"an export's seq is an int >= 1 (list_exports() says which exist), got {seq!r}")
    return seq


def check_keep(keep: object) -> int | None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"keep must be None (keep every export) or an int >= 1, got {keep!r}")
    return keep


def check_names(tensors: object) -> list[str]:
    """The tensor names of ``tensors``, a non-empty mapping of non-empty strings."""
    if not isinstance(tensors, Mapping):
        raise ConfigError(f"an export takes a mapping of name -> tensor (a state_dict), got a {type(tensors).__name__}")
    if not tensors:
        raise ConfigError("an export needs at least one tensor; the mapping given is empty")
    bad = [k for k in tensors if not isinstance(k, str) or not k]
    if bad:
        raise ConfigError(f"tensor names must be non-empty strings, got {bad[0]!r}")
    return list(tensors)


def check_meta(meta: object) -> dict[str, Any]:
    """``meta`` as the manifest will hold it: a dict with string keys whose values any
    JSON reader reads back as they are (no NaN, no infinities, no objects)."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping) or not all(isinstance(k, str) for k in meta):
        raise ConfigError(f"export meta must be a mapping with string keys, got {meta!r}")
    try:
        return json.loads(json.dumps(dict(meta), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"export meta is not JSON-safe ({exc}); give numbers, strings, booleans, None, lists and dicts") from exc


@attrs.frozen
class TensorSpec:
    """One tensor of an export: its name, safetensors dtype (``F32``, ``BF16``, ...) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@attrs.frozen
class Export:
    """One complete export: its number, the URL of its model file, and its manifest.

    ``created`` is the writer's UTC time in ISO 8601; ``bytes`` and ``sha256`` are of
    ``model.safetensors``; ``meta`` is what the writer passed (window, round, ...).
    """

    seq: int
    path: str
    created: str
    bytes: int
    sha256: str
    tensors: tuple[TensorSpec, ...] = attrs.field(converter=tuple)
    meta: dict[str, Any] = attrs.field(factory=dict, hash=False)

    def manifest(self) -> bytes:
        body = {
            "format": FORMAT,
            "seq": self.seq,
            "created": self.created,
            "file": MODEL,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "tensors": [t.to_json() for t in self.tensors],
            "meta": self.meta,
        }
        return json.dumps(body, indent=1, allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes, seq: int, path: str, where: str) -> Export:
        """The export whose manifest is ``data`` (read from ``where``, in folder ``seq``);
        CorruptExport naming ``where`` when it is not one."""
        try:
            body = json.loads(data.decode("utf-8"))
            if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("seq") != seq:
                raise ValueError(f"format {FORMAT} and seq {seq} expected")
            tensors = tuple(TensorSpec(t["name"], t["dtype"], [int(d) for d in t["shape"]]) for t in body["tensors"])
            export = cls(seq, path, str(body["created"]), int(body["bytes"]), str(body["sha256"]), tensors, dict(body["meta"]))
        except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
            raise CorruptExport(f"export manifest {where} cannot be read: {exc}", where) from exc
        return export


def pointer(seq: int) -> bytes:
    """What ``LATEST`` holds when it names export ``seq``."""
    return json.dumps({"seq": seq}).encode()


def pointed(data: bytes, where: str) -> int:
    """The seq a ``LATEST`` pointer names; CorruptExport naming ``where`` when it names none."""
    try:
        seq = json.loads(data.decode("utf-8"))["seq"]
        if type(seq) is not int or seq < 1:
            raise ValueError(f"seq {seq!r} is not a positive int")
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise CorruptExport(f"export pointer {where} cannot be read: {exc}", where) from exc
    return seq


def to_delete(paths: Iterable[str], *, keep: int, latest: int | None, current: int) -> list[int]:
    """The folders a publish of export ``current`` deletes with ``keep``: every complete
    export but the ``keep`` newest (never the one ``latest`` names) and every unfinished
    folder below ``current`` (a killed writer's; one writer per URL, so none is alive).
    Oldest first."""
    found = folders(paths)
    done = complete(p for inside in found.values() for p in inside)
    kept = set(done[-keep:]) | {latest, current}
    unfinished = [seq for seq in found if seq not in done and seq < current]
    return sorted({seq for seq in done if seq not in kept} | set(unfinished))


def mismatches(want: Sequence[TensorSpec], got: Sequence[TensorSpec]) -> list[str]:
    """How the tensors read from a model file differ from its manifest's; [] when alike."""
    by_name = {t.name: t for t in got}
    out = []
    for spec in want:
        have = by_name.pop(spec.name, None)
        if have is None:
            out.append(f"{spec.name!r} is missing")
        elif have != spec:
            out.append(f"{spec.name!r} is {have.dtype} {list(have.shape)}, the manifest says {spec.dtype} {list(spec.shape)}")
    out += [f"{name!r} is not in the manifest" for name in sorted(by_name)]
    return out
