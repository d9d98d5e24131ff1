"""KServe's own gRPC client against a dietserve server; prints the outputs as JSON.

Runs in its own process: kserve's protocol module registers the same protobuf messages as
tritonclient's, which the test process has loaded.

    python kserve_infer.py HOST:PORT MODEL IDS_JSON
"""

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest


async def main(url: str, model: str, ids: list[list[int]]) -> None:
    client = InferenceGRPCClient(url, timeout=60)
    live, ready = await client.is_server_live(), await client.is_model_ready(model)
    array = np.array(ids, dtype=np.int64)
    typed = InferInput("input_ids", list(array.shape), "INT64", data=array.flatten().tolist())
    raw = InferInput("input_ids", list(array.shape), "INT64")
    raw.set_data_from_numpy(array, binary_data=True)
    results = {}
    for label, tensor in (("typed", typed), ("raw", raw)):
        response = await client.infer(InferRequest(model_name=model, infer_inputs=[tensor], request_id=label))
        results[label] = {output.name: output.as_numpy().tolist() for output in response.outputs}
        results[label]["id"] = response.id
    await client.close()
    print(json.dumps({"live": live, "ready": ready, "results": results}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
