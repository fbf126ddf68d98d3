"""Tiny models with seeded random weights, written to a cache folder for the engine check.

Why real random weights: with vLLM's dummy weights attention is almost uniform, greedy output
depends almost only on the last token, and a manager that hands out a wrong block on a prefix
hit changes no output. Seeded random weights with q/k std ~0.15 make attention peaked enough
that reading the wrong KV block changes the generated tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB = 1024
HIDDEN = 128
HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 256
QK_STD = 0.15
OTHER_STD = 0.05
EMBED_STD = 0.5
# Bumped when the written files change, so a stale cache is rewritten.
FORMAT_VERSION = 2


def _write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer "t0".."t1023": enough for vLLM and the server to detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "t1",
                "eos_token": "t2",
                "unk_token": "t0",
                "model_max_length": 4096,
            }
        )
    )


def _attention_weights(prefix: str, gen: object) -> dict[str, object]:
    import torch

    g = gen  # a torch.Generator
    q_out = HEADS * HEAD_DIM
    return {
        f"{prefix}.q_proj.weight": torch.randn(q_out, HIDDEN, generator=g) * QK_STD,  # type: ignore[arg-type]
        f"{prefix}.k_proj.weight": torch.randn(q_out, HIDDEN, generator=g) * QK_STD,  # type: ignore[arg-type]
        f"{prefix}.v_proj.weight": torch.randn(q_out, HIDDEN, generator=g) * OTHER_STD * 4,  # type: ignore[arg-type]
        f"{prefix}.o_proj.weight": torch.randn(HIDDEN, q_out, generator=g) * OTHER_STD * 2,  # type: ignore[arg-type]
    }


def _llama_like_weights(num_layers: int, seed: int, extra_norms: bool) -> dict[str, object]:
    import torch

    g = torch.Generator().manual_seed(seed)
    w: dict[str, object] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * EMBED_STD,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g) * OTHER_STD * 4,
    }
    for i in range(num_layers):
        p = f"model.layers.{i}"
        w.update(_attention_weights(f"{p}.self_attn", g))
        w[f"{p}.mlp.gate_proj.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=g) * OTHER_STD
        w[f"{p}.mlp.up_proj.weight"] = torch.randn(INTERMEDIATE, HIDDEN, generator=g) * OTHER_STD
        w[f"{p}.mlp.down_proj.weight"] = torch.randn(HIDDEN, INTERMEDIATE, generator=g) * OTHER_STD
        w[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        if extra_norms:
            w[f"{p}.pre_feedforward_layernorm.weight"] = torch.zeros(HIDDEN)
            w[f"{p}.post_feedforward_layernorm.weight"] = torch.zeros(HIDDEN)
            w[f"{p}.self_attn.q_norm.weight"] = torch.zeros(HEAD_DIM)
            w[f"{p}.self_attn.k_norm.weight"] = torch.zeros(HEAD_DIM)
    return w


def _common_config() -> dict[str, object]:
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def llama_config() -> dict[str, object]:
    cfg = _common_config()
    cfg.update(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 2,
            "hidden_act": "silu",
        }
    )
    return cfg


SLIDING_WINDOW = 96


def hybrid_config() -> dict[str, object]:
    """Gemma-3 text layout: sliding-window layers interleaved with full attention."""
    cfg = _common_config()
    cfg.update(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "num_hidden_layers": 4,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            "sliding_window": SLIDING_WINDOW,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": HEAD_DIM,
            "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "rope_scaling": None,
        }
    )
    return cfg


MODELS = {
    "llama": (llama_config, 0, False),
    "hybrid": (hybrid_config, 1, True),
}


def write_model(name: str, cache_dir: Path) -> Path:
    """Writes (or reuses) the model `name` under cache_dir and returns its folder."""
    from safetensors.torch import save_file

    make_config, seed, extra_norms = MODELS[name]
    folder = cache_dir / f"{name}-v{FORMAT_VERSION}"
    if (folder / "model.safetensors").exists():
        return folder
    tmp = cache_dir / f".{name}-tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = make_config()
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _write_tokenizer(tmp)
    weights = _llama_like_weights(int(cfg["num_hidden_layers"]), seed, extra_norms)  # type: ignore[call-overload]
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))  # type: ignore[attr-defined]
    tmp.rename(folder)
    return folder
