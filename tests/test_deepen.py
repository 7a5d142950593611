"""A deep model's graph written from a trace of its first blocks (autoplan/trace/deepen.py) is
the graph a trace of the whole model gives, node for node (names, ops, arguments, shapes,
modules, lifted parameters), for the common families; models whose blocks differ are traced;
and the pipeline search plans alike with written graphs or traces, its plan made on a trace."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers as tf

from autoplan.load import make_model_spec
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.trace.deepen import (MIN_BLOCKS, NotDeepenable, UnitsDiffer, deepened_trace, repeated_stacks,
    settings_period)
from autoplan.trace.layers import make_layers
from autoplan.trace.microbatch import microbatch_inputs
from autoplan.trace.repeated import find_classes
from autoplan.trace.rescale import BatchSizeGraphs
from autoplan.trace.tracer import describe, trace
from launcher import ROOT

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]
import gpt  # noqa: E402
import llama  # noqa: E402
from zoo import BATCH  # noqa: E402
from zoo_hf import _BERT_LIKE, _LLAMA_LIKE, HEADS, HIDDEN, FFN, _build, _ids, _SPECIAL  # noqa: E402

DEEP = 7


def _hf_lm(config_cls: type, model_cls: type, **config) -> tuple[torch.nn.Module, dict]:
    ids = _ids()
    return _build(config_cls, model_cls, **config), {"input_ids": ids, "labels": ids}


def _mixtral():
    return _hf_lm(tf.MixtralConfig, tf.MixtralForCausalLM, **{**_LLAMA_LIKE, "num_hidden_layers": DEEP},
                  num_local_experts=4, num_experts_per_tok=2)


def _deepseek_v3():  # a dense first block before the MoE ones, and a buffer in every MoE block
    return _hf_lm(tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                  **{**_LLAMA_LIKE, "num_hidden_layers": DEEP, "num_key_value_heads": HEADS}, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, moe_intermediate_size=32,
                  first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=16)


def _gpt2():
    return _hf_lm(tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=128, n_embd=HIDDEN, n_layer=DEEP, n_head=HEADS,
                  n_positions=64, bos_token_id=1, eos_token_id=2)


def _bert():
    model = _build(tf.BertConfig, tf.BertForSequenceClassification, num_labels=4,
                   **{**_BERT_LIKE, "num_hidden_layers": DEEP})
    return model, {"input_ids": _ids(), "labels": torch.arange(BATCH) % 4}


def _bart():  # encoder and decoder stacks: both written
    return _hf_lm(tf.BartConfig, tf.BartForConditionalGeneration, vocab_size=128, d_model=HIDDEN,
                  encoder_layers=DEEP + 1, decoder_layers=DEEP, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                  max_position_embeddings=64, decoder_start_token_id=2, forced_eos_token_id=2, **_SPECIAL)


def _t5():  # every block reads the first block's position bias: four units traced
    model = _build(tf.T5Config, tf.T5ForConditionalGeneration, vocab_size=128, d_model=HIDDEN, d_kv=16,
                   d_ff=FFN, num_layers=DEEP + 1, num_decoder_layers=DEEP + 1, num_heads=HEADS, pad_token_id=0,
                   eos_token_id=2, decoder_start_token_id=0)
    return model, {"input_ids": _ids(), "labels": _ids()}


def _gemma2(layers: int = 12):  # sliding and global attention alternate: units of two blocks
    return _hf_lm(tf.Gemma2Config, tf.Gemma2ForCausalLM, **{**_LLAMA_LIKE, "num_hidden_layers": layers},
                  head_dim=16, sliding_window=8)


def _gemma3(layers: int):  # five sliding-window layers, then a global one: units of six
    return _hf_lm(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, **{**_LLAMA_LIKE, "num_hidden_layers": layers},
                  head_dim=16, sliding_window=8)


BUILDERS = {
    "llama": lambda: llama.build(layers=DEEP, batch=BATCH, seq=16),
    "nanogpt": lambda: (*gpt.build(layers=DEEP, batch=BATCH, seq=16), gpt.loss_fn),
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "bert": _bert,
    "bart": _bart,
    "gemma2": _gemma2,
    "t5": _t5,
}


def _spec(builder):
    built = builder()
    return make_model_spec(*built) if len(built) == 3 else make_model_spec(built[0], built[1])


def _nodes(graph) -> list[tuple]:
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), graph.nodes[n.name])
            for n in graph.graph_module.graph.nodes]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_written_graph_is_the_trace(name: str) -> None:
    spec = _spec(BUILDERS[name])
    stacks = repeated_stacks(spec.module)
    assert stacks and all(stack.length >= MIN_BLOCKS for stack in stacks)
    assert len(stacks) == (2 if name in ("bart", "t5") else 1)
    real, written = trace(spec), deepened_trace(spec)
    assert _nodes(written) == _nodes(real)
    assert written.graph_hash == real.graph_hash
    assert (written.param_names, written.input_names, written.tied) == (real.param_names, real.input_names, real.tied)
    assert written.exported.graph_signature == real.exported.graph_signature
    layers = [layer.nodes for layer in make_layers(written, find_classes(written))]
    assert layers == [layer.nodes for layer in make_layers(real, find_classes(real))]
    assert written.graph_module.code == real.graph_module.code
    # the model is whole again after the cut trace
    assert all(len(spec.module.get_submodule(stack.path)) == stack.length for stack in stacks)


class _Block(torch.nn.Module):
    def __init__(self, index: int, differs: range) -> None:
        super().__init__()
        self.index = index  # differs in every block: not a setting
        self.differs = differs  # not a plain attribute: the blocks' settings do not tell them apart
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linear(x))
        return x * 2 if self.index in self.differs else x


class _Stack(torch.nn.Module):
    def __init__(self, differs: range) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(i, differs) for i in range(8))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _stack_spec(differs: range):
    torch.manual_seed(0)
    return make_model_spec(_Stack(differs), (torch.randn(16, 32),), lambda out, x: out.pow(2).mean())


def test_blocks_repeat_with_the_period_of_their_settings() -> None:
    assert settings_period(list(_spec(BUILDERS["llama"]).module.model.layers)) == 1
    assert settings_period(list(_spec(_gemma2).module.model.layers)) == 2
    gemma3 = _spec(lambda: _gemma3(24))
    assert settings_period(list(gemma3.module.model.layers)) == 6
    with pytest.raises(NotDeepenable, match="too few"):  # three units of six would be most of it
        deepened_trace(gemma3)


def test_blocks_that_differ_are_traced() -> None:
    with pytest.raises(UnitsDiffer, match="2 and 3 ops"):  # block 2 differs from block 1, in code only
        deepened_trace(_stack_spec(differs=range(2, 3)))
    shallow = _spec(lambda: llama.build(layers=MIN_BLOCKS - 1, batch=BATCH, seq=16))
    assert repeated_stacks(shallow.module) == []


def test_a_block_the_trace_did_not_see_is_planned_on_the_trace() -> None:
    spec = _stack_spec(differs=range(4, 8))  # blocks 4 to 7 compute an op more, in code only
    assert deepened_trace(spec).graph_hash != trace(spec).graph_hash  # written wrong: a search estimate only
    plan = plan_model(spec, PlanOptions(2, "h100", jobs=1, stages=2, microbatches=2, recompute="none"))
    assert len(plan.stages) == 2
    traced = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches)))
    assert plan.graph_hash == traced.graph_hash


def test_graphs_are_written_until_the_model_refuses() -> None:
    spec = _spec(BUILDERS["llama"])
    calls: list[str] = []

    def trace_fn(size: int):
        calls.append(f"trace {size}")
        return trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, BATCH // size)))

    def deepen(size: int):
        calls.append(f"deepen {size}")
        if size == 2:
            raise NotDeepenable("refused")
        return deepened_trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, BATCH // size)))

    graphs = BatchSizeGraphs(trace_fn, lambda gm, ep: describe(gm, ep, spec.module), deepen)
    graphs.get(BATCH)
    graphs.base(1)
    assert not graphs.is_traced(graphs.get(4))  # rescaled from the two written graphs
    assert calls == [f"deepen {BATCH}", "deepen 1"]
    graphs.deepen = lambda size: (_ for _ in ()).throw(NotDeepenable("no"))
    graphs.base(2)  # refused: traced, and never asked again
    assert calls[-1] == "trace 2" and graphs.deepen is None and graphs.is_traced(graphs.get(2))


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_pipeline_plan_is_the_same_with_written_graphs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import autoplan.planner.pipeline.search as search

    spec = _spec(BUILDERS[name])
    options = PlanOptions(4, "h100", jobs=1, memory_per_device=4e6, recompute="none") if name == "llama" else \
        PlanOptions(4, "h100", jobs=1, stages=2, microbatches=2, recompute="none")  # two stacks: one pipeline
    written_sizes: list[int] = []
    real_deepened = search.deepened_trace

    def recording(spec, stack):
        written_sizes.append(len(spec.example_inputs[0]))
        return real_deepened(spec, stack)

    monkeypatch.setattr(search, "deepened_trace", recording)
    written = plan_model(spec, options)
    assert written_sizes  # the search ran on written graphs
    monkeypatch.setattr(search, "repeated_stacks", lambda module: [])
    traced = plan_model(spec, options)
    assert len(written.stages) > 1
    assert written.decisions() == traced.decisions()
    assert written.graph_hash == traced.graph_hash


class _Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class _MixtureBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(_Expert() for _ in range(10))  # longer than the stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(expert(x) for expert in self.experts)


class _Mixture(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(_MixtureBlock() for _ in range(7)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_a_list_of_experts_is_part_of_its_block() -> None:
    torch.manual_seed(0)
    model = _Mixture()
    spec = make_model_spec(model, (torch.randn(4, 16),), lambda out, x: out.mean())
    assert [stack.path for stack in repeated_stacks(model)] == ["blocks"]
    assert _nodes(deepened_trace(spec)) == _nodes(trace(spec))
