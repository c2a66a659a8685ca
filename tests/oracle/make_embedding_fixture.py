"""Reference embeddings for ferrite's embedding tests, written once so CI needs no torch.

- all-MiniLM-L6-v2 (scripts/fetch-model.sh minilm): sentence-transformers' own encode of a few
  texts (mean pooling, normalized), with the token ids its tokenizer gives them.
- tiny/qwen3_embedding: the tiny random Qwen3 of make_tiny.py described as a
  sentence-transformers model with last-token pooling (Qwen3-Embedding's shape):
  transformers' Qwen3Model in f32, the last position's final-normed state, normalized.
- tiny/bert_cross_encoder: a random BertForSequenceClassification (one label) with a small
  WordPiece vocabulary, written here: transformers' sigmoid of each pair's logit.

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
CROSS_WORDS = ("the a cat dog sat ran on under mat rug paris france berlin germany city capital "
               "is of and big small red blue river house tree car fast slow").split()
CROSS_PAIRS = [("the cat sat on the mat", "a cat is on a rug"),
               ("paris is the capital of france", "berlin is a big city"),
               ("red car", "the blue river ran under the house"),
               ("dog", "dog")]


def cross_encoder():
    """A tiny random cross-encoder folder and transformers' scores of CROSS_PAIRS."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification
    out = os.path.join(HERE, "tiny", "bert_cross_encoder")
    os.makedirs(out, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *CROSS_WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(os.path.join(out, "tokenizer.json"))
    torch.manual_seed(1)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, num_labels=1,
                     initializer_range=0.2, architectures=["BertForSequenceClassification"])
    model = BertForSequenceClassification(cfg).eval()
    model.save_pretrained(out)
    scores = []
    with torch.no_grad():
        for a, b in CROSS_PAIRS:
            enc = tok.encode(a, b)
            logit = model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits
            scores.append(torch.sigmoid(logit)[0, 0].item())
    return {"pairs": CROSS_PAIRS, "scores": scores}


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
        "bert_cross_encoder": cross_encoder(),
    }
    path = os.path.join(HERE, "embedding_fixture.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
