"""OpenAI response objects: chat.completion, text_completion, their stream chunks, and SSE lines."""

from __future__ import annotations

import json
import time
from typing import Any

from strata import __version__
from strata.server.tool_calls import ToolCall

FINGERPRINT = f"strata-{__version__}"


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached: prompt tokens reused from the prefix cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class Builder:
    """The objects of one response; `kind` is "chat" or "completion"."""

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool = False):
        self.kind, self.rid, self.model = kind, rid, model
        self.include_usage = include_usage
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    def full(self, text: str, finish: str, prompt: int, completion: int, reasoning: str = "",
             calls: tuple[ToolCall, ...] = (), cached: int = 0) -> dict[str, Any]:
        if self.kind == "chat":
            content = (text or None) if calls else text  # OpenAI: null beside calls
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            out = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            out = self._base("text_completion")
        return out | {"choices": [choice], "usage": usage(prompt, completion, cached)}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = self._base("text_completion")
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def delta(self, delta: dict[str, Any]) -> bytes:
        """A chat chunk with its own delta (reasoning_content, tool_calls)."""
        out = self._base("chat.completion.chunk")
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def usage_chunk(self, prompt: int, completion: int, cached: int = 0) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return sse(self._base(obj) | {"choices": [], "usage": usage(prompt, completion, cached)})
