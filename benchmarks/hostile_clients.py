"""Hostile and careless clients against ``vlmspec serve``: what each gets, and what it costs the server.

The cases of issue #44's audit, each sent by a raw HTTP client (so bodies, headers and
hang-ups are exactly what a hostile client would send), each followed by a normal request
that must be answered as before. For each case: the expected answer, the observed one, and
the server process's peak resident memory above its level before the case (sampled every
20 ms). Every error body is also checked for a filesystem path or a traceback.

The same cases run in CI against an in-process server with small limits
(``tests/server/test_hostile.py``); here they run at the audit's sizes against a real
``vlmspec serve`` on the reference pair (or any ``--target``)::

    python -m benchmarks.hostile_clients --out docs/results/hostile_clients
    python -m benchmarks.hostile_clients --target tiny:qwen2_vl --drafter prompt-lookup --out runs/hostile-tiny

Writes ``hostile.json`` and ``hostile.md`` (case, expected, observed, peak RSS) into ``--out``.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.peer_process import PeakRSS
from vlmspec.server.limits import FLAGS, RequestLimits
from vlmspec.targets.inputs import ImageLimits

API_KEY = "hostile-suite-key"
NORMAL = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
# What no error body may contain: a traceback, a Python frame, a path on the server.
LEAKS = re.compile(r"Traceback|File \"|site-packages|\.py\b|(?<![\w.:/])/(?:root|home|tmp|work|usr|etc|var)/")


# ------------------------------------------------------------------------------------ the client
@dataclass
class Answer:
    """One HTTP exchange as the client saw it (status 0: the connection broke before an answer)."""

    status: int
    headers: dict[str, str]
    body: str
    seconds: float

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except json.JSONDecodeError:
            return {}

    @property
    def message(self) -> str:
        error = self.json().get("error") or {}
        return f"{error.get('message', '')} (param {error.get('param')})"


@dataclass
class Client:
    """Raw HTTP/1.1 to one server: bodies are sent in chunks and sending stops when the server answers."""

    url: str
    api_key: str | None = API_KEY
    timeout: float = 600.0

    def exchange(
        self,
        method: str,
        path: str,
        body: bytes | Iterable[bytes] = b"",
        *,
        length: int | None = None,
        chunked: bool = False,
        key: str | None | bool = True,
    ) -> Answer:
        """Send a request (``body`` whole, or in pieces, declared ``length`` long, or chunked) and read the answer."""
        parts = urllib.parse.urlsplit(self.url)
        tick = time.perf_counter()
        sock = socket.create_connection((parts.hostname, parts.port), timeout=self.timeout)
        try:
            pieces = [body] if isinstance(body, bytes) else body
            headers = {"Host": parts.netloc, "Content-Type": "application/json", "Connection": "close"}
            api_key = self.api_key if key is True else key or None
            if api_key:
                headers["Authorization"] = f"Bearer {api_key}"
            if chunked:
                headers["Transfer-Encoding"] = "chunked"
            elif method == "POST":
                headers["Content-Length"] = str(length if length is not None else len(body))
            head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
            sock.sendall(head.encode())
            for piece in pieces:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered before the whole body: stop sending, as a client should
                frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece
                try:
                    sock.sendall(frame)
                except (BrokenPipeError, ConnectionResetError):
                    break
            else:
                if chunked:
                    try:
                        sock.sendall(b"0\r\n\r\n")
                    except (BrokenPipeError, ConnectionResetError):
                        pass
            response = http.client.HTTPResponse(sock)
            try:
                response.begin()
                text = response.read().decode("utf-8", "replace")
            except (ConnectionResetError, http.client.HTTPException):
                return Answer(0, {}, "", time.perf_counter() - tick)
            return Answer(
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                text,
                time.perf_counter() - tick,
            )
        finally:
            sock.close()

    def chat(self, body: dict, **options) -> Answer:
        return self.exchange("POST", "/v1/chat/completions", json.dumps(body).encode(), **options)

    def get(self, path: str, **options) -> Answer:
        return self.exchange("GET", path, **options)


# ------------------------------------------------------------------------------------ payloads
@dataclass(frozen=True)
class Scale:
    """How big the hostile payloads are: the audit's sizes, or a CI run's."""

    many_images: int = 50  # images in one request (the audit: 50 PNGs of 3000 x 3000)
    image_side: int = 3000
    body_bytes: int = 300 * 1024 * 1024  # the audit's 300 MiB body
    long_prompt_words: int = 4000  # about as many tokens
    burst: int = 16  # short requests sent beside the long prompt
    stream_tokens: int = 2000  # max_tokens of the streams that fill the server or are abandoned


AUDIT_SCALE = Scale()
CI_SCALE = Scale(many_images=12, image_side=64, body_bytes=6 * 1024 * 1024, long_prompt_words=400, burst=2)


def png(width: int, height: int) -> bytes:
    """An all-black 1-bit PNG (kilobytes, whatever its pixels): tests/image_helpers' decompression bomb."""
    import struct
    import zlib

    scanline = b"\x00" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    pixels = b"".join(compressor.compress(scanline) for _ in range(height)) + compressor.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def pillow_image(kind: str) -> bytes:
    """A small image in a format the server must refuse (TIFF, ICO), made by Pillow."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buffer, kind)
    return buffer.getvalue()


EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\n%%EndComments\n"
    b"newpath 0 0 moveto 32 32 lineto stroke\nshowpage\n%%EOF\n"
)


def image_message(images: list[bytes], mime: str = "image/png", detail: str | None = None) -> dict:
    parts = [
        {
            "type": "image_url",
            "image_url": {
                "url": f"data:{mime};base64," + base64.b64encode(data).decode(),
                **({"detail": detail} if detail else {}),
            },
        }
        for data in images
    ]
    return {"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}


def ask(*messages: dict, **fields) -> dict:
    return {"messages": list(messages), "max_tokens": 8, "temperature": 0, **fields}


def body_pieces(total: int, piece: int = 1024 * 1024) -> Iterable[bytes]:
    """``total`` bytes of a JSON-looking body, made lazily (a 300 MiB body is never held by the client)."""
    head = b'{"messages": [{"role": "user", "content": "'
    yield head
    sent = len(head)
    while sent < total:
        size = min(piece, total - sent)
        yield b"a" * size
        sent += size


# ------------------------------------------------------------------------------------ the cases
@dataclass
class Limits:
    """The limits the server under test was started with."""

    request: RequestLimits = field(default_factory=RequestLimits)
    image: ImageLimits = field(default_factory=ImageLimits)
    max_places: int = 96  # --max-batch-size + --max-queued
    prompt_cap: int = 8191  # the prompt-token cap in force (RequestLimits.prompt_tokens of the model)
    longest_token: int = 128  # characters of the tokenizer's longest token


@dataclass
class Outcome:
    passed: bool
    observed: str
    answers: list[Answer]


@dataclass(frozen=True)
class Case:
    name: str
    expected: str
    run: Callable[[Client, Scale, Limits], Outcome]


def expect(answer: Answer, status: int, *names: str | tuple[str, ...], extra: bool = True) -> Outcome:
    """The answer has ``status`` and its error message or param names every one of ``names`` (a tuple: one of them)."""
    named = all(any(n in answer.body for n in ((name,) if isinstance(name, str) else name)) for name in names)
    observed = f"{answer.status}" + (f": {answer.message}" if answer.status >= 400 else "")
    return Outcome(answer.status == status and named and extra, observed[:200], [answer])


def many_images(client: Client, scale: Scale, limits: Limits) -> Outcome:
    images = [png(scale.image_side, scale.image_side)] * max(scale.many_images, limits.request.max_images + 1)
    return expect(client.chat(ask(image_message(images))), 400, FLAGS["max_images"])


def total_pixels(client: Client, scale: Scale, limits: Limits) -> Outcome:
    side = int(limits.image.max_pixels**0.5)  # each image at the per-image cap ...
    count = limits.request.max_total_pixels // side**2 + 1  # ... and together over the request's
    return expect(client.chat(ask(image_message([png(side, side)] * count))), 400, FLAGS["max_total_pixels"])


def huge_body(client: Client, scale: Scale, limits: Limits) -> Outcome:
    answer = client.exchange("POST", "/v1/chat/completions", body_pieces(scale.body_bytes), length=scale.body_bytes)
    return expect(answer, 413, FLAGS["max_body_bytes"])


def huge_chunked_body(client: Client, scale: Scale, limits: Limits) -> Outcome:
    answer = client.exchange("POST", "/v1/chat/completions", body_pieces(scale.body_bytes), chunked=True)
    return expect(answer, 413, FLAGS["max_body_bytes"])


def prompt_over_cap(client: Client, scale: Scale, limits: Limits) -> Outcome:
    words = limits.prompt_cap + 8  # "hello " is one token: over the cap (a cap of the context less one: over both)
    answer = client.chat(ask({"role": "user", "content": "hello " * words}))
    return expect(answer, 400, (FLAGS["max_prompt_tokens"], "the model's context"))


def prompt_too_long_to_tokenise(client: Client, scale: Scale, limits: Limits) -> Outcome:
    characters = limits.prompt_cap * limits.longest_token + 1  # refused from its length, never tokenised
    answer = client.chat(ask({"role": "user", "content": "x" * characters}))
    return expect(answer, 400, FLAGS["max_prompt_tokens"], "characters")


def burst_with_long_prompt(client: Client, scale: Scale, limits: Limits) -> Outcome:
    """The audit's memory case: short requests and one long prompt at once; all answered, within the limits."""
    words = min(scale.long_prompt_words, limits.prompt_cap // 2)
    bodies = [ask({"role": "user", "content": "hello " * words})] + [NORMAL] * scale.burst
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(client.chat, bodies))
    statuses = sorted({a.status for a in answers})
    return Outcome(statuses == [200], f"{len(answers)} answered: statuses {statuses}", answers)


def stop_count(client: Client, scale: Scale, limits: Limits) -> Outcome:
    stops = [f"s{i}" for i in range(limits.request.max_stop_strings + 1)]
    return expect(client.chat(ask(NORMAL["messages"][0], stop=stops)), 400, FLAGS["max_stop_strings"])


def stop_length(client: Client, scale: Scale, limits: Limits) -> Outcome:
    stop = "x" * (limits.request.max_stop_length + 1)
    return expect(client.chat(ask(NORMAL["messages"][0], stop=stop)), 400, FLAGS["max_stop_length"])


def tiny_temperature(temperature: float) -> Callable[[Client, Scale, Limits], Outcome]:
    def run(client: Client, scale: Scale, limits: Limits) -> Outcome:
        greedy = client.chat(NORMAL)
        answer = client.chat({**NORMAL, "temperature": temperature})
        same = _content(answer) == _content(greedy)
        outcome = expect(answer, 200, extra=same)
        outcome.observed += ", the greedy answer" if same else ", NOT the greedy answer"
        return outcome

    return run


def refused_field(name: str, value) -> Callable[[Client, Scale, Limits], Outcome]:
    def run(client: Client, scale: Scale, limits: Limits) -> Outcome:
        return expect(client.chat({**NORMAL, name: value}), 400, name)

    return run


def honoured(
    fields: dict, check: Callable[[dict, dict], bool], what: str
) -> Callable[[Client, Scale, Limits], Outcome]:
    """A field that must change the answer as it says (compared with the normal request's answer)."""

    def run(client: Client, scale: Scale, limits: Limits) -> Outcome:
        plain, answer = client.chat(NORMAL), client.chat({**NORMAL, **fields})
        ok = answer.status == 200 and check(plain.json(), answer.json())
        return Outcome(ok, f"{answer.status}, {what}" if ok else f"{answer.status}: {answer.body[:160]}", [answer])

    return run


def forced_token(plain: dict, biased: dict) -> bool:
    """logit_bias +100 on one token: every generated token is that one (a different answer from the plain one)."""
    usage = biased.get("usage", {})
    return biased["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"] and bool(usage)


def two_choices(plain: dict, answer: dict) -> bool:
    return [c["index"] for c in answer["choices"]] == [0, 1]


def image_format(data: bytes, mime: str) -> Callable[[Client, Scale, Limits], Outcome]:
    def run(client: Client, scale: Scale, limits: Limits) -> Outcome:
        return expect(client.chat(ask(image_message([data], mime))), 400, "PNG, JPEG, WebP, GIF, BMP")

    return run


def no_key(client: Client, scale: Scale, limits: Limits) -> Outcome:
    answers = [client.get("/v1/models", key=False), client.chat(NORMAL, key="wrong"), client.get("/metrics", key=False)]
    health = client.get("/health", key=False)
    statuses = [a.status for a in answers]
    ok = statuses == [401, 401, 401] and health.status == 200
    return Outcome(ok, f"{statuses}, /health {health.status}", [*answers, health])


def full_server(client: Client, scale: Scale, limits: Limits) -> Outcome:
    """Every place taken by long streams; the next request, with an image the server cannot read, gets 429 at once."""
    streams = [_open_stream(client, scale.stream_tokens) for _ in range(limits.max_places)]
    try:
        bad_image = ask(image_message([b"not an image" * 1000]))
        answer = client.chat(bad_image)  # 429 (not the image's 400): admission comes before any decoding
        outcome = expect(answer, 429, "at capacity", extra="retry-after" in answer.headers)
        outcome.observed += f", Retry-After {answer.headers.get('retry-after')}"
        return outcome
    finally:
        for sock in streams:
            sock.close()
        _wait_idle(client)


def abandoned_stream(client: Client, scale: Scale, limits: Limits) -> Outcome:
    """A stream read for a moment, then the client hangs up: freed by the next step, as /metrics shows."""
    before = _metric(client, "vlmspec_requests_total", 'finish_reason="abort"')
    sock = _open_stream(client, scale.stream_tokens, read=3)
    tick = time.perf_counter()
    sock.close()
    freed = _wait_idle(client)
    seconds = time.perf_counter() - tick
    aborted = _metric(client, "vlmspec_requests_total", 'finish_reason="abort"') - before
    ok = freed and aborted == 1
    return Outcome(ok, f"freed {seconds:.2f} s after the hang-up; /metrics: running 0, aborts +{aborted:.0f}", [])


CASES = [
    Case("many images in one request (the audit: 50)", f"400 naming {FLAGS['max_images']}", many_images),
    Case("images together over the pixel cap", f"400 naming {FLAGS['max_total_pixels']}", total_pixels),
    Case(
        "a body over the cap (the audit: 300 MiB; Content-Length)", f"413 naming {FLAGS['max_body_bytes']}", huge_body
    ),
    Case("a body over the cap (chunked)", f"413 naming {FLAGS['max_body_bytes']}", huge_chunked_body),
    Case(
        "a prompt over the token cap",
        f"400 naming {FLAGS['max_prompt_tokens']} (or the context, when the cap is the context's)",
        prompt_over_cap,
    ),
    Case("a text too long to tokenise", f"400 naming {FLAGS['max_prompt_tokens']}", prompt_too_long_to_tokenise),
    Case("short requests beside a long prompt", "200 for all", burst_with_long_prompt),
    Case("too many stop strings", f"400 naming {FLAGS['max_stop_strings']}", stop_count),
    Case("a long stop string", f"400 naming {FLAGS['max_stop_length']}", stop_length),
    Case("temperature 1e-45", "200, the greedy answer", tiny_temperature(1e-45)),
    Case("temperature 1e-300", "200, the greedy answer", tiny_temperature(1e-300)),
    Case("logit_bias", "200, honoured", honoured({"logit_bias": {"11": 100}}, forced_token, "the forced token")),
    Case("min_p", "200, honoured", honoured({"min_p": 0.2, "temperature": 0.8}, lambda p, a: True, "served")),
    Case("n = 2", "200, two choices", honoured({"n": 2, "temperature": 0.8, "seed": 1}, two_choices, "two choices")),
    Case(
        "response_format json_object",
        "400 naming response_format",
        refused_field("response_format", {"type": "json_object"}),
    ),
    Case("tools", "400 naming tools", refused_field("tools", [{"type": "function", "function": {"name": "f"}}])),
    Case("an unknown field", "400 naming it", refused_field("frobnicate", 1)),
    Case("an EPS image", "400, Ghostscript never run", image_format(EPS, "image/png")),
    Case("a TIFF image", "400", image_format(pillow_image("TIFF"), "image/tiff")),
    Case("an ICO image", "400", image_format(pillow_image("ICO"), "image/x-icon")),
    Case("no or a wrong API key", "401 (/health: 200)", no_key),
    Case("a full server", "429 with Retry-After, before decoding", full_server),
    Case("an abandoned stream", "freed within a step, /metrics shows it", abandoned_stream),
]


def _content(answer: Answer) -> str | None:
    choices = answer.json().get("choices") or [{}]
    return (choices[0].get("message") or {}).get("content")


def _open_stream(client: Client, max_tokens: int, read: int = 0) -> socket.socket:
    """A streaming request left open (``read`` of its events read): the socket, to close later."""
    parts = urllib.parse.urlsplit(client.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=client.timeout)
    body = json.dumps({**NORMAL, "max_tokens": max_tokens, "stream": True, "stop": None}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nAuthorization: Bearer {client.api_key}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    received = b""
    while received.count(b"data: ") < read:
        received += sock.recv(65536)
    return sock


def _metric(client: Client, name: str, labels: str = "") -> float:
    wanted = name + ("{" + labels + "}" if labels else "")
    for line in client.get("/metrics").body.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def _wait_idle(client: Client, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = client.get("/health", key=False).json()
        if health.get("active_requests") == 0 and _metric(client, "vlmspec_num_requests_running") == 0:
            return True
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------------------------ the run
def run_cases(client: Client, scale: Scale, limits: Limits, pid: int | None = None) -> list[dict]:
    """Every case, then a normal request; one row each (the peak RSS growth when ``pid`` is given)."""
    reference = client.chat(NORMAL)
    if reference.status != 200:
        raise SystemExit(f"the server does not answer a normal request: {reference.status} {reference.body[:200]}")
    rows = []
    for case in CASES:
        meter = PeakRSS(pid) if pid is not None else None
        tick = time.perf_counter()
        if meter is not None:
            with meter:
                outcome = case.run(client, scale, limits)
        else:
            outcome = case.run(client, scale, limits)
        seconds = time.perf_counter() - tick
        after = client.chat(NORMAL)
        leaked = [a.body[:200] for a in outcome.answers if a.status >= 400 and LEAKS.search(a.body)]
        rows.append(
            {
                "case": case.name,
                "expected": case.expected,
                "observed": outcome.observed,
                "passed": outcome.passed and not leaked,
                "leaks": leaked,
                "server_errors": sum(a.status >= 500 for a in outcome.answers),
                "seconds": round(seconds, 2),
                "peak_rss_growth_mib": None if meter is None else round(meter.growth_mib, 1),
                "normal_request_after": after.status == 200 and _content(after) == _content(reference),
            }
        )
        print(f"{case.name}: {rows[-1]['observed']} ({'ok' if rows[-1]['passed'] else 'FAILED'})", flush=True)
    return rows


def cli_cases() -> list[dict]:
    """``vlmspec serve`` with a numeric option out of range exits 2 before loading anything."""
    rows = []
    for flags in (["--default-max-tokens", "-5"], ["--default-max-tokens", "0"], ["--port", "0"]):
        command = [sys.executable, "-m", "vlmspec.cli", "serve", "--target", "tiny:qwen2_vl", *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        rows.append(
            {
                "case": f"vlmspec serve {' '.join(flags)}",
                "expected": "exit 2 naming the option",
                "observed": f"exit {done.returncode}: {message[:120]}",
                "passed": done.returncode == 2 and flags[0] in message,
                "leaks": [],
                "server_errors": 0,
                "seconds": None,
                "peak_rss_growth_mib": None,
                "normal_request_after": None,
            }
        )
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, idle_rss_mib: float) -> str:
    lines = [
        "# Hostile clients against `vlmspec serve`",
        "",
        f"Server: `vlmspec serve --target {args.target} --drafter {args.drafter} --max-batch-size "
        f"{args.max_batch_size} --max-queued {args.max_queued} --api-key ...`, its default limits otherwise; "
        f"resident memory at rest after a normal request: {idle_rss_mib:.0f} MiB. Peak RSS growth: the server "
        "process's peak resident memory during the case above its level just before it (sampled every 20 ms).",
        "",
        "| case | expected | observed | peak RSS growth | normal request after | ok |",
        "| --- | --- | --- | ---: | --- | --- |",
    ]
    for row in rows:
        rss = "" if row["peak_rss_growth_mib"] is None else f"{row['peak_rss_growth_mib']:+.0f} MiB"
        after = {True: "answered", False: "NOT answered", None: ""}[row["normal_request_after"]]
        observed = row["observed"].replace("|", "\\|")
        lines.append(
            f"| {row['case']} | {row['expected']} | {observed} | {rss} | {after} | {'yes' if row['passed'] else 'NO'} |"
        )
    failed = [row["case"] for row in rows if not row["passed"]]
    errors = sum(row["server_errors"] for row in rows)
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} cases as expected; {errors} answers with a 5xx."]
    if failed:
        lines.append(f"Not as expected: {', '.join(failed)}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import peer_logs_dir, prepare_out_dir, write_json, write_text
    from benchmarks.peer_process import vlmspec_serve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="reference")
    parser.add_argument("--drafter", default="reference")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-queued", type=int, default=4)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--scale", choices=("audit", "ci"), default="audit", help="the payloads' sizes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = prepare_out_dir(args.out)

    fake_bin = Path(tempfile.mkdtemp(prefix="vlmspec-hostile-"))
    marker = fake_bin / "gs-was-run"
    (fake_bin / "gs").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")  # a Ghostscript that tells on its caller
    (fake_bin / "gs").chmod(0o755)
    extra = ["--api-key", API_KEY, "--max-batch-size", str(args.max_batch_size), "--max-queued", str(args.max_queued)]
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"}
    server = vlmspec_serve(
        "server-hostile",
        target=args.target,
        dtype="float32",
        drafter=args.drafter,
        extra=extra,
        log_dir=peer_logs_dir(out, "servers"),
        port=args.port,
        env=env,
    ).launch()
    process = server.process
    try:
        server.wait_ready(timeout=900)
        client = Client(server.url)
        from vlmspec.loading import load_target

        target = load_target(args.target)
        limits = Limits(
            max_places=args.max_batch_size + args.max_queued,
            prompt_cap=RequestLimits().prompt_tokens(target.max_context),
            longest_token=max(map(len, target.tokenizer.get_vocab())),
        )
        del target
        client.chat(NORMAL)
        import psutil

        idle = psutil.Process(process.pid).memory_info().rss / 2**20
        rows = run_cases(client, AUDIT_SCALE if args.scale == "audit" else CI_SCALE, limits, pid=process.pid)
    finally:
        server.stop()
    for row in rows:
        if row["case"] == "an EPS image" and marker.exists():
            row["passed"], row["observed"] = False, row["observed"] + "; Ghostscript WAS run"
    rows += cli_cases()
    write_json(out / "hostile.json", {"target": args.target, "drafter": args.drafter, "cases": rows})
    write_text(out / "hostile.md", markdown(rows, args, idle))
    print(f"wrote {out / 'hostile.md'}")
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
