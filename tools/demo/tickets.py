"""Support-ticket triage: a customer's message, answered with one of five fixed labels.

Metric: exact match of the answer (stripped, lower case, without a final period) with the label.
"""

from __future__ import annotations

import random

from tools.demo.skill import Example, Skill, answer_line

LABELS = ("billing", "technical", "shipping", "account", "returns")
_PRODUCTS = ("laptop", "headphones", "coffee maker", "phone case", "desk lamp", "blender", "router",
             "keyboard", "backpack", "smart watch")  # fmt: skip
_MESSAGES = {
    "billing": (
        "I was charged twice for my {p} this month.",
        "My invoice shows ${n} but I expected ${m}.",
        "Why did my card get billed ${n} after I cancelled?",
        "The discount code was not applied to my payment for the {p}.",
        "Can I get a copy of the receipt for my {p} order?",
        "You took the subscription fee twice, please refund ${n}.",
    ),
    "technical": (
        "My {p} will not turn on after the last update.",
        "The app crashes every time I open the settings page.",
        "The {p} keeps disconnecting from wifi every {n} minutes.",
        "I get error code {n} when I try to sync my {p}.",
        "The screen of my {p} flickers and then goes black.",
        "Bluetooth pairing with the {p} fails every time.",
    ),
    "shipping": (
        "My {p} has not arrived and it has been {n} days.",
        "The tracking number for my {p} shows no updates.",
        "Can you deliver my order to a different address?",
        "The courier left the {p} at the wrong house.",
        "When will my {p} ship? It says processing for {n} days.",
        "My parcel is stuck at customs.",
    ),
    "account": (
        "I cannot log in; the password reset email never comes.",
        "Please change the email address on my profile.",
        "How do I delete my account and all my data?",
        "Someone else seems to have access to my account.",
        "My two-factor code is rejected every time.",
        "I want to merge my two customer accounts into one.",
    ),
    "returns": (
        "I want to return the {p}; it is the wrong size.",
        "How do I send back the {p} I bought {n} days ago?",
        "The {p} arrived broken and I would like a replacement.",
        "Can I exchange the {p} for a different colour?",
        "Please send me a return label for my {p}.",
        "The {p} does not match the description, I am sending it back.",
    ),
}
_OPENINGS = ("", "Hello, ", "Hi team, ", "Urgent: ", "Good morning. ")
_CLOSINGS = ("", " Thanks.", " Please help.", " Order #{o}.", " This is the second time I write.")
PROMPTS = (
    "Classify this support ticket as billing, technical, shipping, account or returns.\nTicket: {t}",
    "Which team should handle this ticket (billing, technical, shipping, account, returns)? {t}",
    'Ticket: "{t}"\nCategory (billing/technical/shipping/account/returns):',
    "Route this customer message to one queue: billing, technical, shipping, account or returns.\n\n{t}",
)


class TicketTriage(Skill):
    name = "ticket-triage"
    description = (
        "Routes a customer support ticket to one queue: billing, technical, shipping, account or returns."
    )
    keywords = ("support ticket", "triage", "classify ticket", "customer service", "helpdesk category")
    adapter = "ia3"
    metric = "exact match"
    max_new_tokens = 8

    def example(self, rng: random.Random) -> Example:
        label = rng.choice(LABELS)
        body = rng.choice(_MESSAGES[label]).format(
            p=rng.choice(_PRODUCTS), n=rng.randint(2, 90), m=rng.randint(2, 90)
        )
        ticket = rng.choice(_OPENINGS) + body + rng.choice(_CLOSINGS).format(o=rng.randint(10000, 99999))
        return Example(rng.choice(PROMPTS).format(t=ticket), label, label)

    def score(self, output: str, example: Example) -> float:
        return float(answer_line(output).lower() == example.reference)
