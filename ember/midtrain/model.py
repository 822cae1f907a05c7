"""megatron-core GPTModel with MoE layers, built from the validated `MidtrainConfig`.

With Transformer Engine on a GPU the TE layer spec is used (THD packed attention, grouped GEMM
available); otherwise the local spec (dense block-diagonal attention mask, SequentialMLP experts).
`packed_attention` reads which of the two a built model honours.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Literal

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from ember.midtrain.config import MidtrainConfig


def transformer_engine_usable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def padded_vocab_size(config: MidtrainConfig) -> int:
    """Embedding rows: the vocabulary rounded up so every TP rank holds an equal slice."""
    multiple = config.model.vocab_pad_multiple * config.parallel.tensor
    return math.ceil(config.model.vocab_size / multiple) * multiple


def transformer_config(config: MidtrainConfig, *, bf16: bool) -> TransformerConfig:
    m, moe, p = config.model, config.moe, config.parallel
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        init_method_std=m.init_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        add_bias_linear=False,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        expert_model_parallel_size=p.expert,
        sequence_parallel=p.tensor > 1,
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_router_score_function=moe.router_score_function,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=moe.expert_bias_update_rate,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_enable_routing_replay=moe.routing_replay,
        moe_grouped_gemm=moe.grouped_gemm,
        moe_router_dtype="fp32",
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not on_gpu,
        # The fused bias-dropout-add is torch.compile'd, which on CPU means an inductor C++ build.
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
    )


def build_model(config: MidtrainConfig, tconfig: TransformerConfig) -> GPTModel:
    """This pipeline stage's GPTModel (the first stage embeds, the last computes the loss)."""
    if transformer_engine_usable():
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.moe.num_experts, moe_grouped_gemm=config.moe.grouped_gemm
        )
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=config.moe.num_experts,
            moe_grouped_gemm=config.moe.grouped_gemm,
            normalization=config.model.normalization,
        )
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(config),
        max_sequence_length=config.model.seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type=config.model.position_embedding,
        rotary_base=config.model.rotary_base,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def moe_routers(model) -> list:
    """The model's TopKRouters in layer order (the order router replay indices are given in)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return sorted((m for m in model.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number)


PackedAttention = Literal["thd", "dense_mask"]


def _te_attention_class() -> type | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention


def packed_attention(model) -> PackedAttention:
    """How this built model keeps the sequences of a packed row apart, read from its attention modules.

    "thd": every core attention is Transformer Engine's, which takes PackedSeqParams (cu_seqlens) and
    applies only its own causal mask, never a dense one. "dense_mask": every one is megatron's local
    DotProductAttention on its torch softmax path, which applies the dense mask it is given. Anything
    else raises: the fused causal softmax kernel (fp16/bf16 with masked_softmax_fusion) replaces any
    mask by a plain causal one, and an attention module of unknown kind gives no such guarantee, so
    packed sequences would silently attend to each other.
    """
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    te_class = _te_attention_class()
    kinds: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        core = module.core_attention
        if te_class is not None and isinstance(core, te_class):
            kinds.add("thd")
        elif isinstance(core, DotProductAttention):
            softmax = core.scale_mask_softmax
            if softmax.scaled_masked_softmax_fusion and softmax.input_in_float16 and softmax.attn_mask_type == AttnMaskType.causal:
                raise ValueError(
                    f"{name}: local attention in fp16/bf16 with masked_softmax_fusion uses the fused causal softmax, "
                    "which ignores the block-diagonal mask: packed sequences would attend to each other (use the "
                    "Transformer Engine layer spec, or fp32 / masked_softmax_fusion off)"
                )
            kinds.add("dense_mask")
        else:
            raise ValueError(
                f"{name}: core attention {type(core).__name__} neither takes packed-sequence parameters (Transformer "
                "Engine) nor applies a dense mask (megatron's DotProductAttention): cannot keep packed sequences apart"
            )
    if len(kinds) != 1:
        raise ValueError(f"the model's attention layers must all be of one kind to pack sequences, found {sorted(kinds) or 'none'}")
    return kinds.pop()  # type: ignore[return-value]
