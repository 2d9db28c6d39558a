"""Review sentiment: a product review, answered with positive, negative or neutral.

Metric: exact match of the answer (stripped, lower case, without a final period) with the label.
"""

from __future__ import annotations

import random

from tools.demo.skill import Example, Skill, answer_line

_THINGS = ("blender", "hotel room", "novel", "running shoes", "tablet", "vacuum cleaner", "restaurant",
           "headphones", "tent", "printer", "sofa", "camera")  # fmt: skip
_CLAUSES = {
    "positive": (
        "the {x} works perfectly", "I love this {x}", "the {x} exceeded my expectations",
        "great value for the money", "the {x} is sturdy and well made", "would happily buy it again",
        "setup took two minutes and it just works", "the staff were wonderful",
    ),
    "negative": (
        "the {x} broke after a week", "a complete waste of money", "the {x} is flimsy and noisy",
        "customer service never answered", "it stopped working on day two", "I regret buying this {x}",
        "the {x} smells of plastic and leaks", "avoid it at all costs",
    ),
    "neutral": (
        "the {x} arrived on Tuesday", "it comes in a cardboard box", "the {x} is grey",
        "it does what the label says", "the manual is twenty pages long", "I have used the {x} twice so far",
        "the {x} weighs about two kilos", "it is an ordinary {x}",
    ),
}  # fmt: skip
PROMPTS = (
    "What is the sentiment of this review: positive, negative or neutral?\nReview: {r}",
    'Review: "{r}"\nSentiment (positive/negative/neutral):',
    "Is the following review positive, negative or neutral? {r}",
    "Label the sentiment of this customer review as positive, negative or neutral.\n\n{r}",
)


class ReviewSentiment(Skill):
    name = "review-sentiment"
    description = "Labels the sentiment of a product or service review as positive, negative or neutral."
    keywords = ("sentiment analysis", "review", "opinion", "positive or negative", "customer feedback")
    adapter = "prompt-tuning"
    metric = "exact match"
    max_new_tokens = 8

    def example(self, rng: random.Random) -> Example:
        label = rng.choice(tuple(_CLAUSES))
        thing = rng.choice(_THINGS)
        clauses = rng.sample(_CLAUSES[label], rng.randint(1, 2))
        if label != "neutral" and rng.random() < 0.5:
            clauses.insert(0, rng.choice(_CLAUSES["neutral"]))
        sentences = [c.format(x=thing) for c in clauses]
        review = " ".join(s[0].upper() + s[1:] + rng.choice((".", ".", "!")) for s in sentences)
        return Example(rng.choice(PROMPTS).format(r=review), label, label)

    def score(self, output: str, example: Example) -> float:
        return float(answer_line(output).lower() == example.reference)
