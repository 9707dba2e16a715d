"""The statistics of ``ModelInfer`` calls: a version without batching is called directly (`ServedVersion.direct`) and
each call counted as one success or failure and one execution, whether its request was decoded in full or from a
learnt form, and a call refused after its model ran still counts the execution; a version that batches goes through
`ServedVersion.infer`, whose executions the batcher counts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from carton.server._grpc import GrpcService, message_type
from carton.server._grpc_plan import KnownRequest, RequestForms
from carton.server._repository import ModelRepository
from carton.server.errors import ServerError
from prometheus_client import generate_latest

from .in_process import in_process_app
from .test_http_fixed_heads import Echo

Request = message_type("ModelInferRequest")
Response = message_type("ModelInferResponse")


def _request(x: np.ndarray, *outputs: str) -> bytes:
    message = Request(model_name="echo", id="s")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=list(x.shape))
    for name in outputs:
        message.outputs.add(name=name)
    message.raw_input_contents.append(x.tobytes())
    return message.SerializeToString()  # type: ignore[no-any-return]


async def _calls(repository: ModelRepository, arrays: list[np.ndarray]) -> list[str]:
    """Each array sent as one ``ModelInfer`` asking for both outputs, parsed as the transport parses a connection's
    requests; what each call answered (its outputs' names, or the refusal's message)."""
    service = GrpcService(repository, server_version="t")
    forms = RequestForms(Request.FromString)
    answers = []
    for x in arrays:
        try:
            payload = await service.model_infer_serialized(forms.parse(_request(x, "OUTPUT0", "OUTPUT1")))
        except ServerError as exc:
            answers.append(str(exc))
        else:
            answers.append(",".join(output.name for output in Response.FromString(payload).outputs))
    return answers


def _counts(stats: dict[str, Any]) -> tuple[Any, ...]:
    inference = stats["inference_stats"]
    return (
        stats["execution_count"], stats["inference_count"], inference["success"]["count"], inference["fail"]["count"],
        inference["compute_infer"]["count"], [batch["compute_infer"]["count"] for batch in stats["batch_stats"]],
    )  # fmt: skip


def test_a_call_is_one_execution_counted_with_it_and_one_refused_after_the_model_ran_still_counts_it(
    tmp_path: Path,
) -> None:
    app, repository = in_process_app(tmp_path, ("echo",), lambda spec: Echo(), asyncio.run)
    try:
        served = repository.get("echo")
        assert served.direct is not None
        x = np.ones((1, 16), dtype=np.float32)
        # Decoded in full (the first request, which teaches the connection its form), then from the learnt form;
        # OUTPUT1 is left out by the model for a negative first element, which refuses the call after the model ran.
        answers = asyncio.run(_calls(repository, [-x, x, x, x, -x]))
        refused = "unexpected inference output 'OUTPUT1' for model 'echo'"
        assert answers == [refused, "OUTPUT0,OUTPUT1", "OUTPUT0,OUTPUT1", "OUTPUT0,OUTPUT1", refused]
        stats = served.stats.to_json()
        assert _counts(stats) == (5, 5, 3, 2, 5, [5])
        assert served.in_flight == 0
        # The same calls through `ServedVersion.infer` (the version's direct call taken away) count the same.
        served.direct = None
        asyncio.run(_calls(repository, [-x, x, x, x, -x]))
        assert _counts(served.stats.to_json()) == (10, 10, 6, 4, 10, [10])
        scrape = generate_latest(app.metrics.registry).decode()
        for line in (
            'carton_inference_requests_total{model="echo",outcome="success",version="1"} 6.0',
            'carton_inference_requests_total{model="echo",outcome="failure",version="1"} 4.0',
            'carton_inference_executions_total{model="echo",version="1"} 10.0',
            'carton_inference_request_duration_seconds_count{model="echo",version="1"} 10.0',
            'carton_inference_compute_duration_seconds_count{model="echo",version="1"} 10.0',
        ):
            assert line in scrape.splitlines()
    finally:
        asyncio.run(repository.close())


def test_a_known_request_reaches_the_model_directly(tmp_path: Path) -> None:
    # The probe stands in for the handle's `infer` where a call finds it: the version's direct call.
    _, repository = in_process_app(tmp_path, ("echo",), lambda spec: Echo(), asyncio.run)
    try:
        served = repository.get("echo")
        direct = served.direct
        assert direct is not None
        ran: list[bool] = []

        async def probe(inputs: dict[str, np.ndarray]) -> Any:
            ran.append(True)
            return await direct(inputs)

        served.direct = probe
        x = np.ones((1, 16), dtype=np.float32)
        forms = RequestForms(Request.FromString)
        forms.parse(_request(x, "OUTPUT0"))  # learnt from this one
        known = forms.parse(_request(x, "OUTPUT0"))
        assert isinstance(known, KnownRequest)
        service = GrpcService(repository, server_version="t")
        payload = asyncio.run(service.model_infer_serialized(known))
        np.testing.assert_array_equal(np.frombuffer(Response.FromString(payload).raw_output_contents[0], np.float32),
                                      x.ravel())  # fmt: skip
        assert ran == [True]
    finally:
        asyncio.run(repository.close())
