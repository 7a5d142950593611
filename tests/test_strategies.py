"""Strategy rules: contractions, followers, reductions, norms, attention, divisibility."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import fx

import autoplan
from autoplan.sharding import P, R, S
from autoplan.strategies.candidates import (
    enumerate_strategies,
    tensor_input_nodes,
    tensor_specs,
)
from autoplan.strategies.index_maps import index_map_for, known_ops
from op_nodes import op_node


def _strategies(node: fx.Node, mesh: tuple[int, ...]):
    names = [n.name for n in tensor_input_nodes(node)]
    return enumerate_strategies(index_map_for(node), names, mesh, frozenset(names))


def test_linear_on_a_1d_mesh_has_batch_row_column_and_partial() -> None:
    node = op_node(lambda x, w: F.linear(x, w), torch.randn(8, 16), torch.randn(32, 16), target="linear")
    specs = {(s.input_specs, s.output_spec) for s in _strategies(node, (4,))}
    assert ((((R,), (R,)), (R,))) in specs                  # replicated
    assert ((((S(0),), (R,)), (S(0),))) in specs            # batch (data parallel)
    assert ((((R,), (S(0),)), (S(1),))) in specs            # column: weight rows sharded
    assert ((((S(1),), (S(1),)), (P,))) in specs            # row: contraction -> partial sums
    assert len(specs) == 4


def test_a_dim_is_split_over_two_mesh_axes_across_nodes_or_where_a_rule_asks() -> None:
    """HSDP's batch: ``S(0)`` on both axes of a 2-D mesh. Offered where a rule asks for it
    (``--manual dp=,fsdp=``) and on a mesh whose axes cross nodes; not on one node, where the
    1-D mesh of the same devices offers it."""
    from autoplan.cost_models import OptimizerSpec, load_cluster
    from autoplan.cost_models.step_costs import CostContext
    from autoplan.planner.mesh_plan import StorageRule, splits_dims_over_axes

    node = op_node(lambda x, w: F.linear(x, w), torch.randn(8, 16), torch.randn(32, 16), target="linear")
    names = [n.name for n in tensor_input_nodes(node)]
    both = ((((S(0), S(0)), (R, R)), (S(0), S(0))))
    for over, expected in ((False, False), (True, True)):
        specs = {(s.input_specs, s.output_spec) for s in enumerate_strategies(
            index_map_for(node), names, (2, 2), frozenset(names), dims_over_axes=over)}
        assert (both in specs) == expected
    assert ((S(0), S(0)) in tensor_specs((8, 16), (2, 2), dims_over_axes=True)) \
        and (S(0), S(0)) not in tensor_specs((8, 16), (2, 2))

    cluster = load_cluster("h100")  # 8 devices a node
    optimizer = OptimizerSpec("adamw")

    def ctx(mesh: tuple[int, ...]) -> CostContext:
        return CostContext(mesh, cluster.mesh_links(mesh), cluster.device, optimizer)

    assert splits_dims_over_axes(ctx((2, 8)))  # axis 0 across nodes, axis 1 inside one
    assert not splits_dims_over_axes(ctx((2, 4)))  # one node
    assert splits_dims_over_axes(ctx((2, 4)), StorageRule(lambda info, spec: True, dims_over_axes=True))


def test_a_dim_the_mesh_does_not_divide_is_absent() -> None:
    node = op_node(lambda x, w: F.linear(x, w), torch.randn(6, 16), torch.randn(32, 16), target="linear")
    outs = {s.output_spec for s in _strategies(node, (4,))}
    assert (S(0),) not in outs  # 6 rows over 4 devices
    assert (S(1),) in outs


def test_column_parallel_input_gradient_is_partial() -> None:
    node = op_node(lambda x, w: F.linear(x, w), torch.randn(8, 16), torch.randn(32, 16), target="linear")
    column = next(s for s in _strategies(node, (4,)) if s.output_spec == (S(1),))
    assert column.partial_grads == ((0, 0),)  # x's gradient is all-reduced over axis 0
    batch = next(s for s in _strategies(node, (4,)) if s.output_spec == (S(0),))
    assert batch.partial_grads == ((1, 0),)  # the weight's gradient: data-parallel reduction


def test_2d_mesh_combines_letters() -> None:
    node = op_node(lambda x, w: F.linear(x, w), torch.randn(8, 16), torch.randn(32, 16), target="linear")
    names = {s.name for s in _strategies(node, (2, 2))}
    assert "S0S1 = S0R x RS0" in names  # batch on axis 0, columns on axis 1


def test_softmax_dim_and_layer_norm_dims_stay_whole() -> None:
    node = op_node(lambda x: torch.softmax(x, -1), torch.randn(8, 16), target="softmax")
    assert {s.output_spec for s in _strategies(node, (2,))} == {(R,), (S(0),)}
    ln = op_node(lambda x, w, b: F.layer_norm(x, (16,), w, b), torch.randn(8, 4, 16), torch.randn(16),
               torch.randn(16), target="layer_norm")
    assert {s.output_spec for s in _strategies(ln, (2,))} == {(R,), (S(0),), (S(1),)}


def test_view_merging_dims_keeps_the_leading_shard() -> None:
    node = op_node(lambda x: x.reshape(32, 16), torch.randn(8, 4, 16), target="reshape")
    pairs = {(s.input_specs[0], s.output_spec) for s in _strategies(node, (2,))}
    assert ((S(0),), (S(0),)) in pairs and ((S(2),), (S(1),)) in pairs
    assert all(inp != (S(1),) for inp, _ in pairs)  # the inner merged dim cannot carry the shard


def test_expand_keeps_the_dims_it_does_not_broadcast() -> None:
    """Grouped-query attention's ``repeat_kv``: ``[B, kv, 1, S, D] -> [B, kv, 4, S, D]``."""
    node = op_node(lambda x: x.expand(4, 2, 4, 8, 16), torch.randn(4, 2, 1, 8, 16), target="expand")
    pairs = {(s.input_specs[0], s.output_spec) for s in _strategies(node, (2, 2))}
    assert ((S(0), S(1)), (S(0), S(1))) in pairs  # batch and key-value heads stay sharded
    assert all(S(2) not in inp and S(2) not in out for inp, out in pairs)  # the broadcast dim stays whole


def test_attention_shards_batch_and_heads_only() -> None:
    q = torch.randn(2, 4, 8, 16)
    node = op_node(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, q.clone(), q.clone(),
                 target="scaled_dot_product_attention")
    assert {s.output_spec for s in _strategies(node, (2,))} == {(R,), (S(0),), (S(1),)}


def test_sum_of_a_sharded_dim_is_partial_and_max_is_not() -> None:
    s = op_node(lambda x: x.sum(0), torch.randn(8, 16), target="sum")
    assert (P,) in {st.output_spec for st in _strategies(s, (2,))}
    m = op_node(lambda x: x.amax(0), torch.randn(8, 16), target="amax")
    assert (P,) not in {st.output_spec for st in _strategies(m, (2,))}


def test_stored_tensor_specs_use_distinct_dims_per_axis() -> None:
    specs = tensor_specs((8, 6), (2, 2))
    assert (S(0), S(1)) in specs and (S(1), S(0)) in specs
    assert (S(0), S(0)) not in specs
    assert all(len(s) == 2 for s in specs)


def test_ops_without_a_rule_have_no_index_map() -> None:
    node = op_node(lambda x: torch.logcumsumexp(x, 0), torch.randn(8, 16), target="logcumsumexp")
    assert "logcumsumexp" not in known_ops()
    assert index_map_for(node) is None


def test_einsum_forms_without_a_rule_have_no_index_map() -> None:
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    ellipsis = op_node(lambda a, b: torch.einsum("...ij,...jk->...ik", a, b), a, b, target="einsum")
    assert index_map_for(ellipsis) is None
    explicit = op_node(lambda a, b: torch.einsum("bij,bjk->bik", a, b), a, b, target="einsum")
    imap = index_map_for(explicit)
    assert imap is not None and imap.reducible == frozenset("j") and imap.outputs == (tuple("bik"),)


def test_an_einsum_without_a_rule_is_planned_replicated_with_a_warning() -> None:
    class Ellipsis(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return torch.einsum("...ij,...kj->...ik", h, h)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoplan.plan(Ellipsis(), torch.randn(4, 8, 16), devices=2)
    messages = [str(w.message) for w in caught if "sharding rule" in str(w.message)]
    assert messages == ["no sharding rule for aten.einsum.default: planned replicated"]
    node = next(n for n in plan.nodes if "einsum" in n.op)
    assert node.strategy == "R = R"  # one input, read twice


def test_every_op_family_is_in_the_table() -> None:
    known = known_ops()
    for op in ("linear", "mm", "einsum", "add", "sum", "softmax", "view", "squeeze", "cat", "layer_norm",
               "scaled_dot_product_attention", "cross_entropy_loss", "max_pool2d", "embedding"):
        assert op in known, op


def test_partial_sums_pass_through_a_sum_of_tensors_but_not_a_number_added_to_them() -> None:
    """``x + y`` of partial sums is the partial sums of the sum; ``x + eps`` (an RMSNorm's
    variance) would add ``eps`` once per rank: partial sums must be reduced before it."""
    add_tensors = op_node(lambda x, y: x + y, torch.randn(8, 4), torch.randn(8, 4), target="add")
    add_number = op_node(lambda x: x + 1e-6, torch.randn(8, 4), target="add")
    scaled = op_node(lambda x: x * 0.5, torch.randn(8, 4), target="mul")
    assert index_map_for(add_tensors).linear and index_map_for(scaled).linear
    assert not index_map_for(add_number).linear
    assert not any(P in s.output_specs[0] for s in _strategies(add_number, (2,)))
    assert any(s.output_specs[0] == (P,) for s in _strategies(add_tensors, (2,)))


def test_partial_sums_pass_through_views_and_casts_but_not_through_a_copy() -> None:
    """DTensor all-reduces partial sums before it copies them (``clone``, a ``contiguous`` of
    a transposed value, a ``reshape`` that cannot view its input: GQA's expanded key/value
    heads), and lets them through views and casts; the planner's rules say the same, so a plan
    never counts on a partial sum a program would have reduced already."""
    x = torch.randn(2, 3, 4)
    passes = {
        "view": op_node(lambda t: t.reshape(6, 4), x, target="reshape"),
        "cast": op_node(lambda t: t.to(torch.float64), x, target="to"),
    }
    copies = {
        "clone": op_node(lambda t: t.clone(), x, target="clone"),
        "reshape of a transposed value": op_node(lambda t: t.transpose(1, 2).reshape(2, 12), x, target="reshape"),
        "contiguous of a transposed value": op_node(lambda t: t.transpose(1, 2).contiguous(), x, target="contiguous"),
        "reshape of expanded heads": op_node(lambda t: t[:, None].expand(2, 2, 3, 4).reshape(4, 3, 4), x,
                                             target="reshape"),
    }
    for name, node in passes.items():
        assert index_map_for(node).linear, name
        assert any(s.output_specs[0] == (P,) for s in _strategies(node, (2,))), name
    for name, node in copies.items():
        assert not index_map_for(node).linear, name
        assert not any(P in s.output_specs[0] for s in _strategies(node, (2,))), name
