"""flintc.errors.listing: the one way an error message lists the first few of many
items and how many more ("a, b, c (and 2 more)")."""

from __future__ import annotations

import pytest

from flintc.errors import listing


@pytest.mark.parametrize("items, expected", [
    ([], ""),
    (["a"], "a"),
    (["a", "b", "c"], "a, b, c"),  # exactly the limit: no tail
    (["a", "b", "c", "d"], "a, b, c (and 1 more)"),
    (["a", "b", "c", "d", "e", "f"], "a, b, c (and 3 more)"),
])
def test_listing_with_a_limit_of_three(items, expected):
    assert listing(items, 3) == expected
    assert listing(tuple(items), 3) == expected and listing(iter(items), 3) == expected


def test_listing_separator_tail_and_limits():
    """The separator and the tail's words are the caller's (the checkpoint checks join with
    "; ", `flintc bench` writes " and N more" and "N more points skipped"); items are
    str()-ed; a limit of 0 lists none, only how many; a negative limit is refused."""
    assert listing(["x: bad", "y: bad"], 1, "; ") == "x: bad (and 1 more)"
    assert listing(["a", "b", "c"], 2, more=" and {} more") == "a, b and 1 more"
    assert listing(["a", "b", "c", "d"], 3, "; ", "; {} more points skipped") == "a; b; c; 1 more points skipped"
    assert listing([1, 2.5, None], 5) == "1, 2.5, None"
    assert listing(["a", "b"], 0) == " (and 2 more)" and listing([], 0) == ""
    with pytest.raises(ValueError, match="limit must be 0 or more, got -1"):
        listing(["a"], -1)
