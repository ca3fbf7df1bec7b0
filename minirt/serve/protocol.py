"""Chapter 08: the OpenAI API's shapes - requests in, responses and stream chunks out.

Requests are pydantic models of OpenAI's `/v1/completions` and `/v1/chat/completions` bodies. Every field is
either honoured or refused by name with 400, never silently ignored:

- honoured: the prompt or messages, `model`, `max_tokens` (chat: `max_completion_tokens` first), `temperature`,
  `top_p`, `seed`, `stop`, `stream`, `stream_options.include_usage`, `n` = 1, `user` (accepted, no effect), and
  vLLM's extensions `top_k` (0: no limit), `stop_token_ids`, `ignore_eos`;
- refused when they ask for something (`REFUSED`: each field with the values that ask for nothing, which pass):
  penalties, `logprobs`, `n` > 1, tools and functions, `response_format`, ...; any other field (`extra="forbid"`).

Chat `content` is a string, a list of text parts (joined with newlines, as vLLM does for string templates), or
null on an assistant message; roles as OpenAI and vLLM name them. `sampling_params` turns a request into a
`minirt.SamplingParams`; `delta_chunks` turns one engine `StreamDelta` into the stream chunks OpenAI sends.
Responses and errors are plain dicts in OpenAI's JSON shapes (platform.openai.com/docs/api-reference); an error
message echoes at most `MAX_ECHO_CHARS` of the input it refuses (`short`), and at most `MAX_MESSAGE_CHARS` in all.
"""

from __future__ import annotations

import reprlib
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minirt.request import RequestOutput, StreamDelta
from minirt.sampling import SamplingParams

TokenIds = list[int]

#: Characters of a refused value an error message shows (a 2 MB bad field must not come back whole).
MAX_ECHO_CHARS = 100
#: Characters of an error message at most, whatever it quotes.
MAX_MESSAGE_CHARS = 1000


def short(value, limit: int = MAX_ECHO_CHARS) -> str:
    """`repr(value)` cut to `limit` characters, with the whole size said: "'xxxx'... (2097152 characters)"."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    text = _REPR.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = MAX_ECHO_CHARS
_REPR.maxlist = _REPR.maxdict = 8


def _asks_nothing(value, noop: tuple) -> bool:
    """True for null and the values `noop` lists (a bool is not a number here: `false` is not `0`)."""
    return value is None or any(value == x and isinstance(value, bool) == isinstance(x, bool) for x in noop)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False     # vLLM's: usage in every chunk (refused when true)


class _SamplingFields(BaseModel):
    """The fields both endpoints share (OpenAI's defaults: temperature 1, top_p 1, n 1). Fields typed `Any` are
    the refused ones: `refuse_unsupported` checks their values against `REFUSED`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)                     # extension (vLLM, TGI): 0 = no limit
    ignore_eos: bool = False                                # extension (vLLM): generate max_tokens exactly
    stop_token_ids: list[int] | None = None                 # extension (vLLM): ids that end the answer
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None                                 # an end-user id for abuse monitoring: accepted
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    min_tokens: Any = None
    response_format: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        # OpenAI's SDK types make every optional field nullable ("temperature": null means the default)
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}
        return data

    @property
    def requested_max_tokens(self) -> int | None:
        """The answer's token limit the client asked for, if any (chat: `max_completion_tokens` first)."""
        return getattr(self, "max_completion_tokens", None) or self.max_tokens


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string or one list of token ids. Default max_tokens: 16 (OpenAI's)."""

    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class TextPart(BaseModel):
    """One part of a message's content; only {"type": "text", "text": ...} is taken (`ChatMessage.text`)."""

    model_config = ConfigDict(extra="allow")        # an image part's fields: refused by its type, by name

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message. `content`: a string, a list of text parts, or null (only on an assistant message)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None                    # an assistant's earlier calls, for the template
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        """The content as one string; raises RequestError naming `messages.<index>.content...`."""
        field = f"messages.{index}.content"
        if self.content is None:
            if self.role != "assistant":
                raise RequestError(field, f"{field}: is required for a {self.role!r} message (null only on assistant)")
            return ""
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise RequestError(f"{field}.{j}.type", f"{field}.{j}.type: only text parts are supported, got "
                                                        f"{short(part.type)}")
        return "\n".join(part.text for part in self.content)

    def for_template(self, index: int) -> dict:
        """The message as the chat template takes it: role, content as a string, and the other fields given."""
        extra = self.model_dump(exclude={"role", "content"}, exclude_none=True)
        return {"role": self.role, "content": self.text(index), **extra}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `messages` go through the tokenizer's chat template. `max_completion_tokens`
    is the newer name of `max_tokens`; without either, the answer may run to `max_model_len`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    prompt_cache_key: str | None = None                     # a caching hint: accepted
    safety_identifier: str | None = None                    # an end-user id: accepted


class RequestError(ValueError):
    """A request the server refuses: `param` is the offending field (OpenAI's error JSON names it)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


_NOT_SUPPORTED = "not supported by minirt's server"
#: The refused fields: the values that ask for nothing (these pass; null always does), and why any other is refused.
REFUSED: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "only n = 1 (one choice per request; send n requests)"),
    "presence_penalty": ((0,), _NOT_SUPPORTED), "frequency_penalty": ((0,), _NOT_SUPPORTED),
    "repetition_penalty": ((1,), _NOT_SUPPORTED), "logit_bias": (({},), _NOT_SUPPORTED),
    "min_p": ((0,), _NOT_SUPPORTED),
    "min_tokens": ((0,), "not supported by minirt's server (EOS cannot be held back yet)"),
    "response_format": (({"type": "text"},), "structured output (JSON mode, JSON schema) is not supported"),
    "skip_special_tokens": ((True,), "special tokens are always skipped in text"),
    "include_stop_str_in_output": ((False,), "stop strings are never included in text"),
    "logprobs": ((False,), _NOT_SUPPORTED), "top_logprobs": ((0,), _NOT_SUPPORTED),
    "echo": ((False,), _NOT_SUPPORTED), "suffix": (("",), _NOT_SUPPORTED), "best_of": ((1,), _NOT_SUPPORTED),
    "tools": (([],), "tool calling is not supported"), "tool_choice": (("none",), "tool calling is not supported"),
    "parallel_tool_calls": ((), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "store": ((False,), "stored completions are not supported"), "metadata": (({},), "metadata needs store"),
    "service_tier": (("auto", "default"), "one service tier"), "modalities": ((["text"],), "text only"),
    "audio": ((), "text only"), "prediction": ((), _NOT_SUPPORTED), "reasoning_effort": ((), _NOT_SUPPORTED),
    "web_search_options": ((), _NOT_SUPPORTED), "verbosity": ((), _NOT_SUPPORTED),
}


def refuse_unsupported(req: _SamplingFields) -> None:
    """Raise RequestError naming the first field that asks for something minirt does not do."""
    for name in REFUSED:
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        noop, why = REFUSED[name]
        if not _asks_nothing(value, noop):
            raise RequestError(name, f"{name}: {why}, got {short(value)}")
    if isinstance(req, CompletionRequest) and prompt_of(req) is not req.prompt and len(req.prompt) != 1:
        raise RequestError("prompt", f"prompt: one prompt per request (a string or one list of token ids), got "
                                     f"a list of {len(req.prompt)}")
    if req.stream_options is not None:
        if not req.stream:
            raise RequestError("stream_options", "stream_options: only allowed when stream is true")
        if req.stream_options.continuous_usage_stats:
            raise RequestError("stream_options.continuous_usage_stats",
                               f"stream_options.continuous_usage_stats: {_NOT_SUPPORTED}")


def prompt_of(req: CompletionRequest):
    """The one prompt of a completion request: a string or a list of token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return prompt


def sampling_params(req: _SamplingFields, max_tokens: int) -> SamplingParams:
    """The `SamplingParams` of a request whose answer may have `max_tokens` tokens. Raises ValueError naming
    the field (SamplingParams' own checks; `api_error` renames it to the API's field names)."""
    return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed, stop=() if req.stop is None else req.stop,
                          stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos)


def api_error(e: ValueError) -> RequestError:
    """An engine ValueError ("field: reason") as a RequestError in the API's names (max_new_tokens is
    max_tokens here; "prompt + max_new_tokens" is about the prompt's length)."""
    message = str(e).replace("max_new_tokens", "max_tokens")
    field = message.split(":", 1)[0]
    param = "prompt" if field.startswith("prompt") else field if field.isidentifier() else None
    return RequestError(param, message)


# ============================================================================ responses


def usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(output: RequestOutput, head: dict, chat: bool) -> dict:
    """The non-streamed answer: `head` holds id, created and model."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text}, "logprobs": None,
                  "finish_reason": output.finish_reason}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage(output)}
    choice = {"index": 0, "text": output.text, "logprobs": None, "finish_reason": output.finish_reason}
    return {**head, "object": "text_completion", "choices": [choice], "usage": usage(output)}


def delta_chunks(delta: StreamDelta, head: dict, chat: bool, first: bool, include_usage: bool) -> list[dict]:
    """The stream chunks (each one SSE `data:` payload) that one engine delta becomes, in order.

    A delta with text, or the last one, becomes one chunk: `choices[0]` holds the new text (`text`, or for
    chat `delta.content`, with `delta.role` = "assistant" in the first chunk) and `finish_reason` (None until
    the last). A delta without text (its tokens end inside a character, or may start a stop string) becomes
    nothing, except the first chat chunk, which announces the role. With `include_usage`, every chunk has
    `"usage": None` and the last delta adds one more chunk with no choices and the usage counts.
    `head` holds id, created and model. Shapes as OpenAI's (chat.completion.chunk, text_completion).
    """
    chunks = []
    if delta.text or delta.finished or (chat and first):
        if chat:
            body = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            if delta.finished and not delta.text and not first:
                body = {}
            choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}
        chunks.append({**chunk, "usage": None} if include_usage else chunk)
    if delta.finished and include_usage:
        chunks.append({**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [],
                       "usage": usage(delta.output)})
    return chunks


def error_body(message: str, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}; the message cut to
    `MAX_MESSAGE_CHARS` (whatever input it quotes), the param (a field's name, which a client chooses) to
    `MAX_ECHO_CHARS`."""
    if param is not None and len(param) > MAX_ECHO_CHARS:
        param = param[:MAX_ECHO_CHARS] + "..."
    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters)"
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
