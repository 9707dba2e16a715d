"""Runner option ``processes``: one model split across the runner process and forked helpers (``_shards``)."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import carton
import numpy as np
import pytest
from carton.mcf import MCFError, MCFFile, payload_layout
from carton_protocol import InvalidOption
from carton_runner_mcf._config import DecoderConfig
from carton_runner_mcf._shards import (
    Exchange,
    ShardFailed,
    plan_shards,
    read_message,
    shared_block,
    write_message,
)
from mcf_runner_models import infer_logits, load_runner, max_relative_error
from serving_process import descendants

pytestmark = pytest.mark.skipif(
    os.uname().sysname != "Linux" or os.uname().machine not in ("x86_64", "AMD64"),
    reason="processes > 1 needs Linux on x86-64",
)

IDS = np.random.default_rng(3).integers(0, 512, size=(2, 20), dtype=np.int64)
MASK = np.ones(IDS.shape, dtype=np.int64)
MASK[1, :6] = 0  # a left-padded row


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


# --- the split ---------------------------------------------------------------------------------------------------
def _config(**changes: object) -> DecoderConfig:
    base = DecoderConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling_factor=1.0, max_position_embeddings=2048,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_ids=(),
        pad_token_id=None, model_type="llama",
    )  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_plan_covers_every_row_once_and_balances_weights(count: int):
    config = _config()
    plans = plan_shards(config, count)
    for field, size in (("kv_heads", 3), ("mlp_rows", 1536), ("vocab_rows", 49152)):
        bounds = [getattr(plan, field) for plan in plans]
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), field
        assert all(start < stop for start, stop in bounds), field
    assert all(plan.mlp_rows[0] % 32 == 0 for plan in plans)
    # SmolLM2's 3 kv heads over 2 processes: 1 and 2 heads; the MLP rows make up for it.
    per_kv_head, per_mlp_row = 64 * 576 * (2 * 3 + 2), 3 * 576
    weights = [
        (p.kv_heads[1] - p.kv_heads[0]) * per_kv_head + (p.mlp_rows[1] - p.mlp_rows[0]) * per_mlp_row for p in plans
    ]
    # As even as whole blocks of 32 MLP rows allow.
    assert max(weights) - min(weights) <= 32 * per_mlp_row
    if count == 2:
        assert [p.kv_heads for p in plans] == [(0, 1), (1, 3)]
        assert plans[0].mlp_rows[1] - plans[0].mlp_rows[0] > plans[1].mlp_rows[1] - plans[1].mlp_rows[0]


@pytest.mark.parametrize(
    ("changes", "count", "message"),
    [
        ({}, 4, r"processes=4: the model has 3 kv head\(s\) and every process needs at least one"),
        ({"num_heads": 3, "num_kv_heads": 3, "head_dim": 48}, 2, r"span 48 values .* not a multiple of 32"),
        ({"intermediate_size": 63}, 2, r"intermediate_size 63 is too small to give every process 32 MLP rows"),
    ],
)
def test_plans_that_cannot_be_made_name_the_limit(changes: dict[str, object], count: int, message: str):
    with pytest.raises(InvalidOption, match=message):
        plan_shards(_config(**changes), count)


# --- exchanges between real processes ------------------------------------------------------------------------------
def _run_peer(block, index: int, count: int, slot: int, parts: list[np.ndarray], widths: list[int]) -> None:
    """Shard ``index`` of a test exchange, in a forked child: allreduce every part, then gather its own."""
    code = 1
    parent = os.getppid()

    def alive() -> None:
        if os.getppid() != parent:
            os._exit(1)

    try:
        exchange = Exchange(block, count=count, index=index, slot_floats=slot, alive=alive)
        for part in parts:
            exchange.allreduce(part * (index + 1))
        exchange.gather(np.full((3, widths[index]), index, np.float32), widths)
        code = 0
    finally:
        os._exit(code)


def test_allreduce_and_gather_across_processes_with_transfers_larger_than_a_slot():
    count, slot = 3, 64
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(shape).astype(np.float32) for shape in ((1, 5), (4, 50), (2, 100))]
    widths = [40, 60, 30]  # a row of logits fits a slot: exchange_floats sees to it
    block = shared_block(count, slot)
    children = []
    for index in (1, 2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child leaves through os._exit
            _run_peer(block, index, count, slot, parts, widths)
        children.append(pid)
    statuses: dict[int, int] = {}

    def alive() -> None:  # a peer may finish first; one that failed must not leave this test spinning
        for pid in children:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
                    assert status == 0, f"peer {pid} failed (wait status {status})"

    exchange = Exchange(block, count=count, index=0, slot_floats=slot, alive=alive)
    for part in parts:
        total = exchange.allreduce(part)
        assert total.shape == part.shape
        # Added in shard order: part + 2 part + 3 part, exactly as every shard adds it.
        np.testing.assert_array_equal(total, (part + part * np.float32(2)) + part * np.float32(3))
    whole = exchange.gather(np.zeros((3, widths[0]), np.float32), widths)
    assert whole is not None and whole.shape == (3, 130)
    np.testing.assert_array_equal(whole[0], np.repeat([0, 1, 2], widths).astype(np.float32))
    for pid in children:
        if pid not in statuses:
            statuses[pid] = os.waitpid(pid, 0)[1]
    assert list(statuses.values()) == [0, 0]


def test_command_frames_are_a_little_endian_header_and_the_payload():
    read_end, write_end = os.pipe()
    try:
        write_message(write_end, 3, b"\x01\x02\x03")
        write_message(write_end, 5)
        assert os.read(read_end, 100) == b"\x03\x00\x00\x00\x03\x00\x00\x00\x01\x02\x03\x05\x00\x00\x00\x00\x00\x00\x00"
        write_message(write_end, 7, bytes(range(10)))
        assert read_message(read_end) == (7, bytes(range(10)))
        os.write(write_end, b"\x01\x00\x00\x00\x09\x00\x00\x00abc")  # a frame cut short by the writer's death
        os.close(write_end)
        write_end = -1
        assert read_message(read_end) is None
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


# --- the runner --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "method", "processes"),
    [("base", None, 2), ("base", "q4", 2), ("base", "k6", 2), ("biased", None, 3), ("biased", "q8", 2)],
)
def test_split_logits_equal_one_process(name: str, method: str | None, processes: int, mcf_model: Callable[..., Path]):
    folder = mcf_model(name, method)
    single = load_runner(folder)
    split = load_runner(folder, processes=processes)
    try:
        assert len(split._loaded.model.helper_pids) == processes - 1  # type: ignore[union-attr]
        inputs = {"input_ids": IDS, "attention_mask": MASK}
        # Equal up to the order in which partial sums of o and down are added: float32 rounding, which the compiled
        # kernels' int16 rounding of the next layer's activations can turn into a step of 1/65534 of a block's
        # largest value here and there.
        assert max_relative_error(split.infer(inputs)["logits"], single.infer(inputs)["logits"]) < 1e-4
    finally:
        single.close()
        split.close()


def test_split_generation_equals_one_process(mcf_model: Callable[..., Path]):
    folder = mcf_model("base", "q8")
    options = {"mode": "generate", "max_new_tokens": 12, "stop_at_eos": False}
    single, split = load_runner(folder, **options), load_runner(folder, processes=2, **options)
    try:
        inputs = {"input_ids": IDS, "attention_mask": MASK}
        np.testing.assert_array_equal(split.infer(inputs)["output_ids"], single.infer(inputs)["output_ids"])
        sampled = inputs | {"temperature": np.array(0.8, np.float32), "seed": np.array(5)}
        np.testing.assert_array_equal(split.infer(sampled)["output_ids"], single.infer(sampled)["output_ids"])
    finally:
        single.close()
        split.close()


def test_close_ends_every_helper(mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("biased"), processes=3)
    helpers = runner._loaded.model.helper_pids  # type: ignore[union-attr]
    assert len(helpers) == 2 and set(helpers) <= descendants(os.getpid())
    runner.close()
    assert all(_gone(pid) for pid in helpers)
    runner.close()  # twice is harmless


def test_a_killed_helper_fails_the_next_call_with_its_fate(mcf_model: Callable[..., Path]):
    runner = load_runner(mcf_model("base", "q4"), processes=2)
    try:
        (helper,) = runner._loaded.model.helper_pids  # type: ignore[union-attr]
        os.kill(helper, signal.SIGKILL)
        message = rf"shard process 1 \(pid {helper}\) was killed by SIGKILL.*load the model again"
        with pytest.raises(ShardFailed, match=message):
            runner.infer({"input_ids": IDS})
        with pytest.raises(ShardFailed, match=message):  # and every call after it, at once
            runner.infer({"input_ids": IDS})
    finally:
        runner.close()


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"processes": 0}, r"runner option 'processes' must be >= 1, got 0"),
        ({"processes": "2"}, r"runner option 'processes' must be int, got '2'"),
        ({"processes": 2, "weight_cache": "packed"}, r"processes=2 needs weight_cache 'int8' or 'fp32' without"),
    ],
)
def test_bad_processes_options_are_refused_at_load(
    opts: dict[str, object], message: str, mcf_model, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("CARTON_MCF_KERNELS", "numpy")  # the compiled kernels multiply parts of packed payloads
    with pytest.raises(InvalidOption, match=message):
        load_runner(mcf_model("base"), **opts)


def test_more_processes_than_kv_heads_is_refused_before_any_fork(mcf_model: Callable[..., Path]):
    before = descendants(os.getpid())
    with pytest.raises(InvalidOption, match=r"processes=2: the model has 1 kv head\(s\)"):
        load_runner(mcf_model("tied_linear"), processes=2)
    assert descendants(os.getpid()) == before


def test_a_bad_tensor_in_a_helpers_rows_fails_the_load_with_its_name(mcf_model: Callable[..., Path], tmp_path):
    """Only the helper reads the broken rows (the last rows of layer 0's gate_proj); its error comes back as the
    same MCFError the runner would raise itself, and no helper is left behind."""
    folder = tmp_path / "broken"
    folder.mkdir()
    source = mcf_model("base", "q8") / "model.mcf"
    data = bytearray(source.read_bytes())
    name = "model.layers.0.mlp.gate_proj.weight"
    with MCFFile.open(source) as mcf:
        entry = mcf.tensors[name]
        layout = payload_layout(entry.method, *entry.shape)
    last_row_scale = entry.data_offset + layout.scales.offset + (entry.shape[0] - 1) * 2 * layout.blocks_per_row
    data[last_row_scale : last_row_scale + 2] = b"\x00\x7c"  # fp16 +inf
    (folder / "model.mcf").write_bytes(bytes(data))
    before = descendants(os.getpid())
    with pytest.raises(MCFError, match=rf"tensor {name!r}: q8 payload: block scale #\d+ is not finite"):
        load_runner(folder, processes=2)
    time.sleep(0.1)
    assert descendants(os.getpid()) == before


def test_split_model_out_of_process_and_its_helpers_die_with_the_runner(mcf_model: Callable[..., Path], tmp_path):
    folder = mcf_model("base", "k4")
    path = carton.pack(
        folder, tmp_path / "split.carton", runner_name="mcf", required_framework_version=">=0.1",
        runner_opts={"processes": 2},
    )  # fmt: skip
    before = descendants(os.getpid())
    with carton.load(path) as model:
        logits = model.infer({"input_ids": IDS})["logits"]
        assert (
            max_relative_error(logits, infer_logits(folder, {"input_ids": IDS})) < 1e-4
        )  # as in test_split_logits_equal_one_process
        started = descendants(os.getpid()) - before
        # The runner and its helper (a sandbox may add a process between them and us).
        runners = [pid for pid in started if any(child in started for child in descendants(pid))]
        helper_parent = min(runners, key=lambda pid: len(descendants(pid)))
        (helper,) = descendants(helper_parent)
        os.kill(helper_parent, signal.SIGKILL)
        assert _gone(helper)  # the helper dies with its parent (PR_SET_PDEATHSIG)
        # The host starts the runner again for the next call; a call that races the host noticing the death gets
        # a clear RunnerCrashed instead.
        try:
            again = model.infer({"input_ids": IDS})["logits"]
        except carton.RunnerCrashed:
            again = model.infer({"input_ids": IDS})["logits"]
        np.testing.assert_array_equal(again, logits)
