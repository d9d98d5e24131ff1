"""KServe v2 REST (the Open Inference protocol over HTTP) with Triton's binary tensor extension.

A request body is a JSON header, optionally followed by binary tensors: the header's length is
in ``Inference-Header-Content-Length``, and each input sent that way says its size in
``parameters.binary_data_size``. Answers are JSON, with each output as binary data where the
request asks (``binary_data`` on a requested output, or the ``binary_data_output`` request
parameter), as tritonclient.http does by default. The checks after parsing are ``codec``'s,
shared with gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from aiohttp import web

from .. import __version__
from ..runtime.errors import InputError
from ..runtime.request import EncoderRequest
from . import codec
from .http_body import dumps, json_response, parse_object, read_body
from .inference import Answer, Inference
from .model import ServedModel
from .servicer import EXTENSIONS, SERVER_NAME

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_TYPE = "application/octet-stream"
# JSON element kinds (numpy's) each v2 datatype accepts: integers for integer types, numbers for
# floating point ones, true/false for BOOL.
ELEMENT_KINDS = {"BOOL": ("b", "true or false")} | {
    name: ("iu", "integers") for name in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
} | {name: ("iuf", "numbers") for name in ("FP16", "FP32", "FP64")}


@dataclass(frozen=True)
class V2Request:
    id: str
    inputs: list[codec.InputTensor]
    outputs: list[str]
    binary_outputs: dict[str, bool] = field(default_factory=dict)  # what each requested output asks
    binary_by_default: bool = False  # the binary_data_output parameter
    truncate: bool | None = None

    def binary(self, output: str) -> bool:
        return self.binary_outputs.get(output, self.binary_by_default)


# ---------------------------------------------------------------------------- parsing


def _split(body: bytes, header_length: str | None) -> tuple[bytes | memoryview, memoryview]:
    if header_length is None:
        return body, memoryview(b"")
    try:
        length = int(header_length)
    except ValueError:
        raise InputError(f"header {HEADER_LENGTH} must be a number of bytes, got {header_length!r}") from None
    if not 0 <= length <= len(body):
        raise InputError(f"header {HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
    view = memoryview(body)
    return view[:length], view[length:]


def _flat(data: object) -> list:
    if not isinstance(data, list):
        return [data]
    return [item for element in data for item in _flat(element)]


def _json_values(name: str, datatype: str, data: object) -> Sequence:
    if not isinstance(data, list):
        raise InputError(f"input '{name}': data must be a JSON list, got {type(data).__name__}")
    if datatype == "BYTES":
        items = _flat(data)
        for item in items:
            if not isinstance(item, str):
                raise InputError(f"input '{name}': BYTES data must hold strings, got {type(item).__name__}")
        try:
            return [item.encode("utf-8") for item in items]
        except UnicodeEncodeError as err:
            raise InputError(f"input '{name}': a string is not valid Unicode: {err}") from None
    if datatype not in ELEMENT_KINDS:
        return ()  # decode_tensor names the unknown datatype
    try:
        array = np.asarray(data)
    except ValueError:
        raise InputError(f"input '{name}': data is a ragged nested list; rows must have equal lengths") from None
    kinds, what = ELEMENT_KINDS[datatype]
    if array.size and array.dtype.kind not in kinds:
        raise InputError(f"input '{name}' is {datatype}: its data must hold {what}, got {array.ravel()[0].tolist()!r}")
    return array.ravel()


JSON_NAMES = {str: "a string", list: "a list", dict: "an object"}


def _field(entry: dict, key: str, kind: type, where: str, required: bool = True):
    value = entry.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, kind):
        got = type(value).__name__ if value is not None else "nothing"
        raise InputError(f"{where}.{key} must be {JSON_NAMES[kind]}, got {got}")
    return value


def _input(entry: object, index: int, binary: memoryview, offset: int) -> tuple[codec.InputTensor, int]:
    where = f"inputs[{index}]"
    if not isinstance(entry, dict):
        raise InputError(f"{where} must be a JSON object")
    name = _field(entry, "name", str, where)
    datatype = _field(entry, "datatype", str, where)
    shape = _field(entry, "shape", list, where)
    if not all(isinstance(dim, int) and not isinstance(dim, bool) for dim in shape):
        raise InputError(f"input '{name}': shape must be a list of integers, got {shape}")
    parameters = _field(entry, "parameters", dict, where, required=False) or {}
    size = parameters.get("binary_data_size")
    if size is None:
        if "data" not in entry:
            raise InputError(f"input '{name}' has neither data nor parameters.binary_data_size")
        return codec.InputTensor(name, datatype, shape, values=_json_values(name, datatype, entry["data"])), offset
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InputError(f"input '{name}': binary_data_size must be a byte count, got {size!r}")
    if "data" in entry:
        raise InputError(f"input '{name}' has both data and binary_data_size; send one")
    if offset + size > len(binary):
        raise InputError(f"input '{name}' declares {size} bytes of binary data, but {len(binary) - offset} "
                         f"follow the JSON header ({HEADER_LENGTH})")
    return codec.InputTensor(name, datatype, shape, raw=bytes(binary[offset : offset + size])), offset + size


def _outputs(entries: object) -> tuple[list[str], dict[str, bool]]:
    if not isinstance(entries, list):
        raise InputError(f"outputs must be a JSON list, got {type(entries).__name__}")
    names, binary = [], {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise InputError(f"outputs[{index}] must be a JSON object")
        name = _field(entry, "name", str, f"outputs[{index}]")
        names.append(name)
        parameters = _field(entry, "parameters", dict, f"outputs[{index}]", required=False) or {}
        if "binary_data" in parameters:
            binary[name] = _bool(parameters["binary_data"], f"output '{name}': binary_data")
    return names, binary


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{what} must be true or false, got {value!r}")
    return value


def parse_request(body: bytes, header_length: str | None) -> V2Request:
    """A v2 REST infer body -> its inputs (binary data attached) and what the answer should be."""
    header, binary = _split(body, header_length)
    document = parse_object(header, "the request's JSON header" if header_length else "the request body")
    entries = document.get("inputs")
    if not isinstance(entries, list):
        raise InputError("the request needs 'inputs', a JSON list of tensors")
    inputs, offset = [], 0
    for index, entry in enumerate(entries):
        tensor, offset = _input(entry, index, binary, offset)
        inputs.append(tensor)
    if offset != len(binary):
        raise InputError(f"{len(binary) - offset} bytes of binary data follow the JSON header that no input claims")
    outputs, binary_outputs = _outputs(document.get("outputs", []))
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InputError(f"parameters must be a JSON object, got {type(parameters).__name__}")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InputError(f"id must be a string, got {type(request_id).__name__}")
    return V2Request(request_id, inputs, outputs, binary_outputs,
                     _bool(parameters.get("binary_data_output", False), "parameter binary_data_output"),
                     codec.check_truncate(parameters.get(codec.TRUNCATE_PARAMETER)))


# ---------------------------------------------------------------------------- answers


def encode_answer(answer: Answer, request: V2Request) -> web.Response:
    model, header_outputs, chunks = answer.model, [], []
    for name, array in answer.outputs.items():
        array = np.ascontiguousarray(array, dtype="<f4")
        entry: dict = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
        if request.binary(name):
            chunks.append(array.tobytes())
            entry["parameters"] = {"binary_data_size": len(chunks[-1])}
        else:
            entry["data"] = array.ravel().tolist()
        header_outputs.append(entry)
    document = {"model_name": model.name, "model_version": model.version, "outputs": header_outputs}
    if request.id:
        document["id"] = request.id
    header = dumps(document)
    if not chunks:
        return web.Response(body=header, content_type="application/json")
    return web.Response(body=b"".join([header, *chunks]), content_type=BINARY_TYPE,
                        headers={HEADER_LENGTH: str(len(header))})


def message_dict(message) -> dict:
    """A protobuf message as JSON values, 64-bit integers as numbers (as Triton's HTTP answers
    give them; protobuf's JSON mapping would give strings) and enums by name."""
    result = {}
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            result[descriptor.name] = {key: message_dict(item) if hasattr(item, "ListFields") else item
                                       for key, item in value.items()}
        elif descriptor.label == descriptor.LABEL_REPEATED:
            result[descriptor.name] = [_value(descriptor, item) for item in value]
        else:
            result[descriptor.name] = _value(descriptor, value)
    return result


def _value(descriptor, value):
    if descriptor.message_type is not None:
        return message_dict(value)
    if descriptor.enum_type is not None:
        return descriptor.enum_type.values_by_number[value].name
    return value


# ---------------------------------------------------------------------------- routes


class V2Routes:
    def __init__(self, core: Inference):
        self.core = core
        self.config = core.state.config

    def add_to(self, app: web.Application) -> None:
        router = app.router
        router.add_get("/v2/health/live", self.live)
        router.add_get("/v2/health/ready", self.ready)
        router.add_get("/v2", self.server_metadata)
        router.add_post("/v2/repository/index", self.repository_index)
        router.add_get("/v2/models/stats", self.statistics)
        for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            router.add_get(model, self.model_metadata)
            router.add_get(model + "/ready", self.model_ready)
            router.add_get(model + "/config", self.model_config)
            router.add_get(model + "/stats", self.statistics)
            router.add_post(model + "/infer", self.infer)

    @staticmethod
    def _name(request: web.Request) -> tuple[str, str]:
        return request.match_info.get("model", ""), request.match_info.get("version", "")

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.core.state.ready
        return json_response({"ready": ready}, 200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})

    async def model_ready(self, request: web.Request) -> web.Response:
        self.core.check_name(*self._name(request))
        ready = self.core.state.ready
        return json_response({"name": self._name(request)[0], "ready": ready}, 200 if ready else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        return json_response(message_dict(self.core.loaded(*self._name(request)).metadata()))

    async def model_config(self, request: web.Request) -> web.Response:
        model, config = self.core.loaded(*self._name(request)), self.config
        return json_response(message_dict(model.config(config.batching, config.max_queue_delay_ms)))

    async def statistics(self, request: web.Request) -> web.Response:
        name, version = self._name(request)
        models = [self.core.loaded(name, version)] if name else list(self.core.state.models.values())
        return json_response({"model_stats": [message_dict(model.statistics_proto()) for model in models]})

    async def repository_index(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.config.max_request_bytes, self.config.http_body_timeout_seconds)
        ready_only = False
        if body.strip():
            ready_only = _bool(parse_object(body, "the request body").get("ready", False), "ready")
        return json_response([{"name": m.name, "version": m.version, "state": m.state}
                              for m in self.core.repository_index(ready_only)])

    async def infer(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.config.max_request_bytes, self.config.http_body_timeout_seconds)
        answer, parsed = await self.core.infer(self._receive(request, body))
        large = answer.request.reply_bytes(answer.model.engine.output_shapes) > codec.INLINE_MESSAGE_BYTES
        return await self.core.off_loop(large, encode_answer, answer, parsed)

    async def _receive(self, request: web.Request, body: bytes) -> tuple[ServedModel, EncoderRequest, V2Request]:
        model = self.core.loaded(*self._name(request))
        large = len(body) > (codec.INLINE_TEXT_BYTES if model.takes_text else codec.INLINE_MESSAGE_BYTES)
        return await self.core.off_loop(large, self._decode, model, body, request.headers.get(HEADER_LENGTH))

    def _decode(self, model: ServedModel, body: bytes, header_length: str | None):
        parsed = parse_request(body, header_length)
        codec.check_shapes(parsed.inputs, model.engine, model.takes_text)
        how = codec.Decoding(model.engine, model.tokenizer, self.core.truncate(parsed.truncate),
                             pairs=codec.in_pairs(parsed.inputs))
        decoded = codec.decode_tensors(parsed.inputs)
        outputs = codec.requested_outputs(parsed.outputs, model.engine.output_shapes)
        return model, codec.encoder_request(decoded, outputs, how, parsed.id), parsed
