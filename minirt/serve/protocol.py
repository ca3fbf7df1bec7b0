"""Chapter 08: the OpenAI API's shapes - requests in, responses and stream chunks out.

Requests are pydantic models of OpenAI's `/v1/completions` and `/v1/chat/completions` bodies (the fields a
client sends; unknown fields are ignored, as OpenAI-compatible servers do), plus two extensions vLLM has too:
`top_k` and `ignore_eos`. A field minirt does not support is refused by name when it asks for something
(`n > 1`, `logprobs`, penalties), never silently ignored. `sampling_params` turns a request into a
`minirt.SamplingParams`; `delta_chunks` turns one engine `StreamDelta` into the stream chunks OpenAI sends.
Responses are plain dicts in OpenAI's JSON shapes (platform.openai.com/docs/api-reference).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from minirt.request import RequestOutput, StreamDelta
from minirt.sampling import SamplingParams

TokenIds = list[int]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share (OpenAI's defaults: temperature 1, top_p 1, n 1)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)                     # extension (vLLM, TGI): 0 = no limit
    ignore_eos: bool = False                                # extension (vLLM): generate max_tokens exactly
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: a string or one list of token ids. Default max_tokens: 16 (OpenAI's)."""

    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `messages` go through the tokenizer's chat template. `max_completion_tokens`
    is the newer name of `max_tokens`; without either, the answer may run to `max_model_len`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None


class RequestError(ValueError):
    """A request the server refuses: `param` is the offending field (OpenAI's error JSON names it)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def refuse_unsupported(req: _SamplingFields) -> None:
    """Raise RequestError naming the first field that asks for something minirt does not do."""
    unsupported = {"n": req.n != 1, "presence_penalty": req.presence_penalty != 0,
                   "frequency_penalty": req.frequency_penalty != 0, "logit_bias": bool(req.logit_bias)}
    if isinstance(req, CompletionRequest):
        unsupported.update(logprobs=req.logprobs is not None, echo=req.echo, suffix=req.suffix is not None,
                           best_of=req.best_of not in (None, 1))
        if prompt_of(req) is not req.prompt:                # a list of prompts
            unsupported["prompt"] = len(req.prompt) != 1
    else:
        unsupported.update(logprobs=req.logprobs, top_logprobs=req.top_logprobs is not None, tools=bool(req.tools))
    for name, asked in unsupported.items():
        if asked:
            what = ("one prompt per request (a string or one list of token ids)" if name == "prompt" else
                    "only n = 1 (one choice per request; send n requests)" if name == "n" else
                    "not supported by minirt's server")
            raise RequestError(name, f"{name}: {what}, got {getattr(req, name)!r}")


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
                          ignore_eos=req.ignore_eos)


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
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
