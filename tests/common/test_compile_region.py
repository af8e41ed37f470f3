"""compile_region: repeated layers share one compiled subgraph, and each kind of layer still runs its own code."""
import torch
from torch import nn

from common.engine.compile_region import compile_region


class Layer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(8, 8))

    @compile_region
    def forward(self, x):  # [T, 8] -> [T, 8]; the kind is an attribute the trace guards on
        return torch.tanh(x @ self.w) * 2 if self.kind == "a" else x @ self.w + 1


class Stack(nn.Module):
    def __init__(self, kinds: str):
        super().__init__()
        self.layers = nn.ModuleList(Layer(k) for k in kinds)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def compiled_graph(model, x):
    """The FX graph dynamo traces for model(x) (one graph: fullgraph), and the compiled output."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert len(graphs) == 1
    return graphs[0], out


def test_layers_of_one_kind_call_one_subgraph_and_every_kind_computes_its_own():
    torch.manual_seed(0)
    model, x = Stack("aabaab"), torch.randn(3, 8)
    gm, out = compiled_graph(model, x)
    torch.testing.assert_close(out, model(x))  # the "b" layers did not run the "a" subgraph, nor the reverse
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    bodies = {n.args[1] for n in calls}  # the subgraphs the calls run, by name
    # two kinds, two subgraphs; every layer calls its kind's, but for at most one traced inline per kind
    assert len(bodies) == 2 and len(calls) >= 6 - 2


def test_outside_torch_compile_the_region_is_the_function():
    layer = Layer("b")
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), x @ layer.w + 1)


class PlainLayer(nn.Module):
    """Layer("a")'s computation, unmarked."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):  # [T, 8] -> [T, 8]
        return torch.tanh(x @ self.w) * 2


def test_a_graph_with_regions_is_told_apart_from_one_without():
    """graph_runner.compile_decode_graph gives a decode graph inductor's C++ wrapper only where it calls no subgraph
    (the C++ wrapper has no subgraph call): the marked layers' graph calls subgraphs, unmarked ones' does not."""
    from common.engine.graph_runner import calls_subgraphs

    torch.manual_seed(0)
    x = torch.randn(3, 8)
    marked, _ = compiled_graph(Stack("aabaab"), x)  # (a kind's first calls are traced inline)
    unmarked, _ = compiled_graph(nn.Sequential(*(PlainLayer() for _ in range(6))), x)
    assert calls_subgraphs(marked) and not calls_subgraphs(unmarked)
