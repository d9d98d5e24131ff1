"""KServe's own REST client (v2 protocol) against a dietserve server; prints what it got as JSON.

Runs in its own process: kserve's protocol module registers the same protobuf messages as
tritonclient's, which the test process has loaded.

    python kserve_rest.py http://HOST:PORT MODEL IDS_JSON
"""

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig


async def main(url: str, model: str, ids: list[list[int]]) -> None:
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
    live, ready = await client.is_server_live(url), await client.is_server_ready(url)
    model_ready = await client.is_model_ready(url, model)
    array = np.array(ids, dtype=np.int64)
    as_json = InferInput("input_ids", list(array.shape), "INT64", data=array.flatten().tolist())
    binary = InferInput("input_ids", list(array.shape), "INT64")
    binary.set_data_from_numpy(array, binary_data=True)
    results = {}
    for label, tensor in (("json", as_json), ("binary", binary)):
        response = await client.infer(url, InferRequest(model_name=model, infer_inputs=[tensor], request_id=label),
                                      model_name=model)
        results[label] = {output.name: output.as_numpy().tolist() for output in response.outputs}
    await client.close()
    print(json.dumps({"live": live, "ready": ready, "model_ready": model_ready, "results": results}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
