"""How often `tool_choice: auto` calls a tool where one is clearly needed, and where one is
clearly not, on a running stack (the default model), with the real `openai` client.

Each prompt runs once, greedy (temperature 0), with the same two tools (get_weather, add); the
requests go 8 at a time. Prints the share of calls among the "needed" prompts and among the "not
needed" ones, and each prompt's outcome.

    python bench/tool_choice_auto.py --url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import openai

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "The sum of two integers", "parameters": ADD},
    },
]
NEEDED = [
    "What is the weather in Paris right now?",
    "Use the get_weather tool for Tokyo.",
    "Call get_weather to find the weather in Lima.",
    "Is it raining in Oslo? Check with the tool.",
    "What is 1234 plus 5678? Use the add tool.",
    "Call add with a=17 and b=25.",
    "What's the temperature in Cairo in celsius?",
    "Please add 99 and 101 using your tool.",
    "Check the weather in Berlin for me.",
    "I need the weather forecast for Madrid.",
]
NOT_NEEDED = [
    "Say hello to me.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Tell me a joke.",
    "Thank you, that is all.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "How are you today?",
    "Name three colors.",
]


def called(client: openai.OpenAI, model: str, prompt: str) -> bool:
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice="auto",
        temperature=0.0,
        max_tokens=48,
    )
    return bool(answer.choices[0].message.tool_calls)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True, help="reception's HTTP front, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    client = openai.OpenAI(
        base_url=args.url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600
    )
    prompts = NEEDED + NOT_NEEDED
    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(lambda p: called(client, args.model, p), prompts))
    needed, not_needed = outcomes[: len(NEEDED)], outcomes[len(NEEDED) :]
    for prompt, call in zip(prompts, outcomes, strict=True):
        print(f"{'call' if call else 'text'}  {prompt}")
    print(
        json.dumps(
            {
                "auto_calls_where_needed": f"{sum(needed)}/{len(needed)}",
                "auto_calls_where_not_needed": f"{sum(not_needed)}/{len(not_needed)}",
            }
        )
    )


if __name__ == "__main__":
    main()
