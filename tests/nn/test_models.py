import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_close, random_graph
from torch_geometric.data import Data
from torch_geometric.nn import GATConv, TransformerConv

from graphattn.nn import GAT, GraphSelfAttention, GraphTransformer
from graphattn.nn.models import feature_dropout

REPO = Path(__file__).resolve().parents[2]


def sparse_features(n, f, density=0.05, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, f, generator=gen) * (torch.rand(n, f, generator=gen) < density)
    return x


@pytest.mark.parametrize("attention", ["additive", "dot"])
@pytest.mark.parametrize("out_heads", [1, 3])
def test_gat_shapes_and_layers(attention, out_heads):
    torch.manual_seed(0)
    model = GAT(12, 5, hidden_channels=4, heads=3, out_heads=out_heads, attention=attention)
    x, ei = torch.randn(20, 12), random_graph(20, 60)
    assert model(x, ei).shape == (20, 5)
    assert model.conv1.heads == 3 and model.conv1.concat and model.conv1.lin_out is None
    assert model.conv2.heads == out_heads and not model.conv2.concat
    assert model.conv1.attention == attention
    assert model.conv1.dropout == model.conv2.dropout == 0.6
    assert model.conv1.value_dropout == model.conv2.value_dropout == 0.6  # as the reference code
    model = GAT(12, 5, dropout=0.5, attention_dropout=0.2, value_dropout=0.1)
    assert (model.dropout, model.conv1.dropout, model.conv2.value_dropout) == (0.5, 0.2, 0.1)


def test_model_defaults_are_the_documented_ones():
    gat = GAT(12, 5)  # hidden 8 x 8 heads, one averaged output head, dropout 0.6
    assert (gat.conv1.out_channels, gat.conv1.heads, gat.conv2.heads) == (8, 8, 1)
    assert gat.conv2.lin_q.in_features == 64 and gat.dropout == 0.6
    gt = GraphTransformer(12, 16, 5)  # 2 blocks, 4 heads, feed-forward 2 D wide, dropout 0.5
    assert len(gt.attns) == 2 and all(a.heads == 4 and a.out_channels == 4 for a in gt.attns)
    assert [ffn[0].out_features for ffn in gt.ffns] == [32, 32] and gt.lin_pe is None
    assert gt.dropout == 0.5 and gt.attns[0].dropout == 0.5


@pytest.mark.parametrize("make", [lambda: GAT(12, 5), lambda: GraphTransformer(12, 16, 5)],
                         ids=["GAT", "GraphTransformer"])
def test_models_take_a_sparse_adjacency(make):
    """PyG's ``ToSparseTensor(layout=torch.sparse_csr)`` output trains the same model."""
    import torch_geometric.transforms as T
    from torch_geometric.data import Data

    torch.manual_seed(0)
    data = Data(x=torch.randn(20, 12), edge_index=torch.unique(random_graph(20, 60), dim=1))
    sparse = T.ToSparseTensor(layout=torch.sparse_csr)(data.clone())
    model = make().eval()
    assert_close(model(sparse.x, sparse.adj_t), model(data.x, data.edge_index))


def test_gat_with_gatconv_layers_equals_graphattn_with_copied_weights():
    """The model's wiring (dropout, ELU, concat/mean) matches the same network built of GATConv."""
    from test_additive_attention import copy_gat_into

    torch.manual_seed(0)
    ours = GAT(10, 4, hidden_channels=3, heads=2, out_heads=2).double().eval()
    ref = GAT(10, 4, hidden_channels=3, heads=2, out_heads=2, conv=GATConv).double().eval()
    for layer, gat in ((ours.conv1, ref.conv1), (ours.conv2, ref.conv2)):
        with torch.no_grad():
            gat.bias.normal_()
        copy_gat_into(layer, gat)
    x, ei = torch.randn(15, 10, dtype=torch.float64), random_graph(15, 40)
    assert_close(ours(x, ei), ref(x, ei))


@pytest.mark.parametrize("conv, backend", [(None, "reference"), (None, "cpu"), (None, "dense"),
                                           (GATConv, None)],
                         ids=["reference", "cpu", "dense", "GATConv"])
def test_gat_adds_its_biases_after_the_dropped_weighted_sum(conv, backend):
    """Attention dropout leaves a target's weights summing to anything but 1, and value
    dropout zeroes values: neither may scale the bias, which GATConv and the GAT reference code
    add after the sum. With every weight 0 the logits are the output bias, in training too."""
    model = GAT(5, 3, hidden_channels=2, heads=2, dropout=0.0, attention_dropout=0.6,
                value_dropout=0.6, conv=conv, **({} if conv else {"backend": backend}))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        bias = model.conv2.bias if conv else model.conv2.out_bias
        bias.copy_(torch.tensor([1.0, -2.0, 3.0]))
    x, ei = torch.randn(30, 5), random_graph(30, 120)
    torch.manual_seed(0)
    for _ in range(3):  # three draws of the masks
        assert_close(model.train()(x, ei), bias.detach().expand(30, 3))


def test_gat_with_sinks_gives_each_node_less_than_all_its_weight():
    """GAT(sinks=True): both layers have a sink logit per head (0 at first), which learns;
    each node's weights over its in-edges (its self-loop included) sum to less than 1; and
    the example's --sinks builds it."""
    torch.manual_seed(0)
    model = GAT(12, 5, hidden_channels=4, heads=3, sinks=True).eval()
    assert model.conv1.sinks.shape == (3,) and model.conv2.sinks.shape == (1,)
    x, ei = torch.randn(20, 12), random_graph(20, 60)
    out, [(ei1, alpha), _] = model(x, ei, return_attention_weights=True)
    totals = torch.zeros(20, 3).index_add_(0, ei1[1], alpha)
    assert ((totals > 0) & (totals < 1 - 1e-3)).all()
    out.square().sum().backward()
    assert (model.conv1.sinks.grad != 0).all() and (model.conv2.sinks.grad != 0).all()
    with torch.no_grad():
        model.conv1.sinks.fill_(float("-inf"))  # a sink of -inf weighs nothing
        _, [(_, alpha), _] = model(x, ei, return_attention_weights=True)
    assert_close(torch.zeros(20, 3).index_add_(0, ei1[1], alpha), torch.ones(20, 3))
    assert GAT(12, 5).conv1.sinks is None
    example = import_example()
    args = example.parse_args(["--sinks"])
    data = Data(x=torch.randn(4, 3), edge_index=random_graph(4, 6), y=torch.tensor([0, 1, 0, 1]))
    for name in ("gat", "transformer"):
        built = example.build_model(name, data, 2, hidden=4, heads=2, dropout=0.0,
                                    sinks=args.sinks)
        assert all(m.sinks is not None for m in built.modules()
                   if isinstance(m, GraphSelfAttention))


def test_gat_accepts_other_convs():
    model = GAT(8, 3, hidden_channels=4, heads=2, conv=TransformerConv)
    assert isinstance(model.conv1, TransformerConv)
    assert model(torch.randn(10, 8), random_graph(10, 30)).shape == (10, 3)


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_coo])
@pytest.mark.parametrize("make", [lambda: GAT(40, 4, hidden_channels=4, heads=2),
                                  lambda: GraphTransformer(40, 8, 4, heads=2)],
                         ids=["GAT", "GraphTransformer"])
def test_sparse_features_give_dense_results(layout, make):
    torch.manual_seed(0)
    x, ei = sparse_features(30, 40), random_graph(30, 90)
    xs = x.to_sparse_csr() if layout == torch.sparse_csr else x.to_sparse()
    model = make().eval()
    out_dense = model(x, ei)
    out_dense.square().sum().backward()
    dense_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out_sparse = model(xs, ei)
    out_sparse.square().sum().backward()
    assert_close(out_sparse, out_dense)
    for g_sparse, g_dense in zip((p.grad for p in model.parameters()), dense_grads, strict=True):
        assert_close(g_sparse, g_dense)


def test_graph_transformer_projects_sparse_features_with_sparse_linear(monkeypatch):
    """Sparse features go through sparse_linear (whose backward transposes x without torch's
    sort), with the input projection's own parameters; dense ones through the module."""
    import graphattn.nn.models as models

    calls = []

    def spy(x, weight, bias=None):
        calls.append((x.layout, weight, bias))
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(models, "sparse_linear", spy)
    model = GraphTransformer(40, 8, 4, heads=2)
    x, ei = sparse_features(30, 40), random_graph(30, 90)
    model(x, ei)
    assert calls == []
    model(x.to_sparse_csr(), ei)
    assert len(calls) == 1 and calls[0][0] == torch.sparse_csr
    assert calls[0][1] is model.lin_in.weight and calls[0][2] is model.lin_in.bias


@pytest.mark.parametrize("layout", [torch.strided, torch.sparse_csr, torch.sparse_csc,
                                    torch.sparse_coo])
def test_feature_dropout(layout):
    x = sparse_features(200, 50, density=0.2) + 0.0
    xs = {torch.strided: x, torch.sparse_csr: x.to_sparse_csr(),
          torch.sparse_csc: x.to_sparse_csc(), torch.sparse_coo: x.to_sparse()}
    torch.manual_seed(0)
    out = feature_dropout(xs[layout], 0.25, training=True)
    out = out if layout == torch.strided else out.to_dense()
    kept = out != 0
    assert not (kept & (x == 0)).any()  # zeros stay zero
    assert_close(out[kept], x[kept] / 0.75)  # survivors are rescaled by 1 / (1 - p)
    frac = kept.sum() / (x != 0).sum()
    assert 0.70 < frac < 0.80, frac
    assert feature_dropout(xs[layout], 0.25, training=False) is xs[layout]


def test_feature_dropout_refuses_block_sparse_features_by_name():
    x = sparse_features(8, 4, density=0.5).to_sparse_bsr((2, 2))
    with pytest.raises(ValueError, match="strided, COO, CSR or CSC features, got "
                                         "torch.sparse_bsr"):
        feature_dropout(x, 0.5, training=True)
    assert feature_dropout(x, 0.5, training=False) is x  # no dropout: passed through


@pytest.mark.parametrize("make", [lambda: GAT(40, 4, hidden_channels=4, heads=2),
                                  lambda: GraphTransformer(40, 8, 4)])
def test_models_train_on_csc_features(make):
    """CSC features ran in eval mode but training crashed in the input dropout ("Expected
    result Tensor to be of format CSR")."""
    torch.manual_seed(0)
    x, ei = sparse_features(30, 40), random_graph(30, 90)
    model = make()
    expected = model.eval()(x, ei)
    assert_close(model(x.to_sparse_csc(), ei), expected)
    out = model.train()(x.to_sparse_csc(), ei)
    out.square().sum().backward()
    assert out.shape == (30, 4) and all(p.grad is not None for p in model.parameters())


def test_models_take_numpy_integer_sizes():
    torch.manual_seed(0)
    x, ei = torch.randn(7, 6), random_graph(7, 20)
    for make in (lambda n: GAT(n(6), n(3), hidden_channels=n(4), heads=n(2), out_heads=n(1)),
                 lambda n: GraphTransformer(n(6), n(8), n(3), num_layers=n(1), heads=n(2),
                                            pe_channels=n(0), ffn_ratio=n(2))):
        torch.manual_seed(0)
        want = make(int).eval()(x, ei)
        torch.manual_seed(0)
        assert torch.equal(make(np.int64).eval()(x, ei), want)


def test_gat_rejects_bad_sizes():
    with pytest.raises(ValueError, match="heads must be a positive integer, got 0"):
        GAT(8, 3, heads=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        GAT(8, 3, dropout=1.0)
    with pytest.raises(ValueError, match=r"attention_dropout must be in \[0, 1\), got -0.1"):
        GAT(8, 3, attention_dropout=-0.1)
    with pytest.raises(ValueError, match=r"value_dropout must be in \[0, 1\), got 2"):
        GAT(8, 3, value_dropout=2)


def copy_into_encoder_layer(model, i, layer):
    attn = model.attns[i]
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(
            torch.cat([attn.lin_q.weight, attn.lin_k.weight, attn.lin_v.weight]))
        layer.self_attn.in_proj_bias.copy_(
            torch.cat([attn.lin_q.bias, attn.lin_k.bias, attn.lin_v.bias]))
        layer.self_attn.out_proj.weight.copy_(attn.lin_out.weight)
        layer.self_attn.out_proj.bias.copy_(attn.lin_out.bias)
        layer.linear1.load_state_dict(model.ffns[i][0].state_dict())
        layer.linear2.load_state_dict(model.ffns[i][3].state_dict())
        layer.norm1.load_state_dict(model.attn_norms[i].state_dict())
        layer.norm2.load_state_dict(model.ffn_norms[i].state_dict())


def test_graph_transformer_on_complete_graph_is_a_pre_norm_transformer_encoder():
    torch.manual_seed(0)
    N, F, D, H, L, P = 7, 5, 12, 3, 2, 4
    model = GraphTransformer(F, D, 3, num_layers=L, heads=H, pe_channels=P, ffn_ratio=2).eval()
    layers = [torch.nn.TransformerEncoderLayer(D, H, dim_feedforward=2 * D, dropout=0.0,
                                               activation="gelu", batch_first=True,
                                               norm_first=True) for _ in range(L)]
    for i, layer in enumerate(layers):
        copy_into_encoder_layer(model, i, layer.eval())
    x, pe = torch.randn(N, F), torch.randn(N, P)
    complete = torch.cartesian_prod(torch.arange(N), torch.arange(N)).t()

    # Reference: positional encodings as extra input features, then standard encoder layers.
    w_in = torch.cat([model.lin_in.weight, model.lin_pe.weight], dim=1)  # (D, F + P)
    h = (torch.cat([x, pe], dim=1) @ w_in.t() + model.lin_in.bias).unsqueeze(0)  # (1, N, D)
    for layer in layers:
        h = layer(h)
    expected = model.lin_out(model.norm_out(h[0]))
    assert_close(model(x, complete, pe), expected)


def test_graph_transformer_on_a_batch_complete_graph_encodes_each_graph_alone():
    # graph-level batches: every node attends to the nodes of its own graph only, so the model
    # on the whole batch equals the model on each graph, outputs and parameter gradients
    from torch_geometric.data import Batch

    from graphattn import graphs

    torch.manual_seed(1)
    data = Batch.from_data_list([Data(x=torch.randn(n, 5), pe=torch.randn(n, 2))
                                 for n in (4, 1, 6)])
    model = GraphTransformer(5, 8, 3, heads=2, pe_channels=2).eval()
    out = model(data.x, graphs.batch_complete_graph(data.batch), data.pe)
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    per_graph = torch.cat([model(g.x, graphs.complete_graph(g.num_nodes), g.pe)
                           for g in data.to_data_list()])
    per_graph.square().sum().backward()
    assert_close(out, per_graph)
    for name, p in model.named_parameters():
        assert_close(grads[name], p.grad)


def test_graph_transformer_pe_checks_and_gradients():
    torch.manual_seed(0)
    x, ei = torch.randn(10, 6), random_graph(10, 30)
    model = GraphTransformer(6, 8, 2, heads=2, pe_channels=3)
    with pytest.raises(ValueError, match=r"pe must have shape \[N, pe_channels\] = \[10, 3\], "
                                         r"got None"):
        model(x, ei)
    with pytest.raises(ValueError, match=r"got \[10, 4\]"):
        model(x, ei, torch.randn(10, 4))
    with pytest.raises(TypeError, match=r"pe must be a torch.Tensor, got list"):
        model(x, ei, torch.randn(10, 3).tolist())  # ("'list' object has no attribute 'dim'")
    model(x, ei, torch.randn(10, 3)).sum().backward()
    assert model.lin_pe.weight.grad.abs().sum() > 0
    one = GraphTransformer(6, 8, 2, heads=2, pe_channels=1)  # a single encoding channel
    one(x, ei, torch.randn(10, 1)).sum().backward()
    assert one.lin_pe.weight.shape == (8, 1) and one.lin_pe.weight.grad.abs().sum() > 0
    plain = GraphTransformer(6, 8, 2, heads=2)
    with pytest.raises(ValueError, match="pe was given but the model has pe_channels=0"):
        plain(x, ei, torch.randn(10, 3))
    with pytest.raises(ValueError, match="hidden_channels must be divisible by heads"):
        GraphTransformer(6, 10, 2, heads=4)
    assert plain(x.to_sparse_csr(), ei).shape == (10, 2)


@pytest.mark.parametrize("edge_mode", ["bias", "key_value"])
def test_graph_transformer_takes_edge_features_in_every_layer(edge_mode):
    """Every block's attention gets ``edge_attr``; shuffling the edges together with their
    features changes nothing."""
    torch.manual_seed(0)
    x, ei = torch.randn(10, 6), random_graph(10, 30)
    edge_attr = torch.randn(ei.size(1), 3)
    model = GraphTransformer(6, 8, 2, num_layers=2, heads=2, edge_dim=3,
                             edge_mode=edge_mode).eval()
    out = model(x, ei, edge_attr=edge_attr)
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(1))
    assert_close(model(x, ei[:, perm], edge_attr=edge_attr[perm]), out)
    assert not torch.allclose(model(x, ei, edge_attr=edge_attr.flip(0)), out)
    out.square().sum().backward()
    assert all(attn.lin_edge.weight.grad.abs().sum() > 0 for attn in model.attns)
    assert model.attns[0].edge_mode == edge_mode


def import_example():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import node_classification
    finally:
        sys.path.remove(str(REPO / "examples"))
    return node_classification


# Scripted validation (loss, accuracy) per epoch, and what each early-stopping rule makes of it
# with patience 2, worked out by hand from the rules' definitions (ties count as better):
# - loss+acc: progress at 1-6 (1 and 4 both at their best; 2, 6 loss; 3, 5 accuracy), none at
#   7, 8 -> stops at 8 with the model of epoch 4;
# - acc: progress at 1, 3, 4, 5 (4 and 5 tie 0.6), none at 6, 7 -> stops at 7 with the model
#   of epoch 5.
VALIDATION_CURVE = [(1.0, 0.5), (0.9, 0.4), (1.1, 0.6), (0.8, 0.6), (1.2, 0.6), (0.7, 0.3),
                    (1.4, 0.2), (1.5, 0.2), (1.6, 0.2), (1.7, 0.2)]
# loss+acc on ties and on a best accuracy that stays while only the loss improves: epoch 2 ties
# epoch 1 (kept), 3 is progress by its loss alone, 4's accuracy 0.4 is below the best 0.5 (no
# progress), 5 neither -> stops at 5 with the model of epoch 2.
TIED_CURVE = [(1.0, 0.5), (1.0, 0.5), (0.9, 0.3), (1.1, 0.4), (1.2, 0.2), (1.3, 0.2)]


@pytest.mark.parametrize("stop_on, epochs, chosen, curve", [
    ("loss+acc", 8, 4, VALIDATION_CURVE), ("acc", 7, 5, VALIDATION_CURVE),
    ("loss+acc", 5, 2, TIED_CURVE)])
def test_early_stopping_rules(monkeypatch, stop_on, epochs, chosen, curve):
    example = import_example()
    mask = torch.ones(6, dtype=torch.bool)
    data = Data(x=torch.randn(6, 3), edge_index=random_graph(6, 12),
                y=torch.tensor([0, 1, 0, 1, 0, 1]), train_mask=mask, val_mask=mask.clone(),
                test_mask=mask.clone())

    class Linear(torch.nn.Linear):
        def forward(self, x, edge_index):
            return super().forward(x)

    states = []  # the model's weights at each validation

    def scripted_evaluate(model, data, mask):
        if mask is data.test_mask:
            return 0.0, 0.75
        states.append(model.weight.detach().clone())
        return curve[len(states) - 1]

    monkeypatch.setattr(example, "evaluate", scripted_evaluate)
    torch.manual_seed(0)
    model = Linear(3, 2)
    r = example.train_node_classifier(model, data, epochs=len(curve), patience=2,
                                      stop_on=stop_on, progress=False)
    assert (r.epochs, r.best_epoch) == (epochs, chosen)
    assert r.val_acc == curve[chosen - 1][1] and r.test_acc == 0.75
    torch.testing.assert_close(model.weight, states[chosen - 1], rtol=0, atol=0)
    assert not torch.equal(states[chosen - 1], states[-1])  # the kept model is not the last one
    with pytest.raises(ValueError, match="stop_on must be one of .*got 'loss'"):
        example.train_node_classifier(model, data, stop_on="loss")


@pytest.mark.parametrize("diverges_at", [1, 3])
def test_diverged_training_stops_and_reports_a_measured_model(diverges_at):
    """A run whose loss went NaN at its first epoch reported "val 0.0%", the initial value of
    a model it never measured, and trained on until patience ran out."""
    example = import_example()
    mask = torch.ones(4, dtype=torch.bool)
    data = Data(x=torch.randn(4, 3), edge_index=random_graph(4, 6),
                y=torch.tensor([0, 1, 0, 0]), train_mask=mask, val_mask=mask, test_mask=mask)

    class Diverging(torch.nn.Module):  # starts at zero logits (class 0 for all: 3 of 4 right)
        def __init__(self):
            super().__init__()
            self.logits, self.steps = torch.nn.Parameter(torch.zeros(4, 2)), 0

        def forward(self, x, edge_index):  # NaN from training step `diverges_at` on
            self.steps += self.training
            nan = self.training and self.steps >= diverges_at
            return self.logits * (math.nan if nan else 1.0)

    with pytest.warns(RuntimeWarning, match=f"training loss is nan at epoch {diverges_at}: "
                                            f"training diverged"):
        r = example.train_node_classifier(Diverging(), data, epochs=50, patience=10,
                                          progress=False)
    assert r.epochs == len(r.train_loss) == len(r.epoch_times) == diverges_at - 1
    assert 0 <= r.best_epoch < diverges_at and r.val_acc == r.test_acc  # one mask, one model
    assert (r.best_epoch, r.val_acc) == (0, 0.75) if diverges_at == 1 else r.best_epoch == 2
    assert math.isnan(example.summarise([r])["epoch_ms"]) == (diverges_at == 1)


def test_training_needs_an_epoch_and_a_patience(capsys):
    """patience 0 used to mean "never stop" and epochs 0 crashed in the summary."""
    example = import_example()
    data = Data(x=torch.randn(4, 3), edge_index=random_graph(4, 6),
                y=torch.tensor([0, 1, 0, 1]), train_mask=torch.ones(4, dtype=torch.bool))
    for kwargs, match in (({"epochs": 0}, "epochs must be at least 1, got 0"),
                          ({"patience": 0}, "patience must be at least 1, got 0"),
                          ({"patience": -1}, "patience must be at least 1, got -1")):
        with pytest.raises(ValueError, match=match):
            example.train_node_classifier(torch.nn.Linear(3, 2), data, **kwargs)
    for flag in ("--epochs", "--runs", "--patience"):
        with pytest.raises(SystemExit):
            example.parse_args([flag, "0"])
        assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err


def test_example_times_epochs_on_the_device_of_the_data(monkeypatch):
    """With --device cuda:1 the epoch timer synchronised the current device (cuda:0), not the
    one doing the work: the times left out the queued backward and optimiser step."""
    example = import_example()

    class CudaFeatures:  # the two attributes the training loop reads of data.x besides passing it
        is_cuda = True
        device = torch.device("cuda", 1)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logits = torch.nn.Parameter(torch.zeros(4, 2))

        def forward(self, x, edge_index):
            return self.logits

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    mask = torch.ones(4, dtype=torch.bool)
    data = Data(x=CudaFeatures(), edge_index=torch.zeros(2, 0, dtype=torch.long),
                y=torch.tensor([0, 1, 0, 1]), train_mask=mask, val_mask=mask, test_mask=mask)
    r = example.train_node_classifier(Logits(), data, epochs=3, progress=False)
    assert r.epochs == 3 and synced == [torch.device("cuda", 1)] * 3


def test_example_accuracy_is_an_exact_ratio():
    """725 of 1000 right is 0.725, not float32's 0.72500002: means over seeds decide goals."""
    example = import_example()

    class Fixed(torch.nn.Module):
        def forward(self, x, edge_index):
            return torch.nn.functional.one_hot((torch.arange(1000) >= 725).long(), 2).float()

    data = Data(x=torch.zeros(1000, 1), edge_index=torch.zeros(2, 0, dtype=torch.long),
                y=torch.zeros(1000, dtype=torch.long))
    assert example.evaluate(Fixed(), data, torch.ones(1000, dtype=torch.bool))[1] == 0.725
    r = example.RunResult(test_acc=0.725, val_acc=0.7, best_epoch=1, epochs=1, epoch_times=[0.1])
    assert example.format_accuracy(example.summarise([r])) == "72.5 (one run: no std)"


def test_example_summary_is_over_runs():
    example = import_example()
    runs = [example.RunResult(test_acc=0.7, val_acc=0.6, best_epoch=4, epochs=10,
                              epoch_times=[0.1, 0.3]),
            example.RunResult(test_acc=0.8, val_acc=0.8, best_epoch=6, epochs=20,
                              epoch_times=[0.2])]
    s = example.summarise(runs)
    assert s["test_mean"] == pytest.approx(75.0) and s["val_mean"] == pytest.approx(70.0)
    assert s["test_std"] == pytest.approx(50 ** 0.5)  # sample std of 70 and 80
    assert s["epoch_ms"] == pytest.approx(200.0)  # the median over every epoch of every run
    assert (s["epochs"], s["best_epoch"]) == (15, 5)


def test_example_runs_use_seeds_seed_plus_run_and_the_documented_score(monkeypatch):
    """--runs 3 --seed 5 trains with seeds 5, 6, 7; --attention defaults to additive for gat
    and dot for the transformer (its --help)."""
    example = import_example()
    seeds = []

    def record(model, data, **kwargs):
        seeds.append(torch.initial_seed())
        return example.RunResult(test_acc=0.5, val_acc=0.5, best_epoch=1, epochs=1)

    data = Data(x=torch.randn(4, 3), edge_index=random_graph(4, 6), y=torch.tensor([0, 1, 0, 1]))
    monkeypatch.setattr(example, "load_planetoid", lambda name, root: data)
    monkeypatch.setattr(example, "train_node_classifier", record)
    monkeypatch.setattr(example, "plot_curves", lambda results, path, title: False)
    example.main(["--runs", "3", "--seed", "5", "--device", "cpu", "--no-progress"])
    assert seeds == [5, 6, 7]
    assert example.parse_args([]).attention == "additive"
    assert example.parse_args(["--model", "transformer"]).attention == "dot"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine "
                    "without CUDA")
def test_example_device_cuda_without_cuda_exits_with_a_message(tmp_path, capsys):
    example = import_example()
    with pytest.raises(SystemExit):
        example.main(["--device", "cuda", "--root", str(tmp_path)])
    assert "error: --device cuda, but torch" in capsys.readouterr().err


def test_example_defaults_follow_the_gat_paper_per_dataset():
    """lr, weight decay and output heads of the GAT paper (section 3.3): PubMed 0.01, 1e-3 and
    8 heads, Cora and CiteSeer 0.005, 5e-4 and 1 head; flags given by hand win."""
    example = import_example()
    paper = {"Cora": (0.005, 5e-4, 1), "CiteSeer": (0.005, 5e-4, 1), "pubmed": (0.01, 1e-3, 8)}
    for dataset, setup in paper.items():
        args = example.parse_args(["--dataset", dataset])
        assert (args.lr, args.weight_decay, args.out_heads) == setup
    args = example.parse_args(["--dataset", "PubMed", "--lr", "0.002", "--out-heads", "2"])
    assert (args.lr, args.weight_decay, args.out_heads) == (0.002, 1e-3, 2)


def test_example_exits_with_the_loader_message(tmp_path):
    """An unknown dataset ends the example with one line, not a traceback."""
    example = import_example()
    with pytest.raises(SystemExit, match=r"error: name must be one of \['Cora', 'CiteSeer', "
                                         r"'PubMed'\] \(any case\), got 'Pubmad'"):
        example.main(["--dataset", "Pubmad", "--root", str(tmp_path)])


@pytest.mark.parametrize("argv, match", [
    (["--device", "gpu"], r"--device must name a torch device .*got 'gpu'"),
    (["--hidden", "0"], r"--hidden must be at least 1, got 0"),
    (["--heads", "-2"], r"--heads must be at least 1, got -2"),
    (["--out-heads", "0"], r"--out-heads must be at least 1, got 0"),
    (["--model", "transformer", "--layers", "0"], r"--layers must be at least 1, got 0"),
    (["--dropout", "1.5"], r"--dropout must be in \[0, 1\), got 1.5"),
    (["--lr", "-1"], r"--lr must be > 0, got -1.0"),
    (["--lr", "0"], r"--lr must be > 0, got 0.0"),
    (["--threads", "0"], r"--threads must be at least 1, got 0"),
    (["--device", "mps"], r"--device mps is not usable here"),
    (["--layers", "3"], r"--layers is an option of --model transformer, got --model gat"),
    (["--model", "transformer", "--out-heads", "2"],
     r"--out-heads is an option of --model gat, got --model transformer"),
    (["--weight-decay", "nan"], r"--weight-decay must be a finite number >= 0, got nan"),
    (["--weight-decay", "inf"], r"--weight-decay must be a finite number >= 0, got inf"),
    (["--lr", "inf"], r"--lr must be a finite number >= 0, got inf"),  # (NaN at epoch 2)
    (["--model", "transformer", "--heads", "3"],
     r"--hidden must be divisible by --heads .*got --hidden 64 and --heads 3"),
    (["--out", __file__], r"--out must be a folder .*, a file"),  # before any training
    (["--out", __file__ + "/sub"], r"--out must be a folder .*, a file"),
])
def test_example_refuses_bad_flag_values_by_flag_name(argv, match, capsys):
    """A wrong value ends the script with a usage error naming the flag, not a traceback from
    torch or from a model constructor (that named hidden_channels or lr)."""
    example = import_example()
    with pytest.raises(SystemExit):
        example.parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


def test_example_missing_files_message_speaks_of_its_flags(tmp_path, monkeypatch):
    """The loader's advice names its own arguments; the example adds what they are called here.
    (The loader is replaced: with internet access it would download the files instead.)"""
    from graphattn.datasets import MissingFilesError

    example = import_example()

    def offline(name, root):
        raise MissingFilesError(f"{name}: 1 raw file(s) missing from {root}")

    monkeypatch.setattr(example, "load_planetoid", offline)
    with pytest.raises(SystemExit, match=r"(?s)^error: Cora: 1 raw file\(s\) missing.*\nHere: "
                                         r"--root names the data root"):
        example.main(["--dataset", "Cora", "--root", str(tmp_path), "--device", "cpu"])


def test_example_trains_gat_on_cora_smoke(tmp_path, capsys):
    """A few epochs of the example end to end: training, early-stopping bookkeeping, table, PNG."""
    from test_datasets import PARTS, source_dir

    root = source_dir("Cora", PARTS).parent.parent
    node_classification = import_example()
    results = node_classification.main(["--epochs", "40", "--runs", "2", "--root", str(root),
                                        "--out", str(tmp_path), "--no-progress",
                                        "--device", "cpu"])
    out = capsys.readouterr().out
    assert "| Cora | gat | additive | 2 |" in out
    assert (tmp_path / "cora_gat_additive.png").is_file()
    for r in results:
        assert r.epochs == 40 and 1 <= r.best_epoch <= 40
        assert r.train_loss[-1] < r.train_loss[0]
        assert r.val_acc == r.val_accs[r.best_epoch - 1]
        assert r.val_acc > 0.5 and r.test_acc > 0.5  # chance is 1/7 (most frequent class 0.32)


def test_models_infer_in_channels():
    torch.manual_seed(0)
    x, edge_index = torch.randn(12, 7), random_graph(12, 40, seed=4)
    for model in (GAT(-1, 3), GraphTransformer(-1, 16, 3)):
        assert model(x, edge_index).shape == (12, 3)
        assert sum(p.numel() for p in model.parameters()) > 0
    with pytest.raises(ValueError, match=r"in_channels must be a positive integer, or -1 .*"
                                         r"got 0"):
        GAT(0, 3)


def test_models_refuse_a_pair_of_in_channels():
    with pytest.raises(ValueError, match=r"in_channels of GAT must be an integer \(one feature "
                                         r"matrix x\), got \(5, 7\)"):
        GAT((5, 7), 3)
    with pytest.raises(ValueError, match=r"in_channels of GraphTransformer must be an integer"):
        GraphTransformer((5, 5), 8, 3)


@pytest.mark.parametrize("model", ["GAT", "GraphTransformer"])
def test_sparse_features_under_autocast(model):
    """fp32 sparse CSR features into an fp32 model under torch.autocast: the first projection
    multiplies them in fp32 (torch has no bf16 CSR product on CPU, and the call failed), and
    the model computes what it computes on the dense features there; training steps run."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(12, 10, generator=gen) * (torch.rand(12, 10, generator=gen) < 0.3)
    edge_index = torch.randint(0, 12, (2, 40), generator=gen)
    torch.manual_seed(0)
    net = (GAT(10, 3, hidden_channels=4, heads=2) if model == "GAT"
           else GraphTransformer(10, 8, 3, heads=2)).eval()
    outs = []
    for features in (x.to_sparse_csr(), x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(net(features, edge_index))
    assert_close(outs[0].float(), outs[1].float(), atol=3e-2, rtol=3e-2)
    net.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = net(x.to_sparse_csr(), edge_index).float().square().mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in net.parameters() if p.requires_grad)


def test_gat_refuses_a_conv_that_builds_nothing():
    with pytest.raises(TypeError, match=r"conv must be a callable that builds a layer .*, got 5"):
        GAT(6, 3, conv=5)  # ('int' object is not callable)


def test_gat_reset_parameters_redraws_both_layers():
    """Every projection of both layers is drawn again: Glorot weights, zero biases."""
    model = GAT(8, 16, hidden_channels=3, heads=4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.reset_parameters()
    for conv in (model.conv1, model.conv2):
        assert conv.lin_v.bias is None and conv.out_bias.abs().sum() == 0
        for lin in (conv.lin_q, conv.lin_k, conv.lin_v):
            assert lin.bias is None or lin.bias.abs().sum() == 0
            bound = (6 / (lin.in_features + lin.out_features)) ** 0.5
            assert 0 < lin.weight.abs().max() <= bound


def test_graph_transformer_reset_parameters_keeps_the_layers_initialisation():
    """reset_parameters re-draws every weight the way the constructor did: the attention
    layers' Glorot projections with zero biases, not torch's default Linear init."""
    torch.manual_seed(0)
    model = GraphTransformer(8, 16, 3, heads=4)
    before = {name: p.clone() for name, p in model.named_parameters()}
    model.reset_parameters()
    for attn in model.attns:
        for lin in (attn.lin_q, attn.lin_k, attn.lin_v, attn.lin_out):
            assert lin.bias.abs().sum() == 0
            bound = (6 / (lin.in_features + lin.out_features)) ** 0.5
            assert lin.weight.abs().max() <= bound
            # Glorot's bound, not Kaiming-uniform's 1/sqrt(fan_in) = 0.25 here
            assert lin.weight.abs().max() > 1 / lin.in_features ** 0.5
    assert not torch.equal(model.lin_in.weight, before["lin_in.weight"])
    assert not torch.equal(model.attns[0].lin_q.weight, before["attns.0.lin_q.weight"])


@pytest.mark.parametrize("x, got", [((torch.randn(10, 6), torch.randn(10, 6)), "tuple"),
                                    (None, "NoneType"), (torch.randn(10), "[10]")])
def test_gat_checks_x_by_name(x, got):
    """A pair (x_src, x_dst), as GraphSelfAttention takes, None, or a 1-D x: "'tuple' object
    has no attribute 'dtype'" and the like before."""
    model = GAT(6, 3, hidden_channels=2, heads=2)
    with pytest.raises(ValueError, match=rf"x must have shape \[N, F\], got {re.escape(got)}"):
        model(x, random_graph(10, 30))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_gat_refuses_integer_features_by_name(training):
    """In training the feature dropout met the integers first: "result type Float can't be
    cast to the desired output type Long"."""
    model = GAT(6, 3, hidden_channels=2, heads=2).train(training)
    with pytest.raises(TypeError, match="x must have a floating-point dtype, got torch.int64"):
        model(torch.ones(10, 6, dtype=torch.long), random_graph(10, 30))


def test_graph_transformer_checks_x_by_name():
    """A wrong x reached torch's own errors ("mat1 and mat2 shapes cannot be multiplied",
    "result type Float can't be cast") or, for a 1-D x, an error quoting the hidden state's
    shape [D] as the shape of x."""
    x, ei = torch.randn(10, 6), random_graph(10, 30)
    for model in (GraphTransformer(6, 8, 2, heads=2), GraphTransformer(-1, 8, 2, heads=2)):
        with pytest.raises(ValueError, match=r"x must have shape \[N, F\], got \[6\]"):
            model(torch.randn(6), ei)
        model(x, ei)  # sizes the lazy model
        with pytest.raises(ValueError, match=r"x must have F = in_channels = 6 features, "
                                             r"got \[10, 5\]"):
            model(torch.randn(10, 5), ei)
        with pytest.raises(ValueError, match=r"x must have F = in_channels = 6 features, "
                                             r"got \[10, 5\]"):
            model(torch.randn(10, 5).to_sparse_csr(), ei)
        with pytest.raises(TypeError, match="x must have a floating-point dtype, got torch.int64"):
            model(torch.ones(10, 6, dtype=torch.long), ei)


def test_graph_transformer_with_edge_dim_needs_edge_attr():
    """With edge_dim set, a call without edge_attr ran without the edge features (no layer's
    lin_edge got a gradient); edge_attr passed by position landed in pe, silently so when its
    shape [E, D_e] happened to be [N, pe_channels]."""
    torch.manual_seed(0)
    x, ei = torch.randn(10, 6), random_graph(10, 10)  # E = N
    edge_attr = torch.randn(10, 3)
    with_pe = GraphTransformer(6, 8, 2, heads=2, pe_channels=3, edge_dim=3)
    no_pe = GraphTransformer(6, 8, 2, heads=2, edge_dim=3)
    match = (r"edge_attr must be given: the model has edge_dim=3 .*by keyword, "
             r"edge_attr=\.\.\.; the third positional argument is pe")
    with pytest.raises(ValueError, match=match):
        with_pe(x, ei, edge_attr)
    with pytest.raises(ValueError, match=match):
        no_pe(x, ei, edge_attr)
    with pytest.raises(ValueError, match=match):
        no_pe(x, ei)
    assert with_pe(x, ei, torch.randn(10, 3), edge_attr=edge_attr).shape == (10, 2)
    assert no_pe(x, ei, edge_attr=edge_attr).shape == (10, 2)


def fixed_dropout(x, p, training=True, inplace=False):
    """A stand-in for dropout with a mask fixed by the shape and p (not by the global RNG), so
    that a reference written out by hand drops the same entries at the same places."""
    if not training or p == 0.0:
        return x
    gen = torch.Generator().manual_seed(x.numel() + round(1000 * p))
    keep = (torch.rand(x.shape, generator=gen, dtype=torch.float64) >= p).to(x.dtype)
    return x * keep / (1 - p)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_gat_is_the_papers_network_of_two_gatconv_layers(monkeypatch, training):
    """GAT written out from the paper with two PyG GATConv layers (not through ``GAT``):
    dropout on the input, ELU of the concatenated hidden heads, dropout, and the output heads
    averaged. Attention and value dropout are 0, and the feature dropout is a fixed mask."""
    from test_additive_attention import copy_gat_into

    import graphattn.nn.models as models

    monkeypatch.setattr(models, "dropout", fixed_dropout)
    torch.manual_seed(0)
    p, F_in, C, H, classes, H_out = 0.3, 10, 3, 2, 4, 3
    model = GAT(F_in, classes, hidden_channels=C, heads=H, out_heads=H_out, dropout=p,
                attention_dropout=0.0, value_dropout=0.0).double().train(training)
    gat1 = GATConv(F_in, C, H, concat=True).double()
    gat2 = GATConv(H * C, classes, H_out, concat=False).double()
    for layer, gat in ((model.conv1, gat1), (model.conv2, gat2)):
        with torch.no_grad():
            gat.bias.normal_()
        copy_gat_into(layer, gat)
    x, ei = torch.randn(15, F_in, dtype=torch.float64), random_graph(15, 40)
    drop = (lambda t: fixed_dropout(t, p)) if training else (lambda t: t)
    hidden = torch.nn.functional.elu(gat1(drop(x), ei))  # (N, H * C)
    expected = gat2(drop(hidden), ei)  # (N, classes), mean of H_out heads
    assert_close(model(x, ei), expected)


def test_graph_transformer_training_wiring(monkeypatch):
    """In training, dropout sits on the input features, on the FFN's inner units and on each
    sublayer's output before the residual sum -- nowhere else (not on pe, nor on the residual
    stream). Written out with the model's own sublayers and a fixed-mask dropout."""
    import graphattn.nn.models as models

    monkeypatch.setattr(models, "dropout", fixed_dropout)  # the FFN's Dropout module too
    torch.manual_seed(0)
    N, F_in, D, P, p = 9, 5, 8, 3, 0.25
    model = GraphTransformer(F_in, D, 3, num_layers=2, heads=2, pe_channels=P, dropout=p,
                             attention_dropout=0.0, ffn_ratio=3).double().train()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))  # LayerNorms too: not ones and zeros
    x, pe = torch.randn(N, F_in, dtype=torch.float64), torch.randn(N, P, dtype=torch.float64)
    ei = random_graph(N, 25)
    gelu = torch.nn.functional.gelu
    h = model.lin_in(fixed_dropout(x, p)) + pe @ model.lin_pe.weight.t()
    for i in range(2):
        h = h + fixed_dropout(model.attns[i](model.attn_norms[i](h), ei), p)
        lin1, lin2 = model.ffns[i][0], model.ffns[i][3]
        inner = fixed_dropout(gelu(lin1(model.ffn_norms[i](h))), p)  # (N, 3 D)
        h = h + fixed_dropout(lin2(inner), p)
    expected = model.lin_out(model.norm_out(h))
    assert_close(model(x, ei, pe), expected)


def test_graph_transformer_ffn_dropout_draws_graphattns_masks():
    """The FFN's dropout module is torch.nn.Dropout drawing graphattn's masks (the fast CPU
    draw): the same seed gives x * dropout_mask; in eval it is the identity; the parameter
    names are those of torch.nn.Dropout in the same place."""
    from graphattn.functional.dropout import dropout_mask

    model = GraphTransformer(5, 8, 3, heads=2, dropout=0.3)
    drop = model.ffns[0][2]
    assert isinstance(drop, torch.nn.Dropout) and drop.p == 0.3
    x = torch.randn(40, 16)
    torch.manual_seed(7)
    out = drop(x)
    torch.manual_seed(7)
    assert_close(out, x * dropout_mask((40, 16), 0.3))
    assert 0 < int((out == 0).sum()) < x.numel()
    assert drop.eval()(x) is x
    keys = [k for k in model.state_dict() if k.startswith("ffns.0.")]
    assert keys == ["ffns.0.0.weight", "ffns.0.0.bias", "ffns.0.3.weight", "ffns.0.3.bias"]


@pytest.mark.parametrize("conv", [None, GATConv], ids=["GraphSelfAttention", "GATConv"])
def test_gat_returns_both_layers_attention_weights(conv):
    torch.manual_seed(0)
    N = 12
    model = GAT(5, 3, hidden_channels=4, heads=2, conv=conv).eval()
    x, ei = torch.randn(N, 5), random_graph(N, 30)
    out, weights = model(x, ei, return_attention_weights=True)
    assert_close(out, model(x, ei))
    hidden, first = model.conv1(x, ei, return_attention_weights=True)
    _, second = model.conv2(torch.nn.functional.elu(hidden), ei, return_attention_weights=True)
    for got, expected in zip(weights, [first, second], strict=True):
        assert torch.equal(got[0], expected[0])
        assert_close(got[1], expected[1])
    assert weights[0][1].shape[1] == 2 and weights[1][1].shape[1] == 1  # heads, out_heads


def test_graph_transformer_returns_each_blocks_attention_weights():
    """The weights of block b are those its layer gives on block b's input, written out with
    the model's own sublayers; the outputs are the same with and without them."""
    from torch_geometric.utils import scatter

    torch.manual_seed(0)
    N, P = 12, 3
    model = GraphTransformer(5, 8, 3, num_layers=3, heads=2, pe_channels=P).eval()
    x, pe, ei = torch.randn(N, 5), torch.randn(N, P), random_graph(N, 30)
    out, weights = model(x, ei, pe, return_attention_weights=True)
    assert_close(out, model(x, ei, pe))
    assert len(weights) == 3
    h = model.lin_in(x) + model.lin_pe(pe)
    for b in range(3):
        a, (edges, alpha) = model.attns[b](model.attn_norms[b](h), ei,
                                           return_attention_weights=True)
        assert torch.equal(weights[b][0], edges)
        assert_close(weights[b][1], alpha)
        assert_close(scatter(alpha, edges[1], 0, dim_size=N, reduce="sum"), torch.ones(N, 2))
        h = h + a
        h = h + model.ffns[b](model.ffn_norms[b](h))
    adj_t = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)), (N, N)).coalesce()
    _, sparse_weights = model(x, adj_t, pe, return_attention_weights=True)
    assert [w[0].layout for w in sparse_weights] == [torch.sparse_coo] * 3


def test_graph_transformer_parameter_count():
    """Counted from the docstring: lin_in, lin_pe without bias, per block two LayerNorms,
    four D x D projections with biases and an FFN of ffn_ratio * D units; a final LayerNorm
    and lin_out. Shared or missing submodules change the count."""
    F_in, D, out, L, P, r = 5, 12, 3, 3, 4, 3
    model = GraphTransformer(F_in, D, out, num_layers=L, heads=3, pe_channels=P, ffn_ratio=r)
    block = 2 * 2 * D + 4 * (D * D + D) + (D * r * D + r * D) + (r * D * D + D)
    expected = (F_in * D + D) + P * D + L * block + 2 * D + (D * out + out)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_feature_dropout_on_uncoalesced_coo():
    """Duplicate COO entries are one feature: summed first, then kept or dropped as a whole."""
    indices = torch.tensor([[0, 0, 1, 2, 2], [1, 1, 0, 3, 3]])
    values = torch.tensor([1.0, 2.0, 4.0, 0.5, 0.25])
    x = torch.sparse_coo_tensor(indices, values, (3, 4))  # not coalesced
    dense = torch.zeros(3, 4)
    dense[0, 1], dense[1, 0], dense[2, 3] = 3.0, 4.0, 0.75
    torch.manual_seed(0)
    for _ in range(5):
        out = feature_dropout(x, 0.5, training=True).to_dense()
        kept = out != 0
        assert not (kept & (dense == 0)).any()
        assert_close(out[kept], dense[kept] / 0.5)


@pytest.mark.parametrize("make", [lambda: GAT(-1, 3), lambda: GraphTransformer(-1, 8, 3)],
                         ids=["GAT", "GraphTransformer"])
def test_to_hetero_on_the_models_is_refused_by_name(make):
    """The models' shape checks read a torch.fx Proxy and said "x must have shape [N, F], got
    Proxy"; their layers add self-loops, which to_hetero refuses between two node types."""
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    data = HeteroData()
    data["paper"].x, data["author"].x = torch.randn(4, 6), torch.randn(3, 6)
    data["author", "writes", "paper"].edge_index = torch.tensor([[0, 1, 2], [0, 1, 3]])
    data["paper", "cites", "paper"].edge_index = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(TypeError, match=r"is a model of graphs with one node type .*"
                                        r"GraphSelfAttention layers"):
        to_hetero(make(), data.metadata())


def test_gat_takes_its_widths_by_keyword():
    """GAT(1433, 64, 7), read in PyG's or GraphTransformer's order (hidden second), built 64
    classes with hidden_channels=7: now a TypeError."""
    with pytest.raises(TypeError, match="positional argument"):
        GAT(20, 64, 7)
    assert GAT(20, 7, hidden_channels=64).conv2.out_channels == 7


def test_model_input_checks_kept_by_mutation_testing():
    """Checks whose removal the suite did not notice: a list in_channels (read as a bipartite
    pair), x of another dtype than the weights (torch's "mat1 and mat2"), and a float64
    positional encoding, which the model casts to its dtype."""
    with pytest.raises(ValueError, match="in_channels"):
        GAT([3, 4], 2)
    model = GraphTransformer(3, 8, 2, pe_channels=2).eval()
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 3]])
    with pytest.raises(TypeError, match=r"x must have the dtype of the layer's weights"):
        model(torch.ones(4, 3, dtype=torch.float64), edge_index, torch.zeros(4, 2))
    pe = torch.randn(4, 2, dtype=torch.float64)
    x = torch.randn(4, 3)
    assert_close(model(x, edge_index, pe), model(x, edge_index, pe.float()))


def test_graph_transformer_attn_bias_reaches_every_block():
    """With ``add_self_loops=False`` the blocks attend along the graph as given (its loops
    included); ``attn_bias`` enters every block's scores: -inf on every edge but the loops
    leaves each node attending to itself in both blocks, as the graph of loops alone does;
    a constant per head changes nothing."""
    from graphattn import graphs, pe

    torch.manual_seed(0)
    N = 15
    x = torch.randn(N, 12)
    edges = torch.unique(random_graph(N, 50), dim=1)
    edges = edges[:, edges[0] != edges[1]]
    loops = torch.arange(N).expand(2, N)
    with_loops = torch.cat([edges, loops], dim=1)
    plain = GraphTransformer(12, 16, 5, dropout=0.0).eval()
    given = GraphTransformer(12, 16, 5, dropout=0.0, add_self_loops=False).eval()
    given.load_state_dict(plain.state_dict())
    assert not any(a.add_self_loops for a in given.attns)
    assert_close(given(x, with_loops), plain(x, edges))
    only_loops = torch.zeros(with_loops.size(1), 4).masked_fill(
        (with_loops[0] != with_loops[1]).unsqueeze(1), float("-inf"))
    assert_close(given(x, with_loops, attn_bias=only_loops), given(x, loops))
    assert not torch.allclose(given(x, with_loops), given(x, loops), atol=1e-3)
    constant = torch.tensor([0.5, -2.0, 3.0, 0.0]).expand(with_loops.size(1), 4)
    assert_close(given(x, with_loops, attn_bias=constant), given(x, with_loops))
    with pytest.raises(ValueError, match="attn_bias needs add_self_loops=False"):
        plain(x, edges, attn_bias=torch.zeros(edges.size(1), 4))
    # a learned bias of each hop distance: its gradient comes back through both blocks
    spatial = pe.DistanceBias(4, 3)
    distance = pe.hop_distance(graphs.chain_graph(N), N, with_loops)
    given.train()
    given(x, with_loops, attn_bias=spatial(distance)).square().sum().backward()
    assert spatial.weight.grad.abs().sum() > 0
