"""An OpenAI-compatible endpoint per agent episode, for agents that run as separate programs.

An agent (`rollover.envs.agent`) gets `client.base_url`, e.g.
`http://127.0.0.1:PORT/episodes/<token>/v1`: a program given that URL as its OpenAI base URL
(`openai.OpenAI(base_url=..., api_key="-")`, curl, any language's client) talks to the same
episode as `client.chat.completions.create` does. One server per process, on the agents' event
loop, bound to 127.0.0.1 on a free port, started with the first agent episode.

It serves `POST <base_url>/chat/completions` (JSON in, a chat completion out; keep-alive
connections; bodies with a Content-Length) and nothing else. A request the agent client would
refuse (`stream`, `n`, a second call while one waits, malformed messages or tools) is
answered 400 with the reason and fails the episode, as a raising in-process call fails it; the
same call again while it waits (a client retrying after its timeout) gets the same reply; a call
to an episode that has ended is answered 410; a request that is not HTTP this server reads (no
Content-Length, a bad header) is answered 400 or 411 and the connection closed. Starting it adds
127.0.0.1 to NO_PROXY, so clients of this process and its children reach it past an HTTP proxy.
Only standard-library asyncio streams: no web framework to install.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import asdict

MAX_BODY = 64 * 1024 * 1024


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AgentServer:
    """The process's endpoint: routes `/episodes/<token>/v1/chat/completions` to the episode's
    channel (`register`)."""

    def __init__(self):
        self.channels: dict = {}  # token -> the episode's _Channel
        self.server: asyncio.AbstractServer | None = None
        self.port: int | None = None

    async def start(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            for key in ("NO_PROXY", "no_proxy"):  # a proxy between an agent and this endpoint would break it
                hosts = [h for h in os.environ.get(key, "").split(",") if h]
                if "127.0.0.1" not in hosts:
                    os.environ[key] = ",".join(hosts + ["127.0.0.1"])

    def url(self, token: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{token}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await self._read(reader)
                except _HTTPError as e:  # not HTTP this server reads: answered, the connection closed
                    return await self._send(writer, e.status, {"error": {"message": str(e)}}, close=True)
                if request is None:
                    return
                method, path, headers, body = request
                status, payload = await self._answer(method, path, body)
                await self._send(writer, status, payload)
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader):
        """(method, path, headers, body) of the next request; None at the end of the connection."""
        try:
            line = await reader.readline()
            if not line:
                return None
            method, path, _ = (line.decode("latin-1").split(" ", 2) + ["", ""])[:3]
            headers = {}
            while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = h.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
        except (ValueError, asyncio.LimitOverrunError) as e:  # a line past the stream's limit
            raise _HTTPError(400, f"unreadable request: {e}") from None
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise _HTTPError(411, "send the body with a Content-Length (chunked bodies are not read)")
        length = headers.get("content-length", "0") or "0"
        if not length.isdigit():
            raise _HTTPError(400, f"bad Content-Length {length!r}")
        if int(length) > MAX_BODY:
            raise _HTTPError(413, "request body too large")
        return method, path, headers, (await reader.readexactly(int(length)) if int(length) else b"")

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        parts = path.split("?")[0].strip("/").split("/")
        if len(parts) != 5 or parts[0] != "episodes" or parts[2:] != ["v1", "chat", "completions"]:
            return 404, {"error": {"message": f"no such endpoint: {path} (POST <base_url>/chat/completions)"}}
        if method != "POST":
            return 405, {"error": {"message": f"{method} {path}: only POST"}}
        channel = self.channels.get(parts[1])
        if channel is None or channel.ended is not None:  # (unknown tokens too: nothing to tell them apart by)
            return 410, {"error": {"message": "this episode has ended"}}
        try:
            request = json.loads(body or b"{}")
            if not isinstance(request, dict):
                raise _HTTPError(400, "the body must be a JSON object")
            arguments = {k: v for k, v in request.items() if k not in ("messages", "model", "tools")}
            completion = await channel.call(request.get("messages"), request.get("tools"), **arguments)
        except asyncio.CancelledError:
            return 410, {"error": {"message": "this episode has ended"}}
        except (ValueError, RuntimeError, TypeError, _HTTPError) as e:  # the agent's mistake: it fails its episode too
            channel.fail(e if not isinstance(e, _HTTPError) else ValueError(str(e)))  # (a call's own already did)
            return getattr(e, "status", 400), {"error": {"message": str(e)}}
        return 200, asdict(completion)

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, payload: dict, close: bool = False) -> None:
        data = json.dumps(payload).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 410: "Gone",
                  411: "Length Required", 413: "Payload Too Large"}[status]
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                     f"\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n".encode() + data)
        await writer.drain()
