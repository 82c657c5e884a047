"""DCP's flattening paths (``Metadata.planner_data``: each key's path of nested keys, which
``dcp_to_torch_save`` rebuilds nesting from) in a format 4 index: a path that is its tensor's
name cut at dots is stored as one of a few patterns (which dots cut, which components are list
indices) and a code per tensor; any other path is kept as it is."""

from __future__ import annotations

import re

import numpy as np

from ..columns import int_column
from ..limits import INT64, FormatViolation


def _pattern(fqn: str, path) -> tuple | None:
    """How DCP's flattening path of ``fqn`` cuts it: ``(cuts, ints)``, ``cuts`` the ordinals of
    the dots that separate components (None: every dot), ``ints`` the components that are list
    indices.  None when the path is not ``fqn`` cut at dots (kept as it is)."""
    if not isinstance(path, (list, tuple)) or not path:
        return None
    try:
        comps, ints = path, ()
        joined = ".".join(path)  # all strings: the usual case, in C
    except TypeError:
        if any(type(p) not in (str, int) for p in path):
            return None
        comps = [str(p) for p in path]
        ints = tuple(k for k, p in enumerate(path) if type(p) is int)
        joined = ".".join(comps)
    if joined != fqn:
        return None
    if len(comps) == fqn.count(".") + 1:
        return None, ints
    cuts, dots = [], -1
    for c in comps[:-1]:
        dots += c.count(".") + 1
        cuts.append(dots)
    return tuple(cuts), ints


def paths_wire(names: list[str], planner_data: dict) -> tuple[dict, dict]:
    """DCP's flattening paths of the index's tensors as a few distinct patterns and one code
    per tensor (-1: none); returns that and the entries it does not cover."""
    at = {n: i for i, n in enumerate(names)}
    patterns: dict[tuple, int] = {}
    code = np.full(len(names), -1, dtype=INT64)
    rest = {}
    for k, path in planner_data.items():
        pat = _pattern(k, path) if k in at else None
        if pat is None:
            rest[k] = path
        else:
            code[at[k]] = patterns.setdefault(pat, len(patterns))
    wire = [[None if c is None else list(c), list(i)] for c, i in patterns]
    return {"patterns": wire, "of": code.tobytes()}, rest


def paths_from_wire(raw, names: list[str]) -> dict[str, list]:
    """The flattening paths ``paths_wire`` encoded, each cut from its tensor's name."""
    if not isinstance(raw, dict) or not isinstance(raw.get("patterns"), list):
        raise FormatViolation("paths must be a map with a list of patterns")
    pats = []
    for w in raw["patterns"]:
        if not (isinstance(w, list) and len(w) == 2 and (w[0] is None or isinstance(w[0], list))
                and isinstance(w[1], list) and all(type(x) is int for x in (w[0] or []) + w[1])):
            raise FormatViolation("a path pattern must be [cuts or null, ints]")
        pats.append(w)
    code = int_column(raw, "of", len(names), -1, len(pats) - 1, "paths")
    out: dict[str, list] = {}
    for i, c in enumerate(code.tolist()):
        if c < 0:
            continue
        cuts, ints = pats[c]
        parts = names[i].split(".")
        if cuts is None:
            comps = parts
        else:
            if any(not 0 <= b < len(parts) - 1 for b in cuts) or any(a >= b for a, b in zip(cuts, cuts[1:])):
                raise FormatViolation(f"path pattern {c} does not fit {names[i]!r}")
            bounds = [0, *(b + 1 for b in cuts), len(parts)]
            comps = [".".join(parts[a:b]) for a, b in zip(bounds, bounds[1:])]
        for k in ints:
            if not 0 <= k < len(comps) or not _INT.fullmatch(comps[k]):
                raise FormatViolation(f"path pattern {c} makes a non-integer of {names[i]!r} an index")
            comps[k] = int(comps[k])  # pyright: ignore[reportArgumentType,reportCallIssue] (str -> int)
        out[names[i]] = comps
    return out


_INT = re.compile(r"-?(0|[1-9][0-9]*)")
