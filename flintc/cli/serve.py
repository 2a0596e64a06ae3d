"""`flintc serve`: an OpenAI-compatible HTTP server (like `vllm serve`).

MODEL is a BF16 checkpoint folder or an NVFP4 `.gguf` file (default: the embedded
tiny model), run on the reference backend; `--build BUILD` serves a compiled build
instead. Answers /v1/models, /v1/completions, /v1/chat/completions (streaming
or not), /health, and vLLM's /tokenize, /detokenize, /version and /metrics
(Prometheus). See docs/serve.md.
"""

from __future__ import annotations

import argparse
import sys

from flintc.errors import InputError
from flintc.serve.server import MAX_REQUEST_BYTES


def add_parser(sub) -> None:
    from flintc.cli import HelpFormatter
    from flintc.cli.args import device_name

    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API",
                       description=__doc__.split("\n\n")[1] if __doc__ else None,
                       formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf file (default: the embedded tiny model)")
    p.add_argument("--build", default=None, help="a compiled build folder (compiled runtime) instead of MODEL")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--hf-config-path", default=None,
                   help="folder with config.json (and tokenizer) for a .gguf MODEL")
    p.add_argument("--tokenizer", default=None,
                   help="folder with tokenizer.json and tokenizer_config.json (default: the first that has one "
                        "of --hf-config-path, MODEL's folder, and with --build the BUILD folder, then the "
                        "tokenizer folder and the checkpoint its build.json records)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: with --build, for a build compiled with --load-format dummy: make its random "
                        "weights on the device again (as flintc run --build BUILD --load-format dummy)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must name (default: MODEL as given)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence, prompt + output (default: the model's maximum)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoded together (KV-cache slots; default: 8, or the build's with --build, "
                        "at most the build's)")
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu or cuda (default: cpu; with --build, the device it was compiled for)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls from replies when tool_choice is \"auto\"")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template to render chats with, a file or the template itself (as vLLM's "
                        "--chat-template), instead of the tokenizer's")
    p.add_argument("--tool-call-parser", choices=("glm47",), default=None,
                   help="the format of the tool calls in replies")
    p.add_argument("--reasoning-parser", choices=("glm47",), default=None,
                   help="put <think>...</think> text into reasoning_content")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave tool definitions out of the prompt when tool_choice is \"none\"")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs' tokens as \"token_id:{id}\" unless a request sets return_tokens_as_token_ids "
                        "(vLLM's flag)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                   help="reuse a finished request's KV cache for a prompt that starts with its tokens (vLLM's "
                        "automatic prefix caching: multi-turn chat skips the earlier turns' prefill); off by "
                        "default: results then differ from a whole-prompt prefill's in the last bits "
                        "(docs/serve.md)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="the order waiting requests get a free slot in (vLLM's flag): fcfs, first come first "
                        "served (a request's priority must be 0); priority, by the requests' priority (lower "
                        "first), then arrival. Running requests are never preempted")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details.cached_tokens (the prompt tokens prefix caching "
                        "skipped, when any) to responses (vLLM's flag)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="largest request body, in bytes: a larger one is answered 413 before it is parsed (0: no "
                        "cap; default: 32 MiB)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    p.set_defaults(func=run_serve)


def chat_template_arg(value: str) -> tuple[str, str]:
    """--chat-template's (source, where): the file's text when `value` is a file, else
    `value` itself when it holds Jinja markup (``{{``, ``{%`` or ``{#``), as vLLM's
    ``load_chat_template`` reads it.

    Raises:
        InputError: neither (a path that does not exist, most likely), or a file that is
            not UTF-8 text.
    """
    from pathlib import Path

    path = Path(value)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError:  # a template too long for a file name
        is_file = is_dir = False
    if is_file:
        try:
            return path.read_text("utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--chat-template {value}: cannot read the file ({exc})") from None
    if any(mark in value for mark in ("{{", "{%", "{#")):
        return value, "--chat-template"
    if is_dir:
        raise InputError(f"--chat-template {value}: is a folder; expected a Jinja template file (or the "
                         f"template itself)")
    raise InputError(f"--chat-template {value}: no such file, and not a Jinja template either (no {{{{ or {{% "
                     f"in it)")


# what `flintc serve` imports beyond flintc's core, in this order
SERVING_STACK = ("fastapi", "uvicorn", "prometheus_client")


def _import_serving_stack() -> None:
    """Import what `flintc serve` needs beyond flintc's core (FastAPI, uvicorn,
    prometheus_client: dependencies in pyproject.toml, missing from an install made
    with --no-deps or a hand-assembled environment).

    Raises:
        InputError: naming the missing module and the pip command.
    """
    import importlib

    for name in SERVING_STACK:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise InputError(f"flintc serve needs {name}, which does not import ({exc}); it is one of "
                             f"flintc's dependencies: pip install {' '.join(SERVING_STACK)} (or "
                             f"reinstall flintc without --no-deps)") from None


def run_serve(args: argparse.Namespace) -> int:
    import torch

    from pathlib import Path

    if not args.host.strip():  # socket.bind(("", port)) listens on every interface, silently
        raise InputError("--host must not be empty: expected the address to listen on, e.g. 127.0.0.1 (the "
                         "default) or 0.0.0.0 for every interface")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0..65535 (0 picks a free port), got {args.port}")
    if args.max_batch is not None and args.max_batch < 1:
        raise InputError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.model is not None and not Path(args.model).exists():
        raise InputError(f"MODEL {args.model}: no such checkpoint file or folder")
    for flag, value in (("--build", args.build), ("--hf-config-path", args.hf_config_path),
                        ("--tokenizer", args.tokenizer)):
        if value is not None and not Path(value).exists():
            raise InputError(f"{flag} {value}: no such file or folder")
    if args.build is not None:
        from flintc.runtime.compiled import check_weight_kind, read_manifest, recorded_weight_source

        manifest = read_manifest(args.build)
        # dummy weights for a dummy build only (and a checkpoint for a checkpoint's build)
        check_weight_kind(args.build, manifest, args.load_format, args.model)
        if args.model is None and args.load_format != "dummy":
            # the checkpoint build.json records must still be there (the tokenizer is looked
            # for beside it too): else say so, naming build.json, not "no tokenizer found"
            recorded_weight_source(args.build, manifest)
    elif args.load_format == "dummy":
        raise InputError("--load-format dummy applies only with --build (a build compiled with --load-format "
                         "dummy); to serve random weights, compile them first: flintc compile --load-format "
                         "dummy --config tiny --out BUILD, then flintc serve --build BUILD --load-format dummy")
    if args.max_request_bytes < 0:
        raise InputError(f"--max-request-bytes must be 0 (no cap) or more, got {args.max_request_bytes}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise InputError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if args.api_key is not None and not args.api_key.strip():
        # an empty key would let `Authorization: Bearer ` (no key at all) through
        raise InputError("--api-key must not be empty: leave it out to serve without a key")
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable()
                                         and args.api_key == args.api_key.strip()):
        # an HTTP header carries the key: the server reads its bytes as Latin-1 and strips the
        # spaces around it, so such a key answered every request 401
        raise InputError("--api-key must be printable ASCII without spaces around it: clients send it in the "
                         "header 'Authorization: Bearer KEY', which carries no other key")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise InputError("--served-model-name must not be empty: leave it out for MODEL as given")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InputError("--enable-auto-tool-choice needs --tool-call-parser glm47")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {args.device}: no CUDA GPU is available (--device cpu runs on the CPU)")
    _import_serving_stack()  # after the argument checks, which need none of it
    from flintc.checkpoint.tokenizer import load_tokenizer
    from flintc.serve.app import ServeOptions, create_app
    from flintc.serve.engine import Engine
    from flintc.serve.server import bind, host_port, make_runner, serve, served_model_name, tokenizer_dir

    options = ServeOptions(model_name=served_model_name(args), api_key=args.api_key,
                           enable_auto_tool_choice=args.enable_auto_tool_choice,
                           tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                           exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                           max_request_bytes=args.max_request_bytes,
                           return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                           enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    tokenizer = load_tokenizer(tokenizer_dir(args))
    if args.chat_template is not None:
        tokenizer.set_chat_template(*chat_template_arg(args.chat_template))
    tokenizer.check_chat_template()  # a malformed one: before the port is bound and the weights load
    sock = bind(args.host, args.port)  # fail fast on a busy port, before loading weights
    # ids the model has no row for: from its config, before the weights load (and again
    # by the Engine, against the config the runner loaded: the same vocab_size, a check
    # that no longer walks the vocabulary, `check_fits_model` having found its top id)
    runner = make_runner(args, check_vocab=tokenizer.check_fits_model)
    engine = Engine(runner, tokenizer, enable_prefix_caching=args.enable_prefix_caching,
                    scheduling_policy=args.scheduling_policy)
    app = create_app(engine, tokenizer, options)
    host, port = sock.getsockname()[:2]
    print(f"flintc serve: '{options.model_name}' on http://{host_port(host, port)}/v1 "
          f"(max batch {runner.max_batch}, max model len {runner.max_model_len})", file=sys.stderr, flush=True)
    serve(app, sock, log_level=args.log_level)
    return 0
