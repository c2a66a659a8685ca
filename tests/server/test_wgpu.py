"""The wgpu backend served: `--device vulkan` on the first Vulkan adapter (CI: lavapipe, Mesa's
CPU driver, which scripts/test.sh installs). Greedy answers, and seeded sampled ones (drawn on
the device from each request's seed), are the same whether each prompt runs alone or all eight
share the steps."""
from concurrent.futures import ThreadPoolExecutor

import openai

from conftest import Server

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about rain.",
    "What is 12 times 12?",
    "Say hello in Spanish.",
    "What does a CPU do?",
    "Name a large ocean.",
    "What color is the sky?",
]

# lavapipe runs shaders on the CPU: small steps, and no step-time fit at start-up (it times
# steps of up to the whole token budget).
LAVAPIPE = ("--device", "vulkan", "--max-num-batched-tokens", "64", "--max-step-ms", "0")


def test_answers_are_the_same_alone_and_at_concurrency_8():
    s = Server(*LAVAPIPE, max_model_len=512)
    try:
        assert "backend wgpu (" in open(s.log.name).read()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")

        def ask(p, **sampling):
            r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": p}],
                                          max_tokens=16, **sampling)
            return r.choices[0].message.content

        def greedy(p):
            return ask(p, temperature=0)

        def seeded(p):
            return ask(p, temperature=1.0, top_p=0.9, seed=PROMPTS.index(p))

        alone = [greedy(p) for p in PROMPTS]
        drawn = [seeded(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(greedy, PROMPTS))
            drawn_together = list(pool.map(seeded, PROMPTS))
    finally:
        s.stop()
    assert all(len(a) > 10 for a in alone), alone
    assert together == alone
    assert "Paris" in alone[0]
    assert drawn_together == drawn
    # Sampled at temperature 1, some answer leaves the greedy path.
    assert drawn != alone, drawn
