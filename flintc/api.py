"""The Python API: `flintc.compile(...)` and `flintc.load(BUILD)`.

    import flintc
    m = flintc.compile("ckpt-nvfp4/model-nvfp4.gguf", out="build", device="cpu")
    r = m.generate(["The quick brown fox"], max_tokens=16, temperature=0)
    print(r.texts[0])

`examples/compiled_generate.py` runs this end to end.

Bad input raises `flintc.errors.InputError` (``except InputError`` catches every case);
arguments of the wrong shape, type or range raise its subclass `ApiInputError`, a
ValueError too.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import numbers
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flintc.errors import InputError, Terminated
from flintc.errors import check_bool as _check_flag
from flintc.errors import describe_type as _describe
from flintc.fileio import new_temp_build_dir, remove_temp_build_dir
from flintc.model.generate import GenerationResult
from flintc.sampling import SamplingParams


@dataclass
class CompiledGeneration(GenerationResult):
    """GenerationResult (output_ids, texts, finish_reasons, stop_reasons, ...: what each
    holds is told there), texts None without a tokenizer. The texts keep the tokenizer's
    special tokens (`tokenizer.decode`'s default, as `flintc run` prints them: the ids are
    the output); `flintc serve` leaves them out by default, as vLLM's
    `skip_special_tokens=True` (docs/serve.md). A text ends before the stop string
    (`SamplingParams.stop`) its sequence ended at, as vLLM's `CompletionOutput.text`, while
    output_ids keep the token that completed it. Stop strings are matched on the text
    without the special tokens' strings, as `flintc serve` and vLLM's `LLM.generate` match
    them by default: "user" never matches in "<|user|>"."""

    extra: dict = field(default_factory=dict)


class CompiledModel:
    """A loaded build: `generate` (prompts as text or token ids) and `forward` (logits).

    Attributes: runner (`flintc.runtime.compiled.CompiledRunner`), tokenizer (or None),
    build (the BUILD folder), manifest (build.json).
    """

    def __init__(self, runner, tokenizer=None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.build = runner.build
        self.manifest = runner.manifest

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 on_token=None, return_prompt_logits: bool = False, **sampling) -> CompiledGeneration:
        """Generate after each prompt (a str needs the tokenizer, or a list of token ids).

        Args:
            prompts: one prompt (a str, or token ids: a list / tuple of ints or an int64
                [T] tensor) or a list of any number of them (at least one): more than
                the build's max_batch run in consecutive batches of max_batch, results
                in input order (as vLLM's LLM.generate; what a prompt's tokens depend
                on: `flintc.runtime.generate.generate_with_runner`).
            params: SamplingParams (one or one per prompt); or, instead, keyword
                arguments of SamplingParams (temperature=0, max_tokens=16 (None, vLLM's:
                until the context is full, the build's max_model_len minus the prompt's
                length), seed=1, and
                vLLM's presence_penalty, frequency_penalty, repetition_penalty, min_p,
                min_tokens, logit_bias={token_id: bias}, allowed_token_ids,
                bad_words, stop, stop_token_ids, include_stop_str_in_output, ...;
                `flintc.SamplingParams` lists them all). bad_words become token ids
                with this model's tokenizer (`SamplingParams.with_tokenizer`, vLLM's
                update_from_tokenizer); without a tokenizer, give bad_words_token_ids.
                structured_outputs (a `flintc.StructuredOutputsParams`, or a dict of
                its fields: json, regex, choice, grammar, json_object) needs the
                tokenizer, and so do stop strings (`stop`: a str or a list of str;
                the sequence ends with finish reason "stop" when one ends in the
                latest token's text, the first in the order given, looked for past
                min_tokens tokens; the text cut before it, or after it with
                include_stop_str_in_output, as vLLM's).
            return_prompt_logits: also return each prompt's fp32 [T, V] logits
                (`prompt_logits`).
            on_token: called as on_token(prompt_index, token_id) (the index into
                prompts, whatever batch the prompt runs in).

        Returns:
            A CompiledGeneration: per prompt output_ids, texts (None without a
            tokenizer), finish_reasons ("stop" / "length") and stop_reasons (the stop
            string, or the id of the stop token that ended the sequence: one of
            stop_token_ids, or with a tokenizer one of the generation config's end ids
            `<|user|>` / `<|observation|>`, which end it unless ignore_eos, as vLLM's and
            `flintc serve`'s; else None, end-of-text among them), as vLLM's
            CompletionOutput's token_ids, text, finish_reason and stop_reason.

        Raises:
            InputError: text prompts without a tokenizer, a prompt that is neither text
                nor token ids, no prompts, bad ids (a stop_token_ids id outside the
                vocabulary among them), invalid sampling values (the field named), stop
                strings or structured_outputs without a tokenizer, min_tokens over what a
                prompt's context leaves with max_tokens None, or both `params` and
                sampling keywords.
        """
        from flintc.runtime.generate import generate_with_runner

        if on_token is not None and not callable(on_token):  # it failed mid-generation
            raise InputError(f"generate: on_token: expected a callable on_token(prompt_index, token_id) or None, "
                             f"got {_describe(on_token)}")
        ids = []
        for p in _prompt_list(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise InputError("text prompts need a tokenizer; pass token ids or tokenizer=DIR")
                ids.append(self.tokenizer.encode(p))
            else:
                ids.append(p)
        if params is None:
            try:
                params = SamplingParams(**sampling)
            except TypeError:  # a keyword SamplingParams does not have
                fields = [f.name for f in dataclasses.fields(SamplingParams)]
                unknown = sorted(set(sampling) - set(fields))
                if not unknown:
                    raise
                raise InputError(f"generate: unknown sampling keyword {', '.join(map(repr, unknown))}; "
                                 f"SamplingParams takes {', '.join(fields)}") from None
        elif sampling:
            raise InputError(f"generate: pass params or sampling keywords ({', '.join(sorted(sampling))}), "
                             "not both")
        if self.tokenizer is not None:
            params = ([p.with_tokenizer(self.tokenizer) if isinstance(p, SamplingParams) else p for p in params]
                      if isinstance(params, (list, tuple)) else
                      params.with_tokenizer(self.tokenizer) if isinstance(params, SamplingParams) else params)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        r = generate_with_runner(self.runner, ids, params, eos_token_id=eos, on_token=on_token,
                                 return_prompt_logits=return_prompt_logits, tokenizer=self.tokenizer)
        return CompiledGeneration(**r.__dict__)  # texts: made as the tokens came (with a tokenizer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                slot: int = 0) -> torch.Tensor:
        """Logits of a token sequence of one sequence slot, through the generated prefill
        (T > 1) or decode (T == 1) function. input_ids: int64 [T] or [1, T]; positions:
        consecutive integers p, p + 1, ... in [0, max_model_len), [T] or [1, T] (a list
        or an integer tensor), default 0..T-1. Writes the slot's KV cache. -> fp32 [T, V].

        Raises:
            InputError (a ValueError): input_ids that are not integer token ids of one
                sequence, none, or an id outside the vocabulary [0, vocab_size);
                positions that are not integers, not one per id, not consecutive, or
                outside [0, max_model_len); a slot that is not an int in [0, max_batch);
                more ids than the slot's cache holds from the start position.
        """
        ids = _token_ids(input_ids, "forward: input_ids", allow_batch_of_one=True)
        vocab = self.runner.config.vocab_size
        if not ids:
            raise ApiInputError("forward needs at least one token id")
        for t in ids:
            if not 0 <= t < vocab:
                raise ApiInputError(f"token id {t} is outside the vocabulary [0, {vocab}) of {self.build}")
        start = 0 if positions is None else self._start_position(positions, len(ids))
        slots = self.runner.max_batch
        if not _is_id(slot) or not 0 <= slot < slots:
            raise ApiInputError(f"forward: slot: expected an int in [0, {slots}) (the KV-cache slots of "
                                 f"{self.build}), got {slot if _is_id(slot) else _describe(slot)}")
        try:
            if len(ids) == 1:
                return self.runner.decode([int(slot)], ids, [start])
            return self.runner.prefill(int(slot), ids, start, all_logits=True)
        except ApiInputError:
            raise
        except InputError as exc:  # the runner's (ids past max_model_len): a ValueError too, as documented
            raise ApiInputError(str(exc)) from None

    def _start_position(self, positions, n: int) -> int:
        """The first of `forward`'s `positions` for `n` ids, once they are checked (the
        runner takes a start and counts up from it)."""
        pos = _token_ids(positions, "forward: positions", allow_batch_of_one=True, kind="positions")
        if len(pos) != n:
            raise ApiInputError(f"forward: positions: expected one position per input id: {n}, got {len(pos)}")
        limit = self.runner.max_model_len
        for p in pos:
            if not 0 <= p < limit:
                raise ApiInputError(f"forward: positions: position {p} is outside [0, {limit}) (the max_model_len "
                                     f"of {self.build})")
        for i in range(1, n):
            if pos[i] != pos[i - 1] + 1:
                raise ApiInputError(f"forward: positions: expected consecutive positions (p, p + 1, ...: one "
                                     f"sequence's tokens in order), got {pos[i]} after {pos[i - 1]} at index {i}")
        return pos[0]


class ApiInputError(InputError, ValueError):
    """The Python API's error for bad arguments (prompts or token ids of the wrong shape
    or type, ids outside the vocabulary, `forward`'s positions and slot): a
    `flintc.errors.InputError`, so ``except InputError`` catches it with the API's other
    input errors, and a ValueError, as `forward` documents (what it raised before)."""


def _token_ids(p, what: str, allow_batch_of_one: bool = False, kind: str = "token ids") -> list[int]:
    """A prompt's token ids (or other integers, `kind`: forward's positions): a list /
    tuple of ints or an integer tensor of shape [T] (or [1, T] when
    `allow_batch_of_one`). Raises InputError naming `what` otherwise."""
    if isinstance(p, range):
        p = list(p)
    if not isinstance(p, (torch.Tensor, list, tuple, str)) and hasattr(p, "__array__"):
        if getattr(getattr(p, "dtype", None), "kind", "i") not in "iu":  # NumPy: object, float, bool, str
            raise ApiInputError(f"{what}: expected an integer array, got a NumPy array of {p.dtype}")
        p = torch.as_tensor(p)  # a NumPy array
    if isinstance(p, torch.Tensor):
        if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool \
                or not (p.dim() == 1 or (allow_batch_of_one and p.dim() == 2 and p.shape[0] == 1)):
            raise ApiInputError(f"{what}: expected an integer tensor of shape [T]"
                                 f"{' or [1, T]' if allow_batch_of_one else ''}, got {p.dtype} "
                                 f"{list(p.shape)}")
        return [int(t) for t in p.reshape(-1).tolist()]
    if allow_batch_of_one and isinstance(p, (list, tuple)) and len(p) == 1 \
            and isinstance(p[0], (list, tuple)):
        p = p[0]
    if not isinstance(p, (list, tuple)) or not all(_is_id(t) for t in p):
        raise ApiInputError(f"{what}: expected {kind} (a list of ints or an integer tensor), "
                             f"got {_describe(p)}")
    return [int(t) for t in p]


def _is_id(t) -> bool:
    """An integer token id: a Python or NumPy integer, not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _prompt_list(prompts) -> list:
    """`generate`'s prompts as a list of str / token-id lists: one prompt (str, ids) or a
    list / tuple of them. Raises InputError for anything else."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor) or (not isinstance(prompts, (list, tuple))
                                             and hasattr(prompts, "__array__")):
        return [_token_ids(prompts, "generate: prompt")]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(_is_id(t) for t in prompts):
            return [[int(t) for t in prompts]]  # one prompt of ids
        return [p if isinstance(p, str) else _token_ids(p, f"generate: prompt {i}")
                for i, p in enumerate(prompts)]
    raise ApiInputError(f"generate: expected a prompt (str or token ids) or a list of prompts, "
                         f"got {_describe(prompts)}")


# The CLI flags the messages of the shared code name, and the keyword of `flintc.compile`
# / `flintc.load` each stands for: an API error names both, "--max-batch (max_batch=)",
# as the loader's "--hf-config-path (hf_config_path=)" does.
_KEYWORDS = {"--max-batch": "max_batch", "--max-model-len": "max_model_len", "--prefill-chunk": "prefill_chunk",
             "--backend": "backend", "--device": "device", "--out": "out", "--load-format": "load_format",
             "--hf-config-path": "hf_config_path", "--tokenizer": "tokenizer", "--build": "build",
             "--format": "fmt", "--config": "config", "--no-check": "check=False"}
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)(?![\w-])(?! \()")


@contextlib.contextmanager
def _keyword_wording():
    """Errors raised in the block (InputError, CheckpointError) name the keyword beside
    the CLI flag their message names: "--max-batch must be ..." becomes "--max-batch
    (max_batch=) must be ...". The exception itself is re-raised (its type kept)."""
    from flintc.errors import FlintcError

    def name(m):
        kw = _KEYWORDS.get(m[1])
        return m[1] if kw is None else f"{m[1]} ({kw}{'' if '=' in kw else '='})"

    try:
        yield
    except FlintcError as exc:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (_FLAG.sub(name, exc.args[0]), *exc.args[1:])
        raise


def _check_path(value, name: str, what: str, none_ok: bool = True) -> None:
    """`value` (argument `name`) is a path: a str or os.PathLike (or None when
    `none_ok`). Raises InputError naming the argument otherwise (a raw TypeError of
    os.fspath or Path(), or an AttributeError, came later)."""
    if (value is None and none_ok) or isinstance(value, (str, os.PathLike)):
        return
    raise InputError(f"{name}: expected {what} (a str or os.PathLike{', or None' if none_ok else ''}), "
                     f"got {_describe(value)}")


def _check_str(value, name: str, what: str) -> None:
    if not isinstance(value, str):
        raise InputError(f"{name}: expected {what}, got {_describe(value)}")


def compile(model=None, out=None, *, hf_config_path=None, tokenizer=None, load_format: str = "auto",
            config: str | None = None, fmt: str = "bf16", max_batch: int = 8,
            max_model_len: int | None = None, prefill_chunk: int | None = None,
            backend: str = "auto", device: str = "cpu", check: bool = True, dump: bool = True,
            progress: bool = False, fold_attention_combine: bool = False,
            split_lm_head_norm: bool = True) -> CompiledModel:
    """Compile `model` (a BF16 folder or NVFP4 .gguf; None: the embedded default tiny
    model) into BUILD `out` (None: a new temporary folder, removed when the interpreter
    exits) and load it.

    Other arguments as `flintc compile` (see `flintc.runtime.build.BuildOptions`; None for
    max_batch, max_model_len or prefill_chunk is the flag's default; fold_attention_combine
    and split_lm_head_norm are the decode schedule's options `--fold-attention-combine`
    and `--split-lm-head-norm`: the fold off and the split on by default); `fmt`
    ("bf16" or "nvfp4") and `config` only with load_format="dummy", as the CLI's
    --format and --config. Raises InputError / CheckpointError / PassCheckError as
    `flintc compile`; InputError also for an empty `out` (`Path("")` is the current
    folder), an `out` that holds `model`, `tokenizer` or `hf_config_path`, or is an
    earlier build that also holds files a compile does not write (a compile replaces
    `out` whole: `flintc.runtime.build.check_out_replaceable`), an unknown
    `load_format` (`flintc.checkpoint.loader.check_load_format`; None is "auto"), a
    `fmt` or `config` that does not apply, a `check`, `dump`, `progress`,
    `fold_attention_combine` or `split_lm_head_norm` that is not True or False (a NumPy bool is taken), and a malformed FLINTC_* variable
    (`flintc.runtime.compiled.check_environment`), before compiling; CheckpointError,
    before compiling too, for a tokenizer (`tokenizer`, else the checkpoint's) with ids
    the model has no row for (`FlintTokenizer.check_fits_model`, naming its file and
    config.json; one with fewer tokens than the model fits).

    A compile that fails removes what it wrote (BUILD is written beside `out` and renamed
    into place at the end; the temporary folder of out=None is removed at once). SIGTERM
    during the compile does the same: where the process has SIGTERM's default action
    (no handler of its own; main thread), the compile and load run with a handler that
    raises :class:`~flintc.errors.Terminated`, and once the clean-up has run the
    signal is delivered again with the default action, so the process still ends as
    killed by SIGTERM (exit status 143 in a shell, -15 as a subprocess returncode).
    """
    _check_path(model, "model", "the path of a checkpoint (a BF16 folder or an NVFP4 .gguf)")
    _check_path(out, "out", "the path of the BUILD folder to write")
    _check_path(hf_config_path, "hf_config_path", "the path of a config.json or its folder")
    _check_path(tokenizer, "tokenizer", "the path of a tokenizer folder or tokenizer.json")
    _check_str(device, "--device (device=)", "cpu or cuda[:N]")
    _check_str(backend, "--backend (backend=)", "auto, torch or triton")
    check, dump = _check_flag(check, "check"), _check_flag(dump, "dump")
    progress = _check_flag(progress, "progress")
    schedule = {"fold_attention_combine": _check_flag(fold_attention_combine, "fold_attention_combine"),
                "split_lm_head_norm": _check_flag(split_lm_head_norm, "split_lm_head_norm")}
    with _keyword_wording():
        return _compile(model, out, hf_config_path, tokenizer, load_format, config, fmt, max_batch, max_model_len,
                        prefill_chunk, backend, device, check, dump, progress, schedule)


def _compile(model, out, hf_config_path, tokenizer, load_format, config, fmt, max_batch, max_model_len,
             prefill_chunk, backend, device, check, dump, progress, schedule) -> CompiledModel:
    from flintc.checkpoint.default import load_checkpoint_or_default
    from flintc.checkpoint.loader import check_load_format
    from flintc.runtime.build import BuildOptions, compile_model
    from flintc.runtime.compiled import check_environment, load_build
    from flintc.runtime.device import prepare_device

    load_format = "auto" if load_format is None else load_format  # as flintc.load takes None
    check_load_format(load_format)  # before the embedded default checkpoint is written
    if out is not None and str(out) == "":
        raise InputError("out must not be empty: expected the path of the BUILD folder to write (or None for "
                         "a temporary one)")
    given_tokenizer = _tokenizer(tokenizer, None)  # a bad one: before the compile writes `out` (and
    # one that does not fit the model, `check_fits_model`, once its config is read)
    if fmt not in ("bf16", "nvfp4"):
        raise InputError(f"compile: fmt must be 'bf16' or 'nvfp4', got {fmt!r}")
    if load_format != "dummy" and (fmt != "bf16" or config is not None):
        raise InputError("compile: fmt and config choose the random weights of load_format='dummy'; "
                         "a checkpoint has its own format and config.json")
    prepare_device(device)  # a CPU run uses Triton's interpreter: set before triton loads
    check_environment("torch" if backend == "auto" and device == "cpu" else backend)  # before the compile
    if out is not None:  # before the checkpoint is read (compile_model checks again, the default one too)
        from flintc.runtime.build import check_build_out

        check_build_out(out, (("model", model), ("--tokenizer", tokenizer), ("--hf-config-path", hf_config_path)))
    with _sigterm_after_cleanup() as cleanups:
        ckpt = load_checkpoint_or_default(model, hf_config_path=hf_config_path, device=device,
                                          load_format=load_format, config=config, fmt=fmt, progress=progress)
        tmp = None
        if out is None:
            tmp = new_temp_build_dir()  # (and removes those a killed process left)
            cleanups.append(lambda: remove_temp_build_dir(tmp))
            out = tmp / "build"
        out = Path(out)
        opts = BuildOptions(max_batch=max_batch, max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                            backend=backend, device=device, check=check, dump=dump, **schedule)
        tokenizer = given_tokenizer or _tokenizer(None, ckpt.tokenizer_dir)
        if tokenizer is not None:  # ids the model has no row for: before the compile, as flintc.load
            tokenizer.check_fits_model(ckpt.config.vocab_size, ckpt.config.source)
        compile_model(ckpt, out, opts, progress=progress, log=lambda *a: None)
        runner = load_build(out, ckpt=ckpt, device=device, progress=progress)
    if tmp is not None:
        atexit.register(remove_temp_build_dir, tmp)
    return CompiledModel(runner, tokenizer)


@contextlib.contextmanager
def _sigterm_after_cleanup():
    """A block whose clean-up runs on SIGTERM too: yields a list of clean-up callables,
    run (last first) when the block raises. Where SIGTERM has its default action and
    this is the main thread, SIGTERM raises Terminated during the block; after the
    clean-ups the default action is restored and the signal sent again, so the process
    ends as it would have without flintc (killed by SIGTERM), never by Terminated's
    KeyboardInterrupt. A SIGTERM whose Terminated Python dropped (raised inside a
    __del__ or a weakref callback) is sent again (`flintc.errors.install_signal_redelivery`,
    for the block), so the block still stops at the next bytecode and cleans up; a
    compile ran to its end there and left a complete BUILD (most likely what a CI run of
    session 36 saw); should the block end first, the clean-ups and the signal follow then.
    Elsewhere (a handler of the caller's own, SIG_IGN, another thread) SIGTERM is left
    alone and the block only runs its clean-ups on an exception."""
    cleanups: list = []
    received = []

    def handler(signum, frame):
        received.append(signum)
        raise Terminated()

    installed = (threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if installed:
        signal.signal(signal.SIGTERM, handler)
        from flintc.errors import install_signal_redelivery

        previous_hook = install_signal_redelivery()
    failed = False
    try:
        yield cleanups
    except BaseException:
        failed = True
        for cleanup in reversed(cleanups):
            cleanup()
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sys.unraisablehook = previous_hook
            if received:
                if not failed:  # its Terminated was dropped: the block ran to its end
                    for cleanup in reversed(cleanups):
                        cleanup()
                os.kill(os.getpid(), signal.SIGTERM)


def load(build, model=None, *, device: str | None = None, load_format: str | None = None,
         hf_config_path=None, tokenizer=None, progress: bool = False) -> CompiledModel:
    """Load BUILD and the weights it was compiled for (see `load_build`), and the
    tokenizer: `tokenizer`, else found as `flintc run --build` finds it
    (`flintc.serve.server.tokenizer_dir`: beside `hf_config_path` or `model`, in BUILD,
    then where its build.json records it), else None (token ids only).

    Raises:
        InputError / CheckpointError: as `load_build` (a `load_format` other than "auto",
            "dummy" or None first); a tokenizer that does not load (its file named).
        CheckpointError: a tokenizer with ids the model has no row for (ids of its
            vocab_size or more), naming its file and the build's build.json.
        InputError: `progress` not True or False (a NumPy bool is taken), first.
    """
    _check_path(build, "build", "the path of a BUILD folder", none_ok=False)
    _check_path(model, "model", "the path of a checkpoint (a BF16 folder or an NVFP4 .gguf)")
    _check_path(hf_config_path, "hf_config_path", "the path of a config.json or its folder")
    _check_path(tokenizer, "tokenizer", "the path of a tokenizer folder or tokenizer.json")
    if device is not None:
        _check_str(device, "--device (device=)", "cpu or cuda[:N], or None for the build's")
    progress = _check_flag(progress, "progress")
    with _keyword_wording():
        return _load(build, model, device, load_format, hf_config_path, tokenizer, progress)


def _load(build, model, device, load_format, hf_config_path, tokenizer, progress) -> CompiledModel:
    from types import SimpleNamespace

    from flintc.runtime.compiled import check_build_load_format, load_build, read_manifest
    from flintc.runtime.device import prepare_device
    from flintc.serve.server import tokenizer_dir

    check_build_load_format(load_format)
    given_tokenizer = _tokenizer(tokenizer, None)
    prepare_device(device or read_manifest(build).get("device", "cpu"))
    runner = load_build(build, model=model, device=device, load_format=load_format,
                        hf_config_path=hf_config_path, progress=progress)
    tokenizer = given_tokenizer
    if tokenizer is None:
        where = SimpleNamespace(tokenizer=None, hf_config_path=hf_config_path, model=model, build=build)
        tokenizer = _tokenizer(None, tokenizer_dir(where, required=False))
    if tokenizer is not None:  # ids the model has no row for: named now, not as a prompt's id later
        tokenizer.check_fits_model(runner.config.vocab_size, runner.config.source)
    return CompiledModel(runner, tokenizer)


def _tokenizer(given, recorded):
    """The tokenizer `given` (its errors raised), else the one in the `recorded` folder
    (the checkpoint's; errors raised too, as the CLI does), else None when that folder
    holds no tokenizer.json: such a build runs on token ids."""
    from flintc.checkpoint.tokenizer import folder_tokenizer, load_tokenizer

    return load_tokenizer(given) if given else folder_tokenizer(recorded)
