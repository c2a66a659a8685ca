"""`transformers serve --continuous-batching` (paged attention, OpenAI API) on a model folder
with random bf16 weights, drawn the way ferrite's `--load-format dummy` draws them (normal,
std 0.02, norms at 1): the peer of `ferrite serve --load-format dummy` on the GPU host, where
no checkpoint can be downloaded. The folder holds config.json and the tokenizer files
(`examples/hf_folder.rs` writes them).
Usage: python3 transformers_serve.py MODEL_DIR PORT [extra `transformers serve` options...]"""
import sys

import torch
import transformers
from transformers.cli.serve import Serve
from transformers.cli.serving import model_manager, server


def load_random(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
    model_id = model_id_and_revision.split("@", 1)[0]
    config = transformers.AutoConfig.from_pretrained(model_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    return model.eval()


def done_terminated(app):
    """Ends each event stream with `data: [DONE]`, as the OpenAI API does (this release's
    stream stops after the last chunk; clients that wait for the terminator count it failed)."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        streaming = False

        async def send_done(message):
            nonlocal streaming
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif streaming and message["type"] == "http.response.body" and not message.get("more_body"):
                await send({"type": "http.response.body", "body": message.get("body", b""), "more_body": True})
                message = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
            await send(message)

        await app(scope, receive, send_done)

    return wrapped


build_server = server.build_server
server.build_server = lambda *a, **k: done_terminated(build_server(*a, **k))
model_manager.ModelManager._load_model = load_random
model_dir, port = sys.argv[1], int(sys.argv[2])
Serve(force_model=model_dir, continuous_batching=True, port=port, host="127.0.0.1", device="cuda",
      log_level="warning")
