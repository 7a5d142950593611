"""Tiny Hugging Face transformers models for the zoo (see :mod:`zoo`): decoder LMs, MoE LMs,
encoders, encoder-decoders, vision/multimodal and state-space models, each with random weights
(``torch.manual_seed(0)``), every dropout 0, float32 on the CPU, and keyword inputs whose
``labels`` make the output carry ``.loss`` (so no ``loss_fn``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import transformers as tf

from zoo import BATCH, SEQ, VOCAB, ZooCase  # import this module through zoo

# ZOO_LAYERS deepens every model (benchmarks/written_graphs.py writes deep graphs from shallow traces)
HIDDEN, LAYERS, HEADS, FFN = 64, int(os.environ.get("ZOO_LAYERS", "2")), 4, 128
# ids that avoid the special tokens configured below (pad 0, bos 1, eos 2)
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _zero_dropout(config: Any) -> Any:
    """Set every dropout probability of ``config`` (and its sub-configs) to 0."""
    for key, value in list(vars(config).items()):
        if isinstance(value, tf.PretrainedConfig):
            _zero_dropout(value)
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key or key == "router_jitter_noise"):
            setattr(config, key, 0.0)
    return config


def _build(config_cls: type, model_cls: type, **config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_cls(_zero_dropout(config_cls(**config)))
    for module in model.modules():  # anything a config flag did not reach
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.float().train()


def _ids(seq: int = SEQ, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _lm_case(name: str, family: str, config_cls: type, model_cls: type, **config: Any) -> ZooCase:
    model = _build(config_cls, model_cls, **config)
    ids = _ids()
    return ZooCase(name, family, model, {"input_ids": ids, "attention_mask": None, "labels": ids})


_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64, **_SPECIAL)


def llama() -> ZooCase:
    return _lm_case("llama", "decoder", tf.LlamaConfig, tf.LlamaForCausalLM, **_LLAMA_LIKE)


def mistral() -> ZooCase:
    return _lm_case("mistral", "decoder", tf.MistralConfig, tf.MistralForCausalLM, **_LLAMA_LIKE, sliding_window=8)


def qwen2() -> ZooCase:
    return _lm_case("qwen2", "decoder", tf.Qwen2Config, tf.Qwen2ForCausalLM, **_LLAMA_LIKE)


def qwen3() -> ZooCase:
    return _lm_case("qwen3", "decoder", tf.Qwen3Config, tf.Qwen3ForCausalLM, **_LLAMA_LIKE, head_dim=16)


def gemma() -> ZooCase:
    return _lm_case("gemma", "decoder", tf.GemmaConfig, tf.GemmaForCausalLM, **_LLAMA_LIKE, head_dim=16)


def gemma2() -> ZooCase:
    return _lm_case("gemma2", "decoder", tf.Gemma2Config, tf.Gemma2ForCausalLM, **_LLAMA_LIKE, head_dim=16,
                    sliding_window=8, query_pre_attn_scalar=16)


def phi3() -> ZooCase:
    return _lm_case("phi3", "decoder", tf.Phi3Config, tf.Phi3ForCausalLM, **_LLAMA_LIKE)


def gpt_neox() -> ZooCase:
    return _lm_case("gpt_neox", "decoder", tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, vocab_size=VOCAB,
                    hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    max_position_embeddings=64, **_SPECIAL)


def opt() -> ZooCase:
    return _lm_case("opt", "decoder", tf.OPTConfig, tf.OPTForCausalLM, vocab_size=VOCAB, hidden_size=HIDDEN,
                    ffn_dim=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN,
                    max_position_embeddings=64, **_SPECIAL)


def gpt2() -> ZooCase:
    return _lm_case("gpt2", "decoder", tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=HIDDEN,
                    n_layer=LAYERS, n_head=HEADS, n_positions=64, bos_token_id=1, eos_token_id=2)


def mixtral() -> ZooCase:
    return _lm_case("mixtral", "moe", tf.MixtralConfig, tf.MixtralForCausalLM, **_LLAMA_LIKE,
                    num_local_experts=4, num_experts_per_tok=2)


def qwen2_moe() -> ZooCase:
    return _lm_case("qwen2_moe", "moe", tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, **_LLAMA_LIKE, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                    decoder_sparse_step=1)


def deepseek_v3() -> ZooCase:
    # multi-head latent attention: as many key/value heads as query heads (as DeepSeek-V3 has)
    return _lm_case("deepseek_v3", "moe", tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                    **{**_LLAMA_LIKE, "num_key_value_heads": HEADS}, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                    moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def _classifier_case(name: str, config_cls: type, model_cls: type, **config: Any) -> ZooCase:
    model = _build(config_cls, model_cls, num_labels=4, **config)
    labels = torch.arange(BATCH) % 4
    return ZooCase(name, "encoder", model, {"input_ids": _ids(), "attention_mask": None, "labels": labels})


_BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=64, **_SPECIAL)


def bert() -> ZooCase:
    return _classifier_case("bert", tf.BertConfig, tf.BertForSequenceClassification, **_BERT_LIKE)


def roberta() -> ZooCase:
    return _classifier_case("roberta", tf.RobertaConfig, tf.RobertaForSequenceClassification, **_BERT_LIKE)


def distilbert() -> ZooCase:
    return _classifier_case("distilbert", tf.DistilBertConfig, tf.DistilBertForSequenceClassification,
                            vocab_size=VOCAB, dim=HIDDEN, hidden_dim=FFN, n_layers=LAYERS, n_heads=HEADS,
                            max_position_embeddings=64, pad_token_id=0)


def t5() -> ZooCase:
    model = _build(tf.T5Config, tf.T5ForConditionalGeneration, vocab_size=VOCAB, d_model=HIDDEN, d_kv=16,
                   d_ff=FFN, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS, pad_token_id=0,
                   eos_token_id=2, decoder_start_token_id=0)
    return ZooCase("t5", "encoder-decoder", model, {"input_ids": _ids(), "attention_mask": None, "labels": _ids()})


def bart() -> ZooCase:
    model = _build(tf.BartConfig, tf.BartForConditionalGeneration, vocab_size=VOCAB, d_model=HIDDEN,
                   encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                   decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                   max_position_embeddings=64, decoder_start_token_id=2, forced_eos_token_id=2, **_SPECIAL)
    return ZooCase("bart", "encoder-decoder", model, {"input_ids": _ids(), "attention_mask": None, "labels": _ids()})


def whisper() -> ZooCase:
    mels, frames = 8, 16  # the encoder's two convs halve the frames to max_source_positions
    model = _build(tf.WhisperConfig, tf.WhisperForConditionalGeneration, vocab_size=VOCAB, num_mel_bins=mels,
                   d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                   decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                   max_source_positions=frames // 2, max_target_positions=32, decoder_start_token_id=1,
                   suppress_tokens=None, begin_suppress_tokens=None, **_SPECIAL)
    features = torch.randn(BATCH, mels, frames, generator=torch.Generator().manual_seed(1))
    return ZooCase("whisper", "encoder-decoder", model, {"input_features": features, "labels": _ids()})


_VIT_LIKE = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=HIDDEN, intermediate_size=FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS)


def _images() -> torch.Tensor:
    return torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def vit() -> ZooCase:
    model = _build(tf.ViTConfig, tf.ViTForImageClassification, num_labels=10, **_VIT_LIKE)
    return ZooCase("vit", "vision", model, {"pixel_values": _images(), "labels": torch.arange(BATCH) % 10})


def clip() -> ZooCase:
    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=SEQ, **_SPECIAL)
    model = _build(tf.CLIPConfig, tf.CLIPModel, text_config=text, vision_config=_VIT_LIKE, projection_dim=32)
    return ZooCase("clip", "vision", model, {"input_ids": _ids(), "pixel_values": _images(), "return_loss": True})


def mamba() -> ZooCase:
    return _lm_case("mamba", "state-space", tf.MambaConfig, tf.MambaForCausalLM, vocab_size=VOCAB,
                    hidden_size=HIDDEN, state_size=8, num_hidden_layers=LAYERS, expand=2, conv_kernel=4,
                    time_step_rank=8, **_SPECIAL)


HF_CASES: dict[str, Callable[[], ZooCase]] = {f.__name__: f for f in (
    llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, gpt_neox, opt, gpt2,
    mixtral, qwen2_moe, deepseek_v3,
    bert, roberta, distilbert,
    t5, bart, whisper,
    vit, clip,
    mamba,
)}
