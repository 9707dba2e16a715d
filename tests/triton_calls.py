"""One inference through tritonclient's HTTP and gRPC clients, for the tests that check both protocols answer alike."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def infer_http(port: int, model: str, name: str, array: np.ndarray, datatype: str, output: str) -> np.ndarray:
    """`output` of `model` for input `name` = `array`, over HTTP with binary tensor data."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=True)
    result = client.infer(model, [tensor]).as_numpy(output)
    assert result is not None
    return result


def infer_grpc(port: int, model: str, name: str, array: np.ndarray, datatype: str, output: str) -> np.ndarray:
    """The same over gRPC."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    result = client.infer(model, [tensor]).as_numpy(output)
    assert result is not None
    return result
