"""The real tokenizers of GPT-OSS, Qwen3 and Llama 3.1 built from the pinned vocabularies, against tiktoken,
openai-harmony and llama.cpp's test vectors; and tiny random chat models that carry them (tests/chat_models.py):
their templates render tool conversations, and peagle_jax decodes them greedily like transformers."""

from __future__ import annotations

import hashlib
import json

import pytest
from chat_models import GENERATION_IDS, KINDS, chat_model_dir

from peagle_jax.assets import fetch
from peagle_jax.chat import tokenizers as T
from peagle_jax.chat.vocab import read_specials, tiktoken_dir
from peagle_jax.loading import load_tokenizer

TEXTS = [
    "Hello, world! I'm here; you've seen THEY'LL and we'd",
    "def f(x):\n    return x**2  # 12345678\n\n\n\tprint(f(3.14159))\n",
    "日本語のテキスト、中文，한국어 🤗🦙 naïve café Ａｂｃ ǅungla",
    "   leading\t\ttabs  \r\n\r\nwindows\n \n  trailing   ",
    "path/to/file.py//x https://example.com/a?b=c&d=e",
    "1234567890 -42 1e10 0x1F ١٢٣ ½",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
MESSAGES = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}'},
]


def _llama_cpp_cases(key: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test strings (each followed by a marker line) and their ids (a line per string)."""
    texts = fetch(f"vocab-test-{key}-inp").read_bytes().decode().split("\n__ggml_vocab_test__\n")
    ids = fetch(f"vocab-test-{key}-out").read_bytes().decode().split("\n")
    assert texts[-1] == "" and len(texts) == len(ids) > 40
    return [(t, [int(i) for i in line.split()]) for t, line in zip(texts[:-1], ids[:-1], strict=True)]


@pytest.fixture(scope="module")
def o200k():
    return T.hf_tokenizer("o200k")


def test_o200k_ids_equal_tiktoken(o200k, tmp_path, monkeypatch):
    """tiktoken's own o200k_harmony (its regex and specials), fed the pinned file through its cache."""
    import tiktoken
    from tiktoken_ext.openai_public import o200k_harmony

    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).symlink_to(tiktoken_dir() / "o200k_base.tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    spec = o200k_harmony()
    enc = tiktoken.Encoding(**spec)
    texts = TEXTS + [t for t, _ in _llama_cpp_cases("qwen2")] + ["<|start|>user<|message|>hi<|end|><|start|>assistant"]
    for text in texts:
        assert o200k.encode(text) == enc.encode(text, allowed_special="all"), text
    # every special at its id, but the duplicate 200018 (<|endofprompt|> in GPT-OSS's tokenizer)
    assert {t: o200k.convert_tokens_to_ids(t) for t in spec["special_tokens"] if t != "<|reserved_200018|>"} == {
        t: i for t, i in spec["special_tokens"].items() if t != "<|reserved_200018|>"
    }
    assert len(o200k) == 201088


def test_o200k_ids_equal_harmony_on_a_rendered_conversation(o200k, monkeypatch):
    import openai_harmony as H

    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tiktoken_dir()))
    harmony = H.load_harmony_encoding(H.HarmonyEncodingName.HARMONY_GPT_OSS)
    tool = H.ToolDescription.new("get_weather", "Weather for a city", parameters=TOOLS[0]["function"]["parameters"])
    conversation = H.Conversation.from_messages(
        [
            H.Message.from_role_and_content(
                H.Role.SYSTEM, H.SystemContent.new().with_reasoning_effort(H.ReasoningEffort.HIGH)
            ),
            H.Message.from_role_and_content(
                H.Role.DEVELOPER, H.DeveloperContent.new().with_instructions("Be terse.").with_function_tools([tool])
            ),
            H.Message.from_role_and_content(H.Role.USER, "What's the weather in Zürich?  25°C?\n\n"),
            H.Message.from_role_and_content(H.Role.ASSISTANT, "Need the tool.").with_channel("analysis"),
            H.Message.from_role_and_content(H.Role.ASSISTANT, '{"city": "Zürich"}')
            .with_channel("commentary")
            .with_recipient("functions.get_weather")
            .with_content_type("<|constrain|>json"),
            H.Message.from_author_and_content(H.Author.new(H.Role.TOOL, "functions.get_weather"), '{"temp": 25}')
            .with_channel("commentary")
            .with_recipient("assistant"),
        ]
    )
    ids = harmony.render_conversation_for_completion(conversation, H.Role.ASSISTANT)
    text = harmony.decode_utf8(ids)
    assert o200k.encode(text) == ids
    assert o200k.decode(ids) == text
    assert o200k.convert_ids_to_tokens(sorted(harmony.stop_tokens())) == ["<|return|>", "<|end|>", "<|call|>"]


@pytest.mark.parametrize("name,key", [("qwen3", "qwen2"), ("llama3", "llama3")])
def test_ids_equal_llama_cpp_test_vectors(name, key):
    tok = T.hf_tokenizer(name)
    for text, ids in _llama_cpp_cases(key):
        assert tok.encode(text, add_special_tokens=False) == ids, text


def test_added_tokens_roles_and_text_tokens():
    qwen, llama = T.hf_tokenizer("qwen3"), T.hf_tokenizer("llama3")
    assert {t: qwen.convert_tokens_to_ids(t) for _, t in read_specials("qwen3")} == {
        t: i for i, t in read_specials("qwen3")
    }
    assert (qwen.eos_token_id, qwen.pad_token_id, qwen.bos_token, len(qwen)) == (151645, 151643, None, 151669)
    ids = qwen.encode("<think>plan</think><tool_call>{}</tool_call><tool_response>ok</tool_response><|im_end|>")
    assert [151667, 151668, 151657, 151658, 151665, 151666, 151645] == [i for i in ids if i >= 151643]
    assert qwen.decode(ids, skip_special_tokens=True) == (
        "<think>plan</think><tool_call>{}</tool_call><tool_response>ok</tool_response>"
    )
    names = ["<|begin_of_text|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
    assert llama.convert_tokens_to_ids(names) == [128000, 128008, 128009, 128010, 128004]
    assert llama.convert_ids_to_tokens([128005, 128011, 128255]) == [
        f"<|reserved_special_token_{k}|>" for k in (2, 3, 247)
    ]
    assert (llama.bos_token_id, llama.eos_token_id, len(llama)) == (128000, 128009, 128256)
    assert llama.encode("hi")[0] == 128000 and llama.encode("hi", add_special_tokens=False) == [6151]
    assert llama.decode(llama.encode("<|python_tag|>x<|eom_id|>"), skip_special_tokens=True) == "x"


def test_the_built_tokenizer_json_is_cached(monkeypatch):
    path = T.tokenizer_json("llama3")
    assert path.parent == T.cache_dir() / "assets" / "tokenizers"
    monkeypatch.setattr(T, "_build", lambda name: pytest.fail("rebuilt a cached tokenizer"))
    assert T.tokenizer_json("llama3") == path


EXPECTED = {  # kind -> markup its template must write for MESSAGES with TOOLS
    "gpt-oss": [
        "Reasoning: low",
        "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n// Weather for a city\n",
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>",
    ],
    "qwen3": [
        f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>',
    ],
    "qwen3-coder": [
        "<tools>\n<function>\n<name>get_weather</name>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        '<tool_response>\n{"temp": 21}\n</tool_response>',
    ],
    "llama3.1": [
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n",
        json.dumps(TOOLS[0], indent=4),
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "<|start_header_id|>ipython<|end_header_id|>\n\n",
    ],
}
PROMPT_END = {
    "gpt-oss": "<|start|>assistant",
    "qwen3": "<|im_start|>assistant\n",
    "qwen3-coder": "<|im_start|>assistant\n",
    "llama3.1": "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def _render(tok, kind, **kwargs):
    if kind == "gpt-oss":
        kwargs.setdefault("reasoning_effort", "low")
    kwargs.setdefault("tokenize", False)
    return tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_each_model_dir_renders_a_tools_conversation(tmp_path_factory, kind):
    path = chat_model_dir(tmp_path_factory, kind)
    config = json.loads((path / "generation_config.json").read_text())
    assert {k: config[k] for k in GENERATION_IDS[kind]} == GENERATION_IDS[kind]
    tok = load_tokenizer(path)
    variants = [{"enable_thinking": True}, {"enable_thinking": False}] if kind == "qwen3" else [{}]
    for kwargs in variants:
        text = _render(tok, kind, **kwargs)
        for markup in EXPECTED[kind]:
            assert markup in text, (markup, text)
        end = "<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else ""
        assert text.endswith(PROMPT_END[kind] + end), text
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert ids == _render(tok, kind, tokenize=True, return_dict=False, **kwargs)
        assert set(config["eos_token_id"]) & set(ids)  # the turn ends are single special tokens


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_matches_transformers(tmp_path_factory, kind):
    import torch
    import transformers

    from peagle_jax.loading import GeneratorOptions, build_generator

    path = chat_model_dir(tmp_path_factory, kind)
    prompt = _render(load_tokenizer(path), kind, tokenize=True, return_dict=False)
    out = build_generator(GeneratorOptions(max_seq_len=512), path).generate(
        [prompt], max_new_tokens=4, stop_token_ids=[]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out[0].token_ids == ref[0, len(prompt) :].tolist()
