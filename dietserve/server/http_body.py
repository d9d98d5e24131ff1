"""HTTP bodies for both HTTP APIs: reading one within ``--max-request-bytes``, JSON in and out."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..runtime.errors import InputError, RequestIncomplete, RequestTooLarge

JSON_TYPE = "application/json"
_PARSED_BODY = "dietserve.parsed_body"  # where read_object keeps a request's parsed body


async def read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The whole body, refused before it is read when its declared length is over ``limit``,
    as soon as it passes ``limit`` when it has no declared length (chunked), and after
    ``timeout`` seconds if it has not all arrived."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise RequestTooLarge(f"the request body is {declared} bytes, over this server's limit of {limit} "
                              "(--max-request-bytes)")
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        expected = f"of the {declared} its Content-Length declares " if declared is not None else ""
        raise RequestIncomplete(f"the request body did not arrive within {timeout:g} s: {request.content.total_bytes} "
                                f"bytes {expected}came") from None
    except web.HTTPRequestEntityTooLarge:
        raise RequestTooLarge(f"the request body is over this server's limit of {limit} bytes "
                              "(--max-request-bytes)") from None
    except HttpProcessingError as err:  # e.g. the connection ended before Content-Length bytes came
        raise InputError(f"the request body could not be read: {err.message}") from None


def parse_object(data: bytes | memoryview, what: str) -> dict:
    """``data`` as a JSON object; ``what`` names it in errors."""
    try:
        value = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{what} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise InputError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


async def read_object(request: web.Request, limit: int, timeout: float) -> tuple[dict, bytes]:
    """The body as a JSON object, and its bytes: read and parsed once per request, so a route that
    hands its request to another (TEI's ``POST /``) does not parse it again."""
    cached = request.get(_PARSED_BODY)
    if cached is None:
        body = await read_body(request, limit, timeout)
        cached = request[_PARSED_BODY] = (parse_object(body, "the request body"), body)
    return cached


def dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def json_response(value: object, status: int = 200) -> web.Response:
    return web.Response(body=dumps(value), status=status, content_type=JSON_TYPE)
