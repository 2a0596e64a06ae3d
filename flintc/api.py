"""The Python API: `flintc.compile(...)` and `flintc.load(BUILD)`.

    import flintc
    m = flintc.compile("ckpt-nvfp4/model-nvfp4.gguf", out="build", device="cpu")
    r = m.generate(["The quick brown fox"], max_tokens=16, temperature=0)
    print(r.texts[0])

`examples/compiled_generate.py` runs this end to end.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flintc.errors import InputError
from flintc.model.generate import GenerationResult
from flintc.sampling import SamplingParams


@dataclass
class CompiledGeneration(GenerationResult):
    """GenerationResult plus the decoded texts (None without a tokenizer)."""

    texts: list[str] | None = None
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
            prompts: one prompt or a list of up to max_batch prompts.
            params: SamplingParams (one or one per prompt); or keyword arguments of
                SamplingParams (temperature=0, max_tokens=16, seed=1, ...).
            on_token: called as on_token(prompt_index, token_id).

        Raises:
            InputError: text prompts without a tokenizer, no prompts or too many, bad
                ids, or invalid sampling values.
        """
        from flintc.runtime.generate import generate_with_runner

        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise InputError("text prompts need a tokenizer; pass token ids or tokenizer=DIR")
                ids.append(self.tokenizer.encode(p))
            else:
                ids.append([int(t) for t in p])
        if params is None:
            params = SamplingParams(**sampling)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        r = generate_with_runner(self.runner, ids, params, eos_token_id=eos, on_token=on_token,
                                 return_prompt_logits=return_prompt_logits)
        out = CompiledGeneration(**r.__dict__)
        if self.tokenizer is not None:
            out.texts = [self.tokenizer.decode(o) for o in r.output_ids]
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                slot: int = 0) -> torch.Tensor:
        """Logits of a token sequence of one sequence slot, through the generated prefill
        (T > 1) or decode (T == 1) function. input_ids: int64 [T] or [1, T]; positions
        default 0..T-1. Writes the slot's KV cache. -> fp32 [T, V].

        Raises:
            ValueError: no token ids, or an id outside the vocabulary [0, vocab_size).
        """
        ids = torch.as_tensor(input_ids).reshape(-1).tolist()
        vocab = self.runner.config.vocab_size
        if not ids:
            raise ValueError("forward needs at least one token id")
        for t in ids:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {vocab}) of {self.build}")
        start = 0 if positions is None else int(torch.as_tensor(positions).reshape(-1)[0])
        if len(ids) == 1:
            return self.runner.decode([slot], ids, [start])
        return self.runner.prefill(slot, ids, start, all_logits=True)


def compile(model=None, out=None, *, hf_config_path=None, tokenizer=None, load_format: str = "auto",
            config: str | None = None, fmt: str = "bf16", max_batch: int = 8,
            max_model_len: int | None = None, prefill_chunk: int | None = None,
            backend: str = "auto", device: str = "cpu", check: bool = True, dump: bool = True,
            progress: bool = False) -> CompiledModel:
    """Compile `model` (a BF16 folder or NVFP4 .gguf; None: the embedded default tiny
    model) into BUILD `out` (None: a new temporary folder) and load it.

    Other arguments as `flintc compile` (see `flintc.runtime.build.BuildOptions`).
    Raises InputError / CheckpointError / PassCheckError as `flintc compile`; InputError
    also for an empty `out` (`Path("")` is the current folder) and a malformed FLINTC_*
    variable (`flintc.runtime.compiled.check_environment`), before compiling.
    """
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.runtime.build import BuildOptions, compile_model
    from flintc.runtime.compiled import check_environment, load_build
    from flintc.runtime.device import prepare_device

    if out is not None and str(out) == "":
        raise InputError("out must not be empty: expected the path of the BUILD folder to write (or None for "
                         "a temporary one)")
    prepare_device(device)  # a CPU run uses Triton's interpreter: set before triton loads
    check_environment("torch" if backend == "auto" and device == "cpu" else backend)  # before the compile
    if model is None and load_format != "dummy":
        from flintc.checkpoint.default import default_checkpoint

        model = default_checkpoint()
    ckpt = load_checkpoint(model, hf_config_path=hf_config_path, device=device, load_format=load_format,
                           config=config, fmt=fmt, progress=progress)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="flintc-build-")) / "build"
    opts = BuildOptions(max_batch=max_batch, max_model_len=max_model_len, prefill_chunk=prefill_chunk,
                        backend=backend, device=device, check=check, dump=dump)
    compile_model(ckpt, out, opts, progress=progress, log=lambda *a: None)
    runner = load_build(out, ckpt=ckpt, device=device, progress=progress)
    return CompiledModel(runner, _tokenizer(tokenizer or ckpt.tokenizer_dir))


def load(build, model=None, *, device: str | None = None, load_format: str | None = None,
         hf_config_path=None, tokenizer=None, progress: bool = False) -> CompiledModel:
    """Load BUILD and the weights it was compiled for (see `load_build`)."""
    from flintc.runtime.compiled import load_build, read_manifest
    from flintc.runtime.device import prepare_device

    prepare_device(device or read_manifest(build).get("device", "cpu"))
    runner = load_build(build, model=model, device=device, load_format=load_format,
                        hf_config_path=hf_config_path, progress=progress)
    return CompiledModel(runner, _tokenizer(tokenizer or runner.tokenizer_dir))


def _tokenizer(folder):
    if not folder:
        return None
    from flintc.checkpoint.tokenizer import load_tokenizer

    try:
        return load_tokenizer(folder)
    except Exception:  # noqa: BLE001 - a build without a usable tokenizer still runs on ids
        return None
