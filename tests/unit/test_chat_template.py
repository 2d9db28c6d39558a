"""Chat templates render like transformers' apply_chat_template(tokenize=False); bad input is named."""

from __future__ import annotations

import os
from datetime import datetime

import jinja2
import pytest

from libs.engine.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer, validate_messages
from libs.engine.tokenizer import chat_template as chat_template_module
from tests.helpers.tokenizer_fixtures import (
    LLAMA2_TEMPLATE,
    SMOLLM2_TEMPLATE,
    build_byte_level_dir,
    save_checkpoint_dir,
    train_byte_level_bpe,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- elif message.tool_calls is defined %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN_STYLE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nReturn each call in <tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

NAMESPACE_TEMPLATE = """{%- set ns = namespace(last_user=-1, count=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{%- continue %}{%- endif %}
    {%- set ns.count = ns.count + 1 %}
    {{- '[' ~ ns.count ~ '] ' ~ message.role ~ ': ' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for part in message.content %}
            {{- part.text }}
            {%- if not loop.last %} | {% endif %}
        {%- endfor %}
    {%- endif %}
    {%- if message.reasoning_content is defined %} <think>{{ message.reasoning_content }}</think>{%- endif %}
    {%- if loop.index0 == ns.last_user %} (latest question){%- endif %}
    {%- if not loop.last %}{{- '\\n' }}{%- endif %}
    {%- if ns.count >= 4 %}{%- break %}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '\\n>> ' }}{%- endif %}
"""

GENERATION_TAG_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A: {{ m.content }}"
    "{% endgeneration %}{% else %}U: {{ m.content }}{% endif %}\n{% endfor %}"
)

TOJSON_TEMPLATE = (
    "{{ messages[0] | tojson }}|{{ tools | tojson(indent=2, sort_keys=true) }}|"
    "{{ extra | tojson(separators=(',', ':')) }}|{{ '<b>é' | tojson }}|"
    "{{ '<b>é' | tojson(ensure_ascii=true) }}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle — current weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {}}},
]

SIMPLE = [{"role": "user", "content": "Hello! ¿Qué tal? 日本語 😀"}]
MULTI_TURN = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "Tell me a joke"},
]
TOOL_CALLING = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def backend():
    return train_byte_level_bpe()


@pytest.fixture
def make_pair(backend, tmp_path):
    """Write a checkpoint with `template` and load it with both our Tokenizer and transformers."""

    def make(template, **config):
        config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template, **config}
        directory = save_checkpoint_dir(tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}", backend, config)
        return Tokenizer.from_dir(directory), transformers.PreTrainedTokenizerFast.from_pretrained(
            str(directory)
        )

    return make


def _assert_same(pair, messages, **kwargs):
    ours, ref = pair
    for add_generation_prompt in (True, False):
        expected = ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert (
            ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            == expected
        )


@pytest.mark.parametrize("messages", [SIMPLE, MULTI_TURN[1:], [MULTI_TURN[0], *MULTI_TURN[1:]]])
def test_smollm2_template_matches_transformers(make_pair, messages):
    _assert_same(make_pair(SMOLLM2_TEMPLATE), messages)


def test_smollm2_template_renders_the_default_system_prompt(make_pair):
    ours, _ = make_pair(SMOLLM2_TEMPLATE)
    assert ours.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("messages", [SIMPLE, MULTI_TURN, TOOL_CALLING])
@pytest.mark.parametrize("with_tools", [False, True])
def test_llama3_style_template_with_bos_system_and_tools_matches_transformers(
    make_pair, messages, with_tools
):
    pair = make_pair(LLAMA3_STYLE_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    _assert_same(pair, messages, tools=TOOLS if with_tools else None)
    _assert_same(pair, messages, tools=TOOLS if with_tools else None, date_string="01 Jan 2025")


@pytest.mark.parametrize("messages", [SIMPLE, MULTI_TURN, TOOL_CALLING])
@pytest.mark.parametrize("with_tools", [False, True])
def test_qwen_style_template_with_tools_matches_transformers(make_pair, messages, with_tools):
    _assert_same(make_pair(QWEN_STYLE_TEMPLATE), messages, tools=TOOLS if with_tools else None)


def test_namespace_loop_controls_and_content_parts_match_transformers(make_pair):
    messages = [
        {"role": "system", "content": "skipped by continue"},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
        {"role": "assistant", "content": "answer", "reasoning": "because"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "cut by break"},
    ]
    _assert_same(make_pair(NAMESPACE_TEMPLATE), messages)
    _assert_same(make_pair(NAMESPACE_TEMPLATE), messages[:4])


def test_generation_tag_renders_its_body_like_transformers(make_pair):
    _assert_same(make_pair(GENERATION_TAG_TEMPLATE), MULTI_TURN[1:])


def test_tojson_matches_transformers(make_pair):
    _assert_same(make_pair(TOJSON_TEMPLATE), SIMPLE, tools=TOOLS, extra={"b": [1, 2], "a": "é"})


def test_llama2_template_uses_bos_and_eos_like_transformers(make_pair):
    pair = make_pair(LLAMA2_TEMPLATE, bos_token="<s>", eos_token="</s>")
    _assert_same(pair, MULTI_TURN)


def test_raise_exception_becomes_a_chat_template_error_with_the_template_message(make_pair):
    ours, ref = make_pair(LLAMA2_TEMPLATE)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as expected:
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError) as raised:
        ours.apply_chat_template(messages)
    assert (
        str(raised.value)
        == str(expected.value)
        == ("Conversation roles must alternate user/assistant/user/assistant/...")
    )


def test_strftime_now_gives_the_current_date():
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render(SIMPLE)
    assert rendered in {datetime.now().strftime("%Y-%m-%d"), datetime.now().date().isoformat()}


def test_extra_variables_reach_the_template_and_override_special_tokens(make_pair):
    ours, _ = make_pair("{{ bos_token }}|{{ eos_token }}|{{ flavour }}")
    assert ours.apply_chat_template(SIMPLE, flavour="mint") == "<|im_start|>|<|im_end|>|mint"
    assert ours.apply_chat_template(SIMPLE, bos_token="<B>", flavour="") == "<B>|<|im_end|>|"


def test_encode_chat_adds_no_special_tokens_of_its_own(tmp_path):
    sp_like = build_byte_level_dir(tmp_path)
    tokenizer = Tokenizer.from_dir(sp_like)
    text = tokenizer.apply_chat_template(SIMPLE)
    assert tokenizer.encode_chat(SIMPLE) == tokenizer.encode(text, add_special_tokens=False)


def test_a_checkpoint_without_a_template_says_so(backend, tmp_path):
    tokenizer = Tokenizer.from_dir(save_checkpoint_dir(tmp_path, backend, {"eos_token": "<|im_end|>"}))
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template(SIMPLE)


def test_a_template_with_bad_syntax_is_rejected_with_its_line():
    with pytest.raises(ChatTemplateError, match="line 2"):
        ChatTemplate("ok\n{% for m in messages %}")


def test_each_template_is_compiled_once():
    source = "{{ messages | length }} compiled once"
    before = chat_template_module._compile.cache_info()
    ChatTemplate(source).render(SIMPLE)
    ChatTemplate(source).render(SIMPLE)
    after = chat_template_module._compile.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.append(1) }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{% set ns = namespace(__x=1) %}",
    ],
)
def test_the_sandbox_refuses_unsafe_templates(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(SIMPLE)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "messages: expected a non-empty list"),
        ("hello", "messages: expected a non-empty list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\]: expected an object"),
        ([{"content": "a"}], r"messages\[0\]\.role: required"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            r"messages\[1\]\.role: expected one of system, user, assistant, tool; got 'robot'",
        ),
        ([{"role": 3, "content": "a"}], r"messages\[0\]\.role: expected one of"),
        ([{"role": "user"}], r"messages\[0\]\.content: required"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content: required"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content: expected a string or a list"),
        ([{"role": "user", "content": ["x"]}], r"messages\[0\]\.content\[0\]: expected an object"),
        (
            [{"role": "user", "content": [{"type": "image", "url": "x"}]}],
            r"messages\[0\]\.content\[0\]\.type: expected 'text'",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            r"messages\[0\]\.content\[0\]\.text: expected a string",
        ),
    ],
)
def test_invalid_messages_name_the_field(messages, error):
    with pytest.raises(ChatTemplateError, match=error):
        validate_messages(messages)


def test_an_assistant_message_with_tool_calls_may_omit_content():
    messages = validate_messages([TOOL_CALLING[1]])
    assert "content" not in messages[0]
    assert messages[0]["tool_calls"] == TOOL_CALLING[1]["tool_calls"]


@pytest.mark.parametrize(
    ("tools", "error"),
    [
        ({"name": "f"}, "tools: expected a list"),
        ([TOOLS[0], "f"], r"tools\[1\]: expected a JSON-schema object"),
    ],
)
def test_invalid_tools_name_the_field(tools, error):
    with pytest.raises(ChatTemplateError, match=error):
        ChatTemplate(QWEN_STYLE_TEMPLATE).render(SIMPLE, tools=tools)


def test_chat_template_error_is_a_value_error():
    assert issubclass(ChatTemplateError, ValueError)


def test_undefined_content_in_template_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(SIMPLE)
