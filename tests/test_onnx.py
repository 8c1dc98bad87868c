"""``torch.onnx.export`` (the dynamo exporter, torch's default) of the layers and models, run
in onnxruntime on graphs of other sizes than the exported one."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close

from graphattn.functional import _transforms
from graphattn.nn import GAT, GraphSelfAttention, GraphTransformer

onnxruntime = pytest.importorskip("onnxruntime", reason="the ONNX tests need onnxruntime "
                                  "(pip install -e '.[test]' installs it)")
pytest.importorskip("onnxscript", reason="torch.onnx.export needs onnxscript")

def _with_sinks(layer: GraphSelfAttention) -> GraphSelfAttention:
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([1.0, -0.5]))  # (0 at first)
    return layer


MODELS = {
    "layer": lambda: GraphSelfAttention(8, 4, heads=2),
    "layer-dense": lambda: GraphSelfAttention(8, 4, heads=2, backend="dense"),
    "layer-cpu-gatv2": lambda: GraphSelfAttention(8, 4, heads=2, attention="gatv2",
                                                  backend="cpu"),
    "layer-softcap": lambda: GraphSelfAttention(8, 4, heads=2, softcap=0.5),
    "layer-sinks": lambda: _with_sinks(GraphSelfAttention(8, 4, heads=2, sinks=True)),
    "layer-gate-qk-norm": lambda: GraphSelfAttention(8, 4, heads=2, kv_heads=1, gate="headwise",
                                                     qk_norm="layer_across_heads"),
    "layer-norms-differential": lambda: GraphSelfAttention(8, 4, heads=2, qk_norm="rms_per_head",
                                                           out_norm="layer", differential=True),
    "layer-latent": lambda: GraphSelfAttention(8, 4, heads=2, q_rank=3, kv_rank=3,
                                               shared_key_channels=1),
    "GAT": lambda: GAT(8, 3, hidden_channels=4, heads=2),
    "GraphTransformer": lambda: GraphTransformer(8, 8, 3, heads=2),
}


@pytest.mark.parametrize("name, private_flag", [(name, True) for name in MODELS]
                         + [("layer", False)])
def test_onnx_export_with_dynamic_sizes_runs_on_other_graphs(name, private_flag, tmp_path,
                                                             monkeypatch):
    """Every backend exports as the reference's plain ops (ONNX has no function for the fused
    operators), with the node and edge counts dynamic; also through torch's public
    ``is_in_onnx_export`` where torch lacks the exporter's private flag."""
    from torch.export import Dim

    if not private_flag:
        monkeypatch.setattr(_transforms, "onnx_flags", None)
    torch.manual_seed(0)
    module = MODELS[name]().eval()
    x, edge_index = torch.randn(12, 8), torch.randint(0, 12, (2, 40))
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(module, (x, edge_index), path, dynamo=True,
                      input_names=["x", "edge_index"], output_names=["out"],
                      dynamic_shapes=({0: Dim("N")}, {1: Dim("E")}))
    session = onnxruntime.InferenceSession(str(path))
    # a dense graph too, where auto takes the dense backend in eager
    for n, e in [(12, 40), (50, 300), (7, 45), (3, 0)]:
        x, edge_index = torch.randn(n, 8), torch.randint(0, n, (2, e))
        (out,) = session.run(None, {"x": x.numpy(), "edge_index": edge_index.numpy()})
        with torch.no_grad():
            assert_close(torch.from_numpy(out), module(x, edge_index), atol=1e-5, rtol=1e-4)


class _Rotary(torch.nn.Module):
    """A layer with a rotary embedding and grouped key heads, its positions an input."""

    def __init__(self) -> None:
        super().__init__()
        from graphattn import pe

        self.layer = GraphSelfAttention(8, 4, heads=2, kv_heads=1, add_self_loops=False,
                                        rotary=pe.RotaryPE(4, axes=2))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor,
                pos: torch.Tensor) -> torch.Tensor:
        return self.layer(x, edge_index, pos=pos)


def test_onnx_export_of_rotary_grouped_layer_runs_on_other_graphs(tmp_path):
    """RoPE's rotation and the grouped heads' repeat are plain ops: the exported program takes
    the positions as an input and runs on graphs of other sizes."""
    from torch.export import Dim

    torch.manual_seed(0)
    module = _Rotary().eval()
    x, edge_index, pos = torch.randn(12, 8), torch.randint(0, 12, (2, 40)), torch.randn(12, 2)
    path = tmp_path / "rotary.onnx"
    nodes = Dim("N")
    torch.onnx.export(module, (x, edge_index, pos), path, dynamo=True,
                      input_names=["x", "edge_index", "pos"], output_names=["out"],
                      dynamic_shapes=({0: nodes}, {1: Dim("E")}, {0: nodes}))
    session = onnxruntime.InferenceSession(str(path))
    for n, e in [(12, 40), (50, 300), (7, 45)]:
        x, edge_index = torch.randn(n, 8), torch.randint(0, n, (2, e))
        pos = torch.randn(n, 2) * 10
        (out,) = session.run(None, {"x": x.numpy(), "edge_index": edge_index.numpy(),
                                    "pos": pos.numpy()})
        with torch.no_grad():
            assert_close(torch.from_numpy(out), module(x, edge_index, pos), atol=1e-5,
                         rtol=1e-4)


@pytest.mark.parametrize("shape", [(12, 8), (2, 12, 8)], ids=["unbatched", "batched"])
def test_onnx_export_of_the_dense_twin_runs(shape, tmp_path):
    """DenseSelfAttention on [L, F] failed to export ("only 4D query, key, and value are
    supported" in ONNX's attention); [B, L, F] exported. Both run in onnxruntime as eager
    computes them, on sequences of other lengths."""
    from torch.export import Dim

    from graphattn.nn import DenseSelfAttention

    torch.manual_seed(0)
    module = DenseSelfAttention(8, 4, heads=2).eval()
    path = tmp_path / "dense.onnx"
    torch.onnx.export(module, (torch.randn(*shape),), path, dynamo=True, input_names=["x"],
                      output_names=["out"], dynamic_shapes=({len(shape) - 2: Dim("L")},))
    session = onnxruntime.InferenceSession(str(path))
    for length in (12, 30, 5):
        x = torch.randn(*shape[:-2], length, 8)
        (out,) = session.run(None, {"x": x.numpy()})
        with torch.no_grad():
            assert_close(torch.from_numpy(out), module(x), atol=1e-5, rtol=1e-4)
