"""Tiny random-weight checkpoints of every decoder family ferrite serves, with transformers'
logits as the oracle.

For each family Hugging Face transformers builds a small config with random weights (a large
`initializer_range` gives peaked logits), saves it as a Hugging Face folder (config.json +
model.safetensors in bf16, so the files stay small) and, where llama.cpp has a GGUF layout for
the family, writes the same weights as a GGUF file with llama.cpp's tensor names, its Q/K row
permutation (Llama) and its norm + 1 (Gemma). It then runs transformers (f32, eager attention)
on a fixed token sequence longer than every sliding window and stores the logits of every
position, twice: in f32 throughout, and with K and V rounded to f16 where they enter the KV
cache (after the rotary embedding), as ferrite's CPU cache holds them. The Rust test `crates/ferrite-model/tests/families.rs` reads only what this writes.

    python3 -m venv /tmp/oracle && /tmp/oracle/bin/pip install torch transformers gguf
    /tmp/oracle/bin/python tests/oracle/make_tiny.py [family ...]   # writes tests/oracle/tiny/
"""
import copy
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")
VOCAB = 128
POSITIONS = 48

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
            initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)

# name: (model_type, config overrides, GGUF architecture or None)
FAMILIES = {
    "llama31": ("llama", dict(num_hidden_layers=2, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)), "llama"),
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=16), None),
    "qwen2": ("qwen2", dict(num_hidden_layers=2, tie_word_embeddings=True), "qwen2"),
    "qwen3": ("qwen3", dict(num_hidden_layers=2, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16)), "qwen3"),
    "gemma2": ("gemma2", dict(num_hidden_layers=2, sliding_window=16, query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh"), "gemma2"),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, sliding_window=16,
        query_pre_attn_scalar=32, tie_word_embeddings=True, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh"), "gemma3"),
    # Mixtures of experts: 8 experts, 2 per token. llama.cpp writes Mixtral as `llama`.
    "mixtral": ("mixtral", dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
        "llama"),
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=96, norm_topk_prob=False),
        "qwen2moe"),
    # Layer 1 dense (`mlp_only_layers`): the routing of mixed stacks.
    # Gated delta-net (linear attention) layers around gated full attention; no GGUF layout.
    "qwen3_5": ("qwen3_5_text", dict(num_hidden_layers=4, layer_types=["linear_attention",
        "linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
        partial_rotary_factor=0.25)), None),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_hidden_layers=4, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)), None),
    # Its fused per-key-head projections; experts with a gated shared expert, layer 2 dense.
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=4, layer_types=["linear_attention",
        "linear_attention", "linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[2],
        partial_rotary_factor=0.25), None),
    # 40 experts: the CUDA router holds more than one per lane.
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, num_experts=40, num_experts_per_tok=6,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]), None),
}

# Written with transformers' fused expert tensors instead of one tensor per expert.
FUSED_EXPERTS = {"qwen3_5_moe"}

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}

def stack_experts(state):
    """transformers' fused expert tensors (`experts.gate_up_proj` `[E, 2I, h]`, gate rows
    first, and `experts.down_proj` `[E, h, I]`) as llama.cpp's `(layer, part) -> [E, rows, cols]`."""
    out, rest = {}, {}
    for name, t in state.items():
        if ".experts." not in name:
            rest[name] = t
            continue
        layer = int(name.split(".")[2])
        if name.endswith("gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[(layer, "gate")], out[(layer, "up")] = gate, up
        else:
            out[(layer, "down")] = t
    return out, rest


def permute(w, heads):
    """llama.cpp's converter: Q/K rows reordered so rotary pairs are adjacent."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(c):
    s = c.rope_parameters if hasattr(c, "rope_parameters") and c.rope_parameters else c.rope_scaling
    base, dim = s.get("rope_theta", 500000.0), c.head_dim
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    orig = s["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        freq = 1.0 / base ** (i / dim)
        wavelen = 2 * np.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path, arch, c, state):
    import gguf
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    if "full_attention" in rope:
        rope = rope["full_attention"]
    w.add_rope_freq_base(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", c.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", c.final_logit_softcapping)
    if rope.get("rope_type") == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                     rope["original_max_position_embeddings"])
    if getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None):
        w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if getattr(c, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    experts, state = stack_experts(state)
    for (layer, part), t in experts.items():
        w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", t.float().numpy().astype(np.float16))
    gemma = arch.startswith("gemma")
    for name, t in state.items():
        t = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            stem, kind = rest.rsplit(".", 1)
            if stem == "mlp.shared_expert_gate":
                t = t.reshape(-1)
            if stem == "post_attention_layernorm":
                part = "post_attention_norm" if gemma else "ffn_norm"
            else:
                part = GGUF_NAMES[stem]
            g = f"blk.{layer}.{part}.{kind}"
            if arch == "llama" and stem == "self_attn.q_proj":
                t = permute(t, c.num_attention_heads)
            if arch == "llama" and stem == "self_attn.k_proj":
                t = permute(t, c.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            t = t + 1.0
        # Matrices as f16 (the safetensors hold bf16: both exact for bf16 values), vectors f32.
        w.add_tensor(g, t.astype(np.float16) if t.ndim == 2 else t.astype(np.float32))
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def f16_kv_logits(model, tokens):
    """Logits with K (after rotary) and V rounded to f16, as an f16 paged KV cache stores them."""
    import importlib
    attn = next(l.self_attn for l in model.model.layers if hasattr(l, "self_attn"))
    mod = importlib.import_module(type(attn).__module__)
    rotary = mod.apply_rotary_pos_emb

    def rounded(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, k.half().float()

    mod.apply_rotary_pos_emb = rounded
    hooks = [l.self_attn.v_proj.register_forward_hook(lambda m, i, out: out.half().float())
             for l in model.model.layers if hasattr(l, "self_attn")]
    try:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].float()
    finally:
        mod.apply_rotary_pos_emb = rotary
        for h in hooks:
            h.remove()


def main(only):
    os.makedirs(OUT, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(3, VOCAB, (POSITIONS,), generator=g).tolist()
    for seed, (name, (model_type, overrides, gguf_arch)) in enumerate(FAMILIES.items()):
        if only and name not in only:
            continue
        shutil.rmtree(os.path.join(OUT, name), ignore_errors=True)
        torch.manual_seed(seed)
        c = AutoConfig.for_model(model_type, **{**BASE, **overrides})
        c._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(c, dtype=torch.float32)
        # Round every weight to bf16 first: the files hold bf16, the oracle runs on those values.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                # Zero-centred norms start at 0 (= 1): perturbed, so the offset is tested.
                if model_type.startswith(("qwen3_5", "qwen3_next")) and "norm" in pname:
                    p.add_(torch.randn_like(p) * 0.1)
                p.copy_(p.to(torch.bfloat16).float())
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
        logits_f16_kv = f16_kv_logits(model, tokens)
        # transformers itself in bf16: how far a bf16 run strays (routing flips near ties,
        # the gated delta rule's sensitivity), the bound of a bf16 backend's agreement.
        with torch.no_grad():
            bf16_run = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor([tokens])).logits[0]
        bf16_diff = (bf16_run.float() - logits).abs()
        bf16_top1 = (bf16_run.argmax(-1) == logits.argmax(-1)).float().mean().item()
        folder = os.path.join(OUT, name)
        # Saved last: casting the model to bf16 also rounds its rotary frequency buffers.
        model.to(torch.bfloat16).save_pretrained(folder)
        if name in FUSED_EXPERTS:
            # transformers' own layout (`experts.gate_up_proj` [E, 2I, h]), as some
            # checkpoints ship it, in place of the per-expert tensors save_pretrained writes.
            from safetensors.torch import save_file
            state = {k: v.contiguous() for k, v in model.state_dict().items()
                     if "rotary" not in k and not (c.tie_word_embeddings and k == "lm_head.weight")}
            save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        model.float()
        if gguf_arch:
            state = {k: v for k, v in model.state_dict().items()
                     if not (c.tie_word_embeddings and k == "lm_head.weight")
                     and "rotary" not in k}
            write_gguf(os.path.join(OUT, f"{name}.gguf"), gguf_arch, c, state)
        with open(os.path.join(folder, "oracle.json"), "w") as fh:
            json.dump({
                "oracle": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                          f"f32, eager attention, bf16-rounded random weights",
                "token_ids": tokens,
                "logits": [[round(x, 5) for x in row] for row in logits.tolist()],
                "logits_f16_kv": [[round(x, 5) for x in row] for row in logits_f16_kv.tolist()],
                "transformers_bf16_max_dlogit": round(bf16_diff.max().item(), 5),
                "transformers_bf16_mean_dlogit": round(bf16_diff.mean().item(), 5),
                "transformers_bf16_top1": round(bf16_top1, 5),
            }, fh)
        print(f"{name}: {model_type}, {sum(p.numel() for p in model.parameters())} weights")


if __name__ == "__main__":
    main(sys.argv[1:])
