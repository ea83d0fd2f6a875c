"""The model and loop of the graph-rule process test (``.../graph_model.py:train``): it
imports nothing of the test module, whose optimizer (Lion) runs on the pservers as a graph."""

import torch
import torch.nn.functional as F


def make_model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(21)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    return model


def train(ctx):
    model = ctx.attach(make_model())
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
    return {"steps": ctx.steps}
