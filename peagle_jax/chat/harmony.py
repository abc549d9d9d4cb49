"""GPT-OSS's harmony format in our own code (openai-harmony is only the tests' reference).

- :func:`render_chat` (:mod:`peagle_jax.chat.harmony_render`): an OpenAI chat (messages, function tools,
  reasoning effort, date) as the harmony prompt text, special tokens written out, ending ``<|start|>assistant``.
- :class:`HarmonyParser` (:mod:`peagle_jax.chat.harmony_parse`): the answer's token ids parsed into reasoning,
  content and tool calls, chunk by chunk.
- The special tokens' ids: :data:`RETURN_ID` and :data:`CALL_ID` are the generation's stop tokens
  (:data:`STOP_IDS`).
"""

from peagle_jax.chat.harmony_parse import HarmonyParser, parse_header
from peagle_jax.chat.harmony_render import (
    CALL,
    CALL_ID,
    CHANNEL,
    CHANNEL_ID,
    CONSTRAIN,
    CONSTRAIN_ID,
    END,
    END_ID,
    FIRST_SPECIAL_ID,
    MESSAGE,
    MESSAGE_ID,
    RETURN,
    RETURN_ID,
    START,
    START_ID,
    STOP_IDS,
    HarmonyMessage,
    drop_analysis,
    harmony_messages,
    render_chat,
)

__all__ = [
    "CALL",
    "CALL_ID",
    "CHANNEL",
    "CHANNEL_ID",
    "CONSTRAIN",
    "CONSTRAIN_ID",
    "END",
    "END_ID",
    "FIRST_SPECIAL_ID",
    "MESSAGE",
    "MESSAGE_ID",
    "RETURN",
    "RETURN_ID",
    "START",
    "START_ID",
    "STOP_IDS",
    "HarmonyMessage",
    "HarmonyParser",
    "drop_analysis",
    "harmony_messages",
    "parse_header",
    "render_chat",
]
