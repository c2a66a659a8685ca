"""Reference embeddings for ferrite's embedding tests, written once so CI needs no torch.

- all-MiniLM-L6-v2 (scripts/fetch-model.sh minilm): sentence-transformers' own encode of a few
  texts (mean pooling, normalized), with the token ids its tokenizer gives them.
- tiny/qwen3_embedding: the tiny random Qwen3 of make_tiny.py described as a
  sentence-transformers model with last-token pooling (Qwen3-Embedding's shape):
  transformers' Qwen3Model in f32, the last position's final-normed state, normalized.

    python3 -m venv /tmp/st && /tmp/st/bin/pip install torch sentence-transformers
    /tmp/st/bin/python tests/oracle/make_embedding_fixture.py MINILM_DIR
"""
import json
import os
import sys

import torch
from sentence_transformers import SentenceTransformer
from transformers import AutoModel

HERE = os.path.dirname(os.path.abspath(__file__))
TEXTS = [
    "hello world",
    "A cat sat on the mat.",
    "The quick brown fox jumps over the lazy dog.",
    "ferrite serves embeddings through the same scheduler as text generation.",
    "Paris is the capital of France, and Berlin is the capital of Germany; both are large "
    "cities with long histories, famous museums and busy train stations.",
    "x",
]
TINY_IDS = [[5, 17, 33, 2], [9, 9, 9, 9, 9, 9, 9, 1, 2, 3], list(range(3, 40))]


def main():
    minilm = sys.argv[1]
    st = SentenceTransformer(minilm, device="cpu")
    vectors = st.encode(TEXTS, convert_to_numpy=True, batch_size=1)
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    torch.manual_seed(0)
    tiny_dir = os.path.join(HERE, "tiny", "qwen3_embedding")
    model = AutoModel.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager")
    tiny = []
    with torch.no_grad():
        for seq in TINY_IDS:
            h = model(torch.tensor([seq])).last_hidden_state[0, -1]
            tiny.append(torch.nn.functional.normalize(h, dim=0).tolist())
    out = {
        "minilm": {
            "texts": TEXTS,
            "token_ids": ids,
            "embeddings": [[round(float(x), 8) for x in v] for v in vectors],
        },
        "qwen3_embedding": {
            "token_ids": TINY_IDS,
            "embeddings": [[round(x, 8) for x in v] for v in tiny],
        },
    }
    path = os.path.join(HERE, "embedding_fixture.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
