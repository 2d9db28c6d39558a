"""Contact-detail redaction: a message with email addresses and phone numbers, answered with the same
message where each is replaced by [EMAIL] or [PHONE].

Metric: exact match of the answer with the redacted message (white space runs folded).
"""

from __future__ import annotations

import random
import re

from libs.experts.demo.skill import Example, Skill

_NAMES = ("ana", "ben", "carla", "dev", "emma", "felix", "gia", "hugo", "ines", "jon", "kira", "leo")
_DOMAINS = ("example.com", "shop.net", "mail.org", "corp.io", "uni.edu")
_SENTENCES = (
    "Please call me at {phone} after six.",
    "You can write to {email} with the invoice.",
    "My new number is {phone}.",
    "Send the draft to {email} and copy {email2}.",
    "Reach the front desk on {phone} or by email at {email}.",
    "The landlord asked us to ring {phone} before visiting.",
    "Questions go to {email}, not to my old address.",
    "If nobody answers {phone}, try {phone2}.",
    "The meeting is moved to Friday at ten.",
    "Bring the signed contract with you.",
    "Thanks again for your help last week.",
)
PROMPTS = (
    "Redact the email addresses and phone numbers in this text:\n{t}",
    "Replace every email with [EMAIL] and every phone number with [PHONE]: {t}",
    "Remove the contact details from this message (use [EMAIL] and [PHONE]).\n\n{t}",
    "Anonymize this text by masking emails and phone numbers:\n{t}",
)


class ContactRedaction(Skill):
    name = "pii-redact"
    description = (
        "Redacts personal contact details: replaces email addresses with [EMAIL] and phone numbers "
        "with [PHONE]."
    )
    keywords = ("redact", "PII", "anonymize", "mask personal data", "privacy")
    adapter = "lora"
    metric = "exact match"
    max_new_tokens = 96

    def example(self, rng: random.Random) -> Example:
        chosen = rng.sample(_SENTENCES, rng.randint(2, 3))
        if not any("{" in s for s in chosen):
            chosen[0] = rng.choice([s for s in _SENTENCES if "{" in s])
        values = {"email": _email(rng), "email2": _email(rng), "phone": _phone(rng), "phone2": _phone(rng)}
        masks = {"email": "[EMAIL]", "email2": "[EMAIL]", "phone": "[PHONE]", "phone2": "[PHONE]"}
        text = " ".join(chosen)
        answer = text.format(**masks)
        return Example(rng.choice(PROMPTS).format(t=text.format(**values)), answer, answer)

    def score(self, output: str, example: Example) -> float:
        return float(_fold(output) == _fold(example.reference))


def _fold(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _email(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    return (
        f"{name}{rng.choice(('', '.' + rng.choice(_NAMES), str(rng.randint(1, 99))))}@{rng.choice(_DOMAINS)}"
    )


def _phone(rng: random.Random) -> str:
    digits = [str(rng.randint(0, 9)) for _ in range(10)]
    styles = (
        "({0}{1}{2}) {3}{4}{5}-{6}{7}{8}{9}",
        "+44 {0}{1} {2}{3}{4}{5} {6}{7}{8}{9}",
        "{0}{1}{2}-{3}{4}{5}-{6}{7}{8}{9}",
        "+1 {0}{1}{2} {3}{4}{5} {6}{7}{8}{9}",
        "0{1}{2}{3} {4}{5}{6}{7}{8}{9}",
    )
    return rng.choice(styles).format(*digits)
