"""Update rules as graphs: a pserver's per-step Adam update of a 10M-parameter shard run
from the graph rule, against the same update in eager torch; conversion time and cache hits.

A benchmark, not a test: it prints figures and ratios against baselines measured in the
same run and asserts nothing about speed (it exits 1 only when the graph-run and the
eager parameters disagree after the timed steps).

What runs
---------
One shard as a pserver holds it: ``--params`` float32 elements (10M; 1M with ``--quick``)
in ``--blocks`` blocks (10 of 1M: the blocks of ten 1000 x 1000 weights), the real
``pdps.adapters.torch_compute.TorchShard`` a pserver builds, stepped by ``apply`` with a
fixed random gradient per block, as a push applies it. The routes, each on its own copy
of the same initial values and gradients, their steps interleaved (graph, eager, named,
graph, ...):

* **graph**: the shard with ``optimizer="graph"``, the rule that
  ``pdps.graph_rule(torch.optim.Adam(..., lr=1e-3))`` makes (the
  ``GraphOptimizer`` runner: a Python loop over the rule's nodes per block, each node a
  whole-block torch operation written in place where it can).
* **eager**: ``torch.optim.Adam(blocks, lr=1e-3)`` itself, torch's defaults (``foreach``
  left to torch), on tensors of the same blocks: the baseline.
* **named**: the shard with ``optimizer="Adam"`` (pdps's named path: torch's Adam with
  the kernel pdps picks), reported, no target.

``--warmup`` steps (2: the first makes Adam's state) are not timed; then ``--steps``
timed steps of each route (20; 5 with ``--quick``); the figure is the median step.
After the steps the graph-run parameters must equal eager torch's to 1e-5 (float32).
The process runs torch with one intra-op thread, as ``pdps launch`` gives a pserver.

Conversion: ``convert`` of a fresh ``torch.optim.Adam`` (hyper-parameters no other
conversion in the process used) timed cold (the first trace of the process: make_fx on
fake tensors, twice) and again (a cache hit), with ``conversion_stats()``; and the time a
pserver takes to check the rule and build its runner (``GraphOptimizer``: the checks
and one probe step).

Ratios
------
* ``graph_vs_eager``: median step of the graph route / of eager torch; the target of
  ``pdps bench --suite graph`` is at most 1.5.
* ``named_vs_eager``: the named route / eager torch; no target.

Run
---
    .venv/bin/python bench/graph.py            # ~1 min on 2 cores
    .venv/bin/python bench/graph.py --quick    # 1M parameters, 5 steps: ~10 s
    .venv/bin/python bench/graph.py --params 20000000 --blocks 20 --steps 40

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.*

import torch  # noqa: E402

from bench.machine import finish  # noqa: E402
from pdps.adapters.torch_compute import TorchShard  # noqa: E402
from pdps.adapters.torch_graph import GraphOptimizer, conversion_stats, convert  # noqa: E402
from pdps.core.slots import Block  # noqa: E402

FULL = {"params": 10_000_000, "blocks": 10, "steps": 20, "warmup": 2}
QUICK = {"params": 1_000_000, "blocks": 10, "steps": 5, "warmup": 2}
LR = 1e-3
AGREE = 1e-5  # graph-run and eager parameters after the steps, float32
#: torch's intra-op threads in this process: one, as ``pdps launch`` gives a pserver process
THREADS = 1


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def blocks_of(params: int, count: int) -> list[Block]:
    size = params // count
    return [Block(f"w{i}", i, 0, size, i * size, size, (size,), "float32") for i in range(count)]


def shard(blocks: list[Block], optimizer: str, args: dict[str, Any], values: torch.Tensor) -> TorchShard:
    s = TorchShard(blocks, optimizer, args)
    s.initialize(list(values.split([b.numel for b in blocks])), "bench")
    return s


def conversion() -> dict[str, Any]:
    """Cold and cached conversion of a fresh Adam, and a pserver's check + runner build."""
    p = torch.zeros(4, dtype=torch.float32, requires_grad=True)
    fresh = {"lr": LR, "betas": (0.9, 0.999), "eps": 1.0000001e-8}  # no other conversion of this process used these
    before = conversion_stats()
    began = time.perf_counter()
    rule = convert(torch.optim.Adam([p], **fresh))
    cold = time.perf_counter() - began
    began = time.perf_counter()
    again = convert(torch.optim.Adam([p], **fresh))
    hit = time.perf_counter() - began
    after = conversion_stats()
    assert again == rule
    began = time.perf_counter()
    GraphOptimizer([torch.zeros(4, dtype=torch.float32)], rule)
    build = time.perf_counter() - began
    nodes = {name: len(rule[name]["nodes"]) for name in ("first", "step")}
    return {
        "first_s": cold, "hit_s": hit, "pserver_build_s": build,
        "traced": after["traced"] - before["traced"], "hits": after["hits"] - before["hits"],
        "rule_bytes": len(json.dumps(rule)), "nodes": nodes,
    }  # fmt: skip


def run(params: int, count: int, steps: int, warmup: int) -> dict[str, Any]:
    blocks = blocks_of(params, count)
    n = sum(b.numel for b in blocks)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(n, generator=gen)
    grads = [torch.randn(b.numel, generator=gen) * 1e-2 for b in blocks]

    say("converting torch.optim.Adam into a graph rule (cold, then cached)")
    conv = conversion()
    rule = convert(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=LR))
    graph = shard(blocks, "graph", {"graph": rule}, values)
    named = shard(blocks, "Adam", {"lr": LR}, values)
    eager_params = [t.clone() for t in values.split([b.numel for b in blocks])]
    eager = torch.optim.Adam(eager_params, lr=LR)  # torch's defaults

    def eager_step() -> None:
        for p, g in zip(eager_params, grads):
            p.grad = g
        eager.step()
        for p in eager_params:
            p.grad = None

    routes = {"graph": lambda: graph.apply(grads), "eager": eager_step, "named": lambda: named.apply(grads)}
    times: dict[str, list[float]] = {k: [] for k in routes}
    say(f"stepping {n:,} float32 parameters in {len(blocks)} blocks: {warmup} warm-up + {steps} timed steps per route, interleaved")
    for i in range(warmup + steps):
        for name, step in routes.items():
            began = time.perf_counter()
            step()
            spent = time.perf_counter() - began
            if i >= warmup:
                times[name].append(spent)
    diff = max(float((g - e).abs().max()) for g, e in zip(graph.views(), eager_params))
    named_diff = max(float((g - e).abs().max()) for g, e in zip(named.views(), eager_params))
    labels = {"graph": "graph rule (GraphOptimizer)", "eager": "eager torch.optim.Adam", "named": "named 'Adam' shard"}
    rows = [{"route": k, "label": labels[k], "step_s": statistics.median(v), "steps_s": v} for k, v in times.items()]
    med = {r["route"]: r["step_s"] for r in rows}
    ratios = {
        "graph_vs_eager": {"value": med["graph"] / med["eager"], "step_s": med["graph"], "baseline_step_s": med["eager"],
                           "row": labels["graph"], "baseline": labels["eager"]},
        "named_vs_eager": {"value": med["named"] / med["eager"], "step_s": med["named"], "baseline_step_s": med["eager"],
                           "row": labels["named"], "baseline": labels["eager"]},
    }  # fmt: skip
    return {"update": rows, "conversion": conv, "ratios": ratios, "max_diff": diff, "named_max_diff": named_diff, "elements": n}


def print_table(report: dict[str, Any]) -> None:
    c = report["config"]
    say("")
    say(f"Adam update of one pserver shard: {report['elements']:,} float32 in {c['blocks']} blocks, median of {c['steps']} steps")
    say(f"{'route':<30} {'ms/step':>9} {'each ms':>40}")
    for r in report["update"]:
        each = ", ".join(f"{v * 1000:.0f}" for v in r["steps_s"][:8])
        say(f"{r['label']:<30} {r['step_s'] * 1000:>9.1f} {each:>40}")
    conv = report["conversion"]
    say("")
    say(f"conversion: first {conv['first_s']:.2f} s (traced {conv['traced']}), cached {conv['hit_s'] * 1000:.2f} ms (hits {conv['hits']}); "
        f"pserver check + runner build {conv['pserver_build_s'] * 1000:.1f} ms; rule {conv['rule_bytes']:,} B, nodes {conv['nodes']}")  # fmt: skip
    say(f"graph - eager after the steps: max |diff| {report['max_diff']:.2e}")
    for name, r in report["ratios"].items():
        say(f"{name}: {r['value']:.3f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--params", type=int, help=f"elements of the shard (default {FULL['params']:,}, --quick {QUICK['params']:,})")
    p.add_argument("--blocks", type=int, help=f"blocks they are cut into (default {FULL['blocks']})")
    p.add_argument("--steps", type=int, help=f"timed steps per route (default {FULL['steps']}, --quick {QUICK['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps first (default {FULL['warmup']})")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['params']:,} parameters, {QUICK['steps']} steps")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout's last line")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    params, count, steps, warmup = (getattr(args, k) or preset[k] for k in ("params", "blocks", "steps", "warmup"))
    if count < 1 or params < count or steps < 1 or warmup < 1:
        p.error("--blocks, --steps and --warmup must be positive (warm-up makes Adam's state), --params at least --blocks")
    torch.set_num_threads(THREADS)
    began = time.monotonic()
    report = run(params, count, steps, warmup)
    report = finish("bench/graph.py", argv, began,
                    {"params": params, "blocks": count, "steps": steps, "warmup": warmup, "optimizer": f"Adam(lr={LR})", "dtype": "float32",
                     "torch_threads": torch.get_num_threads()},
                    report, packages=("torch",), table=print_table, as_json=args.json)  # fmt: skip
    if not report["max_diff"] <= AGREE:
        say(f"bench/graph.py: the graph-run parameters differ from eager torch's by {report['max_diff']:.2e} (more than {AGREE:g})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
