"""Regeneration through OpenAI-compatible servers (``data.regen_endpoints``): vLLM, or replicas of
``python -m peagle_jax.serve``.

:class:`EndpointGenerator` has the ``generate`` method that :func:`peagle_jax.train.regen.regenerate` calls on
the in-process :class:`~peagle_jax.engine.generator.Generator`, so the shards, their resumption and their
checks are the same. Each prompt is one ``POST /v1/completions`` with the prompt as token ids and vLLM's
``return_token_ids`` and ``stop_token_ids`` extensions, so the answer comes back as the target's own token
ids (no detokenize / retokenize drift). The prompts of a batch go out concurrently, ``concurrency`` at a time
per endpoint. A prompt whose endpoint fails (refused connection, timeout, a 5xx or a malformed answer) is
sent to the next endpoint; after ``attempts`` failures in a row it stops the run with a
:class:`~peagle_jax.train.prompts.DataError` that names the endpoints and their last errors (finished shards
are kept: running again resumes). A 4xx is the request's own fault and stops the run at once, and so does a
server that answers without the token ids or with other prompt token ids than those sent (it does not
implement ``return_token_ids``, or it rewrote the prompt): retrying could only mix its answers in.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from peagle_jax.train.prompts import DataError


@dataclass(frozen=True)
class EndpointResult:
    """One answer, as :class:`~peagle_jax.engine.generator.Generator` returns it."""

    token_ids: list[int]
    finish_reason: str


class _Refused(Exception):
    """The server refused the request (a 4xx) or cannot answer it exactly: retrying would not help."""


def parse_endpoints(spec: str) -> list[str]:
    """``"http://a:8000,http://b:8000/"`` -> base URLs without a trailing slash or ``/v1``."""
    urls = [u.strip().rstrip("/") for u in spec.split(",") if u.strip()]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise DataError(f"data.regen_endpoints: {u!r} is not an http:// or https:// URL")
    return [u[: -len("/v1")] if u.endswith("/v1") else u for u in urls]


def _token_ids(url: str, choice: dict, prompt: list[int]) -> list[int]:
    """The answer's token ids from a completions choice, refusing a server that does not return them or that
    saw other prompt ids (vLLM before 0.10.2 ignores ``return_token_ids``; a server may add a BOS)."""
    ids, seen = choice.get("token_ids"), choice.get("prompt_token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _Refused(
            f"{url} answered without token ids: it needs the return_token_ids extension "
            "(vLLM >= 0.10.2 or python -m peagle_jax.serve)"
        )
    if seen is not None and list(seen) != prompt:
        raise _Refused(f"{url} generated from other prompt token ids than those sent (a BOS added?)")
    return ids


class EndpointGenerator:
    """``generate(prompts, ...)`` through the servers at ``urls`` (see the module docstring)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 600.0,
        attempts: int = 0,
        api_key: str | None = None,
        retry_wait_s: float = 0.5,
    ):
        if not urls:
            raise DataError("data.regen_endpoints names no server")
        self.urls, self.concurrency, self.timeout_s = list(urls), concurrency, timeout_s
        self.attempts = attempts or 2 * len(self.urls) + 1
        self.api_key, self.retry_wait_s = api_key, retry_wait_s
        self._next = itertools.count()
        self._lock = threading.Lock()
        self.model = model or self._model_name()

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _request(self, url: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=self._headers(), method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            if 400 <= err.code < 500 and err.code not in (408, 429):
                raise _Refused(f"{url} answered {err.code}: {detail}") from None
            raise OSError(f"{url} answered {err.code}: {detail}") from None
        except json.JSONDecodeError as err:
            raise OSError(f"{url} answered something that is not JSON ({err})") from None
        except http.client.HTTPException as err:  # a connection cut mid-answer (a server killed mid-request)
            raise OSError(f"{url}: {type(err).__name__} {err}") from None

    def _model_name(self) -> str:
        """The model the reachable endpoints serve (``GET /v1/models``); servers of different models are
        refused, since their answers would be mixed in one data set."""
        names, errors = {}, []
        for url in self.urls:
            try:
                names[url] = self._request(f"{url}/v1/models")["data"][0]["id"]
            except (OSError, KeyError, IndexError, TypeError, _Refused) as err:
                errors.append(f"{url}: {err}")
        if not names:
            raise DataError("data.regen_endpoints: no server answered GET /v1/models (" + "; ".join(errors) + ")")
        if len(set(names.values())) > 1:
            served = ", ".join(f"{u}: {n}" for u, n in names.items())
            raise DataError(f"data.regen_endpoints: the servers serve different models ({served})")
        return next(iter(names.values()))

    def _one(self, prompt: list[int], *, max_new_tokens, temperature, seed, stop_token_ids) -> EndpointResult:
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_new_tokens,
            "temperature": float(temperature),
            "seed": int(seed),
            "stop_token_ids": list(stop_token_ids or ()),
            "return_token_ids": True,
        }
        with self._lock:
            first = next(self._next)
        errors: dict[str, str] = {}
        for attempt in range(self.attempts):
            url = self.urls[(first + attempt) % len(self.urls)]
            try:
                choice = self._request(f"{url}/v1/completions", body)["choices"][0]
                return EndpointResult(_token_ids(url, choice, body["prompt"]), str(choice["finish_reason"]))
            except _Refused as err:
                raise DataError(f"data.regen_endpoints: {err}") from None
            except (OSError, KeyError, IndexError, TypeError) as err:
                errors[url] = str(err) or type(err).__name__
                time.sleep(self.retry_wait_s * (attempt // len(self.urls)))
        last = "; ".join(f"{u}: {e}" for u, e in errors.items())
        raise DataError(f"data.regen_endpoints: a prompt failed {self.attempts} times ({last})")

    def generate(self, prompts, *, max_new_tokens, temperature=0.0, seed=0, stop_token_ids=None, **_):
        """One :class:`EndpointResult` per prompt, in order; ``seed`` an int or one per prompt."""
        seeds = list(seed) if isinstance(seed, Sequence) else [seed + i for i in range(len(prompts))]
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids)
        workers = max(1, min(len(prompts), self.concurrency * len(self.urls)))
        pool = ThreadPoolExecutor(workers, thread_name_prefix="regen")
        try:
            futures = [pool.submit(self._one, p, seed=s, **kw) for p, s in zip(prompts, seeds, strict=True)]
            return [f.result() for f in futures]
        finally:  # on an error, the prompts not yet sent are dropped rather than tried in vain
            pool.shutdown(wait=True, cancel_futures=True)
