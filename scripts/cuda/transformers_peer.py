"""The peer of `ferrite bench throughput` on the GPU host: Hugging Face transformers'
continuous batching (`generate_batch`, paged attention) on the same config with random bf16
weights, over the exact prompts ferrite wrote with `--dump-prompts`, greedy, `--output-len`
new tokens each. Prints one table row in ferrite's format.
Usage: python3 transformers_peer.py CONFIG.json PROMPTS.json OUTPUT_LEN"""
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import GenerationConfig

config_path, prompts_path, output_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = json.load(open(prompts_path))
config = LlamaConfig(**json.load(open(config_path)))
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(config)
model.eval()
# Weights like ferrite's dummy load: normal with std 0.02, norms at 1.
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.02)
        else:
            p.fill_(1.0)
gen = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                       eos_token_id=None, pad_token_id=0)


def run(batch):
    torch.cuda.synchronize()
    t0 = time.time()
    with torch.no_grad():
        out = model.generate_batch(inputs=batch, generation_config=gen, progress_bar=False)
    torch.cuda.synchronize()
    return out, time.time() - t0


last_error = None
for attn in ["paged|sdpa", "sdpa_paged", "paged_attention", None]:
    try:
        if attn is not None:
            model.set_attn_implementation(attn)
        run([prompts[0][:16]])  # warm-up: graphs, kernels, the cache
        out, elapsed = run(prompts)
        break
    except Exception as e:  # the attention name moved between releases
        last_error = e
        print(f"attn_implementation={attn}: {type(e).__name__}: {e}", file=sys.stderr)
else:
    raise SystemExit(f"generate_batch failed: {last_error}")

results = list(out.values()) if isinstance(out, dict) else list(out)
output = sum(len(r.generated_tokens) for r in results)
input_tokens = sum(map(len, prompts))
n = len(prompts)
print(f"| transformers {__import__('transformers').__version__} generate_batch ({attn}) | {n} | "
      f"{input_tokens} | {output} | {elapsed:.2f} | {n / elapsed:.2f} | {output / elapsed:.0f} | "
      f"{(input_tokens + output) / elapsed:.0f} | - |")
