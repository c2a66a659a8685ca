"""Builds the oracle fixture for ferrite's numerics tests from Hugging Face transformers.

transformers loads the same GGUF (dequantized to f32) and runs its own Llama implementation:
nobody on this project wrote it. For each text we store the token ids transformers' tokenizer
produces, and teacher-forced, for every position, its top-1 next token and that token's
logprob. The Rust tests read only the JSON this writes.

    python3 -m venv /tmp/oracle && /tmp/oracle/bin/pip install torch transformers accelerate gguf
    /tmp/oracle/bin/python tests/oracle/make_fixture.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, "
    "printing shops had spread to more than two hundred cities across Europe, and the price of "
    "books fell sharply. Scholars could compare identical copies of a text for the first time, "
    "which changed how knowledge was checked, shared and argued about.",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n"
    "    seq = [0, 1]\n    while len(seq) < n:\n        seq.append(seq[-1] + seq[-2])\n"
    "    return seq[:n]\n\n\nif __name__ == \"__main__\":\n    for i, x in enumerate(fibonacci(12)):\n"
    "        print(f\"{i:2d}: {x}\")\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France, and roughly how many people live there?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris. About 2.1 million people live in the city "
    "itself, and roughly 12 million in the wider metropolitan area.<|im_end|>\n",
    "In 2024 the team shipped 1,337 releases; the median build took 42.5 seconds and the p99 was "
    "311 s. Café owners in Zürich paid 4.80 CHF for a croissant — naïve estimates said 3.90. "
    "Temperatures ranged from -12°C to 38°C, and the river rose 0.75 m in 36 hours.",
]

TOKENIZER_TEXTS = TEXTS + [
    "x = 1234567890; y = 3.14159e-10 + 0x1F",
    "日本語のテキストと한국어 and emoji 🚀🔥 mixed in",
    "   leading spaces\tand tabs\n\n\nnewlines  trailing   ",
    "It's we're they'll I'd you've SHOUTING CamelCaseIdentifiers snake_case_names",
]


def main():
    gguf_path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "smollm2_fixture.json")
    d, f = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()
    records = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        top = lp.argmax(dim=-1)
        records.append({
            "text": text,
            "token_ids": ids,
            "top1": top.tolist(),
            "top1_logprob": lp.gather(1, top[:, None])[:, 0].tolist(),
        })
    tokenizer_cases = [{"text": t, "token_ids": tok.encode(t, add_special_tokens=False)} for t in TOKENIZER_TEXTS]
    import transformers
    with open(out, "w") as fh:
        json.dump({
            "oracle": f"transformers {transformers.__version__}, torch {torch.__version__}, f32, gguf_file={f}",
            "teacher_forced": records,
            "tokenizer": tokenizer_cases,
        }, fh, ensure_ascii=False, indent=1)
    print(f"wrote {out}: {sum(len(r['token_ids']) for r in records)} positions")


if __name__ == "__main__":
    main()
