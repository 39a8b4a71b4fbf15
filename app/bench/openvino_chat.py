"""A minimal OpenAI chat server over OpenVINO GenAI's LLMPipeline, for `specserve bench --against openvino`.

OpenVINO GenAI has no HTTP server of its own (OpenVINO Model Server is a separate product), so this HTTP layer is
ours: /health, and /v1/chat/completions greedy only, streamed or not, one generation at a time (LLMPipeline runs
one), the chat template applied by the pipeline's tokenizer, `prompt_lookup` turning on its prompt lookup
decoding. It runs in the OpenVINO anchor's own venv, as a script (`python openvino_chat.py --model DIR ...`), so it
imports nothing of specserve; `make_app` takes the generating function, so that it can be tried without OpenVINO.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

# Prompt lookup's settings: draft tokens per step, and the longest n-gram matched in the prompt.
LOOKUP_DRAFT_TOKENS = 5
LOOKUP_NGRAM = 3

# generate(messages, max_tokens, on_text) -> tokens generated; on_text receives each piece of text as decoded.
Generate = Callable[[list[dict[str, str]], int, Callable[[str], None]], int]


def make_app(generate: Generate, model_name: str) -> Any:
    """The FastAPI app: GET /health, POST /v1/chat/completions (400 with a JSON body for what it does not do)."""
    app = FastAPI()
    lock = threading.Lock()  # one generation at a time: the pipeline is not shared between requests

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON"}}, status_code=400)
        problem = _refuse(body)
        if problem:
            return JSONResponse({"error": {"message": problem}}, status_code=400)
        messages = [{"role": m["role"], "content": m["content"]} for m in body["messages"]]
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 128)
        created = int(time.time())
        if not body.get("stream"):
            parts: list[str] = []
            with lock:
                tokens = generate(messages, max_tokens, parts.append)
            return {
                "id": f"chatcmpl-{created}",
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)}}],
                "usage": {"completion_tokens": tokens},
            }
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _stream(generate, lock, messages, max_tokens, usage, model_name, created), media_type="text/event-stream"
        )

    return app


def _refuse(body: Any) -> str | None:
    """What in the request this server does not do, or None."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: a non-empty list is required"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "messages: each needs a string role and a string content"
    if body.get("temperature", 1.0) != 0:
        return "this bench server decodes greedily only: send temperature 0"
    known = {"messages", "max_tokens", "max_completion_tokens", "temperature", "stream", "stream_options", "model"}
    unknown = sorted(set(body) - known)
    if unknown:
        return f"not supported here: {', '.join(unknown)}"
    return None


def _stream(
    generate: Generate,
    lock: threading.Lock,
    messages: list[dict[str, str]],
    max_tokens: int,
    usage: bool,
    model_name: str,
    created: int,
) -> Iterator[bytes]:
    """The answer as server-sent events, each piece as the pipeline decodes it, generated in a thread of its own."""
    pieces: queue.Queue[tuple[str, Any]] = queue.Queue()

    def run() -> None:
        try:
            with lock:
                tokens = generate(messages, max_tokens, lambda text: pieces.put(("text", text)))
            pieces.put(("done", tokens))
        except Exception as exc:  # sent to the client as an error event
            pieces.put(("error", f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=run, daemon=True).start()

    def event(payload: dict[str, Any]) -> bytes:
        base = {"id": f"chatcmpl-{created}", "object": "chat.completion.chunk", "created": created}
        return b"data: " + json.dumps({**base, "model": model_name, **payload}).encode() + b"\n\n"

    yield event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    while True:
        kind, value = pieces.get()
        if kind == "text":
            if value:
                yield event({"choices": [{"index": 0, "delta": {"content": value}}]})
        elif kind == "error":
            yield event({"error": {"message": value}})
            break
        else:
            finish = "length" if value >= max_tokens else "stop"
            yield event({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            if usage:
                yield event({"choices": [], "usage": {"completion_tokens": value}})
            break
    yield b"data: [DONE]\n\n"


def pipeline_generate(model: str, threads: int, prompt_lookup: bool) -> Generate:
    """A Generate over OpenVINO GenAI's LLMPipeline on CPU for the exported model at `model`, `threads` inference
    threads, greedy, with prompt lookup decoding where asked."""
    import openvino_genai as ov_genai

    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads}
    if prompt_lookup:
        properties["prompt_lookup"] = True
    pipe = ov_genai.LLMPipeline(model, "CPU", **properties)
    tokenizer = pipe.get_tokenizer()

    def generate(messages: list[dict[str, str]], max_tokens: int, on_text: Callable[[str], None]) -> int:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        config = pipe.get_generation_config()
        config.max_new_tokens = max_tokens
        config.do_sample = False
        config.apply_chat_template = False  # applied above, as the chat route's template
        if prompt_lookup:
            config.num_assistant_tokens = LOOKUP_DRAFT_TOKENS
            config.max_ngram_size = LOOKUP_NGRAM

        def streamer(text: str) -> Any:
            on_text(text)
            return ov_genai.StreamingStatus.RUNNING

        # A list of one prompt gives DecodedResults, with the count; a bare string, only the text.
        result = pipe.generate([prompt], config, streamer)
        return int(result.perf_metrics.get_num_generated_tokens())

    return generate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model exported by optimum-cli export openvino")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--prompt-lookup", action="store_true", help="prompt lookup decoding")
    args = parser.parse_args(argv)
    import uvicorn

    generate = pipeline_generate(args.model, args.threads, args.prompt_lookup)
    uvicorn.run(make_app(generate, args.model), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
