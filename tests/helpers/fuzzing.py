"""What the fuzzers share: a seed that is printed and can be given again (EXPERT_FUZZ_SEED, or
Hypothesis's own `--hypothesis-seed`), a time budget, and Hypothesis strategies of any protobuf
message built from its descriptor, with the values a schema-minded client never sends: numbers at
and past every bound, unknown enum values, long text, deep nesting and text that is not UTF-8."""

from __future__ import annotations

import os
import random
import time

import pytest
from google.protobuf import descriptor, message_factory
from google.protobuf.message import Message
from hypothesis import strategies as st

SEED_VARIABLE = "EXPERT_FUZZ_SEED"

# Stands for a lone surrogate in a string field: protobuf refuses to serialize one, so the message
# carries this character (three UTF-8 bytes) and `with_surrogates` puts the surrogate's three
# bytes (CESU-8, invalid UTF-8) in their place, the message's lengths unchanged.
SURROGATE_STAND_IN = "\ue000"
_STAND_IN_BYTES = SURROGATE_STAND_IN.encode()
_SURROGATE_BYTES = b"\xed\xa0\x80"
_SIZES = (0, 1, 64, 65, 255, 256, 1_000, 1_001, 100_001)
_INT_BOUNDS = {
    descriptor.FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    descriptor.FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    descriptor.FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    descriptor.FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


def fuzz_seed(config: pytest.Config) -> int:
    """The run's seed: `--hypothesis-seed`, else EXPERT_FUZZ_SEED, else a new one; printed, so that
    a failure can be replayed with `EXPERT_FUZZ_SEED=<seed> pytest <the test>`."""
    given = config.getoption("--hypothesis-seed", None) or os.environ.get(SEED_VARIABLE)
    seed = int(given) if given else random.randrange(2**32)
    print(f"fuzz seed: {seed} (replay: {SEED_VARIABLE}={seed})")
    return seed


class Budget:
    """A fuzzer's wall-clock budget: once spent, the examples left are skipped, so that the test
    ends in bounded time on a slow machine instead of running all of its examples."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.ran = self.skipped = 0

    def spent(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.skipped += 1
            return True
        self.ran += 1
        return False


def with_surrogates(data: bytes) -> bytes:
    """The serialized message with each SURROGATE_STAND_IN made a lone surrogate (not UTF-8)."""
    return data.replace(_STAND_IN_BYTES, _SURROGATE_BYTES)


def texts() -> st.SearchStrategy[str]:
    """Short text, text of a size around the usual limits, and text holding a stand-in surrogate."""
    long = st.builds(
        lambda piece, size: (piece * size)[:size], st.text(min_size=1, max_size=3), st.sampled_from(_SIZES)
    )
    marked = st.builds(lambda text: text + SURROGATE_STAND_IN, st.text(max_size=8))
    return st.one_of(st.text(max_size=24), long, marked)


def messages(message: type[Message], depth: int = 4) -> st.SearchStrategy[Message]:
    """Any `message`: each field unset or set to a value of its type (any enum number, numbers at
    and past their bounds), nested messages down to `depth` levels."""
    fields = {field.name: _field(field, depth) for field in message.DESCRIPTOR.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: _build(message, values))


def _build(message: type[Message], values: dict) -> Message:
    built = message()
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):
            _fill_map(built, name, value, _map_of_messages(field))
        elif _is_repeated(field):
            getattr(built, name).extend(value)
        elif field.message_type is not None:
            getattr(built, name).CopyFrom(value)
        else:
            setattr(built, name, value)
    return built


def _fill_map(built: Message, name: str, value: dict, of_messages: bool) -> None:
    for key, item in value.items():
        if of_messages:
            getattr(built, name)[key].CopyFrom(item)
        else:
            getattr(built, name)[key] = item


def _is_map(field: descriptor.FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _map_of_messages(field: descriptor.FieldDescriptor) -> bool:
    return field.message_type.fields_by_name["value"].message_type is not None


def _is_repeated(field: descriptor.FieldDescriptor) -> bool:
    return field.is_repeated


def _field(field: descriptor.FieldDescriptor, depth: int) -> st.SearchStrategy:
    if _is_map(field):
        entry = field.message_type.fields_by_name
        return st.dictionaries(_single(entry["key"], depth), _single(entry["value"], depth - 1), max_size=3)
    value = _single(field, depth)
    if not _is_repeated(field):
        return value
    # Many elements (past the usual list limits), each small: a list of long texts or deep
    # messages would only measure the fuzzer's own memory.
    small = (
        st.just(_message_class(field)()) if field.message_type is not None else _single(field, 0, short=True)
    )
    many = st.builds(lambda item, n: [item] * n, small, st.sampled_from([17, 101, 1_001]))
    return st.one_of(st.lists(value, max_size=3), many)


def _single(field: descriptor.FieldDescriptor, depth: int, short: bool = False) -> st.SearchStrategy:
    """A value of the field's type (one element of a repeated field)."""
    cpp = field.cpp_type
    if cpp == descriptor.FieldDescriptor.CPPTYPE_MESSAGE:
        if depth <= 0:
            return st.just(_message_class(field)())
        return st.deferred(lambda: messages(_message_class(field), depth - 1))
    if cpp in _INT_BOUNDS:
        low, high = _INT_BOUNDS[cpp]
        return st.one_of(st.sampled_from([low, high, 0, -1 if low else 1]), st.integers(low, high))
    if cpp == descriptor.FieldDescriptor.CPPTYPE_ENUM:
        numbers = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-(2**31), 2**31 - 1))
    if cpp == descriptor.FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if cpp in (descriptor.FieldDescriptor.CPPTYPE_FLOAT, descriptor.FieldDescriptor.CPPTYPE_DOUBLE):
        width = 32 if cpp == descriptor.FieldDescriptor.CPPTYPE_FLOAT else 64
        return st.floats(width=width)
    if field.type == descriptor.FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.sampled_from([b"{}", b'{"a": 1}\n', b"\xff\xfe"]))
    return st.text(max_size=8) if short else texts()


def _message_class(field: descriptor.FieldDescriptor) -> type[Message]:
    return message_factory.GetMessageClass(field.message_type)
