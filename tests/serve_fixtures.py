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


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """A random tiny Llama (vocab 128, EOS = <|im_end|>) with the character tokenizer, in ``path``."""
    from conftest import tiny_hf_model

    assert len(VOCAB) == 128
    model = tiny_hf_model("llama", seed=seed, eos_token_id=EOS_ID, bos_token_id=None)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def write_tiny_drafter(path: Path, k: int = 3) -> Path:
    """A random P-EAGLE drafter for :func:`write_tiny_model` (shares its embedding, mask token 127)."""
    import jax

    from peagle_jax.drafter.config import DrafterConfig
    from peagle_jax.drafter.load import save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.models.config import ModelConfig

    layer = ModelConfig(
        family="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        aux_layer_ids=(0,),
    )
    dcfg = DrafterConfig(layer=layer, algorithm="peagle", mask_token_id=127, own_embedding=False, speculative_tokens=k)
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
