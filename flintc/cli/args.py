"""Argument types and checks shared by the CLI commands. The argparse `type=` callables
only parse (text that is no number is argparse's error, after its usage block, except
--buckets's, which `check_option_values` reports); what is checked beyond that is
`check_option_values`'s, one line `flintc: error: ...`."""

from __future__ import annotations

import argparse
import re

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a 64-bit integer


def seed(text: str) -> int:
    """A random seed as an integer; its range, [0, 2**63) (`torch.Generator.manual_seed`'s,
    the one `flintc run --seed` checks too), is checked by `check_option_values`. Raises
    argparse.ArgumentTypeError for text that is not an integer."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text!r}") from None


def device_name(text: str) -> str:
    """A --device value as given (cpu, cuda or cuda:N; checked where it is used:
    `torch_device`, `flintc.runtime.device.prepare_device`); an empty one is refused by
    `check_option_values` (it used to mean the default device: an unset shell variable,
    most often)."""
    return text


BUCKETS_EXPECTED = "comma-separated decode batch sizes, e.g. 1,8"


class Buckets(tuple):
    """The sizes `buckets` parsed, with `text`: what was typed, which the errors echo
    (also `BuildOptions.resolve`'s, given this as decode_buckets)."""

    text: str = ""


def buckets(text: str) -> Buckets:
    """--buckets: comma-separated decode batch sizes, '1,8' -> (1, 8); '' -> (); an empty
    item is None ('1,,2' -> (1, None, 2)); an item that is not an integer is kept as its
    text ('1,x' -> (1, 'x')). An empty value, an empty item, an item that is not an
    integer and a size given twice are refused by `check_option_values` (one line
    echoing what was typed, not argparse's usage block); the sizes themselves (each >= 1,
    the largest --max-batch) are checked with --max-batch
    (`flintc.runtime.build.BuildOptions.resolve`)."""
    def item(b: str):
        try:
            return int(b) if b.strip() else None
        except ValueError:
            return b.strip()

    sizes = Buckets(item(b) for b in text.split(",")) if text.strip() else Buckets()
    sizes.text = text
    return sizes


def check_option_values(args: argparse.Namespace) -> None:
    """The checks of values argparse parsed (`seed`, `device_name`, `buckets`) beyond
    their parsing, for any sub-command that has the option, before any work: argparse
    would print its usage block before a `type=` function's message; these are one line,
    `flintc: error: ...`, as every other flintc value check. `flintc.cli.main` calls it.

    Raises:
        InputError: a --seed outside [0, 2**63); an empty --device or --buckets (they used
            to mean the default; --buckets ' ' is echoed as typed); an empty --buckets item ('1,,2': argparse's usage
            block), or one that is not an integer; a --buckets size given twice (it was
            dropped silently).
    """
    from flintc.errors import InputError

    value = getattr(args, "seed", None)
    if isinstance(value, int) and not 0 <= value < SEED_LIMIT:
        raise InputError(f"--seed {value}: expected an integer in [0, 2**63)")
    value = getattr(args, "device", None)
    if isinstance(value, str) and not value.strip():
        raise InputError(f"--device {value!r}: must not be empty: expected cpu or cuda (or cuda:N); leave --device "
                         "out for the default")
    value = getattr(args, "buckets", None)
    if value is not None:
        # what was typed (' , ' was shown as ','); for a plain tuple (the Python API), its items
        text = value.text if isinstance(value, Buckets) else ",".join("" if b is None else str(b) for b in value)
        if not value:
            raise InputError(f"--buckets {text!r}: must not be empty: expected {BUCKETS_EXPECTED}; leave --buckets "
                             "out for 1,2,4,8 up to --max-batch")
        if None in value:  # '1,,2', '1,': a typo, not a size
            raise InputError(f"--buckets {text!r}: item {value.index(None) + 1} is empty; expected "
                             f"{BUCKETS_EXPECTED}")
        bad = next((b for b in value if isinstance(b, str)), None)
        if bad is not None:  # it was argparse's usage block and "invalid buckets value"
            raise InputError(f"--buckets {text!r}: {bad!r} is not an integer; expected {BUCKETS_EXPECTED}")
        twice = sorted({b for b in value if value.count(b) > 1})
        if twice:  # they were dropped silently
            raise InputError(f"--buckets {text!r}: {', '.join(map(str, twice))} given twice; expected "
                             f"{BUCKETS_EXPECTED}, each size once")


def torch_device(text: str, flag: str = "--device"):
    """`text` as a torch.device, which must be the CPU or an available CUDA GPU.

    Raises:
        InputError: not a device torch knows (e.g. "bogus"), another device type, or CUDA
            on a machine without a usable GPU (the message names `flag`).
    """
    import torch

    from flintc.errors import InputError

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise InputError(f"{flag} {text!r}: expected cpu or cuda (or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{flag} {text}: expected cpu or cuda (or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{flag} {text}: no CUDA GPU is available (--device cpu runs on the CPU)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"{flag} {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


# Options whose value may start with "-" and a digit and not be one plain number: a list
# of integers ("--prompt-ids -1,2") or a token id and a bias ("--logit-bias -1=1"), which
# argparse takes for an option, saying the option "expected one argument".
INT_LIST_OPTIONS = ("--prompt-ids", "--logit-bias")
_NEGATIVE_VALUE = re.compile(r"-\d")


def join_int_list_values(argv: list[str]) -> list[str]:
    """`argv` with `OPTION -1,2` written `OPTION=-1,2` (`--logit-bias -1=1` written
    `--logit-bias=-1=1`) for the INT_LIST_OPTIONS (up to a `--`), so that such a value
    reaches the option's own check, which names the option and says what is wrong (a
    negative token id), instead of argparse's "expected one argument"."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] in INT_LIST_OPTIONS and i + 1 < len(argv) and _NEGATIVE_VALUE.match(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out
