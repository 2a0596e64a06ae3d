"""Flint's tokenizer: a byte-level BPE with GLM-4.7 special tokens, and its chat template.

Flint ships no trained tokenizer, so :func:`build_tokenizer` makes one: a byte-level BPE
(GLM's pre-tokenizer regex, then GPT-2's byte-to-character map) trained with the
``tokenizers`` library on a small corpus generated here from fixed word lists, so that the
result is byte-identical on every machine and Python version. Token ids are laid out as
GLM lays them out: the 256 byte symbols and the BPE merges first, then the 13 special
tokens of :data:`SPECIAL_TOKENS`, then ``<|reserved_N|>`` special tokens filling the table
to exactly ``vocab_size`` (the full model's 151552 holds far more than the corpus yields).

:class:`FlintTokenizer` reads a ``tokenizer.json`` + ``tokenizer_config.json`` folder (ours
or any Hugging Face byte-level BPE), renders chat templates exactly as transformers does,
and :class:`IncrementalDetokenizer` turns a token stream into text without ever emitting a
broken UTF-8 sequence. The chat template itself lives in ``chat_template.jinja``.

Chat templates are found where transformers (>= 4.47) finds them: a ``chat_template.jinja``
file and ``additional_chat_templates/NAME.jinja`` files in the tokenizer folder take the
place of ``tokenizer_config.json``'s ``chat_template``, which is a string or a list of
``{"name", "template"}`` objects. Of several named templates, ``tool_use`` renders requests
with tools when there is one, ``default`` the others (transformers' ``get_chat_template``).
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Iterator
from datetime import datetime
from importlib import resources
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from flintc.errors import CheckpointError, InputError
from flintc.fileio import write_text_atomic
from flintc.stop_strings import TOKENIZER_EOS, resolve_eos_token_id  # noqa: F401 (re-exported)

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
)
EOS_TOKEN = "<|endoftext|>"
# The end ids of GLM's generation_config.json (GLM-4.5 / 4.6 / 4.7: "eos_token_id": [151329,
# 151336, 151338]), by their tokens: `generation_stop_token_ids`
GENERATION_STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
NUM_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = NUM_BYTE_SYMBOLS + len(SPECIAL_TOKENS)
# The largest vocab_size build_tokenizer makes: 2**20 = 1,048,576, four times the largest
# released vocabulary (Gemma 3's 262,208). Every id past the corpus's ~2,000 BPE tokens is
# a reserved special token, about 1.1 KB of memory and 130 bytes of tokenizer.json each:
# 2**20 takes ~5 s, 1.2 GB and writes 136 MB; 2,000,000 took 23 s and 4 GB, 1e8 > 20 GB.
MAX_VOCAB_SIZE = 1 << 20
# The BPE trainer's vocab_size: the built-in corpus yields 1,958 tokens (bytes and merges),
# so asking for more makes the same tokenizer, but the trainer reserves memory for all it
# is asked (~66 bytes a token: 2**40 was a 72 TB allocation's abort, exit 134).
_MAX_TRAINED_TOKENS = 1 << 14
RESERVED_PREFIX = "<|reserved_"
DEFAULT_MODEL_MAX_LENGTH = 262144
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' names (tokenization_utils_base)
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# GLM-4's pre-tokenizer split (cl100k-like): contractions, words, 1-3 digit numbers,
# punctuation runs, newlines, spaces. ByteLevel then maps bytes to printable characters.
GLM_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# --------------------------------------------------------------------------------------------
# The training corpus: generated, not stored, from fixed lists and a fixed-seed LCG (Python's
# `random` has changed its algorithms between versions; this cannot).

_NOUNS = """model token layer expert router weight tensor kernel graph node pass cache
memory batch sequence window head query key value norm scale block file folder prompt
answer question language river mountain city garden window teacher student book table
system user assistant tool function argument result error value number string list""".split()
_VERBS = """run read write load save compute route fuse split merge check return build
send find keep move open close start stop learn teach walk carry count print parse call""".split()
_ADJS = """small large fast slow quiet bright dark new old simple careful local global
sparse dense hidden shared final first last empty full green blue warm cold""".split()
_ADVS = "quickly slowly carefully often rarely never always again together".split()
_DETS = "the a this that every each one some no".split()
_PREPS = "in on under over with without from into after before near".split()
_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy".split()
_FOREIGN = """café naïve Zürich résumé München señor façade 東京 数据 模型 语言 Привет мир
Γειά σου αύριο ñandú élève straße 😀 🚀 ✓ → ½ π""".split()


def _lcg(seed: int) -> Iterator[int]:
    """Yield pseudo-random 31-bit ints from a 64-bit LCG (Knuth's MMIX constants)."""
    state = seed
    while True:
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        yield state >> 33


def _corpus_lines(num_lines: int = 4000) -> list[str]:
    """Return the deterministic training corpus: prose, Python-like code and JSON lines."""
    rng = _lcg(1234)

    def pick(words: list[str]) -> str:
        return words[next(rng) % len(words)]

    lines = []
    for i in range(num_lines):
        kind = i % 8
        noun, noun2, verb, adj = pick(_NOUNS), pick(_NOUNS), pick(_VERBS), pick(_ADJS)
        num = next(rng) % 2000
        if kind < 4:
            lines.append(
                f"{pick(_DETS).capitalize()} {adj} {noun} {verb}s {pick(_DETS)} {noun2} "
                f"{pick(_PREPS)} {pick(_DETS)} {pick(_ADJS)} {pick(_NOUNS)} {pick(_ADVS)}. "
                f"{pick(_NAMES)} said it's {num} {noun}s, and they'll {verb} "
                f"{pick(_FOREIGN)} too!"
            )
        elif kind < 6:
            lines.append(
                f"def {verb}_{noun}(self, {noun2}: int = {num}) -> list[str]:\n"
                f"    # {verb} the {adj} {noun}\n"
                f"    if {noun2} is None or self.{noun}_{noun2} < {num}:\n"
                f"        return [str(x) for x in range({noun2})]\n"
                f"    return self.{noun}.{pick(_VERBS)}({noun2}, key=\"{adj}\")\n"
            )
        else:
            lines.append(
                f'{{"name": "{verb}_{noun}", "id": {num}, "{noun2}": {{"{adj}": true, '
                f'"count": {next(rng) % 100}, "tags": ["{pick(_ADJS)}", "{pick(_NOUNS)}"]}}, '
                f'"note": "{pick(_FOREIGN)}", "value": null}}'
            )
    return lines


# --------------------------------------------------------------------------------------------
# Building and writing


def _new_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Build Flint's byte-level BPE tokenizer with exactly ``vocab_size`` tokens.

    Ids ``[0, 256)`` are the byte symbols, then BPE merges (as many as the built-in corpus
    yields, at most ``vocab_size - 269``), then :data:`SPECIAL_TOKENS`, then
    ``<|reserved_N|>`` special tokens up to ``vocab_size``. Deterministic: two builds give
    byte-identical ``to_str()``. On 2 CPU cores: ~0.6 s for 151552 tokens, ~0.15 s for 512,
    ~5 s for :data:`MAX_VOCAB_SIZE`.

    Raises:
        ValueError: ``vocab_size`` is below 269 (256 byte symbols + 13 special tokens) or
            above :data:`MAX_VOCAB_SIZE`.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: the tokenizer needs at least "
            f"{MIN_VOCAB_SIZE} ({NUM_BYTE_SYMBOLS} byte symbols + {len(SPECIAL_TOKENS)} "
            f"special tokens)"
        )
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} is too large: the tokenizer is made with at most "
                         f"{MAX_VOCAB_SIZE} tokens (2**20)")
    tok = _new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size - len(SPECIAL_TOKENS), _MAX_TRAINED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    num_model = tok.get_vocab_size(with_added_tokens=False)
    num_reserved = vocab_size - num_model - len(SPECIAL_TOKENS)
    reserved = [f"{RESERVED_PREFIX}{i}|>" for i in range(num_reserved)]
    tok.add_special_tokens([
        AddedToken(content, special=True, normalized=False)
        for content in (*SPECIAL_TOKENS, *reserved)
    ])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def chat_template_source() -> str:
    """Return the Jinja source of Flint's chat template (package data)."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text("utf-8")


def _tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict:
    """Hugging Face ``tokenizer_config.json`` for ``tok``.

    ``added_tokens_decoder`` lists the named special tokens only: the reserved ones are in
    tokenizer.json's ``added_tokens``, and copying ~150k of them here adds nothing.
    """
    decoder = {}
    for content in SPECIAL_TOKENS:
        decoder[str(tok.token_to_id(content))] = {
            "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True,
        }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": chat_template_source(),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "pad_token": EOS_TOKEN,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(out_dir: str | os.PathLike, vocab_size: int, *,
                    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> None:
    """Build the tokenizer and write ``tokenizer.json`` and ``tokenizer_config.json``.

    ``out_dir`` is created if missing. Each file is written under a temporary name in
    ``out_dir`` and renamed, so a crash never leaves a half-written file.

    Raises:
        ValueError: ``vocab_size`` is too small or too large (see :func:`build_tokenizer`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    config = _tokenizer_config(tok, model_max_length)
    write_text_atomic(out / "tokenizer.json", tok.to_str())
    write_text_atomic(out / "tokenizer_config.json",
                           json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# Loading and using


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' template
    environment has (its AssistantTracker marks the assistant's tokens for training
    masks): renders the block as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` without underscore-prefixed attributes, as transformers'
    (a sandbox hardening: no route to CPython internals)."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers' ``chat_template_utils`` does (its
    globals, filters and tags; the environment of transformers 5.x)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: unlike Jinja's own tojson, no HTML escaping or key sorting.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:  # `dict(...)` and `dict.fromkeys(...)`, and no attribute of the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _chat_template_files(folder: Path) -> dict[str, tuple[str, str]]:
    """name -> (source, path) of the template files in tokenizer folder `folder`:
    ``chat_template.jinja`` ("default") and ``additional_chat_templates/NAME.jinja``, as
    transformers (>= 4.47) saves and loads them. Empty when there are none.

    Raises:
        CheckpointError: a template file that cannot be read as UTF-8, naming it.
    """
    paths = {"default": folder / CHAT_TEMPLATE_FILE}
    if (folder / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            paths[path.name.removesuffix(".jinja")] = path
    out = {}
    for name, path in paths.items():
        if path.is_file():
            try:
                out[name] = (path.read_text("utf-8"), str(path))
            except (OSError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{path}: cannot read chat template file ({exc})") from None
    return out


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: tokenizer file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read tokenizer file ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-character map (what ``decoders.ByteLevel`` undoes)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    num_shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + num_shifted)
            num_shifted += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _byte_decoder()


class FlintTokenizer:
    """A loaded tokenizer: encode, decode, stream-decode and render chat templates.

    Wraps a ``tokenizers.Tokenizer`` whose decoder must be ``ByteLevel`` (GLM, GPT-2 and
    Flint's own tokenizers all are), plus the ``tokenizer_config.json`` dict.
    """

    config_path: str | Path = "tokenizer_config.json"  # where `config` was read (from_dir sets it)
    tokenizer_path: str | Path = "tokenizer.json"  # where `tokenizer` was read (from_dir sets it)

    def __init__(self, tokenizer: Tokenizer, config: dict, *, tokenizer_path: str | Path | None = None,
                 config_path: str | Path | None = None):
        """`tokenizer_path` / `config_path`: the files `tokenizer` and `config` were read
        from, named in error messages (`from_dir` passes them).

        Raises:
            CheckpointError: the vocabulary has no token for the eos_token, naming the
                tokenizer file and where the eos_token came from.
        """
        self._tok = tokenizer
        self.config = config
        if tokenizer_path is not None:
            self.tokenizer_path = tokenizer_path
        if config_path is not None:
            self.config_path = config_path
        # name -> (Jinja source, where it was read); None: from config["chat_template"], once
        # read (`_chat_template_sources`)
        self._template_sources: dict[str, tuple[str, str]] | None = None
        self._templates: dict[str, jinja2.Template] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._special_strings: dict[int, str] | None = None  # `special_strings`
        self._top_id: int | None = None  # the largest token id, once `check_fits_model` looks
        eos = config.get("eos_token", EOS_TOKEN)
        eos = eos.get("content") if isinstance(eos, dict) else eos  # an AddedToken's fields, as HF writes it
        if not isinstance(eos, str):
            raise CheckpointError(f"{self.config_path}: eos_token is {json.dumps(config.get('eos_token'))}; "
                                  "expected a token's text (a string, or an object with a \"content\" string)")
        self.eos_token = eos
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # ids `decode` and the rest take: the tokenizer's own, up to the model's vocab_size
        # once paired with a model of more embedding rows (`check_fits_model`)
        self._id_limit = self.vocab_size
        self.eos_token_id = tokenizer.token_to_id(self.eos_token)
        if self.eos_token_id is None:
            where = (f"the eos_token of {self.config_path}" if "eos_token" in config else
                     f"the default: {self.config_path} names no eos_token")
            raise CheckpointError(f"{self.tokenizer_path}: no token for eos_token {self.eos_token!r} ({where}); "
                                  f"expected it in the vocabulary (model.vocab or added_tokens)")
        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_token_ids = {
            t.content: i for i, t in sorted(added.items())
            if t.special and not t.content.startswith(RESERVED_PREFIX)
        }

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> FlintTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from folder ``path``.

        Raises:
            CheckpointError: a file is missing, unreadable, or not a byte-level BPE; the
                message names the file.
        """
        folder = Path(path)
        tok_path, config_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not tok_path.is_file():
            raise CheckpointError(f"{tok_path}: tokenizer file not found")
        try:
            tok = Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception for any bad file
            raise CheckpointError(f"{tok_path}: cannot read tokenizer file ({exc})") from None
        if not isinstance(tok.decoder, decoders.ByteLevel):
            raise CheckpointError(f"{tok_path}: decoder must be ByteLevel (byte-level BPE), "
                                  f"got {type(tok.decoder).__name__}")
        out = cls(tok, _read_json(config_path), tokenizer_path=tok_path, config_path=config_path)
        files = _chat_template_files(folder)
        if files:  # as transformers: the files replace tokenizer_config.json's chat_template
            out._template_sources = files
        return out

    @property
    def id_limit(self) -> int:
        """The token ids this tokenizer takes, [0, id_limit): its own, and once paired with
        a model of more embedding rows (`check_fits_model`) the model's vocab_size (the
        ids it has no token for decode to nothing)."""
        return self._id_limit

    def check_fits_model(self, vocab_size: int, config_where: str) -> None:
        """Pair this tokenizer with a model of `vocab_size` embedding rows, read from
        `config_where` (its config.json, or a build's build.json): the one rule of every
        entry point (`flintc run`, `flintc serve` and its Engine, `flintc.compile`,
        `flintc.load`), before any prompt is encoded. Every token id (of the vocabulary
        and the added tokens) must be below `vocab_size`: such a tokenizer.json used to
        surface as a prompt's "token id N is outside the vocabulary". A tokenizer with
        fewer tokens than the model fits, as vLLM takes a model whose vocabulary is padded
        (FLINT_SPEC fixes only the model's vocab_size); the model's ids the tokenizer has
        no token for then decode to nothing (as ``tokenizers``' decode drops them, and
        vLLM detokenizes them as ""), so a model that samples one does not fail mid-text.

        The largest id is found once (a walk of the whole vocabulary: about 0.2 s for
        150k tokens), so pairing again is free: `flintc serve` pairs with the build's or
        config.json's vocab_size before the weights load, and its Engine with the config
        the runner loaded.

        Raises:
            CheckpointError: naming the tokenizer file, its largest id and `config_where`'s
                vocab_size.
        """
        if self._top_id is None:
            self._top_id = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
        top = self._top_id
        if top >= vocab_size:
            raise CheckpointError(f"{self.tokenizer_path}: token ids up to {top}, but {config_where} has vocab_size "
                                  f"{vocab_size}: expected every id below it (a tokenizer of another model?)")
        self._id_limit = max(self.vocab_size, vocab_size)

    def set_chat_template(self, source: str, where: str) -> None:
        """Render chats with `source` (a Jinja template) instead of the tokenizer's
        templates, as vLLM's ``--chat-template``; `where` names it in error messages.
        Checked by the next `check_chat_template` or rendering."""
        self._template_sources = {"default": (source, where)}
        self._templates = {}

    def _chat_template_sources(self) -> dict[str, tuple[str, str]]:
        """name -> (source, where): the files' templates, or tokenizer_config.json's
        ``chat_template`` (a string: "default"; a list of {"name", "template"} or a
        {name: template} object: by name).

        Raises:
            CheckpointError: ``chat_template`` is neither, naming the file and the entry.
        """
        if self._template_sources is not None:
            return self._template_sources
        where = str(self.config_path)
        source = self.config.get("chat_template")
        if source is None or isinstance(source, str):
            self._template_sources = {} if source is None else {"default": (source, where)}
            return self._template_sources
        if isinstance(source, dict):  # {name: template}, as transformers holds several
            source = [{"name": k, "template": v} for k, v in source.items()]
        if not isinstance(source, list):
            raise CheckpointError(f"{where}: chat_template must be a string (a Jinja template) or a list of "
                                  f"{{\"name\", \"template\"}} objects, got {type(source).__name__}")
        if not source:
            raise CheckpointError(f"{where}: chat_template is an empty list: expected a Jinja template string, or "
                                  f"{{\"name\", \"template\"}} objects (one named \"default\"); leave it out or "
                                  f"null for no template")
        named = {}
        for i, entry in enumerate(source):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise CheckpointError(f"{where}: chat_template[{i}] must be an object with string \"name\" and "
                                      f"\"template\", got {json.dumps(entry)[:80]}")
            named[entry["name"]] = (entry["template"], where)
        self._template_sources = named
        return named

    @property
    def chat_template_names(self) -> list[str]:
        """The names of the chat templates ("default" for a single one), sorted."""
        return sorted(self._chat_template_sources())

    def _chat_template(self, tools) -> jinja2.Template:
        """The compiled template for a chat with or without `tools`, chosen as
        transformers' ``get_chat_template`` chooses: "tool_use" for a chat with tools when
        there is one, else "default".

        Raises:
            CheckpointError: no template, none named "default" (naming those there are),
                or the chosen one does not compile.
        """
        sources = self._chat_template_sources()
        if not sources:
            raise CheckpointError(f"{self.config_path}: no chat template "
                                  f"(no chat_template in it, no {CHAT_TEMPLATE_FILE} beside it)")
        name = "tool_use" if tools is not None and "tool_use" in sources else "default"
        if name not in sources:
            where = ", ".join(sorted({w for _, w in sources.values()}))
            raise CheckpointError(f"{where}: several chat templates ({', '.join(sorted(sources))}) and none "
                                  f"named 'default' (transformers needs one too, to render a chat without "
                                  f"naming its template)")
        return self._compiled(name)

    def _compiled(self, name: str) -> jinja2.Template:
        """Chat template `name`, compiled once.

        Raises:
            CheckpointError: it does not compile, naming its file, the problem and the line.
        """
        if name not in self._templates:
            source, where = self._chat_template_sources()[name]
            try:
                self._templates[name] = _compile_chat_template(source)
            except jinja2.TemplateSyntaxError as exc:  # TemplateAssertionError (unknown filter / test) too
                why = " ".join(str(exc.message or type(exc).__name__).split())
                what = "the chat_template" if name == "default" else f"the chat template {name!r}"
                raise CheckpointError(f"{where}: {what} does not compile: {why} "
                                      f"(template line {exc.lineno})") from None
        return self._templates[name]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their single ids.
        ``add_special_tokens``: also those the tokenizer's post-processor adds (a BOS,
        say; none for Flint's own tokenizer), as transformers' default does.

        Computed by ``tokenizers``' batch encoder (``encode_batch_fast``, which skips the
        offsets, where the installed version has it), which releases the GIL, unlike
        ``Tokenizer.encode`` (4.7 s held for a 5M-character text): a server can encode
        on a worker thread without stalling its event loop. The same ids. Safe from
        several threads at once (encoding only reads the tokenizer).

        Raises:
            InputError: ``text`` is not valid Unicode (a lone surrogate).
        """
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate (undecodable bytes of argv, ...)
                raise InputError(f"the text to encode is not valid Unicode: {e.reason} at character "
                                 f"{e.start} ({text[e.start]!r}); expected UTF-8 text") from None
        batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = list(ids)
        for i in ids:
            if not 0 <= i < self._id_limit:
                raise InputError(f"token id {i} is outside the vocabulary [0, {self._id_limit})")
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD.

        Raises:
            InputError: an id is outside ``[0, vocab_size)`` (the model's, once paired:
                `check_fits_model`; its ids of no token decode to nothing).
        """
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (byte-level: ``"Ġhello"``), as transformers'
        method of that name.

        Raises:
            InputError: an id is outside ``[0, vocab_size)`` (the model's, once paired;
                its ids of no token are "").
        """
        return [self._tok.id_to_token(i) or "" for i in self._check_ids(ids)]  # "": a model's id of no token

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` decodes to (what ``decoders.ByteLevel`` does)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            text = self._tok.id_to_token(self._check_ids([token_id])[0])
            if text is None:  # a model's id the tokenizer has no token for (`check_fits_model`)
                return b""
            try:
                cached = bytes(_BYTE_DECODER[c] for c in text)
            except KeyError:  # like the Rust decoder: a non-byte-level token stays as UTF-8
                cached = text.encode("utf-8")
            self._token_bytes[token_id] = cached
        return cached

    def special_strings(self) -> dict[int, str]:
        """Special token id -> its string, as the detokenizer makes it (computed once): what
        `flintc.stop_strings.VisibleText` leaves out of a text to match stop strings on
        the text without special tokens (vLLM's ``skip_special_tokens``)."""
        if self._special_strings is None:
            self._special_strings = {i: self.token_bytes(i).decode("utf-8", errors="replace")
                                     for i in self.all_special_ids}
        return self._special_strings

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens)

    def decode_stream(self, ids: Iterable[int],
                      skip_special_tokens: bool = False) -> Iterator[str]:
        """Yield text pieces for ``ids`` one token at a time (empty while a character is
        incomplete); ``"".join`` of them equals :meth:`decode` of all ids."""
        detok = self.detokenizer(skip_special_tokens)
        for token_id in ids:
            yield detok.push(token_id)
        tail = detok.flush()
        if tail:
            yield tail

    def check_chat_template(self) -> bool:
        """Compile the chat templates now, as their first rendering would, so that a
        malformed one is found at startup (as vLLM's server does), not at every chat
        request. -> True when there is a template, False when there is none (no
        ``chat_template``, or null, and no template files).

        Raises:
            CheckpointError: ``chat_template`` is not a string or a list of named
                templates; a template does not compile (a Jinja syntax error, an unknown
                filter or test), naming its file, the problem and the template line;
                several templates and none named "default".
        """
        sources = self._chat_template_sources()
        if not sources:
            return False
        self._chat_template(None)  # "default": there must be one
        for name in sorted(sources):
            self._compiled(name)
        return True

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            documents: list[dict] | None = None, **kwargs) -> str | list[int]:
        """Render ``messages`` with the config's ``chat_template`` as transformers does.

        Extra ``kwargs`` (e.g. ``enable_thinking=False``) reach the template, as do
        ``documents`` (transformers' RAG documents; None by default) and the config's ``eos_token``/``pad_token``/``bos_token``. Returns the text, or its ids
        when ``tokenize``.

        With several named templates, a chat with ``tools`` renders with "tool_use" if
        there is one, else with "default" (transformers' choice).

        Raises:
            CheckpointError: no chat template, or none for this chat (`_chat_template`).
            jinja2.TemplateError: the template rejects the messages (``raise_exception``).
        """
        template = self._chat_template(tools)
        special = {k: self.config.get(k) for k in ("bos_token", "eos_token", "pad_token")
                   if self.config.get(k) is not None}
        text = template.render(messages=messages, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**special, **kwargs})
        return self.encode(text) if tokenize else text


class IncrementalDetokenizer:
    """Turns token ids into text one at a time, holding back incomplete UTF-8 sequences.

    ``push(id)`` returns the newly completed text (possibly ``""``); ``flush()`` returns what
    is left at the end of the stream (U+FFFD for a dangling partial character). The pieces
    concatenate to exactly ``FlintTokenizer.decode(ids)``: both join all token bytes and
    decode with maximal-subpart replacement.
    """

    def __init__(self, tokenizer: FlintTokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes.

        Raises:
            InputError: ``token_id`` is outside the vocabulary.
        """
        if self._skip and token_id in self._tokenizer.all_special_ids:
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End the stream: return any held-back bytes, as U+FFFD, and reset."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail


def generation_stop_token_ids(tokenizer) -> frozenset[int]:
    """The generation config's end ids that a request stops at besides the tokenizer's own
    end-of-text: the ids of the :data:`GENERATION_STOP_TOKENS` (``<|endoftext|>``,
    ``<|user|>``, ``<|observation|>``, the ``eos_token_id`` list of GLM's
    generation_config.json) that are special tokens of `tokenizer`, less its
    ``eos_token_id``, as vLLM's `SamplingParams.update_from_generation_config` discards the
    model's eos id from that list and adds the rest to every request's ``stop_token_ids``
    (completions, chat and `LLM.generate` alike) unless ``ignore_eos``. One list for every
    route: `flintc serve`'s chat and completions, `flintc.runtime.generate` (the Python API,
    `flintc run`), composed with the end-of-text id by `model_stop_token_ids`. For Flint's
    tokenizer: ``<|user|>`` and ``<|observation|>``.

    Args:
        tokenizer: a :class:`FlintTokenizer` (its ``special_token_ids``, ``eos_token_id``).

    Returns:
        frozenset of token ids (empty for a tokenizer with none of those special tokens).
    """
    special = tokenizer.special_token_ids
    return frozenset(special[t] for t in GENERATION_STOP_TOKENS if t in special) - {tokenizer.eos_token_id}


def model_stop_token_ids(tokenizer, eos_token_id=TOKENIZER_EOS,
                         generation_ids: Iterable[int] | None = None) -> tuple[int, ...]:
    """Every request's stop tokens but its own ``stop_token_ids``: the end-of-text id and the
    generation config's other end ids, vLLM's `SamplingParams.update_from_generation_config`
    set (its ``_all_stop_token_ids`` less the request's own): they end a sequence unless
    ``ignore_eos`` and are masked before ``min_tokens``. The one composition behind
    `flintc serve` (chat and completions), `generate_with_runner` (the Python API) and
    `flintc run`.

    Args:
        tokenizer: a :class:`FlintTokenizer`, or None (token ids alone).
        eos_token_id: the end-of-text id (an int), or None for none; default: the
            tokenizer's ``eos_token_id`` (None without a tokenizer).
        generation_ids: the generation config's end ids (an iterable of ints, checked by
            the caller); None: `generation_stop_token_ids(tokenizer)` when there is both a
            tokenizer and an end-of-text id, else none (a caller that ends on no
            end-of-text token gets none of the generation config's other end ids either).

    Returns:
        tuple of token ids: ``eos_token_id`` first (left out when None), then the
        generation ids less it, deduplicated, in increasing order; never a None.
    """
    eos_token_id = resolve_eos_token_id(tokenizer, eos_token_id)
    if generation_ids is None:
        generation_ids = (generation_stop_token_ids(tokenizer)
                          if tokenizer is not None and eos_token_id is not None else ())
    return (() if eos_token_id is None else (eos_token_id,)) + tuple(sorted(set(generation_ids) - {eos_token_id}))


def folder_tokenizer(folder: str | os.PathLike | None) -> FlintTokenizer | None:
    """The tokenizer of a checkpoint's `folder` (`load_tokenizer`, its errors raised), or
    None when `folder` is None or holds no tokenizer.json (a checkpoint run on token ids).

    Raises:
        CheckpointError: as `load_tokenizer`, for a tokenizer.json that is there.
    """
    if not folder or not (Path(folder) / "tokenizer.json").is_file():
        return None
    return load_tokenizer(folder)


def load_tokenizer(path: str | os.PathLike | None) -> FlintTokenizer:
    """Load a tokenizer from a folder, or from a ``tokenizer.json`` path (its config is read
    from the same folder).

    Raises:
        CheckpointError: ``path`` is None or missing, or a tokenizer file is missing or bad.
    """
    if path is None:
        raise CheckpointError("no tokenizer given: pass a folder with tokenizer.json and "
                              "tokenizer_config.json")
    p = Path(path)
    if p.is_file():
        p = p.parent
    elif not p.is_dir():
        raise CheckpointError(f"{p}: tokenizer folder not found")
    return FlintTokenizer.from_dir(p)
