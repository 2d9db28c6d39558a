"""SQL over a given schema: a question about one table, answered with one SQLite query.

Metric: the answer's query (the first statement, out of a ```sql fence if there is one) is run with
`sqlite3` on a seeded database of that schema, and its rows must equal the reference query's rows
(in order when the reference sorts, as a multiset otherwise). A query that fails to run scores 0.
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass
from functools import cache

from tools.demo.skill import Example, Skill


@dataclass(frozen=True)
class Table:
    name: str
    row: str  # one row in words: "employee"
    rows: str  # "employees"
    label: str  # the column that names a row
    group: str  # a text column with few values
    group_words: str  # how questions say it: "department"
    groups: tuple[str, ...]
    number: str  # a numeric column
    number_words: str  # "salary"
    low: int
    high: int
    columns: tuple[tuple[str, str], ...]  # (column, SQL type), in the order of CREATE TABLE

    def ddl(self) -> str:
        return f"CREATE TABLE {self.name} ({', '.join(f'{c} {t}' for c, t in self.columns)});"


TABLES = (
    Table(
        "employees", "employee", "employees", "name", "department", "department",
        ("Sales", "Finance", "Support", "Legal", "Research"), "salary", "salary", 30000, 120000,
        (("id", "INTEGER"), ("name", "TEXT"), ("department", "TEXT"), ("salary", "INTEGER"),
         ("hire_year", "INTEGER")),
    ),
    Table(
        "products", "product", "products", "name", "category", "category",
        ("garden", "kitchen", "toys", "office", "sports"), "price", "price", 2, 900,
        (("id", "INTEGER"), ("name", "TEXT"), ("category", "TEXT"), ("price", "INTEGER"),
         ("stock", "INTEGER")),
    ),
    Table(
        "books", "book", "books", "title", "genre", "genre",
        ("fantasy", "history", "poetry", "science", "crime"), "pages", "page count", 80, 900,
        (("id", "INTEGER"), ("title", "TEXT"), ("author", "TEXT"), ("genre", "TEXT"),
         ("pages", "INTEGER")),
    ),
    Table(
        "students", "student", "students", "name", "city", "city",
        ("Leeds", "Bristol", "York", "Bath", "Derby"), "score", "score", 0, 100,
        (("id", "INTEGER"), ("name", "TEXT"), ("city", "TEXT"), ("score", "INTEGER"), ("year", "INTEGER")),
    ),
)  # fmt: skip
_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "iris", "juniper",
          "kelp", "lotus", "maple", "nova", "onyx", "pine", "quartz", "raven", "sage", "tundra")  # fmt: skip
_ROWS_PER_TABLE = 40

# (question, SQL, sorted?) with {t} the table and {g} {v} {n} {x} filled in
QUESTIONS = (
    ("How many {rows} are in the {v} {gw}?", "SELECT COUNT(*) FROM {t} WHERE {g} = '{v}';", False),
    ("Count the {rows} whose {gw} is {v}.", "SELECT COUNT(*) FROM {t} WHERE {g} = '{v}';", False),
    ("List the {l} of every {row} with a {nw} above {x}.", "SELECT {l} FROM {t} WHERE {n} > {x};", False),
    ("Which {rows} have a {nw} below {x}? Give their {l}.", "SELECT {l} FROM {t} WHERE {n} < {x};", False),
    ("What is the average {nw} in the {v} {gw}?", "SELECT AVG({n}) FROM {t} WHERE {g} = '{v}';", False),
    ("What is the total {nw} of {rows} in {v}?", "SELECT SUM({n}) FROM {t} WHERE {g} = '{v}';", False),
    ("Which {row} has the highest {nw}?", "SELECT {l} FROM {t} ORDER BY {n} DESC LIMIT 1;", False),
    ("Which {row} has the lowest {nw}?", "SELECT {l} FROM {t} ORDER BY {n} ASC LIMIT 1;", False),
    ("How many {rows} are there in each {gw}?", "SELECT {g}, COUNT(*) FROM {t} GROUP BY {g};", False),
    ("What is the maximum {nw} per {gw}?", "SELECT {g}, MAX({n}) FROM {t} GROUP BY {g};", False),
    ("List the {l} of the {rows} in {v}, sorted by {nw} from high to low.",
     "SELECT {l} FROM {t} WHERE {g} = '{v}' ORDER BY {n} DESC;", True),
    ("Show the {l} of the three {rows} with the largest {nw}.",
     "SELECT {l} FROM {t} ORDER BY {n} DESC LIMIT 3;", True),
)  # fmt: skip
PROMPTS = (
    "Database schema:\n{ddl}\n\nWrite an SQLite query to answer: {q}",
    "Given the table\n{ddl}\nwrite a SQL query: {q}",
    "{ddl}\n-- {q}\nAnswer with the SQL query only.",
    "Schema: {ddl}\nQuestion: {q}\nSQL:",
)


class SqlQueries(Skill):
    name = "sql-query"
    description = (
        "Writes an SQLite query that answers a question about a table, given its CREATE TABLE schema."
    )
    keywords = ("sql", "sqlite", "database query", "select statement", "text to sql")
    adapter = "lora"
    metric = "result match in sqlite3"
    max_new_tokens = 64

    def example(self, rng: random.Random) -> Example:
        table = rng.choice(TABLES)
        question, sql, ordered = rng.choice(QUESTIONS)
        values = {
            "t": table.name, "row": table.row, "rows": table.rows, "l": table.label, "g": table.group,
            "gw": table.group_words, "v": rng.choice(table.groups), "n": table.number,
            "nw": table.number_words, "x": _round_number(rng, table),
        }  # fmt: skip
        query = sql.format(**values)
        prompt = rng.choice(PROMPTS).format(ddl=table.ddl(), q=question.format(**values))
        return Example(prompt, query, (query, ordered))

    def score(self, output: str, example: Example) -> float:
        reference, ordered = example.reference
        expected = run_query(reference)
        try:
            got = run_query(answer_query(output))
        except sqlite3.Error:
            return 0.0
        if not ordered:
            got, expected = sorted(got, key=repr), sorted(expected, key=repr)
        return float(got == expected)


def answer_query(output: str) -> str:
    """The SQL an answer gives: inside its first ```sql fence if any, up to the first semicolon."""
    fenced = re.search(r"```(?:sql|sqlite)?\s*\n(.*?)```", output, re.DOTALL | re.IGNORECASE)
    text = fenced.group(1) if fenced else output
    return text.split(";")[0].strip()


def _round_number(rng: random.Random, table: Table) -> int:
    step = 1000 if table.high > 10000 else 10 if table.high > 200 else 5
    return rng.randrange(table.low + step, table.high, step) // step * step


def run_query(query: str) -> list[tuple]:
    """The rows of `query` on the seeded database (read-only; results rounded so AVG compares)."""
    rows = _database().execute(query).fetchmany(1000)
    return [tuple(round(v, 4) if isinstance(v, float) else v for v in row) for row in rows]


@cache
def _database() -> sqlite3.Connection:
    connection = sqlite3.connect(":memory:", check_same_thread=False)
    rng = random.Random("sql-query:database")
    for table in TABLES:
        connection.execute(table.ddl())
        for i in range(1, _ROWS_PER_TABLE + 1):
            connection.execute(
                f"INSERT INTO {table.name} VALUES ({', '.join('?' * len(table.columns))})",
                [_cell(rng, table, column, kind, i) for column, kind in table.columns],
            )
    connection.commit()
    connection.execute("PRAGMA query_only = ON")
    return connection


def _cell(rng: random.Random, table: Table, column: str, kind: str, row_id: int) -> object:
    if column == "id":
        return row_id
    if column == table.group:
        return rng.choice(table.groups)
    if column == table.number:
        return rng.randint(table.low, table.high)
    if kind == "INTEGER":
        return rng.randint(1990, 2024)
    return f"{rng.choice(_WORDS).title()} {rng.choice(_WORDS).title()} {row_id}"
