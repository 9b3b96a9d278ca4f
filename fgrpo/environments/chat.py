"""An episode's tokens around the model's own: the first prompt (with the tools described), and after each of the model's
turns the suffix that closes it and opens the next (an observation as a user turn, tool results as a tool turn, then
the assistant's header). The model's sampled tokens are never decoded and encoded again: an episode is its first
prompt's ids, then each turn's sampled ids as they came, each followed by a suffix's ids (:meth:`Renderer.suffix_ids`).

A suffix is rendered append-only: the chat template over a fixed two-message conversation with and without the new
messages, the difference taken as text. So a template that re-renders earlier turns differently (Qwen3 drops earlier
``<think>`` blocks) cannot change tokens already sampled. Tools are described through the template's own tool support
where it has one (``tools`` in the template); where it has none (SmolLM2's ChatML), in the system message
(:data:`TOOLS_FALLBACK`), calls written as JSON in ``<tool_call>`` tags either way (Hermes' and Qwen's form), results in
a ``tool`` turn (a ``user`` turn for a template that refuses the role).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["Renderer", "ToolCall", "parse_tool_calls", "TOOLS_FALLBACK"]

TOOLS_FALLBACK = ("You can call these tools:\n{tools}\n\nTo call a tool, write <tool_call>{{\"name\": \"<tool name>\", "
                  "\"arguments\": {{<arguments as JSON>}}}}</tool_call> and stop; its result comes back in the next "
                  "turn. When you know the answer, reply without a tool call.")
_DUMMY = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: ``name`` and ``arguments``, or ``error`` (what is wrong with it: malformed JSON, no
    name) and the text shown to the model."""

    name: str = ""
    arguments: dict | None = None
    error: str = ""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>{...}</tool_call>`` blocks of a turn, in order (an unclosed last one too: the turn may stop at
    the closing tag's first token). None: no call, the model answered."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as error:
            calls.append(ToolCall(error=f"the tool call is not valid JSON ({error.msg} at column {error.colno}); write "
                                        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(error="a tool call needs a \"name\" (a string) and \"arguments\" (an object)"))
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, dict) else None,
                              "" if isinstance(arguments, dict) else "the arguments must be a JSON object"))
    return calls


class Renderer:
    """Token ids of an episode's prompt and suffixes. ``chat``: through ``tokenizer``'s chat template (else plain
    text, turns one paragraph each); ``tools``: the tools' JSON schemas (none for a text game)."""

    def __init__(self, tokenizer, *, chat: bool, system_prompt: str | None = None, tools: tuple[dict, ...] = ()):
        self.tokenizer, self.chat, self.system_prompt, self.tools = tokenizer, chat, system_prompt, tuple(tools)
        template = getattr(tokenizer, "chat_template", None) or ""
        self.native_tools = bool(tools) and chat and "tools" in template
        self.tool_role = "tool"
        if chat and tools:
            try:
                self._render(_DUMMY + [{"role": "tool", "content": "R"}], True)
            except Exception:  # noqa: BLE001 - jinja's errors: a template that allows user and assistant only
                self.tool_role = "user"
        if chat:
            prefix = self._render(_DUMMY, False)
            self._closing = prefix[prefix.rindex("A") + 1:]  # what the template writes after an assistant turn

    def _render(self, messages: list[dict], generation: bool) -> str:
        extra = {"tools": list(self.tools)} if self.native_tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **extra)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def messages(self, prompt, reset_text: str | None) -> list[dict]:
        """The first prompt's messages: the row's (its chat messages or its question), ``reset_text`` appended to the last
        user message (TRL's rule), the system prompt and, without native tool support, the tools in the system
        message."""
        messages = [dict(m) for m in prompt] if isinstance(prompt, (list, tuple)) else [
            {"role": "user", "content": prompt}]
        if reset_text:
            last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
            messages[last]["content"] = f"{messages[last]['content']}\n\n{reset_text}".strip()
        system = self.system_prompt or ""
        if self.tools and not self.native_tools:
            listed = "\n".join(json.dumps(tool["function"]) for tool in self.tools)
            system = f"{system}\n\n{TOOLS_FALLBACK.format(tools=listed)}".strip()
        if system:
            if messages[0]["role"] == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{system}"
            else:
                messages.insert(0, {"role": "system", "content": system})
        return messages

    def prompt_ids(self, prompt, reset_text: str | None) -> list[int]:
        """The episode's first prompt, through the template with the assistant's header (or plain text)."""
        messages = self.messages(prompt, reset_text)
        if not self.chat:
            return list(self.tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"])
        return self._encode(self._render(messages, True))  # a template that writes a BOS writes it as text

    def suffix_ids(self, messages: list[dict], turn_ids: list[int], stopped: bool) -> list[int]:
        """The tokens after a model turn ``turn_ids`` (``stopped``: it ended with an EOS token, else it was cut at its
        length): the rest of the turn's closing, ``messages`` (an observation, tool results), the next header."""
        if not self.chat:
            return self._encode("".join(f"\n\n{m['content']}" for m in messages) + "\n\n")
        before = self._render(_DUMMY, False)
        after = self._render(_DUMMY + [self._role(m) for m in messages], True)
        if not after.startswith(before):
            raise ValueError("the chat template is not append-only for these messages")
        closing = self._closing
        if stopped and turn_ids:
            ended = self.tokenizer.decode([turn_ids[-1]])
            if closing.startswith(ended):
                closing = closing[len(ended):]
        return self._encode(closing + after[len(before):])

    def _role(self, message: dict) -> dict:
        if message["role"] == "tool" and self.tool_role != "tool":
            return {"role": self.tool_role, "content": f"Tool result: {message['content']}"}
        return message
