"""Multi-token-prediction (MTP) heads on the tiny hybrid checkpoints of `make_tiny.py`, with a
reference computed from transformers' own modules.

transformers loads Qwen3-Next and Qwen3.5 checkpoints without their `mtp.*` tensors (it has no
MTP model), so the reference is assembled here from its parts, as vLLM runs the head: the
embedding of the token at p + 1 and the target's final hidden state at p, each RMS-normed
(`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), concatenated, projected by `fc` from 2h to h,
then one full-attention decoder layer of the family (transformers' class, on positions 0..T-1
with its own causal attention), the head's `norm` and the target's LM head: the logits of the
token at p + 2. K and V are rounded to f16 where they enter the cache, in the target's layers
and in the head's, as ferrite's CPU cache holds them.

For each family it writes `tests/oracle/tiny/<family>_mtp/`: the family's config with its MTP
layer count, its weights plus random `mtp.*` tensors (bf16), and `oracle.json` (the target's
and the head's logits at every position). The Rust test `crates/ferrite-model/tests/mtp.rs`
reads only what this writes.

    /tmp/oracle/bin/python tests/oracle/make_mtp.py   # after make_tiny.py, same venv
"""
import importlib
import json
import os
import shutil

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")
# family: the config key of its MTP layer count.
FAMILIES = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}


def bf16(t):
    return t.to(torch.bfloat16).float()


class Rounded:
    """K (after rotary) and V rounded to f16 in every attention layer of the listed ones."""

    def __init__(self, layers):
        self.attn = [l.self_attn for l in layers if hasattr(l, "self_attn")]
        self.mod = importlib.import_module(type(self.attn[0]).__module__)

    def __enter__(self):
        rotary = self.rotary = self.mod.apply_rotary_pos_emb

        def rounded(q, k, cos, sin, *args, **kwargs):
            q, k = rotary(q, k, cos, sin, *args, **kwargs)
            return q, k.half().float()

        self.mod.apply_rotary_pos_emb = rounded
        self.hooks = [a.v_proj.register_forward_hook(lambda m, i, out: out.half().float())
                      for a in self.attn]

    def __exit__(self, *exc):
        self.mod.apply_rotary_pos_emb = self.rotary
        for h in self.hooks:
            h.remove()


def main():
    for seed, (name, count_key) in enumerate(FAMILIES.items()):
        src, out = os.path.join(TINY, name), os.path.join(TINY, f"{name}_mtp")
        with open(os.path.join(src, "oracle.json")) as fh:
            tokens = json.load(fh)["token_ids"]
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        model.eval()
        c = model.config
        c._attn_implementation = "eager"
        h, n = c.hidden_size, len(tokens)
        # The head's layer: a full-attention layer of the family whose MLP is of the kind of
        # layer 0's (vLLM builds it as `mtp.layers.0`), its weights that layer's, perturbed.
        torch.manual_seed(100 + seed)
        full = c.layer_types.index("full_attention")
        assert full not in getattr(c, "mlp_only_layers", []), "an MoE layer like layer 0"
        layer = type(model.model.layers[full])(c, full)
        layer.load_state_dict(model.model.layers[full].state_dict(), strict=False)
        Norm = type(model.model.norm)
        norms = {k: Norm(h, eps=c.rms_norm_eps) for k in
                 ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        fc = torch.nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn_like(p) * 0.05).copy_(bf16(p))
            for m in norms.values():
                m.weight.copy_(bf16(torch.randn(h) * 0.1))
            fc.weight.copy_(bf16(torch.randn(h, 2 * h) * 0.1))
        layer.eval()

        ids = torch.tensor([tokens])
        with torch.no_grad(), Rounded(list(model.model.layers) + [layer]):
            target = model.model(ids)
            hidden = target.last_hidden_state[0]  # after the final norm
            logits = model.lm_head(hidden)
            # Row p: the token at p + 1 (the last row's is the one after the sequence: any).
            nxt = torch.tensor(tokens[1:] + [tokens[0]])
            e = model.model.embed_tokens(nxt)
            x = fc(torch.cat([norms["pre_fc_norm_embedding"](e),
                              norms["pre_fc_norm_hidden"](hidden)], -1))[None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            y = layer(x, position_embeddings=model.model.rotary_emb(x, pos),
                      attention_mask=mask, position_ids=pos)
            y = y[0] if isinstance(y, tuple) else y
            mtp_logits = model.lm_head(norms["norm"](y))[0]

        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        with open(os.path.join(src, "config.json")) as fh:
            config = json.load(fh)
        config[count_key] = 1
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2)
        state = load_file(os.path.join(src, "model.safetensors"))
        layer_state = layer.state_dict()
        if name == "qwen3_next" and any(".experts.gate_up_proj" in k for k in layer_state):
            # Per-expert tensors, as Qwen3-Next checkpoints ship them.
            for k in [k for k in layer_state if ".experts." in k]:
                t = layer_state.pop(k)
                base = k.split(".experts.")[0]
                for e_ in range(t.shape[0]):
                    if k.endswith("gate_up_proj"):
                        g, u = t[e_].chunk(2, dim=0)
                        layer_state[f"{base}.experts.{e_}.gate_proj.weight"] = g
                        layer_state[f"{base}.experts.{e_}.up_proj.weight"] = u
                    else:
                        layer_state[f"{base}.experts.{e_}.down_proj.weight"] = t[e_]
        for k, v in layer_state.items():
            state[f"mtp.layers.0.{k}"] = v
        for k, m in norms.items():
            state[f"mtp.{k}.weight"] = m.weight
        state["mtp.fc.weight"] = fc.weight
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}
        save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "oracle.json"), "w") as fh:
            json.dump({
                "oracle": f"transformers {transformers.__version__}, torch {torch.__version__}: "
                          f"its decoder layer, norms and LM head assembled as vLLM runs the "
                          f"MTP head; f32, f16 K/V",
                "token_ids": tokens,
                "logits_f16_kv": [[round(v, 5) for v in r] for r in logits.tolist()],
                "mtp_logits_f16_kv": [[round(v, 5) for v in r] for r in mtp_logits.tolist()],
            }, fh)
        print(f"{name}_mtp: {sum(p.numel() for p in layer.parameters()) + fc.weight.numel()} "
              f"MTP weights")

if __name__ == "__main__":
    main()
