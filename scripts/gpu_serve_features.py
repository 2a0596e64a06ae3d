"""Time two `flintc serve` features no GPU has timed: prefix caching's time to first token
of a second chat turn, and structured outputs' cost per decode step.

1. Prefix caching (`flintc.serve.engine.Engine(enable_prefix_caching=...)`, `flintc serve
   --enable-prefix-caching`): a first turn (a user message of --turn1-len tokens, through
   the tokenizer's chat template) gets a greedy reply of --reply-len tokens, then the
   second turn's prompt is sent, and its time to first token (`RequestTimeline`:
   `first_token - queued`, the engine's own stamps, in ms) is taken, median of --repeats
   (each repeat a new first turn; one untimed warm-up pair first). Two second turns:
   "chat template" (the conversation rendered again, first turn + reply + a new user
   message of --turn2-len tokens: GLM's template re-renders the reply with
   `<think></think>` before it, so only the first turn's prompt is reused: with the ring
   rows saved after its prefill where the reply ran past the sliding window) and
   "continuation" (the first turn's ids + the reply's ids + the new message's: everything
   but the reply's last token is reused). Off, the whole prompt is prefilled; the
   "cached" column is the tokens the prefill skipped.
2. Structured outputs (`flintc.structured`, llguidance): --steps decode steps at each
   batch of --batches, as the engine's decode step runs them (`runner.decode`, then
   `flintc.sampling.sample` with Flint's default sampling, each row's own seed, the
   token read, each row's grammar fed its token), with no constraint and with a JSON
   schema on every row; wall clock per step, median (after --warmup steps). A grammar
   that completes is started again (a new matcher; not counted). Then the host's mask
   work alone at those states (not inside the step time; the three ways' order reversed
   every other step): every row's mask in one parallel llguidance call
   (`flintc.structured.allowed_words_batch(..., parallel=True)`, what `sample` did for
   two or more constrained rows on a CUDA device until session 45, when an H100 machine
   found it 6x slower than the others at batch 8), all rows into one buffer in this
   thread (`parallel=False`, what `sample` does for two or more constrained rows), and
   row by row (`GrammarMatcher.allowed_words`, what it does for one row).

The model: a build (--build, with --load-format dummy for a dummy build, as `flintc
serve`), or a checkpoint folder (MODEL, the reference runner; the CPU test uses the tiny
checkpoint). The tokenizer is found as `flintc serve` finds it (--tokenizer, MODEL, the
build's records). A dummy build records none: then the project's own tokenizer
(`flintc.checkpoint.tokenizer.write_tokenizer`) of the model's vocab_size is written to a
temporary folder: its ~2,000 BPE tokens (a byte-level BPE on a built-in corpus), the
special tokens, and reserved special tokens up to vocab_size (151,552 at full size). A
grammar's mask then walks ~2,000 tokens, not a real 151k vocabulary's: give a real tokenizer
(--tokenizer) for masks of that cost. Prints Markdown tables (also to --out).

    python3 scripts/gpu_serve_features.py --build gpu_builds/full-nvfp4 --load-format dummy \\
        --out $OUT/serve-features.md
    python3 scripts/gpu_serve_features.py TINY_CHECKPOINT --device cpu --max-model-len 256 \\
        --turn1-len 48 --reply-len 8 --turn2-len 8 --repeats 2 --steps 4 --warmup 1   # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import int_list, markdown_table, write_out  # noqa: E402  (benchmarks/common.py)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
WORDS = ("the quick brown fox jumps over the lazy dog while a small model writes long answers about "
         "serving, caching, grammars and the cost of every step ").split()


def _text(tok, n: int, seed: int) -> str:
    """Text of about `n` tokens: words of WORDS in a seeded order."""
    g = torch.Generator().manual_seed(seed)
    words, ids = [], []
    while len(ids) < n:
        words += [WORDS[i] for i in torch.randint(0, len(WORDS), (16,), generator=g).tolist()]
        ids = tok.encode(" ".join(words))
    return tok.decode(ids[:n])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# ------------------------------------------------------------------------ prefix caching
def _run(engine, prompt: list[int], max_tokens: int):
    """One greedy request through the running engine. -> (its token ids, its GenRequest)."""
    from flintc.sampling import SamplingParams
    from flintc.serve.engine import GenRequest

    done, out, err = threading.Event(), [], []

    def emit(o):
        out.extend(o.token_ids)
        if o.error:
            err.append(o.error)
        if o.finished:
            done.set()

    req = GenRequest(prompt_ids=list(prompt), emit=emit,
                     params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    engine.submit(req)
    if not done.wait(600):
        raise RuntimeError("the engine did not finish a request in 600 s")
    if err:
        raise RuntimeError(f"the engine failed a request: {err[0]}")
    return out, req


def _second_turns(tok, engine, args, seed: int) -> dict[str, list[int]]:
    """Run a first turn; -> the second turn's prompt ids per case."""
    user1, user2 = _text(tok, args.turn1_len, seed), _text(tok, args.turn2_len, seed + 10_000)
    first = tok.apply_chat_template([{"role": "user", "content": user1}], tokenize=True)
    reply, _ = _run(engine, first, args.reply_len)
    chat = tok.apply_chat_template([{"role": "user", "content": user1},
                                    {"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)},
                                    {"role": "user", "content": user2}], tokenize=True)
    # the new message as the template renders a user turn after an assistant turn
    tail = tok.apply_chat_template([{"role": "user", "content": user2}], tokenize=False)
    return {"chat template": chat, "continuation": first + reply + tok.encode(tail)}


def prefix_caching_rows(runner, tok, args) -> list[list[str]]:
    from flintc.serve.engine import Engine

    rows = []
    for case in ("chat template", "continuation"):
        for enable in (False, True):
            engine = Engine(runner, tok, enable_prefix_caching=enable).start()
            try:
                for r in range(args.repeats + 1):  # repeat 0: the warm-up
                    prompt = _second_turns(tok, engine, args, seed=100 * r + (case == "continuation"))[case]
                    _, req = _run(engine, prompt, 1)
                    tl = req.timeline
                    if r == 0:
                        ttft, lens, cached = [], [], []
                        continue
                    ttft.append(tl.first_token - tl.queued)
                    lens.append(len(prompt))
                    cached.append(tl.cached_tokens)
            finally:
                engine.shutdown()
            rows.append([case, "on" if enable else "off", f"{statistics.median(lens):.0f}",
                         f"{statistics.median(cached):.0f}", _ms(statistics.median(ttft))])
    return rows


# ---------------------------------------------------------------------- structured outputs
def structured_rows(runner, tok, args, batches: list[int]) -> list[list[str]]:
    from flintc.sampling import SamplingParams, StructuredOutputsParams, TokenHistory, sample
    from flintc.structured import GrammarMatcher, allowed_words_batch

    spec = StructuredOutputsParams(json=SCHEMA)
    stops = frozenset({tok.eos_token_id})
    prompt = tok.encode(_text(tok, args.prompt_len, 7))
    sync = torch.cuda.synchronize if torch.device(runner.device).type == "cuda" else (lambda: None)
    rows = []
    for B in batches:
        for constrained in (False, True):
            params = [SamplingParams(seed=1000 + b, structured_outputs=spec if constrained else None)
                      for b in range(B)]
            gens = [p.make_generator(runner.device) for p in params]
            outs: list[list[int]] = [[] for _ in range(B)]
            hist = [TokenHistory(prompt, outs[b], stops, grammar=GrammarMatcher(spec, tok, stops))
                    if constrained else None for b in range(B)]
            last, pos = [], []
            for b in range(B):  # the prompt into slot b; its first token
                logits = runner.prefill(b, prompt, 0)[None]
                tok0 = int(sample(logits, params[b:b + 1], gens[b:b + 1], history=hist[b:b + 1])[0])
                outs[b].append(tok0)
                last.append(tok0)
                pos.append(len(prompt))
            step_s, batched_s, serial_s, rowwise_s = [], [], [], []
            for i in range(args.warmup + args.steps):
                for b in range(B):
                    g = hist[b].grammar if constrained else None
                    if g is not None:
                        g.advance(outs[b])
                        if g.finished:  # complete: start the grammar again (the KV cache goes on)
                            outs[b] = []
                            hist[b] = TokenHistory(prompt, outs[b], stops, grammar=GrammarMatcher(spec, tok, stops))
                grammars = [h.grammar for h in hist] if constrained else []
                if constrained and i >= args.warmup:  # the host's mask work alone, outside the step
                    ways = [(batched_s, lambda: allowed_words_batch(grammars, parallel=True)),
                            (serial_s, lambda: allowed_words_batch(grammars, parallel=False)),
                            (rowwise_s, lambda: [g.allowed_words() for g in grammars])]
                    for times, fn in ways[::1 if i % 2 else -1]:  # order reversed every other step
                        t0 = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - t0)
                sync()
                t0 = time.perf_counter()
                logits = runner.decode(list(range(B)), last, pos)
                toks = sample(logits, params, gens, history=hist if constrained else None).tolist()
                for b, t in enumerate(toks):
                    outs[b].append(int(t))
                    if constrained:
                        hist[b].grammar.advance(outs[b])
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    step_s.append(dt)
                last = [int(t) for t in toks]
                pos = [p + 1 for p in pos]
            rows.append([str(B), "JSON schema" if constrained else "none", _ms(statistics.median(step_s)),
                         _ms(statistics.median(batched_s)) if constrained else "-",
                         _ms(statistics.median(serial_s)) if constrained else "-",
                         _ms(statistics.median(rowwise_s)) if constrained else "-"])
    return rows


# --------------------------------------------------------------------------------- main
def _tokenizer(args, runner):
    """The tokenizer as `flintc serve` finds it, else the project's tokenizer of the
    model's vocab_size in a temporary folder.
    -> (FlintTokenizer, where it came from)."""
    from flintc.checkpoint.tokenizer import load_tokenizer
    from flintc.serve.server import tokenizer_dir

    folder = tokenizer_dir(args, required=False)
    if folder is not None:
        return load_tokenizer(folder), str(folder)
    from flintc.checkpoint.tokenizer import write_tokenizer

    n = runner.config.vocab_size
    tmp = tempfile.mkdtemp(prefix="flintc-serve-features-tok-")
    write_tokenizer(tmp, n, model_max_length=runner.max_model_len)
    return load_tokenizer(tmp), f"the project's tokenizer of {n} tokens (written to {tmp})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="a checkpoint folder (reference runner); or --build")
    ap.add_argument("--build", default=None)
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--hf-config-path", default=None)
    ap.add_argument("--device", default=None, help="cuda (default when there is a GPU) or cpu")
    ap.add_argument("--max-batch", type=int, default=None, help="slots (default: the build's; a checkpoint: 8)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--turn1-len", type=int, default=1024, help="tokens of the first user message")
    ap.add_argument("--reply-len", type=int, default=128, help="tokens of the first turn's reply")
    ap.add_argument("--turn2-len", type=int, default=64, help="tokens of the second user message")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of each structured-outputs row")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--skip", choices=("prefix", "structured"), default=None, help="leave one part out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    batches = int_list(ap, "--batches", args.batches, 1, 1024)
    for flag in ("turn1_len", "reply_len", "turn2_len", "repeats", "steps", "prompt_len"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be at least 1")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    from flintc.serve.server import make_runner

    runner = make_runner(args)
    if max(batches) > runner.max_batch:
        ap.error(f"--batches {args.batches}: more than the runner's {runner.max_batch} slots")
    L = runner.max_model_len  # (the chat template's own tokens: a margin of 32)
    if args.skip != "prefix" and args.turn1_len + args.reply_len + args.turn2_len + 32 > L:
        ap.error(f"--turn1-len + --reply-len + --turn2-len (+ 32 for the chat template): more than the "
                 f"runner's max_model_len {L}")
    if args.skip != "structured" and args.prompt_len + args.warmup + args.steps + 1 > L:
        ap.error(f"--prompt-len + --warmup + --steps: more than the runner's max_model_len {L}")
    tok, tok_from = _tokenizer(args, runner)
    tok.check_fits_model(runner.config.vocab_size, runner.config.source)
    what = args.build or args.model
    out = [f"# flintc serve features: {what} on {args.device}"
           + (f" ({torch.cuda.get_device_name()})" if torch.device(args.device).type == "cuda" else ""), "",
           f"tokenizer: {tok_from}", ""]
    with torch.inference_mode():
        if args.skip != "prefix":
            rows = prefix_caching_rows(runner, tok, args)
            out += [f"## Prefix caching: time to first token of a second chat turn (median of {args.repeats}; "
                    f"first turn {args.turn1_len} tokens + reply {args.reply_len} + new message {args.turn2_len})",
                    "", markdown_table(["second turn", "prefix caching", "prompt tokens", "cached tokens",
                                        "TTFT ms"], rows), ""]
        if args.skip != "structured":
            rows = structured_rows(runner, tok, args, batches)
            out += [f"## Structured outputs: decode step (median of {args.steps} after {args.warmup}; "
                    f"prompt {args.prompt_len} tokens; schema {json.dumps(SCHEMA)})", "",
                    markdown_table(["batch", "constraint", "step ms", "host mask ms, one parallel call",
                                    "host mask ms, one buffer in one thread (default)",
                                    "host mask ms, row by row"], rows), ""]
    text = "\n".join(out)
    print(text)
    write_out(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
