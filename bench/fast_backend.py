"""A backend that costs nothing: for measuring what a router adds, not what a model costs.

`python fast_backend.py PORT` serves, over raw asyncio streams with keep-alive:
POST /v1/completions -> a small JSON completion at once, or with "stream": true, "chunks"
SSE events "gap_ms" apart (both from the body); GET /v1/models; GET /health. No
/metrics: llmhealth judges it by its tiny request (no_metrics), as it would a backend
that exports none. Prints "ready" when it listens.
"""

from __future__ import annotations

import asyncio
import json
import sys

COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "model": "tiny",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()


def _response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            target = head.split(b" ", 2)[1]
            if target.startswith(b"/v1/completions"):
                request = json.loads(body or b"{}")
                if request.get("stream"):
                    await _stream(writer, int(request.get("chunks", 20)), request.get("gap_ms", 10))
                    return  # connection: close after a stream, as the simulator does
                writer.write(_response("200 OK", COMPLETION))
            elif target.startswith(b"/v1/models"):
                writer.write(_response("200 OK", MODELS))
            elif target.startswith(b"/health"):
                writer.write(_response("200 OK", b""))
            else:
                writer.write(_response("404 Not Found", b'{"error": "not found"}'))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def _stream(writer: asyncio.StreamWriter, chunks: int, gap_ms: float) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"connection: close\r\n\r\n"
    )
    for index in range(chunks):
        if index:
            await asyncio.sleep(gap_ms / 1000)
        event = b'data: {"choices": [{"index": 0, "text": " ok"}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    await writer.drain()


async def main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
