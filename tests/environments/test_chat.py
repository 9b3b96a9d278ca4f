"""An episode's tokens around the model's (fgrpo.environments.chat): tools described through a template's own tool
support or, without it, in the system message; suffixes rendered append-only and closing a turn cut at its length;
a template that refuses the tool role; plain text without a template; tool calls parsed."""

import copy

import pytest

from fgrpo.environments.chat import Renderer, ToolCall, parse_tool_calls

TOOL = {"type": "function", "function": {"name": "add", "description": "Add.",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
# a template with tool support, in the manner of Qwen2.5's: tools in the system turn, results as tool responses
WITH_TOOLS = (
    "{% if tools %}<|im_start|>system\nTools: {% for tool in tools %}{{ tool.function.name }} {% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
USER_AND_ASSISTANT_ONLY = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('no role ' + "
    "m.role) }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(compose):
    from fgrpo.learner.model import load_tokenizer, resolve_model_folder

    return load_tokenizer(resolve_model_folder(compose("model=tiny_random").model))


def with_template(tokenizer, template):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def turn(tokenizer, text, stopped=True):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if stopped else [])


def test_without_tool_support_the_tools_go_in_the_system_message(tokenizer):
    renderer = Renderer(tokenizer, chat=True, tools=(TOOL,))
    assert not renderer.native_tools and renderer.tool_role == "tool"
    text = tokenizer.decode(renderer.prompt_ids("What is 2 + 3?", "Use the tool."))
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n{\"name\": \"add\"")
    assert "<|im_start|>user\nWhat is 2 + 3?\n\nUse the tool.<|im_end|>\n<|im_start|>assistant\n" in text


def test_a_template_with_tool_support_describes_them_and_renders_the_results(tokenizer):
    renderer = Renderer(with_template(tokenizer, WITH_TOOLS), chat=True, tools=(TOOL,))
    assert renderer.native_tools
    assert tokenizer.decode(renderer.prompt_ids("Q?", None)).startswith("<|im_start|>system\nTools: add <|im_end|>")
    suffix = renderer.suffix_ids([{"role": "tool", "name": "add", "content": "5"}], turn(tokenizer, "x"), True)
    assert tokenizer.decode(suffix) == "\n<|im_start|>user\n<tool_response>5</tool_response><|im_end|>\n" \
                                       "<|im_start|>assistant\n"


def test_a_turn_cut_at_its_length_is_closed_by_the_suffix(tokenizer):
    renderer = Renderer(tokenizer, chat=True)
    cut = renderer.suffix_ids([{"role": "user", "content": "lower"}], turn(tokenizer, "12", stopped=False), False)
    assert tokenizer.decode(cut) == "<|im_end|>\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_refusing_the_tool_role_gets_results_in_a_user_turn(tokenizer):
    renderer = Renderer(with_template(tokenizer, USER_AND_ASSISTANT_ONLY), chat=True, tools=(TOOL,))
    assert renderer.tool_role == "user"
    suffix = renderer.suffix_ids([{"role": "tool", "content": "5"}], turn(tokenizer, "x"), True)
    assert tokenizer.decode(suffix).startswith("\n<|im_start|>user\nTool result: 5<|im_end|>")


def test_plain_text_episodes_without_a_template(tokenizer):
    renderer = Renderer(tokenizer, chat=False)
    assert tokenizer.decode(renderer.suffix_ids([{"role": "user", "content": "lower"}], [5], True)) == \
        "\n\nlower\n\n"


def test_tool_calls_parsed_in_order_with_what_is_wrong_with_each():
    calls = parse_tool_calls('a <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> b '
                             '<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>'
                             '<tool_call>[1]</tool_call><tool_call>{"name": "add", "arguments": 3}</tool_call>'
                             '<tool_call>{"name": "add", "arguments": {"a": ')
    assert calls[:2] == [ToolCall("add", {"a": 1}), ToolCall("add", {"a": 2})]  # a JSON string of arguments too
    assert "needs a \"name\"" in calls[2].error and "must be a JSON object" in calls[3].error
    assert "not valid JSON" in calls[4].error  # a turn cut inside its call
    assert parse_tool_calls("The answer is 5.") == []
