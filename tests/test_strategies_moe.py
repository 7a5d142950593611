"""Rules for the ops of mixture-of-experts layers and their routing: repeat, repeat_interleave,
floor_divide, histc, scatter, and the grouped matmul of the experts (aten._grouped_mm and
transformers' grouped_mm_fallback).

Every rule is checked numerically: for each strategy it enumerates on a mesh of two devices,
the op is run on each device's shards of its inputs (``torch.chunk`` along a sharded dim, the
whole tensor where replicated, addends of the value where partial) and the shard outputs,
combined (concatenated where sharded, summed where partial), must equal the op on the whole
inputs."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch import fx

import transformers
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
from autoplan.load import make_model_spec
from autoplan.sharding import P, R, S
from autoplan.strategies.candidates import Strategy, enumerate_strategies, tensor_input_nodes
from autoplan.strategies.index_maps import index_map_for, known_ops, op_name
from autoplan.trace.experts import EXPERTS_OP, local_experts_forward
from autoplan.trace.tracer import trace
from op_nodes import op_node

MESH = (2,)


def _strategies(node: fx.Node, mesh: tuple[int, ...] = MESH) -> list[Strategy]:
    names = [n.name for n in tensor_input_nodes(node)]
    floating = node.meta["val"].dtype.is_floating_point  # as the planner: partial sums of floats only
    return enumerate_strategies(index_map_for(node), names, mesh, frozenset(names), allow_partial=floating)


def _outputs(node: fx.Node) -> set:
    return {s.output_spec for s in _strategies(node)}


def _run(node: fx.Node, values: dict[str, torch.Tensor]) -> torch.Tensor:
    args = fx.node.map_arg(node.args, lambda n: values[n.name])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n.name])
    return node.target(*args, **kwargs)


def _check_numerically(node: fx.Node, *inputs: torch.Tensor) -> int:
    """Run every strategy of ``node`` on a mesh of 2 on shards of ``inputs`` (the node's tensor
    inputs, in order); returns how many strategies were checked."""
    names = [n.name for n in tensor_input_nodes(node)]
    assert len(names) == len(inputs)
    whole = _run(node, {n: t.clone() for n, t in zip(names, inputs)})
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for strategy in _strategies(node):
        # a partial input's addends: rank 0 holds a random part, rank 1 the rest
        noise = [torch.randint(-3, 4, v.shape, generator=gen).to(v.dtype) for v in inputs]
        per_rank = []
        for rank in range(MESH[0]):
            shards = {}
            for name, value, spec, part in zip(names, inputs, strategy.input_specs, noise):
                p = spec[0] if spec is not None else R
                if p.is_shard:
                    shard = value.chunk(MESH[0], p.dim)[rank]
                elif p.is_partial:
                    shard = part if rank == 0 else value - part
                else:
                    shard = value
                shards[name] = shard.clone(memory_format=torch.contiguous_format)
            per_rank.append(_run(node, shards))
        out = strategy.output_spec[0]
        if out.is_shard:
            combined = torch.cat(per_rank, dim=out.dim)
        elif out.is_partial:
            combined = sum(per_rank[1:], per_rank[0])
        else:
            for other in per_rank[1:]:
                torch.testing.assert_close(other, per_rank[0], rtol=0, atol=0)
            combined = per_rank[0]
        torch.testing.assert_close(combined, whole, msg=f"{node.target} strategy {strategy.name}")
        checked += 1
    return checked


def _ints(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Small integer values: sums of products are exact in any float type."""
    return torch.randint(-2, 3, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- repeat, repeat_interleave


def test_repeat_keeps_dims_repeated_once_and_keeps_tiled_dims_whole() -> None:
    x = _ints(4, 6)
    node = op_node(lambda x: x.repeat(1, 2), x, target="repeat")
    imap = index_map_for(node)
    (xl,), (out,) = imap.inputs.values(), imap.outputs
    assert out[0] == xl[0] and out[0] not in imap.fixed  # repeated once: follows
    assert {xl[1], out[1]} <= imap.fixed  # tiled twice: whole
    assert imap.linear
    assert _outputs(node) == {(R,), (S(0),), (P,)}
    assert _check_numerically(node, x) == 3

    node = op_node(lambda x: x.repeat(2, 1, 3), x, target="repeat")
    imap = index_map_for(node)
    (xl,), (out,) = imap.inputs.values(), imap.outputs
    assert out[0] in imap.fixed  # the new leading dim
    assert out[1] == xl[0] and out[1] not in imap.fixed
    assert {xl[1], out[2]} <= imap.fixed
    assert _outputs(node) == {(R,), (S(1),), (P,)}
    assert _check_numerically(node, x) == 3


def test_repeat_interleave_keeps_every_dim() -> None:
    x = _ints(4, 6)
    node = op_node(lambda x: x.repeat_interleave(2, dim=0), x, target="repeat_interleave")
    assert _outputs(node) == {(R,), (S(0),), (S(1),)}  # not linear: no partial sums through it
    assert _check_numerically(node, x) == 3
    flat = op_node(lambda x: x.repeat_interleave(2), x, target="repeat_interleave")
    assert index_map_for(flat) is not None and _outputs(flat) == {(R,)}  # n-D flattened: replicated


# ---------------------------------------------------------------- floor_divide


def test_floor_divide_is_element_wise_and_not_linear() -> None:
    a = torch.randint(-20, 20, (4, 6), generator=torch.Generator().manual_seed(1))
    b = torch.randint(1, 5, (6,), generator=torch.Generator().manual_seed(2))
    node = op_node(lambda a, b: torch.floor_divide(a, b), a, b, target="floor_divide")
    imap = index_map_for(node)
    assert imap.inputs[node.args[1].name] == imap.outputs[0][1:]  # broadcast right-aligned
    assert not imap.linear
    assert _outputs(node) == {(R,), (S(0),), (S(1),)}
    assert _check_numerically(node, a, b) == 3

    scalar = op_node(lambda a: torch.ops.aten.floor_divide.Scalar(a, 3), a, target="floor_divide")
    assert str(scalar.target) == "aten.floor_divide.Scalar"
    assert _outputs(scalar) == {(R,), (S(0),), (S(1),)}
    assert _check_numerically(scalar, a) == 3

    x = _ints(4, 6) * 3.5  # float: a linear op would offer partial sums
    for fn, target in ((lambda x: x // 2, "floor_divide"), (lambda x: torch.div(x, 2, rounding_mode="floor"), "div")):
        node = op_node(fn, x, target=target)
        assert not index_map_for(node).linear, node.target
        assert (P,) not in _outputs(node)
        assert _check_numerically(node, x) == 3
    assert index_map_for(op_node(lambda x: x / 2, x, target="div")).linear  # plain scaling stays linear


# ---------------------------------------------------------------- histc


def test_histc_of_shards_adds_up_when_the_range_is_given() -> None:
    x = torch.randint(0, 4, (4, 6), generator=torch.Generator().manual_seed(3)).float()
    node = op_node(lambda x: torch.histc(x, bins=4, min=0, max=3), x, target="histc")
    imap = index_map_for(node)
    assert imap.reducible == frozenset(imap.inputs[node.args[0].name]) and not imap.linear
    pairs = {(s.input_specs[0], s.output_spec) for s in _strategies(node)}
    assert pairs == {((R,), (R,)), ((S(0),), (P,)), ((S(1),), (P,))}
    assert _check_numerically(node, x) == 3


def test_histc_without_a_range_stays_replicated() -> None:
    x = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 100])
    node = op_node(lambda x: torch.histc(x, bins=4), x, target="histc")  # bins over each shard's own range
    assert index_map_for(node) is not None and _outputs(node) == {(R,)}
    lo, hi = x.chunk(2)
    assert not torch.equal(torch.histc(lo, 4) + torch.histc(hi, 4), torch.histc(x, 4))


# ---------------------------------------------------------------- scatter


def test_scatter_splits_the_dims_it_does_not_write_along() -> None:
    x = _ints(8, 4)
    idx = torch.randint(0, 4, (8, 1), generator=torch.Generator().manual_seed(4))
    node = op_node(lambda x, i: torch.zeros_like(x).scatter_(1, i, 1.0), x, idx, target="scatter")
    assert op_name(node) == "scatter_"
    pairs = {(s.input_specs, s.output_spec) for s in _strategies(node)}
    assert pairs == {(((R,), (R,)), (R,)), (((S(0),), (S(0),)), (S(0),))}
    assert _check_numerically(node, torch.zeros(8, 4), idx) == 2

    small = torch.randint(0, 4, (4, 2), generator=torch.Generator().manual_seed(5))
    src = _ints(4, 2)
    node = op_node(lambda x, i, s: torch.scatter(x, 1, i, s), x, small, src, target="scatter")
    assert _outputs(node) == {(R,)}  # index has fewer rows than x: rows do not line up
    assert _check_numerically(node, x, small, src) == 1


# ---------------------------------------------------------------- grouped matmul

OFFS = torch.tensor([2, 3, 6, 8], dtype=torch.int32)  # 4 experts, rows sorted by expert (one empty: 2:3 has 1)


def _grouped_strategy_set(node: fx.Node) -> set:
    return {(s.input_specs, s.output_spec) for s in _strategies(node)}


def test_grouped_mm_fallback_shards_columns_never_experts() -> None:
    """transformers' custom op runs on local tensors (DTensor has no rule for it), which gives
    a shard of the output: the column split only; the contraction stays whole."""
    x, w = _ints(8, 16), _ints(4, 16, 8, seed=1)
    node = op_node(lambda x, w, o: torch.ops.transformers.grouped_mm_fallback(x, w, o), x, w, OFFS,
                 target="grouped_mm_fallback")
    imap = index_map_for(node)
    xl, wl, ol = (imap.inputs[n.name] for n in node.args)
    assert xl[1] == wl[1] and xl[1] in imap.fixed  # in: contracted, kept whole
    assert wl[2] == imap.outputs[0][1]  # out: column-parallel
    assert {xl[0], wl[0], ol[0]} <= imap.fixed  # tokens and experts stay whole
    assert _grouped_strategy_set(node) == {
        (((R,), (R,), (R,)), (R,)),
        (((R,), (S(2),), (R,)), (S(1),)),  # column: w on its last dim
    }
    assert _check_numerically(node, x, w, OFFS) == 2
    # why the experts stay whole: a device holding experts 2:4 and their offsets starts expert 2's
    # group at row 0 (rows 0:3 belong to experts 0 and 1), so the two devices' outputs do not add up
    full = torch.ops.transformers.grouped_mm_fallback(x, w, OFFS)
    halves = [torch.ops.transformers.grouped_mm_fallback(x, w[e:e + 2], OFFS[e:e + 2]) for e in (0, 2)]
    assert torch.equal(halves[0][:OFFS[1]], full[:OFFS[1]]) and torch.equal(halves[1][OFFS[1]:], full[OFFS[1]:])
    assert not torch.equal(halves[0] + halves[1], full)


def test_aten_grouped_mm_2d_by_3d_and_batched() -> None:
    x, w = _ints(8, 16, dtype=torch.bfloat16), _ints(4, 16, 16, dtype=torch.bfloat16, seed=1)
    node = op_node(lambda x, w, o: torch._grouped_mm(x, w, offs=o), x, w, OFFS, target="_grouped_mm")
    assert _grouped_strategy_set(node) == {
        (((R,), (R,), (R,)), (R,)),
        (((R,), (S(2),), (R,)), (S(1),)),
        (((S(1),), (S(1),), (R,)), (P,)),
    }
    assert _check_numerically(node, x, w, OFFS) == 3

    a, b = _ints(4, 8, 16, dtype=torch.bfloat16), _ints(4, 16, 16, dtype=torch.bfloat16, seed=1)
    node = op_node(lambda a, b: torch._grouped_mm(a, b), a, b, target="_grouped_mm")
    assert _outputs(node) == {(R,), (S(0),), (S(1),), (S(2),), (P,)}  # batch, rows, columns, contraction
    assert _check_numerically(node, a, b) == 5


def test_aten_grouped_mm_with_groups_along_k_or_n() -> None:
    a, b = _ints(16, 32, dtype=torch.bfloat16), _ints(32, 16, dtype=torch.bfloat16, seed=1)
    offs = torch.tensor([8, 16, 24, 32], dtype=torch.int32)
    node = op_node(lambda a, b, o: torch._grouped_mm(a, b, offs=o), a, b, offs, target="_grouped_mm")
    assert _outputs(node) == {(R,), (S(1),), (S(2),)}  # 2-D x 2-D, groups along k: m and n only
    assert _check_numerically(node, a, b, offs) == 3

    a, b = _ints(4, 16, 32, dtype=torch.bfloat16), _ints(32, 64, dtype=torch.bfloat16, seed=1)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    node = op_node(lambda a, b, o: torch._grouped_mm(a, b, offs=o), a, b, offs, target="_grouped_mm")
    assert _outputs(node) == {(R,), (S(0),), (P,)}  # 3-D x 2-D, groups along n: m and k only
    assert _check_numerically(node, a, b, offs) == 3


# ---------------------------------------------------------------- tiny MoE models


def _tiny(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4)
        return transformers.MixtralForCausalLM(cfg)
    if kind == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(**common, num_key_value_heads=2, num_experts=4, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=32, decoder_sparse_step=1)
        return transformers.Qwen2MoeForCausalLM(cfg)
    cfg = transformers.DeepseekV3Config(**common, num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=16,
                                        n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                                        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=8)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _op_by_op(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with experts modules :mod:`autoplan.trace.experts` does not trace as one op (an
    interleaved gate and up projection): they are traced op by op."""
    for m in model.modules():
        if hasattr(m, "_is_expert_parallel"):
            m.is_concatenated = False
    return model


@pytest.mark.parametrize("kind,dtype", [("mixtral", torch.float32), ("qwen2moe", torch.float32),
                                        ("deepseekv3", torch.float32), ("mixtral", torch.bfloat16)])
def test_tiny_moe_models_have_a_rule_for_every_op(kind: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _op_by_op(_tiny(kind).to(dtype))
    ids = torch.randint(0, 64, (2, 8))
    graph = trace(make_model_spec(model, {"input_ids": ids, "labels": ids}))
    ops = collections.Counter(op_name(n) for n in graph.graph_module.graph.nodes if n.op == "call_function")
    missing = sorted({str(n.target) for n in graph.graph_module.graph.nodes
                      if n.op == "call_function" and op_name(n) != "getitem" and index_map_for(n) is None})
    assert missing == []
    # float32 experts run transformers' fallback (torch._grouped_mm needs bfloat16 on CPU)
    grouped = "grouped_mm_fallback" if dtype == torch.float32 else "_grouped_mm"
    assert ops[grouped] == 4 and ops["histc"] == 2 and ops["floor_divide"] == 2 and ops["moe_experts"] == 0
    for n in graph.graph_module.graph.nodes:
        if n.op == "call_function" and op_name(n) == grouped:
            imap = index_map_for(n)
            weight = imap.inputs[n.args[1].name]
            assert weight[0] in imap.fixed and weight[2] not in imap.fixed  # experts whole, columns split
            rows, inner = graph.nodes[n.args[0].name].shape
            assert graph.nodes[n.name].flops == 2 * rows * inner * graph.nodes[n.args[1].name].shape[2]
    assert {"_grouped_mm", "grouped_mm_fallback", "histc", "floor_divide", "repeat", "scatter_"} <= known_ops()


# ---------------------------------------------------------------- the experts as one op


@pytest.mark.parametrize("kind", ["mixtral", "qwen2moe", "deepseekv3"])
def test_experts_trace_as_one_op_whose_experts_are_reduced_and_tokens_split(kind: str) -> None:
    torch.manual_seed(0)
    model = _tiny(kind)
    ids = torch.randint(0, 64, (2, 8))
    graph = trace(make_model_spec(model, {"input_ids": ids, "labels": ids}))
    nodes = [n for n in graph.graph_module.graph.nodes if n.op == "call_function" and op_name(n) == "moe_experts"]
    ops = collections.Counter(op_name(n) for n in graph.graph_module.graph.nodes if n.op == "call_function")
    assert len(nodes) == 2 and ops["grouped_mm_fallback"] == 0 and ops["histc"] == 0
    assert all(not hasattr(m, "forward") or "forward" not in vars(m) for m in model.modules())  # put back
    for n in nodes:
        x, index, weights, up, down = n.args[:5]
        # 2 x 8 tokens x 2 slots, each through one expert's up and down projections
        (_, *up_matrix), (_, *down_matrix) = graph.nodes[up.name].shape, graph.nodes[down.name].shape
        assert graph.nodes[n.name].flops == 2 * 32 * (math.prod(up_matrix) + math.prod(down_matrix)) > 0
        by_spec = {s.output_spec: s for s in _strategies(n)}
        assert set(by_spec) == {(R,), (S(0),), (P,)}
        ep = by_spec[(P,)]  # expert parallelism: each device its experts, for every token
        assert ep.input_specs == ((R,), (R,), (R,), (S(0),), (S(0),)) and ep.compute_shards == 2
        assert ep.partial_axes(0) == {0} and ep.partial_axes(2) == {0}  # x's and w's gradients partial
        tokens = by_spec[(S(0),)]  # the tokens split, every expert on every device: data parallel
        assert tokens.input_specs == ((S(0),), (S(0),), (S(0),), (R,), (R,))
        assert tokens.partial_grads == ((3, 0), (4, 0))  # the experts' gradients are summed


def _experts_inputs(kind: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    block = _tiny(kind).to(dtype).model.layers[0].mlp
    experts = block.experts
    hidden = torch.randn(12, 32, dtype=dtype)
    _, weights, index = block.gate(hidden)
    return experts, hidden, index, weights


@pytest.mark.parametrize("kind,dtype", [("mixtral", torch.float32), ("deepseekv3", torch.float32),
                                        ("mixtral", torch.bfloat16)])
def test_shards_of_the_experts_add_up_to_the_layer_and_its_gradients(kind: str, dtype: torch.dtype) -> None:
    """The experts' module as the model runs it, against two devices' halves of the experts
    (:func:`local_experts_forward` from expert 0 and from expert 2), summed: the output and the
    gradients of the tokens, the routing weights and every expert's weights."""
    experts, hidden, index, weights = _experts_inputs(kind, dtype)
    x, w = hidden.clone().requires_grad_(), weights.detach().clone().requires_grad_()
    reference = experts(x, index, w)
    grad = torch.randn_like(reference)
    reference.backward(grad)

    xs, ws = hidden.clone().requires_grad_(), weights.detach().clone().requires_grad_()
    ups = [experts.gate_up_proj.detach()[i:i + 2].clone().requires_grad_() for i in (0, 2)]
    downs = [experts.down_proj.detach()[i:i + 2].clone().requires_grad_() for i in (0, 2)]
    halves = [local_experts_forward(xs, index, ws, up, down, True, False, "silu", first_expert=first, num_experts=4)
              for first, up, down in zip((0, 2), ups, downs)]
    assert not torch.equal(halves[0], reference)  # a half alone is a partial sum
    total = halves[0] + halves[1]
    total.backward(grad)
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(total, reference, rtol=rtol, atol=atol)
    torch.testing.assert_close(xs.grad, x.grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(ws.grad, w.grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.cat([u.grad for u in ups]), experts.gate_up_proj.grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.cat([d.grad for d in downs]), experts.down_proj.grad, rtol=rtol, atol=atol)


def test_the_one_op_runs_eagerly_with_its_gradients() -> None:
    """``autoplan::moe_experts`` itself (outside the planned program, which calls
    :func:`local_experts_forward`) computes the module's output and gradients."""
    experts, hidden, index, weights = _experts_inputs("mixtral")
    x, w = hidden.clone().requires_grad_(), weights.detach().clone().requires_grad_()
    reference = experts(x, index, w)
    reference.sum().backward()
    grads = [x.grad, w.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()]
    experts.zero_grad()
    x2, w2 = hidden.clone().requires_grad_(), weights.detach().clone().requires_grad_()
    out = EXPERTS_OP(x2, index, w2, experts.gate_up_proj, experts.down_proj, True, False, "silu")
    out.sum().backward()
    torch.testing.assert_close(out, reference)
    for got, want in zip([x2.grad, w2.grad, experts.gate_up_proj.grad, experts.down_proj.grad], grads):
        torch.testing.assert_close(got, want)
