"""JSON field extraction: facts about a person in prose, the asked-for fields as one JSON object.

Metric: the first JSON object of the answer (a code fence or prose around it is forgiven); the share
of asked-for keys whose value is right (numbers may come as numbers or digits). No object: 0.
"""

from __future__ import annotations

import json
import random

from tools.demo.skill import Example, Skill, first_json_object, join_words

NAMES = (
    "Ana", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ingrid", "Jamal", "Keiko",
    "Liam", "Maria", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Samuel", "Tala", "Ulrich", "Vera",
    "Wei", "Ximena", "Yusuf", "Zoe", "Marta Silva", "John Carter", "Aiko Tanaka", "Pedro Alves",
    "Fatima Zahra", "Lars Eriksen", "Sofia Rossi", "Kwame Mensah", "Olga Petrova", "Diego Ramos",
)  # fmt: skip
CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Cairo", "Prague", "Denver", "Porto",
    "Hanoi", "Dublin", "Seville", "Quito", "Perth", "Munich", "Accra", "Bergen", "Austin", "Lyon",
)  # fmt: skip
JOBS = (
    "nurse", "teacher", "pilot", "chef", "lawyer", "plumber", "architect", "baker", "dentist",
    "engineer", "journalist", "farmer", "librarian", "pharmacist", "designer", "electrician",
)  # fmt: skip
COMPANIES = (
    "Acme Corp", "Blue Harbor", "Nimbus Labs", "Redwood Bank", "Orbit Foods", "Kestrel Air",
    "Lumen Health", "Granite Works", "Polaris Media", "Tidewater Energy",
)  # fmt: skip
DOMAINS = ("example.com", "mail.org", "post.net", "inbox.io")

# field -> (how a prompt names it, the JSON key)
FIELDS = {
    "name": ("name", "name"),
    "age": ("age", "age"),
    "city": ("city", "city"),
    "job": ("job", "job"),
    "email": ("email address", "email"),
    "company": ("employer", "company"),
}
PROMPTS = (
    "Extract the {fields} from: {text} Answer in JSON.",
    "Extract the {fields} from the text below. Answer in JSON.\n\n{text}",
    "Return a JSON object with the keys {keys} for this text: {text}",
    "Text: {text}\nGive the person's {fields} as a JSON object.",
    "Read this and output JSON with {keys}.\n{text}",
    "{text}\n\nExtract {fields} into JSON.",
)


class JsonExtraction(Skill):
    name = "json-extract"
    description = (
        "Extracts the requested fields about a person (name, age, city, job, email, employer) from text "
        "and answers with one JSON object."
    )
    keywords = ("json", "extract fields", "information extraction", "structured output", "parse text")
    adapter = "lora"
    metric = "JSON field accuracy"
    max_new_tokens = 64

    def example(self, rng: random.Random) -> Example:
        person = _person(rng)
        asked = rng.sample(list(FIELDS), rng.randint(2, 4))
        if "name" not in asked and rng.random() < 0.6:
            asked[0] = "name"
        text = _describe(rng, person)
        template = rng.choice(PROMPTS)
        prompt = template.format(
            fields=join_words([FIELDS[f][0] for f in asked]),
            keys=join_words([f'"{FIELDS[f][1]}"' for f in asked]),
            text=text,
        )
        answer = {FIELDS[f][1]: person[f] for f in asked}
        return Example(prompt, json.dumps(answer, ensure_ascii=False), answer)

    def score(self, output: str, example: Example) -> float:
        found = first_json_object(output)
        if found is None:
            return 0.0
        expected: dict = example.reference
        right = sum(_same(found.get(key), value) for key, value in expected.items())
        return right / len(expected)


def _same(got: object, expected: object) -> bool:
    if isinstance(expected, int):
        return str(got).strip() == str(expected)
    return isinstance(got, str) and got.strip().lower() == str(expected).lower()


def _person(rng: random.Random) -> dict:
    name = rng.choice(NAMES)
    local = name.lower().replace(" ", ".")
    return {
        "name": name,
        "age": rng.randint(19, 88),
        "city": rng.choice(CITIES),
        "job": rng.choice(JOBS),
        "email": f"{local}{rng.randint(1, 99)}@{rng.choice(DOMAINS)}",
        "company": rng.choice(COMPANIES),
    }


def _describe(rng: random.Random, p: dict) -> str:
    """Prose holding every fact of `p`, in one of several shapes and orders."""
    first = p["name"].split()[0]
    facts = [
        rng.choice(
            (
                f"{p['name']} is {p['age']} years old.",
                f"{p['name']} turned {p['age']} last month.",
                f"{p['name']}, aged {p['age']}, says hello.",
            )
        ),
        rng.choice(
            (
                f"{first} lives in {p['city']}.",
                f"Home for {first} is {p['city']}.",
                f"{first} moved to {p['city']}.",
            )
        ),
        rng.choice(
            (
                f"{first} works as a {p['job']} at {p['company']}.",
                f"By trade a {p['job']}, {first} is employed by {p['company']}.",
                f"{p['company']} hired {first} as a {p['job']}.",
            )
        ),
        rng.choice(
            (
                f"Contact: {p['email']}.",
                f"{first} can be reached at {p['email']}.",
                f"Email {p['email']} for details.",
            )
        ),
    ]
    head, rest = facts[0], facts[1:]
    rng.shuffle(rest)
    return " ".join([head, *rest])
