"""Loading a model for `flintc serve` and running the HTTP server.

:func:`make_runner` picks the backend: the compiled runtime for ``--build BUILD``
(:mod:`flintc.runtime.compiled`, when it exists), else the eager reference model
(:class:`~flintc.runtime.runner.ReferenceRunner`) over MODEL, or over the embedded
tiny default when MODEL is omitted. :func:`serve` binds the socket first (so a
busy port is a one-line error, not a uvicorn exit), then runs uvicorn on it.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from flintc.errors import FlintcError, InputError

# --max-request-bytes' default, a common proxy default (5M token ids as JSON are ~35 MB);
# here, not in app.py, so that the CLI's parser does not import FastAPI
MAX_REQUEST_BYTES = 32 * 2**20


def make_runner(args: argparse.Namespace, check_vocab=None):
    """-> a ModelRunner for the parsed `flintc serve` arguments (``model``, ``build``,
    ``hf_config_path``, ``max_batch``, ``max_model_len``, ``device``, ``load_format``:
    "dummy" makes the dummy weights of a build compiled with them). `check_vocab`, if
    given, is called with the model's vocab_size and where it was read (the build's
    build.json, or config.json) before any weight loads (`flintc serve` pairs the
    tokenizer with it: `FlintTokenizer.check_fits_model`).

    Raises:
        FlintcError: ``--build`` given but the compiled runtime is not available.
        InputError: ``--max-model-len`` / ``--max-batch`` above the build's
            (:func:`flintc.runtime.compiled.limit_build`); without a build,
            ``--max-model-len`` above the model's max_position_embeddings, or KV caches
            the CPU has not the memory for (`_check_caches_fit`).
        CheckpointError / ConfigError: the checkpoint cannot be loaded.
    """
    import torch

    device = torch.device(getattr(args, "device", "cpu") or "cpu")
    if args.build is not None:
        try:
            from flintc.runtime import compiled
        except ImportError as exc:
            raise FlintcError(f"--build {args.build}: the compiled runtime is not available yet "
                              f"(cannot import flintc.runtime.compiled: {exc}); serve a checkpoint "
                              f"(MODEL) on the reference backend instead") from None
        # a --max-model-len / --max-batch the build cannot meet: before the weights load
        manifest = compiled.read_manifest(args.build)
        compiled.check_build_limits(args.build, manifest, max_model_len=args.max_model_len, max_batch=args.max_batch)
        build_config = manifest.get("config")
        vocab_size = build_config.get("vocab_size") if isinstance(build_config, dict) else None
        if check_vocab is not None and isinstance(vocab_size, int):
            check_vocab(vocab_size, str(Path(args.build) / "build.json"))
        dummy = getattr(args, "load_format", None) == "dummy"
        runner = compiled.load_build(args.build, model=args.model, hf_config_path=args.hf_config_path,
                                     device=getattr(args, "device", None), load_format="dummy" if dummy else None,
                                     progress=sys.stderr.isatty())
        # The build fixes the decode buckets and the cache length; a smaller request limits
        # the scheduler, a larger one cannot be met.
        compiled.limit_build(runner, args.build, max_model_len=args.max_model_len, max_batch=args.max_batch)
        return runner
    from flintc.checkpoint.default import load_checkpoint_or_default
    from flintc.model.reference import FlintModel
    from flintc.runtime.runner import ReferenceRunner

    check_config = None if check_vocab is None else lambda config: check_vocab(config.vocab_size, config.source)
    ckpt = load_checkpoint_or_default(args.model, hf_config_path=args.hf_config_path, device=device,
                                      progress=sys.stderr.isatty(), check_config=check_config)
    max_batch = args.max_batch or 8
    limit = ckpt.config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        # it was cut to max_position_embeddings silently (as a build's compile refuses it)
        raise InputError(f"--max-model-len {args.max_model_len}: more than the model's max_position_embeddings "
                         f"({limit}); drop the flag for {limit}, or give a smaller one")
    _check_caches_fit(ckpt.config, max_batch, args.max_model_len or limit, device)  # before the RoPE tables
    # RoPE tables for the positions served (vLLM sizes by max_model_len), not always limit
    model = FlintModel(ckpt.config, ckpt.weights, max_positions=args.max_model_len)
    return ReferenceRunner(model, max_batch=max_batch, max_model_len=args.max_model_len)


def _check_caches_fit(config, max_batch: int, max_model_len: int, device, itemsize: int = 2) -> None:
    """Refuse KV caches (`FlintModel.new_kv_cache` of `max_batch` slots, `max_model_len`
    rows per full-attention layer, W per sliding one, `itemsize` bytes a value: bf16;
    sized by `flintc.model.reference.kv_cache_bytes`, from the shapes the allocation
    uses) that the CPU has not the memory for, before allocating them: `--max-batch 100000`
    was a bare "can't allocate memory" RuntimeError. Nothing is checked on another
    device or when the available memory cannot be read
    (`flintc.runtime.device.available_memory_bytes`). When the sliding layers' rings
    alone take half the memory or more, the advice is a smaller --max-batch only: a
    ring is sliding_window rows at any --max-model-len (the same 3814.7 GiB were
    refused at --max-model-len 64 and 4096 with "give a smaller --max-model-len").

    Raises:
        InputError: naming --max-batch, --max-model-len, the caches' size and the memory
            available, in GiB.
    """
    import torch

    from flintc.model.reference import kv_cache_bytes
    from flintc.runtime.device import available_memory_bytes

    if torch.device(device).type != "cpu":
        return
    c = config
    need = kv_cache_bytes(c, max_batch, max_model_len, itemsize)
    avail = available_memory_bytes()
    if avail is not None and need > avail:
        advice = "give a smaller --max-batch or --max-model-len"
        rings = kv_cache_bytes(c, max_batch, max_model_len, itemsize, sliding_only=True)  # at any --max-model-len
        if rings > avail / 2:  # a shorter --max-model-len cannot make enough room
            num_sliding = sum(map(c.is_sliding_layer, range(c.num_hidden_layers)))
            advice = (f"the {num_sliding} sliding layers' rings ({c.sliding_window} rows each, sliding_window, "
                      f"at any --max-model-len) take {rings / 2**30:.1f} GiB of it: give a smaller "
                      "--max-batch")
        raise InputError(f"--max-batch {max_batch} x --max-model-len {max_model_len}: the KV caches would take "
                         f"{need / 2**30:.1f} GiB, but only {avail / 2**30:.1f} GiB of memory is available; "
                         f"{advice}")


def model_path(args: argparse.Namespace) -> Path:
    """MODEL, or the embedded default checkpoint (made on first use)."""
    if args.model is not None:
        return Path(args.model)
    from flintc.checkpoint.default import default_checkpoint

    return default_checkpoint()


def given_tokenizer_dir(path, flag: str = "--tokenizer") -> Path:
    """The folder of a tokenizer the user named (`path` the folder, or a file in it).

    Raises:
        InputError: that folder holds no tokenizer.json (the message names `flag`).
    """
    p = Path(path)
    p = p.parent if p.is_file() else p
    if not (p / "tokenizer.json").is_file():
        raise InputError(f"{flag} {path}: no tokenizer.json there")
    return p


def tokenizer_dir(args: argparse.Namespace, required: bool = True) -> Path | None:
    """Where the tokenizer is (a folder holding tokenizer.json), for `flintc serve` and
    `flintc run --build` (``tokenizer``, ``hf_config_path``, ``model``, ``build``): the
    first of --tokenizer, --hf-config-path, MODEL's folder (MODEL itself when it is a
    folder; without --build and MODEL, the embedded default model's), and with --build
    the BUILD folder, then where its build.json says the tokenizer was at compile time
    (`flintc.runtime.compiled.recorded_tokenizer_places`: the tokenizer folder it records,
    then beside the checkpoint it records). So a MODEL given with --build is looked
    beside first, then the checkpoint the build was compiled from.

    -> the folder, or None when none holds tokenizer.json and not `required`.

    Raises:
        InputError: --tokenizer holds no tokenizer.json; or `required` and none of the
            places does: the message names each place looked in.
    """
    if args.tokenizer is not None:
        return given_tokenizer_dir(args.tokenizer)
    places: list[tuple[Path, str]] = []
    if args.hf_config_path is not None:
        places.append((Path(args.hf_config_path), "--hf-config-path"))
    if args.model is not None or args.build is None:
        m = model_path(args)
        places.append((m if m.is_dir() else m.parent, "MODEL" if args.model is not None else "the default model"))
    recorded = []
    if args.build is not None:
        from flintc.runtime.compiled import read_manifest, recorded_tokenizer_places

        places.append((Path(args.build), "--build"))
        recorded = recorded_tokenizer_places(args.build, read_manifest(args.build))
        places += recorded
    folders = [(p.parent if p.is_file() else p, what) for p, what in places]
    for folder, _ in folders:
        if (folder / "tokenizer.json").is_file():
            return folder
    if not required:
        return None
    looked = ", ".join(f"{folder} ({what})" for folder, what in folders)
    if args.build is not None and not recorded:
        looked += f"; {Path(args.build) / 'build.json'} records no tokenizer folder"
    raise InputError(f"no tokenizer found: no tokenizer.json in {looked}; pass --tokenizer DIR (a folder with "
                     "tokenizer.json and tokenizer_config.json)")


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.build is not None:
        return str(args.build)
    return str(args.model) if args.model is not None else "flint-tiny-default"


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets (``[::1]:8000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port).

    Raises:
        OSError: the address is taken or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host_port(host, port)}: {exc.strerror}") from None
    sock.listen(128)
    return sock


def uvicorn_server(config):
    """A ``uvicorn.Server`` for ``config`` whose shutdown (Ctrl-C, SIGTERM) first calls
    the app's ``app.state.abort_in_flight()`` (:func:`flintc.serve.app.create_app`):
    in-flight requests are aborted in the engine and answered (a non-streamed one a
    JSON 503, a stream an error event and ``[DONE]``), so uvicorn's graceful shutdown
    finds them done instead of cancelling them after its timeout (a CancelledError
    traceback, a text/plain 500, streams cut)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            state = getattr(config.app, "state", None)
            abort = getattr(state, "abort_in_flight", None) if state is not None else None
            if abort is not None:
                abort()
            await super().shutdown(sockets)

    return _Server(config)


def serve(app, sock: socket.socket, log_level: str = "info") -> None:
    """Run uvicorn with ``app`` on the bound ``sock`` until interrupted."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn_server(config).run(sockets=[sock])
