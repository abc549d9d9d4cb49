"""The real embedded SmolLM2 behind the server, speculated by the shipped P-EAGLE drafter (the default): a
greedy chat completion equals plain ``python -m peagle_jax.generate --chat --k 0`` for the same prompt, and
the streamed text equals the non-streamed response."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serve_fixtures import ServerProcess

MAX_SEQ = 64


@pytest.mark.slow
def test_smollm2_server_equals_generate(tmp_path):
    from openai import OpenAI

    server = ServerProcess("--max-batch", "2", "--max-seq-len", str(MAX_SEQ), log=tmp_path / "server.log").wait(
        timeout=900
    )
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
        prompt = "What is the capital of France?"
        kw = dict(model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0)
        out = client.chat.completions.create(**kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    finally:
        server.stop()
    cmd = [
        sys.executable,
        "-m",
        "peagle_jax.generate",
        "--chat",
        "--prompt",
        prompt,
        "--max-new-tokens",
        "20",
        "--k",
        "0",
    ]
    ref = json.loads(
        subprocess.run(
            [*cmd, "--max-seq-len", str(MAX_SEQ), "--json"], capture_output=True, text=True, check=True, timeout=300
        ).stdout
    )
    assert out.choices[0].message.content == ref["text"] and "Paris" in ref["text"]
    assert streamed == ref["text"]
    assert out.usage.completion_tokens == ref["completion_tokens"] and out.usage.prompt_tokens == ref["prompt_tokens"]
