"""Builds the oracle fixture for ferrite's numerics tests from Hugging Face transformers.

transformers loads the same GGUF (dequantized to f32) and runs its own Llama implementation:
nobody on this project wrote it. For each text we store the token ids transformers' tokenizer
produces, and teacher-forced, for every position, its top-1 next token and that token's
logprob. The Rust tests read only the JSON this writes.

    python3 -m venv /tmp/oracle && /tmp/oracle/bin/pip install torch transformers accelerate gguf
    /tmp/oracle/bin/python tests/oracle/make_fixture.py models/SmolLM2-135M-Instruct.Q4_1.gguf
    /tmp/oracle/bin/python tests/oracle/make_fixture.py models/gemma-3-270m-q4_k_m.gguf \
        tests/oracle/gemma3_fixture.json
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
    "{user}What is the capital of France, and roughly how many people live there?{end}"
    "{assistant}The capital of France is Paris. About 2.1 million people live in the city "
    "itself, and roughly 12 million in the wider metropolitan area.{end}",
    "In 2024 the team shipped 1,337 releases; the median build took 42.5 seconds and the p99 was "
    "311 s. Café owners in Zürich paid 4.80 CHF for a croissant — naïve estimates said 3.90. "
    "Temperatures ranged from -12°C to 38°C, and the river rose 0.75 m in 36 hours.",
]

TOKENIZER_TEXTS = [
    "x = 1234567890; y = 3.14159e-10 + 0x1F",
    "日本語のテキストと한국어 and emoji 🚀🔥 mixed in",
    "   leading spaces\tand tabs\n\n\nnewlines  trailing   ",
    "It's we're they'll I'd you've SHOUTING CamelCaseIdentifiers snake_case_names",
]


# Each model's own chat markup, so the chat text exercises its special tokens.
CHAT_MARKUP = {
    "llama": {"user": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
              "Hugging Face<|im_end|>\n<|im_start|>user\n", "assistant": "<|im_start|>assistant\n",
              "end": "<|im_end|>\n"},
    "gemma3": {"user": "<start_of_turn>user\n", "assistant": "<start_of_turn>model\n",
               "end": "<end_of_turn>\n"},
}


def main():
    gguf_path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "smollm2_fixture.json")
    d, f = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()
    markup = CHAT_MARKUP[model.config.model_type.removesuffix("_text")]
    texts = []
    for t in TEXTS:
        for k, v in markup.items():
            t = t.replace("{" + k + "}", v)
        texts.append(t)
    records = []
    for text in texts:
        # Gemma is trained with BOS first; SmolLM2's GGUF adds none.
        ids = tok.encode(text, add_special_tokens=True)
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
    # Greedy continuation of a chat in the model's turn format, as the server must render it
    # (Gemma's GGUF has no template: ferrite's own writes this format).
    chat = None
    if "user" in markup and model.config.model_type.startswith("gemma"):
        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name the largest planet."}]
        prompt = ("<bos>" + markup["user"] + messages[0]["content"] + "\n\n" + messages[1]["content"]
                  + markup["end"] + markup["assistant"])
        ids = tok.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        new = generated[0][len(ids):].tolist()
        chat = {"messages": messages, "prompt_ids": ids, "greedy_ids": new,
                "greedy_text": tok.decode(new, skip_special_tokens=True)}
    tokenizer_cases = [{"text": t, "token_ids": tok.encode(t, add_special_tokens=False)}
                       for t in texts + TOKENIZER_TEXTS]
    import transformers
    with open(out, "w") as fh:
        json.dump({
            "oracle": f"transformers {transformers.__version__}, torch {torch.__version__}, f32, gguf_file={f}",
            "teacher_forced": records,
            "tokenizer": tokenizer_cases,
            "chat": chat,
        }, fh, ensure_ascii=False, indent=1)
    print(f"wrote {out}: {sum(len(r['token_ids']) for r in records)} positions")


if __name__ == "__main__":
    main()
