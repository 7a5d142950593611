"""Tracing models into ATen-level graphs with shapes, FLOPs, modules and parameters."""

from __future__ import annotations

import math
import operator
import os
import resource
import time

import pytest
import torch

from autoplan.errors import AutoplanError
from autoplan.trace.graph import TracedGraph
from autoplan.load import import_file, load_model_file, make_model_spec
from autoplan.trace.tracer import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example(name: str):
    return import_file(os.path.join(ROOT, "examples", f"{name}.py"))


def ops(tg: TracedGraph, target: str):
    return [n for n in tg.nodes.values() if n.kind == "op" and n.target == target]


def output_args(tg: TracedGraph):
    (out,) = [n for n in tg.graph_module.graph.nodes if n.op == "output"]
    return list(out.args[0])


def check_common(tg: TracedGraph) -> None:
    """What every traced graph must satisfy."""
    targets = {str(n.target) for n in tg.graph_module.graph.nodes}
    assert "aten._assert_tensor_metadata.default" not in targets
    assert not any(n.op in ("get_attr", "call_module") for n in tg.graph_module.graph.nodes)
    for info in tg.nodes.values():
        if info.kind == "op":
            assert info.shape is not None, f"{info.name} ({info.target}) has no shape"
            assert info.dtype and info.itemsize > 0
        assert not info.module.startswith("m."), info.module
    for fqn in tg.param_names.values():
        assert not fqn.startswith("m."), fqn
    loss = output_args(tg)[0]
    assert tg.nodes[loss.name].shape == ()
    assert tg.nodes[loss.name].dtype.startswith("float")
    assert list(tg.nodes) == [n.name for n in tg.graph_module.graph.nodes]
    assert tg.exported is not None and tg.exported.graph_module is tg.graph_module


# --------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def mlp():
    mod = example("mlp")
    model, inputs = mod.build(hidden=256, batch=2, seq=16)
    spec = make_model_spec(model, inputs, mod.loss_fn, name="mlp")
    return spec, trace(spec)


@pytest.fixture(scope="module")
def gpt():
    spec = load_model_file(os.path.join(ROOT, "examples", "gpt.py"))
    return spec, trace(spec)


@pytest.fixture(scope="module")
def gpt2():
    spec = load_model_file(os.path.join(ROOT, "examples", "gpt2.py"))
    assert spec.module.config.use_cache is True  # the default: autoplan must cope
    return spec, trace(spec)


# --------------------------------------------------------------------------------- MLP


def test_mlp_linear_flops_modules_params(mlp):
    spec, tg = mlp
    check_common(tg)
    linears = ops(tg, "aten.linear.default")
    assert [n.module for n in linears] == ["up", "down"]
    assert [n.module_type for n in linears] == ["Linear", "Linear"]
    assert linears[0].params == ("up.weight", "up.bias")
    assert linears[1].params == ("down.weight", "down.bias")
    m, h = 2 * 16, 256
    assert linears[0].flops == 2 * m * h * (4 * h)
    assert linears[1].flops == 2 * m * (4 * h) * h
    assert linears[0].shape == (2, 16, 4 * h) and linears[0].dtype == "float32"
    assert linears[0].itemsize == 4
    # bytes: input + weight + bias + output
    assert linears[0].bytes == 4 * (m * h + 4 * h * h + 4 * h + m * 4 * h)
    assert tg.total_flops >= linears[0].flops + linears[1].flops
    gelu = ops(tg, "aten.gelu.default")[0]
    assert gelu.module == "act" and gelu.flops == 0 and gelu.params == ()


def test_mlp_placeholders(mlp):
    spec, tg = mlp
    kinds = {n.name: n.kind for n in tg.nodes.values() if n.target == "placeholder"}
    assert sorted(tg.param_names.values()) == ["down.bias", "down.weight", "up.bias", "up.weight"]
    for name, fqn in tg.param_names.items():
        assert kinds[name] == "parameter" and tg.nodes[name].fqn == fqn
    assert tg.input_names == ["x"]
    assert kinds["x"] == "input" and tg.nodes["x"].shape == (2, 16, 256)
    up_w = next(n for n in tg.nodes.values() if n.fqn == "up.weight")
    assert up_w.shape == (1024, 256) and up_w.module == "up" and up_w.bytes == 1024 * 256 * 4
    assert tg.nodes["output"].kind == "output" and tg.nodes["output"].target == "output"
    assert tg.tied == {}


def test_trace_computes_what_the_model_computes(mlp):
    spec, tg = mlp
    model, (x,) = spec.module, spec.example_inputs
    expected = spec.loss_fn(model(x), x)
    loss, out = tg.exported.module()(x)
    assert torch.allclose(loss, expected) and torch.allclose(out, model(x))


def test_real_weights_are_not_copied(mlp):
    spec, tg = mlp
    assert tg.exported.state_dict["m.up.weight"].data_ptr() == spec.module.up.weight.data_ptr()


# --------------------------------------------------------------------------------- meta device


def test_large_meta_model_traces_without_allocating():
    mod = example("gpt")
    model, inputs = mod.build(hidden=4096, layers=12, heads=32, seq=512, vocab=51200, batch=4, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 2.3e9  # about 10 GB in float32 if it were allocated
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    tg = trace(make_model_spec(model, inputs, mod.loss_fn))
    elapsed = time.perf_counter() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mib < 1024, f"tracing a meta model grew peak memory by {grown_mib:.0f} MiB"
    assert elapsed < 30
    check_common(tg)
    assert all(p.device.type == "meta" for p in model.parameters())
    c_fc = [n for n in ops(tg, "aten.linear.default") if n.module == "h.11.mlp.c_fc"]
    assert c_fc[0].flops == 2 * 4 * 512 * 4096 * 4 * 4096
    assert c_fc[0].params == ("h.11.mlp.c_fc.weight", "h.11.mlp.c_fc.bias")


def test_meta_and_cpu_models_have_the_same_hash(gpt):
    spec, tg = gpt
    mod = example("gpt")
    model, inputs = mod.build(device="meta")
    assert trace(make_model_spec(model, inputs, mod.loss_fn)).graph_hash == tg.graph_hash


# --------------------------------------------------------------------------------- nanoGPT


def test_gpt_example(gpt):
    spec, tg = gpt
    check_common(tg)
    b, t, c, heads, vocab = 8, 32, 64, 4, 256
    attn = ops(tg, "aten.scaled_dot_product_attention.default")
    assert len(attn) == 2 and attn[0].module == "h.0.attn"
    assert attn[0].module_type == "CausalSelfAttention"
    assert attn[0].flops == 4 * b * heads * t * t * (c // heads)
    c_attn = [n for n in ops(tg, "aten.linear.default") if n.module == "h.1.attn.c_attn"]
    assert c_attn[0].params == ("h.1.attn.c_attn.weight", "h.1.attn.c_attn.bias")
    assert c_attn[0].flops == 2 * b * t * c * 3 * c
    # lm_head is tied to the token embedding: one tensor read through one placeholder
    (lm_head,) = [n for n in ops(tg, "aten.linear.default") if n.module == "lm_head"]
    (embedding,) = [n for n in ops(tg, "aten.embedding.default") if n.module == "wte"]
    assert embedding.params == lm_head.params
    assert tg.tied == {"wte.weight": "lm_head.weight"}
    # the loss computed inside forward is the graph's loss, not repeated as a model output
    outs = output_args(tg)
    assert len(outs) == 2 and tg.nodes[outs[1].name].shape == (b, t, vocab)
    assert tg.nodes[outs[0].name].target == "aten.cross_entropy_loss.default"


def test_graph_hash_stable_and_sensitive(gpt):
    spec, tg = gpt
    assert len(tg.graph_hash) >= 16 and int(tg.graph_hash, 16) >= 0
    assert trace(spec).graph_hash == tg.graph_hash
    mod = example("gpt")
    model, inputs = mod.build(hidden=128)
    assert trace(make_model_spec(model, inputs, mod.loss_fn)).graph_hash != tg.graph_hash
    model, inputs = mod.build(batch=4)
    assert trace(make_model_spec(model, inputs, mod.loss_fn)).graph_hash != tg.graph_hash


def test_gpt_124m_traces_fast():
    mod = example("gpt")
    model, inputs = mod.build(**mod.GPT_124M, device="meta")
    start = time.perf_counter()
    tg = trace(make_model_spec(model, inputs, mod.loss_fn))
    assert time.perf_counter() - start < 20
    assert len(ops(tg, "aten.scaled_dot_product_attention.default")) == 12


# --------------------------------------------------------------------------------- transformers


def test_gpt2_hf(gpt2):
    spec, tg = gpt2
    check_common(tg)
    assert spec.module.config.use_cache is True  # restored after tracing
    assert tg.input_names == ["input_ids"]
    assert tg.nodes["input_ids"].dtype == "int64"
    c_attn = [n for n in tg.nodes.values() if n.kind == "op" and n.module == "transformer.h.0.attn.c_attn"]
    mm = [n for n in c_attn if n.target == "aten.addmm.default"]
    assert mm and mm[0].module_type == "Conv1D"
    assert mm[0].params == ("transformer.h.0.attn.c_attn.bias", "transformer.h.0.attn.c_attn.weight")
    assert mm[0].flops == 2 * (8 * 32) * 64 * 192
    assert "transformer.h.1.mlp.c_proj.weight" in tg.param_names.values()
    assert ops(tg, "aten.scaled_dot_product_attention.default")[0].flops > 0
    assert tg.tied == {"transformer.wte.weight": "lm_head.weight"}


def test_gpt2_loss_is_the_hf_lm_loss(gpt2):
    spec, tg = gpt2
    (input_ids,) = spec.example_inputs
    with torch.no_grad():
        hf = spec.module(input_ids, labels=input_ids, use_cache=False).loss
        ours = spec.loss_fn(spec.module(input_ids, use_cache=False), input_ids)
        traced = tg.exported.module()(input_ids)[0]
    assert torch.allclose(hf, ours, atol=1e-5) and torch.allclose(traced, ours, atol=1e-5)


def test_bert_hf():
    spec = load_model_file(os.path.join(ROOT, "examples", "bert.py"))
    tg = trace(spec)
    check_common(tg)
    assert tg.input_names == ["input_ids", "attention_mask"]
    query = [n for n in ops(tg, "aten.linear.default") if n.module.endswith("layer.0.attention.self.query")]
    assert query[0].params == (
        "bert.encoder.layer.0.attention.self.query.weight",
        "bert.encoder.layer.0.attention.self.query.bias",
    )
    assert query[0].flops == 2 * 8 * 32 * 64 * 64


def test_llama_hf_default_config():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, 256, (2, 16))
    tg = trace(make_model_spec(model, input_ids, name="llama"))
    check_common(tg)  # the rotary embedding's no_grad region is inlined
    assert config.use_cache is True
    assert not any("wrap_with" in n.target for n in tg.nodes.values())
    # grouped-query attention: 4 query heads of dimension 16 over 16 positions
    attn = ops(tg, "aten.scaled_dot_product_attention.default")
    assert attn[0].flops == 4 * 2 * 4 * 16 * 16 * 16
    k_proj = [n for n in ops(tg, "aten.linear.default") if n.module == "model.layers.1.self_attn.k_proj"]
    assert k_proj[0].params == ("model.layers.1.self_attn.k_proj.weight",)
    assert k_proj[0].shape == (2, 16, 32)
    buffers = {n.fqn for n in tg.nodes.values() if n.kind == "buffer"}
    assert "model.rotary_emb.inv_freq" in buffers
    loss, logits = tg.exported.module()(input_ids)
    assert torch.allclose(loss, model(input_ids).logits.float().mean(), atol=1e-6)


# --------------------------------------------------------------------------------- conv net


def test_resnet():
    spec = load_model_file(os.path.join(ROOT, "examples", "resnet.py"))
    tg = trace(spec)
    check_common(tg)
    convs = ops(tg, "aten.conv2d.default") + ops(tg, "aten.convolution.default")
    assert len(convs) == 6
    stem = next(n for n in convs if n.module == "conv1")
    assert stem.flops == 2 * 8 * 16 * 3 * 3 * 3 * 32 * 32
    assert stem.params == ("conv1.weight",)
    bn = [n for n in tg.nodes.values() if n.kind == "op" and n.module == "bn1" and "norm" in n.target]
    assert "bn1.running_mean" in bn[0].params
    assert {n.kind for n in tg.nodes.values() if n.fqn == "bn1.running_var"} == {"buffer"}
    (fc,) = ops(tg, "aten.linear.default")
    assert fc.module == "fc" and fc.flops == 2 * 8 * 32 * 10


# --------------------------------------------------------------------------------- behaviour


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        y = self.drop(self.lin(x))
        return {"hidden": y, "none": None, "count": 3, "pair": (y * 2, y.sum())}


def test_outputs_flattened_and_training_mode():
    model = _Tiny().eval()
    tg = trace(make_model_spec(model, torch.randn(2, 4)))
    assert not model.training and not model.drop.training  # restored
    assert ops(tg, "aten.dropout.default"), "export must trace in training mode"
    shapes = [tg.nodes[a.name].shape for a in output_args(tg)]
    assert shapes == [(), (2, 4), (2, 4), ()]
    assert tg.nodes[output_args(tg)[0].name].module == ""
    assert tg.nodes[output_args(tg)[0].name].module_type == "_Tiny"


def test_loss_must_be_a_scalar_tensor():
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    for loss_fn, words in ((lambda out, x: out, "shape (2, 4)"), (lambda out, x: 1.0, "float")):
        with pytest.raises(AutoplanError) as info:
            trace(make_model_spec(model, x, loss_fn))
        assert words in str(info.value) and "\n" not in str(info.value)


def test_untraceable_model_is_one_line_error():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(AutoplanError) as info:
        trace(make_model_spec(Branchy(), torch.randn(3), name="branchy"))
    message = str(info.value)
    assert "\n" not in message and "branchy" in message and "control flow" in message


def test_getitem_nodes_are_named_and_free(gpt):
    spec, tg = gpt
    getitems = [n for n in tg.graph_module.graph.nodes if n.target is operator.getitem]
    assert getitems
    for node in getitems:
        info = tg.nodes[node.name]
        assert info.target == "getitem" and info.bytes == 0 and info.shape is not None
    assert math.isclose(tg.total_flops, sum(n.flops for n in tg.nodes.values()))
