"""Where an etcd member's CPU goes: its Go CPU profile, taken and summed by function.

Why: the etcd-v3 rendezvous figures are set by the one member's CPU on this 2-core machine
(docs/scale.md), and which of its costs a change of ftrun's can
remove (a request fewer, a smaller buffer, no JSON gateway) is read from where that CPU
goes. etcd serves Go's ``/debug/pprof/profile`` when started with ``--enable-pprof``
(tests/infra/etcd_cluster.py's ``loopback_etcd(profiling=True)``); the answer is a gzipped
``profile.proto`` message, read here field by field (no protobuf package, no Go toolchain
on this machine), so only what a summary needs is decoded: each sample's stack of
locations and its CPU nanoseconds, each location's functions, the string table.

Timeouts and errors: :func:`cpu_profile` waits its ``seconds`` plus ``timeout_s`` and
raises ``OSError`` (urllib's) when the member does not answer; :func:`top` raises
``ValueError`` for what is not such a profile.
"""

from __future__ import annotations

import gzip
import urllib.request
import zlib
from collections import Counter
from dataclasses import dataclass

from ftrun.control.etcdkeepalive import protobuf_fields, read_varint


def cpu_profile(endpoint: str, seconds: float, timeout_s: float = 10.0) -> bytes:
    """The member's CPU profile over the next ``seconds`` (whole seconds, at least 1: Go's
    handler takes an integer, and 0 would mean its default of 30)."""
    whole = max(1, round(seconds))
    with urllib.request.urlopen(f"http://{endpoint}/debug/pprof/profile?seconds={whole}",
                                timeout=whole + timeout_s) as answer:
        return answer.read()


@dataclass(frozen=True)
class FunctionCost:
    """CPU seconds in one function: ``flat_s`` running it, ``cumulative_s`` with callees."""

    name: str
    cumulative_s: float
    flat_s: float


#: Where the member's time is told apart: etcd's own packages (which request, which store
#: path), the JSON gateway's dispatch of an HTTP request, and Go's collector. Generic frames
#: (``net/http``'s serve loop, ``runtime.systemstack``) are in nearly every stack and say
#: nothing on their own.
ETCD_PARTS = ("go.etcd.io/etcd/", "grpc-gateway/runtime.(*ServeMux).ServeHTTP",
              "runtime.gcBgMarkWorker", "runtime.gcAssistAlloc")


def top(profile: bytes, count: int = 15,
        within: tuple[str, ...] = ()) -> tuple[float, list[FunctionCost]]:
    """``(sampled CPU seconds, the ``count`` functions of most cumulative CPU)``; with
    ``within``, only functions whose name contains one of those parts (``ETCD_PARTS``)."""
    try:
        message = gzip.decompress(profile)
    except (OSError, EOFError, zlib.error) as error:
        raise ValueError(f"not a gzipped profile: {error}") from None
    samples, functions_at, names = _decode(message)
    flat: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    total = 0
    for locations, nanoseconds in samples:
        total += nanoseconds
        stack = [names.get(f, f"function {f}") for at in locations
                 for f in functions_at.get(at, [])]
        if stack:
            flat[stack[0]] += nanoseconds
        for name in set(stack):
            cumulative[name] += nanoseconds
    ranked = [(name, ns) for name, ns in cumulative.most_common()
              if not within or any(part in name for part in within)]
    return total / 1e9, [FunctionCost(name, round(ns / 1e9, 3), round(flat[name] / 1e9, 3))
                         for name, ns in ranked[:count]]


def _decode(message: bytes) -> tuple[list[tuple[list[int], int]], dict[int, list[int]],
                                     dict[int, str]]:
    """profile.proto: ``sample`` (2: location ids 1, values 2, the last being CPU ns),
    ``location`` (4: id 1, lines 4 whose function id is 1), ``function`` (5: id 1, name
    2 as a string-table index), ``string_table`` (6)."""
    samples: list[tuple[list[int], int]] = []
    functions_at: dict[int, list[int]] = {}
    function_names: dict[int, int] = {}
    strings: list[str] = []
    for number, value in _fields(message):
        if number == 2 and isinstance(value, bytes):
            ids: list[int] = []
            values: list[int] = []
            for field, item in _fields(value):
                (ids if field == 1 else values if field == 2 else []).extend(_packed(item))
            if values:
                samples.append((ids, values[-1]))
        elif number == 4 and isinstance(value, bytes):
            location, functions = 0, []
            for field, item in _fields(value):
                if field == 1 and isinstance(item, int):
                    location = item
                elif field == 4 and isinstance(item, bytes):
                    functions += [f for n, f in _fields(item) if n == 1 and isinstance(f, int)]
            functions_at[location] = functions
        elif number == 5 and isinstance(value, bytes):
            parts = {field: item for field, item in _fields(value) if isinstance(item, int)}
            function_names[parts.get(1, 0)] = parts.get(2, 0)
        elif number == 6 and isinstance(value, bytes):
            strings.append(value.decode(errors="replace"))
    try:
        names = {fid: strings[at] for fid, at in function_names.items()}
    except IndexError:
        raise ValueError("a function's name is past the profile's string table") from None
    return samples, functions_at, names


def _fields(message: bytes) -> list[tuple[int, int | bytes]]:
    return [(number, value) for number, _, value in protobuf_fields(message)]


def _packed(item: int | bytes) -> list[int]:
    if isinstance(item, int):
        return [item]
    values, at = [], 0
    while at < len(item):
        value, at = read_varint(item, at)
        values.append(value)
    return values

