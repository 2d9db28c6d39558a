"""Text that UTF-8 can hold. Python's str can hold a lone surrogate (U+D800-U+DFFF), and JSON can
escape one (`"\ud800"`), so text decoded from a client's JSON may be text no protobuf string, no
tokenizer and no later stage can take. This module is the one rule for it: reception refuses such
text by field, and the engine answers it as the client's error, never as its own failure."""

from __future__ import annotations


def is_encodable(text: str) -> bool:
    """Whether UTF-8 can hold `text` (it holds no lone surrogate)."""
    return surrogate_problem(text) is None


def surrogate_problem(text: str) -> str | None:
    """What is wrong with `text` as text, naming its first lone surrogate and where it is; None
    when UTF-8 can hold it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return f"not valid Unicode text: a lone surrogate (U+{code:04X}) at character {exc.start}"
    return None


def undecodable(value: object, path: str) -> tuple[str, str] | None:
    """The first string in a JSON value (objects, lists, strings, numbers) that UTF-8 cannot hold:
    its path (`path.key[0]`; for a key, the object holding it) and what is wrong with it. None when
    there is none. Iterative, so a value of any depth is walked without recursion."""
    pending: list[tuple[object, str]] = [(value, path)]
    while pending:
        item, where = pending.pop()
        if isinstance(item, str):
            problem = surrogate_problem(item)
            if problem is not None:
                return where, problem
        elif isinstance(item, dict):
            if not all(is_encodable(key) for key in item if isinstance(key, str)):
                return where, "not valid Unicode text: a key holds a lone surrogate"
            # reversed onto the stack, so that the first key is looked at first
            pending.extend(reversed([(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()]))
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed([(v, f"{where}[{i}]") for i, v in enumerate(item)]))
    return None


def first_undecodable(value: object, path: str) -> str | None:
    """The path of the first string (or key) in a JSON value that UTF-8 cannot hold (`undecodable`)."""
    found = undecodable(value, path)
    return None if found is None else found[0]
