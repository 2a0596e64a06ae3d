"""Tests for flintc.checkpoint.tokenizer: vocabulary layout, round trips, determinism,
the GLM-style chat template, streaming detokenization and loader errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from flintc.checkpoint.tokenizer import (
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    FlintTokenizer,
    build_tokenizer,
    chat_template_source,
    load_tokenizer,
    write_tokenizer,
)
from flintc.errors import CheckpointError, InputError

TINY_VOCAB = 512
FULL_VOCAB = 151552
REPO_ROOT = Path(__file__).resolve().parents[2]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tokenizer(out, TINY_VOCAB, model_max_length=4096)
    return out


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return FlintTokenizer.from_dir(tiny_dir)


# --- vocabulary -----------------------------------------------------------------------------


def test_tiny_vocab_is_exact_with_specials_after_merges():
    t = build_tokenizer(TINY_VOCAB)
    assert t.get_vocab_size(with_added_tokens=True) == TINY_VOCAB
    num_model = TINY_VOCAB - len(SPECIAL_TOKENS)
    assert t.get_vocab_size(with_added_tokens=False) == num_model  # 256 bytes + 243 merges
    for i, content in enumerate(SPECIAL_TOKENS):
        assert t.token_to_id(content) == num_model + i
    assert not any(tok.startswith("<|reserved_") for tok in t.get_vocab())


@pytest.mark.slow
def test_full_vocab_is_exact_and_padded_with_reserved_tokens():
    t = build_tokenizer(FULL_VOCAB)
    assert t.get_vocab_size(with_added_tokens=True) == FULL_VOCAB
    added = t.get_added_tokens_decoder()
    assert added[FULL_VOCAB - 1].content.startswith("<|reserved_")
    assert all(token.special for token in added.values())
    assert [added[t.token_to_id(s)].content for s in SPECIAL_TOKENS] == list(SPECIAL_TOKENS)


def test_smallest_vocab_has_no_merges():
    t = build_tokenizer(MIN_VOCAB_SIZE)
    assert t.get_vocab_size(with_added_tokens=False) == 256
    assert t.get_vocab_size(with_added_tokens=True) == MIN_VOCAB_SIZE


@pytest.mark.parametrize("bad", [0, 268, -1, 512.0, True])
def test_too_small_or_non_int_vocab_raises(bad):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(bad)


def test_too_large_vocab_raises_before_training(monkeypatch):
    """vocab_size 2**31 aborted the process (exit 134, a Rust "memory allocation of ...
    bytes failed" in the BPE trainer), 1e8 took > 20 GB: above MAX_VOCAB_SIZE (2**20) a
    ValueError names the bound before the trainer runs (a trainer made here fails the
    test instead of allocating)."""
    import flintc.checkpoint.tokenizer as tokenizer

    def no_trainer(**kwargs):
        raise AssertionError(f"the BPE trainer was made for {kwargs.get('vocab_size')} tokens")

    monkeypatch.setattr(tokenizer.trainers, "BpeTrainer", no_trainer)
    for bad in (2**20 + 1, 2**31, 2**40):
        with pytest.raises(ValueError, match=rf"^vocab_size {bad} is too large: .* at most 1048576 tokens \(2\*\*20\)$"):
            build_tokenizer(bad)
    assert getattr(tokenizer, "MAX_VOCAB_SIZE", None) == 2**20


def test_the_bpe_trainer_is_asked_for_no_more_than_the_corpus_can_give(monkeypatch):
    """The trainer reserves memory for every token it is asked for (2**40 was a 72 TB
    allocation) though the corpus yields 1,958: it is asked for at most 2**14, and the
    tokenizer is the same (the rest are reserved tokens, as before)."""
    import flintc.checkpoint.tokenizer as tokenizer

    asked = []
    real = tokenizer.trainers.BpeTrainer

    def recording(**kwargs):
        asked.append(kwargs["vocab_size"])
        return real(**kwargs)

    monkeypatch.setattr(tokenizer.trainers, "BpeTrainer", recording)
    t = build_tokenizer(2**15)
    assert asked == [2**14]
    assert t.get_vocab_size(with_added_tokens=False) == 1958  # the corpus's yield, below the cap
    assert t.get_vocab_size(with_added_tokens=True) == 2**15


def test_build_is_deterministic_in_process_and_across_hash_seeds():
    first = build_tokenizer(TINY_VOCAB).to_str()
    assert build_tokenizer(TINY_VOCAB).to_str() == first
    code = ("import sys; from flintc.checkpoint.tokenizer import build_tokenizer; "
            f"sys.stdout.write(build_tokenizer({TINY_VOCAB}).to_str())")
    env = {**os.environ, "PYTHONHASHSEED": "12345",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                           env=env, encoding="utf-8")
    assert child.stdout == first


def test_write_tokenizer_files_and_config(tiny_dir):
    assert sorted(p.name for p in tiny_dir.iterdir()) == ["tokenizer.json",
                                                          "tokenizer_config.json"]
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text("utf-8"))
    assert config["eos_token"] == "<|endoftext|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == 4096
    assert config["chat_template"] == chat_template_source()
    decoder = config["added_tokens_decoder"]
    assert [decoder[k]["content"] for k in sorted(decoder, key=int)] == list(SPECIAL_TOKENS)
    assert all(v["special"] and not v["normalized"] for v in decoder.values())


# --- encode / decode ------------------------------------------------------------------------


def test_special_tokens_are_single_ids_and_round_trip(tok):
    assert tok.vocab_size == TINY_VOCAB
    assert list(tok.special_token_ids) == list(SPECIAL_TOKENS)
    assert tok.eos_token_id == tok.special_token_ids["<|endoftext|>"]
    for content, token_id in tok.special_token_ids.items():
        assert tok.encode(content) == [token_id]
        assert tok.decode([token_id]) == content
        assert tok.decode([token_id], skip_special_tokens=True) == ""
    ids = tok.encode("<|user|>\nhi<|assistant|>\n")
    assert ids[0] == tok.special_token_ids["<|user|>"]
    assert tok.decode(ids, skip_special_tokens=True) == "\nhi\n"


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=80))
def test_encode_decode_round_trips_unicode(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_out_of_range_id_raises(tok):
    with pytest.raises(InputError, match="512"):
        tok.decode([TINY_VOCAB])
    with pytest.raises(InputError):
        tok.detokenizer().push(-1)


# --- streaming ------------------------------------------------------------------------------


def test_stream_holds_back_split_multibyte_characters(tok):
    text = "naïve 東京 😀 🚀 straße → ½"
    ids = tok.encode(text)
    assert any(b >= 0x80 and len(tok.token_bytes(i)) == 1
               for i in ids for b in tok.token_bytes(i))  # some character spans tokens
    pieces = list(tok.decode_stream(ids))
    assert "".join(pieces) == text == tok.decode(ids)
    assert "" in pieces and not any("\ufffd" in p for p in pieces)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(st.integers(0, TINY_VOCAB - 1), max_size=40), skip=st.booleans())
def test_stream_equals_full_decode_for_any_ids(tok, ids, skip):
    """Arbitrary ids include invalid UTF-8 and special tokens: the replacement characters and
    skipping must match the Rust decoder's exactly."""
    pieces = list(tok.decode_stream(ids, skip_special_tokens=skip))
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_flush_replaces_dangling_partial_character_and_resets(tok):
    ids = tok.encode("😀")
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == "\ufffd" == tok.decode(ids[:-1])
    assert detok.push(tok.encode("a")[0]) == "a"


# --- chat template --------------------------------------------------------------------------


def test_template_renders_system_user_assistant(tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
            {"role": "user", "content": "Bye"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|system|>\nBe brief.<|user|>\nHi<|assistant|>\n<think></think>Hello!<|user|>\nBye")


def test_template_keeps_reasoning_after_last_user_and_splits_think_tags(tok):
    msgs = [{"role": "user", "content": "Q"},
            {"role": "assistant", "content": "<think>hmm</think>A"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|user|>\nQ<|assistant|>\n<think>hmm</think>A")


def test_template_generation_prompt_and_thinking_switch(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Q"}]}]
    assert tok.apply_chat_template(msgs) == "<|user|>\nQ<|assistant|>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|user|>\nQ"
    assert tok.apply_chat_template(msgs, enable_thinking=False) == (
        "<|user|>\nQ<|assistant|>\n<think></think>")


def test_template_renders_tool_calls_and_grouped_tool_results(tok):
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
                {"name": "lookup", "arguments": {"q": {"a": [1, "é"]}}}]},
            {"role": "tool", "content": '{"temp": 3}'},
            {"role": "tool", "content": "ok"}]
    assert tok.apply_chat_template(msgs) == (
        "<|user|>\nWeather?<|assistant|>\n<think></think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
        '<tool_call>lookup<arg_key>q</arg_key><arg_value>{"a": [1, "é"]}</arg_value>'
        "</tool_call>"
        '<|observation|>\n<tool_response>{"temp": 3}</tool_response>'
        "\n<tool_response>ok</tool_response><|assistant|>\n")


def test_template_renders_tools_block_one_json_per_line(tok):
    other = {"name": "now", "description": "Time <UTC>", "parameters": {}}
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   tools=[WEATHER_TOOL, other])
    head, rest = text.split("<tools>\n", 1)
    assert head.startswith("<|system|>\n# Tools\n\n")
    block, tail = rest.split("\n</tools>\n\n", 1)
    assert [json.loads(line) for line in block.split("\n")] == [WEATHER_TOOL, other]
    assert "Time <UTC>" in block  # transformers' tojson: no HTML escaping
    assert "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key>" in tail
    assert tail.endswith("</tool_call><|user|>\nHi<|assistant|>\n")


def test_template_rejects_string_arguments_and_unknown_roles(tok):
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}
    with pytest.raises(jinja2.TemplateError, match="mapping"):
        tok.apply_chat_template([call])
    with pytest.raises(jinja2.TemplateError, match="narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_tokenized_template_uses_single_special_ids(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert ids[0] == tok.special_token_ids["<|user|>"]
    assert ids[-2:] == [tok.special_token_ids["<|assistant|>"], tok.encode("\n")[0]]


def test_matches_transformers_rendering_when_installed(tiny_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_dir))
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "cold"}]
    assert hf.apply_chat_template(msgs, tools=[WEATHER_TOOL], tokenize=False,
                                  add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tools=[WEATHER_TOOL])


# --- where chat templates come from ---------------------------------------------------------

def _copy_tokenizer(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of tokenizer folder `src` in `dst`, its tokenizer_config.json updated
    (a value None removes the key)."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text("utf-8"))
    config.update(config_changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


USER_HI = [{"role": "user", "content": "Hi"}]


def test_chat_template_files_replace_the_config_template(tiny_dir, tmp_path):
    """chat_template.jinja beside tokenizer_config.json wins over its chat_template, and
    additional_chat_templates/NAME.jinja adds named ones, as transformers >= 4.47 saves
    and loads them; a chat with tools renders with "tool_use"."""
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t")
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    tok = FlintTokenizer.from_dir(folder)
    assert tok.check_chat_template() and tok.chat_template_names == ["default"]
    assert tok.apply_chat_template(USER_HI) == "FILE Hi"
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(
        "TOOLS {{ tools | length }} {{ messages[0].content }}", encoding="utf-8")
    tok = FlintTokenizer.from_dir(folder)
    assert tok.check_chat_template() and tok.chat_template_names == ["default", "tool_use"]
    assert tok.apply_chat_template(USER_HI) == "FILE Hi"
    assert tok.apply_chat_template(USER_HI, tools=[WEATHER_TOOL]) == "TOOLS 1 Hi"


def test_chat_template_list_form(tiny_dir, tmp_path):
    """tokenizer_config.json's chat_template as a list of {"name", "template"} (Hugging
    Face's form for several templates): "default" without tools, "tool_use" with."""
    templates = [{"name": "default", "template": "D {{ messages[0].content }}"},
                 {"name": "tool_use", "template": "T {{ messages[0].content }}"}]
    tok = FlintTokenizer.from_dir(_copy_tokenizer(tiny_dir, tmp_path / "t", chat_template=templates))
    assert tok.check_chat_template() and tok.chat_template_names == ["default", "tool_use"]
    assert tok.apply_chat_template(USER_HI) == "D Hi"
    assert tok.apply_chat_template(USER_HI, tools=[WEATHER_TOOL]) == "T Hi"
    only_default = FlintTokenizer.from_dir(_copy_tokenizer(tiny_dir, tmp_path / "d", chat_template=templates[:1]))
    assert only_default.apply_chat_template(USER_HI, tools=[WEATHER_TOOL]) == "D Hi"


@pytest.mark.parametrize("chat_template, files, needle", [
    ([{"name": "tool_use", "template": "x"}], {}, "several chat templates (tool_use) and none named 'default'"),
    ([{"name": "default", "template": 3}], {}, 'chat_template[0] must be an object with string "name"'),
    (None, {"additional_chat_templates/a.jinja": "x", "additional_chat_templates/b.jinja": "y"},
     "several chat templates (a, b) and none named 'default'"),
    (None, {"chat_template.jinja": "{{ x }"}, "chat_template.jinja: the chat_template does not compile"),
    (None, {"chat_template.jinja": "ok", "additional_chat_templates/tool_use.jinja": "{% if %}"},
     "tool_use.jinja: the chat template 'tool_use' does not compile"),
])
def test_bad_chat_template_sets_are_refused_naming_the_file(tiny_dir, tmp_path, chat_template, files, needle):
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t", chat_template=chat_template)
    for name, text in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    tok = FlintTokenizer.from_dir(folder)
    with pytest.raises(CheckpointError) as err:
        tok.check_chat_template()
    assert needle in str(err.value)


def test_chat_template_dict_form_and_empty_list(tiny_dir, tmp_path):
    """{name: template} (transformers' in-memory form) is read as the list form; an
    empty list is refused at the check, naming the file (chat was a 400 saying there is
    no chat_template)."""
    tok = FlintTokenizer.from_dir(_copy_tokenizer(tiny_dir, tmp_path / "d", chat_template={
        "default": "D", "tool_use": "T"}))
    assert tok.apply_chat_template(USER_HI) == "D" and tok.apply_chat_template(USER_HI, tools=[WEATHER_TOOL]) == "T"
    empty = FlintTokenizer.from_dir(_copy_tokenizer(tiny_dir, tmp_path / "e", chat_template=[]))
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: chat_template is an empty list"):
        empty.check_chat_template()


def test_chat_template_environment_as_transformers(tok):
    """transformers' template globals and tags: {% generation %} blocks render as they
    are, dict() builds a mapping, and a namespace refuses underscore attributes."""
    t = FlintTokenizer(tok._tok, {**tok.config})
    t.set_chat_template("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
                        "{{ dict(a=1) | tojson }}", "test")
    assert t.check_chat_template() and t.apply_chat_template(USER_HI) == '[Hi]{"a": 1}'
    t.set_chat_template("{% set ns = namespace(_x=1) %}{{ ns._x }}", "test")
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
        t.apply_chat_template(USER_HI)


def test_no_chat_template_anywhere(tiny_dir, tmp_path):
    tok = FlintTokenizer.from_dir(_copy_tokenizer(tiny_dir, tmp_path / "t", chat_template=None))
    assert tok.check_chat_template() is False and tok.chat_template_names == []
    with pytest.raises(CheckpointError, match="no chat template"):
        tok.apply_chat_template(USER_HI)


def test_set_chat_template_replaces_the_tokenizers(tiny_dir, tmp_path):
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t")
    (folder / "chat_template.jinja").write_text("FILE", encoding="utf-8")
    tok = FlintTokenizer.from_dir(folder)
    assert tok.apply_chat_template(USER_HI) == "FILE"
    tok.set_chat_template("SET {{ messages[0].content }}", "--chat-template")
    assert tok.check_chat_template() and tok.apply_chat_template(USER_HI, tools=[WEATHER_TOOL]) == "SET Hi"


def test_chat_template_files_as_transformers_loads_them(tiny_dir, tmp_path):
    """The same choice of template as transformers' for files and the list form."""
    transformers = pytest.importorskip("transformers")
    files = _copy_tokenizer(tiny_dir, tmp_path / "files")
    (files / "chat_template.jinja").write_text("FILE {{ messages[0].content }}", encoding="utf-8")
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ messages[0].content }}",
                                                                        encoding="utf-8")
    listed = _copy_tokenizer(tiny_dir, tmp_path / "list", chat_template=[
        {"name": "default", "template": "D {{ messages[0].content }}"},
        {"name": "tool_use", "template": "T {{ messages[0].content }}"}])
    generation = _copy_tokenizer(tiny_dir, tmp_path / "generation", chat_template=(
        "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"))
    for folder in (files, listed, generation):
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
        tok = FlintTokenizer.from_dir(folder)
        for tools in (None, [WEATHER_TOOL]):
            assert tok.apply_chat_template(USER_HI, tools=tools) == hf.apply_chat_template(
                USER_HI, tools=tools, tokenize=False, add_generation_prompt=True)


# --- loading errors -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_raises_naming_it(tiny_dir, tmp_path, name):
    for f in tiny_dir.iterdir():
        if f.name != name:
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match=name):
        FlintTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_unreadable_file_raises_naming_it(tiny_dir, tmp_path, name):
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / name).write_text('{"truncated": ', encoding="utf-8")
    with pytest.raises(CheckpointError, match=name):
        load_tokenizer(tmp_path)


def test_non_byte_level_tokenizer_is_rejected(tiny_dir, tmp_path):
    (tmp_path / "tokenizer_config.json").write_bytes(
        (tiny_dir / "tokenizer_config.json").read_bytes())
    Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="ByteLevel"):
        FlintTokenizer.from_dir(tmp_path)


def test_load_tokenizer_accepts_folder_or_file_and_rejects_none(tiny_dir, tmp_path):
    assert load_tokenizer(tiny_dir).vocab_size == TINY_VOCAB
    assert load_tokenizer(tiny_dir / "tokenizer.json").vocab_size == TINY_VOCAB
    with pytest.raises(CheckpointError):
        load_tokenizer(None)
    with pytest.raises(CheckpointError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


@pytest.mark.parametrize("config_eos", [True, False])
def test_missing_eos_token_names_the_files(tiny_dir, tmp_path, config_eos):
    """tokenizer.json with empty `added_tokens` said only "tokenizer has no token for
    eos_token '<|endoftext|>'": the message names the tokenizer file and where the
    eos_token came from (tokenizer_config.json's, or the default when it names none)."""
    data = json.loads((tiny_dir / "tokenizer.json").read_text("utf-8"))
    data["added_tokens"] = []
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), "utf-8")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text("utf-8"))
    if not config_eos:
        del config["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    where = (f"the eos_token of {tmp_path / 'tokenizer_config.json'}" if config_eos else
             f"the default: {tmp_path / 'tokenizer_config.json'} names no eos_token")
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(tmp_path)
    assert str(err.value) == (f"{tmp_path / 'tokenizer.json'}: no token for eos_token '<|endoftext|>' ({where}); "
                              "expected it in the vocabulary (model.vocab or added_tokens)")


@pytest.mark.parametrize("eos", [None, 5, ["a"], {"x": 1}])
def test_eos_token_of_another_type_names_the_file(tiny_dir, tmp_path, eos):
    """tokenizer_config.json's eos_token null, a number, a list or an object without
    "content" gave a bare TypeError / KeyError from the tokenizers library: one line
    naming the file, the field and what was expected."""
    import shutil

    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text("utf-8"))
    config["eos_token"] = eos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(tmp_path)
    assert str(err.value) == (f"{tmp_path / 'tokenizer_config.json'}: eos_token is {json.dumps(eos)}; expected a "
                              "token's text (a string, or an object with a \"content\" string)")


def test_check_fits_model(tiny_dir, tmp_path):
    """The largest token id must be below the model's vocab_size, else the tokenizer file,
    the id and the config are named (it used to surface as a prompt's id "outside the
    vocabulary"). A tokenizer smaller than the model fits."""
    tok = load_tokenizer(tiny_dir)
    tok.check_fits_model(TINY_VOCAB, "config.json")
    tok.check_fits_model(TINY_VOCAB + 64, "config.json")
    with pytest.raises(CheckpointError) as err:
        tok.check_fits_model(TINY_VOCAB - 1, "m/config.json")
    assert str(err.value).startswith(f"{tiny_dir / 'tokenizer.json'}: token ids up to {TINY_VOCAB - 1}, but "
                                     f"m/config.json has vocab_size {TINY_VOCAB - 1}: expected every id below it")
    for f in tiny_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = json.loads((tiny_dir / "tokenizer.json").read_text("utf-8"))
    data["model"]["vocab"] = {k: v + 1000 for k, v in data["model"]["vocab"].items()}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), "utf-8")
    shifted = load_tokenizer(tmp_path)
    assert shifted.vocab_size == TINY_VOCAB  # the count: the size check alone passed it
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: token ids up to 1\d{3}, but m/config.json has "
                                              f"vocab_size {TINY_VOCAB}"):
        shifted.check_fits_model(TINY_VOCAB, "m/config.json")


def test_tokenizer_of_a_padded_model_decodes_its_extra_ids_to_nothing(tiny_dir):
    """A tokenizer smaller than the model fits it (`check_fits_model`, the one rule of
    run, serve, the Engine, compile and load; as vLLM takes a padded vocabulary): once
    paired, the model's ids the tokenizer has no token for decode to nothing, as
    `tokenizers`' decode drops them and vLLM detokenizes them as "", where decode,
    token_bytes and the incremental detokenizer raised "outside the vocabulary" (a
    model that sampled one failed mid-text). Ids of the model's vocab_size or more are
    still refused."""
    tok = load_tokenizer(tiny_dir)
    pad = TINY_VOCAB + 3
    with pytest.raises(InputError, match=rf"token id {pad} is outside the vocabulary \[0, {TINY_VOCAB}\)"):
        tok.decode([pad])  # not paired: its own vocabulary
    tok.check_fits_model(TINY_VOCAB + 64, "config.json")
    ids = tok.encode("hello world")
    assert tok.decode([*ids[:1], pad, *ids[1:]]) == tok.decode(ids) == "hello world"
    assert tok.token_bytes(pad) == b"" and tok.convert_ids_to_tokens([pad]) == [""]
    assert "".join(tok.decode_stream([pad, *ids, pad])) == "hello world"
    with pytest.raises(InputError, match=rf"token id {TINY_VOCAB + 64} is outside the vocabulary "
                                         rf"\[0, {TINY_VOCAB + 64}\)"):
        tok.decode([TINY_VOCAB + 64])
