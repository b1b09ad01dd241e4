"""Every MoE family of the installed transformers, built tiny from its own config class (test helper).

`families()` lists the model folders whose configuration declares experts (num_experts, n_routed_experts,
num_local_experts, moe_*); `build(family)` gives (model, reason): a randomly initialised causal LM (or the
text model of a multimodal family) with 3 layers, 8 experts, top-2, hidden 64, or None and why not.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

LAYERS, EXPERTS, TOPK, HIDDEN = 3, 8, 2, 64
EXPERT_RE = re.compile(r"num_experts|n_routed_experts|num_local_experts|moe_")
# Not causal language models: their experts sit in an encoder-decoder, a vision backbone or a speech model,
# or the "experts" are no MoE at all (gemma4_assistant's centroid head).
NOT_CAUSAL_LM = {
    "nllb_moe": "encoder-decoder translation model (no causal LM head for RL)",
    "switch_transformers": "encoder-decoder T5 model (no causal LM head for RL)",
    "vitpose_backbone": "vision backbone whose expert is chosen by a dataset index, not routed",
    "gemma4_assistant": "no MoE block: a centroid-masked embedder head",
    "nemotron3_5_transcribe": "speech model without a routed MoE block in its modeling code",
    "openai_privacy_filter": "token classifier (no causal LM head for RL)",
}
# Set on the text config when the config class declares them.
WIDTHS = dict(vocab_size=128, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
              shared_experts_intermediate_size=32, first_dense_intermediate_size=64, dense_intermediate_size=64,
              prefix_dense_intermediate_size=64, expert_ffn_hidden_size=32, moe_hidden_size=32,
              num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=256,
              q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16,
              index_head_dim=16, index_n_heads=2, index_topk=8, o_lora_rank=16, o_groups=2, swa_head_dim=16,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_head_dim=8, mamba_head_dim=8, mamba_n_heads=8, mamba_num_heads=8, n_groups=1, mamba_n_groups=1,
              mamba_d_state=8, ssm_state_size=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
              router_hidden_size=32, moe_latent_size=None, gated_norm_rank=8, hc_lowrank=8, indexer_head_dim=16,
              sliding_window=16, n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
              n_group=2, topk_group=1, first_k_dense_replace=1, num_dense_layers=1, num_dense_blocks=1,
              num_mtp_layers=0, num_nextn_predict_layers=0, zero_expert_num=0, tie_word_embeddings=False,
              use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOPK_NAMES = ("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k", "top_k_experts", "top_k")


def models_dir() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


def families() -> list[str]:
    """Model folders of the installed transformers whose configuration declares experts."""
    out = []
    for path in sorted(models_dir().glob("*/configuration_*.py")):
        if EXPERT_RE.search(path.read_text()):
            out.append(path.parent.name)
    return sorted(set(out))


def _config_classes(family: str) -> list[type]:
    import transformers

    mod = importlib.import_module(f"transformers.models.{family}")
    return [getattr(mod, n) for n in dir(mod)
            if n.endswith("Config") and isinstance(getattr(mod, n), type)
            and issubclass(getattr(mod, n), transformers.PreTrainedConfig)]


def _text_config_class(family: str) -> type | None:
    """The config class of the family's text (decoder) model: the one with layers and experts."""
    best = None
    for cls in _config_classes(family):
        fields = _fields(cls)
        if fields & {"num_hidden_layers", "n_layers", "num_layers", "layers_block_type"}:
            score = sum(name in fields for name in EXPERT_COUNTS + TOPK_NAMES) + ("Text" in cls.__name__)
            if best is None or score > best[0]:
                best = (score, cls)
    return None if best is None else best[1]


def _fields(cls: type) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
    return names


def tiny_config(family: str):
    """The family's text config with 3 layers, 8 experts, top-2, hidden 64 (whatever of these it declares)."""
    cls = _text_config_class(family)
    if cls is None:
        raise LookupError("no text config class with layers")
    fields = _fields(cls)
    kw = {k: v for k, v in WIDTHS.items() if k in fields}
    for name in ("num_hidden_layers", "n_layers", "num_layers"):
        if name in fields:
            kw[name] = LAYERS
    kw.update({name: EXPERTS for name in EXPERT_COUNTS if name in fields})
    kw.update({name: TOPK for name in TOPK_NAMES if name in fields})
    kw.update(FAMILY_OVERRIDES.get(family, {}))
    return cls(**kw)


# Per family: what the generic widths do not fit (a layer pattern of 3 layers with an MoE layer in it, ...).
FAMILY_OVERRIDES: dict[str, dict] = {
    "dbrx": {"d_model": HIDDEN, "n_heads": 4, "max_seq_len": 256,
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": EXPERTS, "moe_top_k": TOPK},
             "attn_config": {"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "step3p7": {"mlp_layer_types": ["dense", "sparse", "sparse"]},
    "glm5_next": {"index_topk": 16},
    "nemotron_h": {"layers_block_type": ["mamba", "moe", "attention"]},
    "jamba": {"expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 0,
              "use_mamba_kernels": False},
    "llama4": {"interleave_moe_layer_step": 1, "num_local_experts": EXPERTS, "intermediate_size_mlp": 64},
    "beam": {"mlp_layer_types": ["dense", "sparse", "sparse"]},
    "gemma4": {"enable_moe_block": True},
    "doge": {"is_moe": True},
    # MiMo: a rotary part of 0.334 x head_dim must be even; its sliding layers double the kv heads
    "mimo_v2_flash": {"head_dim": 24, "v_head_dim": 16, "num_attention_heads": 8, "num_key_value_heads": 2},
    "glm4v_moe": {"head_dim": 128},  # its default mrope_section [8, 12, 12] spans a 64-wide rotary half
    "aria": {"moe_topk": 3},  # k from the module: Aria's config has no num_experts_per_tok
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe", "moe"]},  # a hash-routed layer beside top-k ones
    "longcat_flash": {"head_dim": 8},  # its rotary embedding is head_dim wide: the MLA rope part
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},
    "zaya": {"num_experts_per_tok": 1},
    "ernie4_5_vl_moe": {"moe_intermediate_size": [32, 32]},
    "ernie4_5_moe": {"moe_layer_start_index": 1, "moe_layer_end_index": LAYERS - 1, "moe_layer_interval": 1},
}


def build(family: str, seed: int = 0):
    """(model, None) for a tiny random model of `family`, or (None, reason) when it cannot be built."""
    import torch
    import transformers

    if family in NOT_CAUSAL_LM:
        return None, NOT_CAUSAL_LM[family]
    if not list((models_dir() / family).glob("modeling_*.py")):
        return None, "config only: this transformers ships no modeling code for it"
    try:
        config = tiny_config(family)
    except Exception as e:  # noqa: BLE001 - the reason is the test's output
        return None, f"tiny config: {type(e).__name__}: {str(e)[:160]}"
    torch.manual_seed(seed)
    errors = []
    for make in (transformers.AutoModelForCausalLM.from_config, transformers.AutoModel.from_config,
                 *_text_model_classes(family, type(config))):
        try:
            model = make(config, attn_implementation="eager") if hasattr(make, "__self__") else make(config)
            return model.eval(), None
        except Exception as e:  # noqa: BLE001
            errors.append(f"{getattr(make, '__qualname__', make)}: {type(e).__name__}: {str(e)[:160]}")
    return None, "; ".join(errors[-1:])


def _text_model_classes(family: str, config_class: type) -> list[type]:
    """The family's model classes built from its text config (for configs the Auto classes do not map)."""
    import transformers

    mod = importlib.import_module(f"transformers.models.{family}")
    out = [getattr(mod, n) for n in dir(mod) if isinstance(getattr(mod, n), type) and "PreTrained" not in n
           and issubclass(getattr(mod, n), transformers.PreTrainedModel)
           and getattr(getattr(mod, n), "config_class", None) is config_class]
    return sorted(out, key=lambda c: ("ForCausalLM" not in c.__name__, "TextModel" not in c.__name__, c.__name__))
