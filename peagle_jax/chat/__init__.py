"""Chat beyond plain text: tool calls and reasoning.

- :mod:`peagle_jax.chat.output`: what a parser returns (:class:`Delta` while streaming, :class:`Parsed` at the
  end) and the :class:`OutputParser` protocol every parser follows.
- :mod:`peagle_jax.chat.parsers`: the text-level parsers (Qwen3 ``<think>``, Qwen3's ``<tool_call>`` JSON,
  Qwen3-Coder's XML calls, Llama 3.1's JSON calls), under vLLM's names.
- :mod:`peagle_jax.chat.harmony`: GPT-OSS's harmony format, rendered and parsed token by token.
"""
