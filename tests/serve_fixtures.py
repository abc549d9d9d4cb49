"""A tiny served model for the server tests: a random tiny Llama with a character-level tokenizer and a
chat template (written with ``save_pretrained``), and a tiny random P-EAGLE drafter for it."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
# 128 tokens: the specials, newline, printable ASCII and 29 accented letters.
CHARS = ["\n"] + [chr(c) for c in range(32, 127)] + [chr(c) for c in range(192, 221)]
VOCAB = SPECIALS + CHARS
EOS_ID = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", additional_special_tokens=SPECIALS[1:]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


class ByteTokenizer:
    """A fake tokenizer for tests without a model: one token per UTF-8 byte (so a multi-byte character spans
    tokens and half of one decodes to U+FFFD), and a chat template writing a line ``role: content`` per message,
    then ``assistant: ``."""

    chat_template = "role: content"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text += "assistant: " if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random tiny Llama (vocab 128, EOS = <|im_end|>) with the character tokenizer, in ``path``."""
    from conftest import tiny_hf_model

    assert len(VOCAB) == 128
    model = tiny_hf_model("llama", seed=seed, eos_token_id=EOS_ID, bos_token_id=None)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def write_tiny_drafter(path: Path, k: int = 3, vocab: int = 128, mask_token_id: int = 127) -> Path:
    """A random one-layer P-EAGLE drafter for :func:`write_tiny_model` (shares its embedding, mask token 127),
    or for another tiny target of width 64 and vocabulary ``vocab``."""
    import jax

    from peagle_jax.drafter.config import DrafterConfig
    from peagle_jax.drafter.load import save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.models.config import ModelConfig

    layer = ModelConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        aux_layer_ids=(0,),
    )
    dcfg = DrafterConfig(
        layer=layer, algorithm="peagle", mask_token_id=mask_token_id, own_embedding=False, speculative_tokens=k
    )
    save_drafter(path, dcfg, init_drafter_params(dcfg, jax.random.key(3)))
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m peagle_jax.serve`` in a subprocess on a free loopback port; :meth:`wait` polls /health
    until it answers 200 (and records whether it answered 503 while compiling)."""

    def __init__(self, *args: str, log: Path):
        import os
        import subprocess
        import sys

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "peagle_jax.serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        self.saw_503 = False

    def wait(self, timeout: float = 600) -> ServerProcess:
        import signal
        import time
        import urllib.error
        import urllib.request

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except urllib.error.HTTPError as err:
                self.saw_503 |= err.code == 503
            except OSError:
                pass
            time.sleep(0.1)
        self.proc.send_signal(signal.SIGUSR1)  # the server prints every thread's stack (faulthandler)
        time.sleep(2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def health(self) -> dict:
        import json
        import urllib.request

        with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> int | None:
        """SIGTERM, then the exit status (None: it had to be killed after 20 s)."""
        self.proc.terminate()
        try:
            return self.proc.wait(20)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            return None


def http(base: str, method: str, path: str, body: bytes | str | None = None, headers=None, timeout: float = 120):
    """(status, headers, body bytes) of one raw HTTP request, whatever the status."""
    import http.client
    from urllib.parse import urlparse

    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; every non-comment line must be ``name[{...}] value``."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


def check_logprobs(base: str, model: str, model_dir: Path) -> None:
    """A server's log-probabilities (chat and completions, streamed and not, sampled at T=0.9): each token's
    equals a float64 log-softmax of the plain target's logits at its prefix (1e-4), the alternatives are the
    most likely tokens, sorted, in the OpenAI shapes; a stream carries the same values; 21 alternatives
    are a 400 naming the parameter."""
    import json

    import jax.numpy as jnp
    import numpy as np

    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.models import model as M

    cfg, params = load_target_any(model_dir)
    tok = char_tokenizer()

    def reference(ids):
        out, _ = M.forward_jit(
            params, M.new_cache(cfg, 1, len(ids)), jnp.asarray([ids]), jnp.zeros(1, jnp.int32), cfg=cfg
        )
        x = np.asarray(out.logits[0], np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def post(path, body):
        status, _, raw = http(base, "POST", path, json.dumps({"model": model, **body}))
        assert status == 200, raw
        if not body.get("stream"):
            return json.loads(raw)
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        return [c["choices"][0] for c in chunks]

    common = {"max_tokens": 12, "temperature": 0.9, "seed": 5}
    chat = {**common, "messages": [{"role": "user", "content": "log me"}], "logprobs": True, "top_logprobs": 5}
    body = post("/v1/chat/completions", {**chat, "return_token_ids": True})
    answer = body["choices"][0]
    ids, prompt = answer["token_ids"], body["prompt_token_ids"]  # vLLM's chat shape: prompt ids once, on top
    ref = reference(prompt + ids)[len(prompt) - 1 : -1]
    content = answer["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.decode([t]) for t in ids]
    for e, t, row in zip(content, ids, ref, strict=True):
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["bytes"] == list(e["token"].encode())
        np.testing.assert_allclose(e["logprob"], row[t], atol=1e-4)
        tops = [a["logprob"] for a in e["top_logprobs"]]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        np.testing.assert_allclose(tops, np.sort(row)[::-1][:5], atol=1e-4)
        assert e["logprob"] <= tops[0] + 1e-6
    streamed = [
        e
        for c in post("/v1/chat/completions", {**chat, "stream": True})
        for e in (c["logprobs"] or {}).get("content", [])
    ]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    np.testing.assert_allclose([e["logprob"] for e in streamed], [e["logprob"] for e in content], atol=1e-6)

    comp = {**common, "prompt": "score this", "logprobs": 3}
    answer = post("/v1/completions", {**comp, "return_token_ids": True})["choices"][0]
    ids, prompt, lp = answer["token_ids"], answer["prompt_token_ids"], answer["logprobs"]
    ref = reference(prompt + ids)[len(prompt) - 1 : -1]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    np.testing.assert_allclose(lp["token_logprobs"], [row[t] for t, row in zip(ids, ref, strict=True)], atol=1e-4)
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
    for text, value, alternatives, row in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], ref, strict=True):
        assert alternatives[text] == value and 3 <= len(alternatives) <= 4  # the top 3 and the chosen token
        top3 = sorted(alternatives.values(), reverse=True)[:3]
        np.testing.assert_allclose(top3, np.sort(row)[::-1][:3], atol=1e-4)
    streamed = [c["logprobs"] for c in post("/v1/completions", {**comp, "stream": True}) if c["logprobs"]]
    assert sum((s["tokens"] for s in streamed), []) == lp["tokens"]
    assert sum((s["text_offset"] for s in streamed), []) == lp["text_offset"]

    echo = {**comp, "echo": True, "logprobs": 2, "max_tokens": 4}
    answer = post("/v1/completions", {**echo, "return_token_ids": True})["choices"][0]
    ids, prompt, lp = answer["token_ids"], answer["prompt_token_ids"], answer["logprobs"]
    assert answer["text"].startswith("score this") and lp["tokens"] == [tok.decode([t]) for t in prompt + ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference(prompt + ids)
    want = [row[t] for t, row in zip((prompt + ids)[1:], ref[:-1], strict=True)]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4)
    chunks = post("/v1/completions", {**echo, "stream": True})
    assert chunks[0]["text"].startswith("score this")
    assert sum((c["logprobs"]["tokens"] for c in chunks if c["logprobs"]), []) == lp["tokens"]
    plain = post("/v1/completions", {**comp, "echo": True, "logprobs": None})["choices"][0]
    assert plain["text"].startswith(answer["text"]) and plain["logprobs"] is None  # 12 tokens, the same seed

    for path, body, param in (
        ("/v1/chat/completions", {**chat, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {**comp, "logprobs": 21}, "logprobs"),
    ):
        status, _, raw = http(base, "POST", path, json.dumps({"model": model, **body}))
        assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
