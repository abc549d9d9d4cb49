"""``load_tokenizer`` builds a tokenizer whose config names the generic fast class directly (no model config,
no model module, no PyTorch import) and it is the tokenizer AutoTokenizer builds; other classes still go
through AutoTokenizer."""

from __future__ import annotations

import json
import shutil

from peagle_jax.hf_tokenizers import transformers
from peagle_jax.loading import load_tokenizer, resolve_model_dir

TEXTS = ["Hello, world!", "  leading spaces\tand tabs\n", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_the_generic_fast_tokenizer_is_autotokenizers():
    model_dir = resolve_model_dir("smollm2")
    ours, auto = load_tokenizer(model_dir), transformers().AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(auto)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        auto.eos_token_id,
        auto.bos_token_id,
        auto.pad_token_id,
    )
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids) == auto.decode(ids) and ours.decode(ids, skip_special_tokens=True) == auto.decode(
            ids, skip_special_tokens=True
        )
    for prompt in (True, False):
        kw = dict(tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(CHAT, **kw) == auto.apply_chat_template(CHAT, **kw)


def test_other_tokenizer_classes_go_through_autotokenizer(tmp_path, monkeypatch):
    model_dir = resolve_model_dir("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    auto = transformers().AutoTokenizer
    calls = []
    original = auto.from_pretrained
    monkeypatch.setattr(auto, "from_pretrained", lambda path, **kw: calls.append(path) or original(path, **kw))
    tok = load_tokenizer(tmp_path)
    assert calls == [str(tmp_path)] and tok("Hello")["input_ids"]
    calls.clear()
    load_tokenizer(model_dir)
    assert calls == []  # the generic class: built directly
