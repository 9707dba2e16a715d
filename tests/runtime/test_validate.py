"""Input and output checks against declared tensor specs, symbol binding across inputs and outputs."""

from __future__ import annotations

import numpy as np
import pytest
from carton._runtime._validate import Checked, Signature
from carton.errors import InvalidInput, InvalidOutput
from carton_protocol import DType, TensorSpec


def ts(name: str, dtype: str, shape: object = "*") -> TensorSpec:
    return TensorSpec(name=name, dtype=DType(dtype), shape=shape)  # type: ignore[arg-type]


SIG = Signature(
    [ts("x", "float32", ("batch", 3)), ts("y", "int64", ("batch",)), ts("s", "string", ())],
    [ts("out", "float32", ("batch", "width")), ts("n", "int32", "*")],
)


def good_inputs(batch: int = 2) -> dict[str, object]:
    return {"x": np.zeros((batch, 3), np.float32), "y": np.arange(batch), "s": np.array("hi")}


def test_good_inputs_and_outputs() -> None:
    tensors, checked = SIG.prepare_inputs(good_inputs())
    assert set(tensors) == {"x", "y", "s"}
    assert checked.bindings["batch"].value == 2
    outputs = SIG.check_outputs({"out": np.ones((2, 7), np.float32), "n": np.int32(3)}, checked)
    assert outputs["n"].shape == ()  # numpy scalars become 0-d arrays
    assert checked.bindings["width"].value == 7


def test_a_layout_seen_before_is_held_to_the_same_rules() -> None:
    """Inputs and outputs whose names, dtypes and shapes passed once pass at once the next time (the per-call
    checks are remembered per layout); every other layout is still checked in full, on every call."""
    sig = Signature([ts("x", "float32", ("batch", 3))], [ts("y", "float32", ("batch", "width"))])
    for _ in range(3):
        tensors, checked = sig.prepare_inputs({"x": np.zeros((2, 3), np.float32)})
        assert list(tensors) == ["x"]
        assert sig.check_outputs({"y": np.zeros((2, 5), np.float32)}, checked)["y"].shape == (2, 5)
        # The same outputs after other inputs: "batch" is 4 now, so (2, 5) breaks it, cached or not.
        _, other = sig.prepare_inputs({"x": np.zeros((4, 3), np.float32)})
        with pytest.raises(InvalidOutput, match="symbol 'batch' is already 4"):
            sig.check_outputs({"y": np.zeros((2, 5), np.float32)}, other)
        with pytest.raises(InvalidInput, match="dimension 1 is 4"):
            sig.prepare_inputs({"x": np.zeros((2, 4), np.float32)})
        with pytest.raises(InvalidInput, match="has dtype float64"):
            sig.prepare_inputs({"x": np.zeros((2, 3), np.float64)})
        with pytest.raises(InvalidOutput, match="did not return output 'y'"):
            sig.check_outputs({}, checked)
        with pytest.raises(InvalidInput, match="object array"):
            sig.prepare_inputs({"x": np.zeros((2, 3), object)})


def test_a_reply_layout_passes_at_once_only_after_the_inputs_it_passed_after() -> None:
    """A reply read by a learnt plan comes with the plan, which stands for its layout: it passes at once after the
    same input layout, and is checked in full after any other (whose symbol bindings may differ)."""
    sig = Signature([ts("x", "float32", ("batch", 3))], [ts("y", "float32", ("batch", "width"))])
    plan = object()  # what the codec hands back: one object per reply layout
    _, checked = sig.prepare_inputs({"x": np.zeros((2, 3), np.float32)})
    assert checked.layout_key is not None
    assert sig.check_outputs({"y": np.zeros((2, 5), np.float32)}, checked, plan)["y"].shape == (2, 5)
    assert plan in checked.layout_key.replies
    _, again = sig.prepare_inputs({"x": np.zeros((2, 3), np.float32)})
    assert again.layout_key is checked.layout_key  # one entry per input layout: the key the codec looks up
    assert sig.check_outputs({"y": np.zeros((2, 5), np.float32)}, again, plan)["y"].shape == (2, 5)
    # Other inputs bind "batch" to 4: the same reply layout breaks it, and is not taken as known.
    _, other = sig.prepare_inputs({"x": np.zeros((4, 3), np.float32)})
    with pytest.raises(InvalidOutput, match="symbol 'batch' is already 4"):
        sig.check_outputs({"y": np.zeros((2, 5), np.float32)}, other, plan)
    # Inputs that are not all plain arrays have no layout key: a reply layout is never taken as known then.
    _, listed = sig.prepare_inputs([np.zeros((4, 3), np.float32)])
    assert listed.layout_key is None
    with pytest.raises(InvalidOutput, match="symbol 'batch' is already 4"):
        sig.check_outputs({"y": np.zeros((2, 5), np.float32)}, listed, plan)


def test_the_caller_dict_is_not_what_the_model_holds() -> None:
    inputs = {"x": np.zeros((2, 3), np.float32), "y": np.arange(2), "s": np.array("hi")}
    for _ in range(2):
        tensors, _ = SIG.prepare_inputs(inputs)
        assert tensors == inputs and tensors is not inputs


def test_positional_inputs_follow_declared_order() -> None:
    x, y, s = good_inputs().values()
    tensors, _ = SIG.prepare_inputs([x, y, s])
    assert tensors["x"] is x and tensors["y"] is y and tensors["s"] is s
    with pytest.raises(InvalidInput, match=r"the model takes 3 input\(s\) \('x', 'y', 's'\), but 2 were given"):
        SIG.prepare_inputs([x, y])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"z": np.zeros(1)}, "unknown input 'z'; the model's inputs are 'x', 'y', 's'"),
        ({"x": np.zeros((2, 3))}, "input 'x' has dtype float64, the model declares float32"),
        (
            {"x": np.zeros((2, 4), np.float32)},
            r"input 'x' dimension 1 is 4, the model declares 3 \(shape \['batch', 3\]\)",
        ),
        ({"x": np.zeros((2, 3, 1), np.float32)}, r"input 'x' has shape \(2, 3, 1\), the model declares 2 dimension"),
        (
            {"y": np.arange(5)},
            r"input 'y' dimension 0 is 5, but symbol 'batch' is already 2 \(from input 'x' dimension 0\)",
        ),
        ({"y": np.arange(2, dtype=np.int32)}, "input 'y' has dtype int32, the model declares int64"),
        ({"s": np.array(["a"])}, r"input 's' has shape \(1,\), the model declares a scalar: \[\]"),
        (
            {"s": np.array(b"a")},
            r"input 's' has dtype bytes, the model declares string \(strings are numpy str arrays\)",
        ),
        ({"s": "plain str"}, r"input 's' must be a numpy array .* got str; convert it with numpy.asarray"),
        ({"x": [[1.0, 2.0, 3.0]]}, "input 'x' is a list, so it must be a nested tensor .* element 0 is list"),
        ({"x": np.array([None, 1])}, "input 'x' is an object array"),
        ({1: np.zeros(1)}, "input names must be strings, got int 1"),
    ],
)
def test_bad_inputs(change: dict[object, object], message: str) -> None:
    inputs = good_inputs()
    inputs.update(change)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=message) as refused:
        SIG.prepare_inputs(inputs)
    named = next(iter(change))
    assert refused.value.tensor == (named if isinstance(named, str) else None)  # the tensor at fault, as a fact


def test_missing_input() -> None:
    inputs = good_inputs()
    del inputs["y"]
    with pytest.raises(InvalidInput, match=r"missing input 'y' \(the model's inputs are 'x', 'y', 's'\)") as refused:
        SIG.prepare_inputs(inputs)
    assert refused.value.tensor == "y"


def test_not_a_container() -> None:
    with pytest.raises(InvalidInput, match="inputs must be a dict of name -> tensor or a list in declared order, got"):
        SIG.prepare_inputs(np.zeros(3))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (
            {"out": np.ones((3, 7), np.float32), "n": np.int32(1)},
            r"output 'out' dimension 0 is 3, but symbol 'batch' is already 2 \(from input 'x' dimension 0\)",
        ),
        (
            {"out": np.ones((2, 7), np.float64), "n": np.int32(1)},
            "output 'out' has dtype float64, the model declares float32",
        ),
        ({"out": np.ones((2, 7), np.float32)}, "the runner did not return output 'n'"),
        (
            {"out": np.ones((2, 7), np.float32), "n": np.int32(1), "extra": np.ones(1)},
            "the runner returned output 'extra', which the model does not declare",
        ),
        ({"out": "nope", "n": np.int32(1)}, "output 'out' must be a numpy array"),
    ],
)
def test_bad_outputs(outputs: dict[str, object], message: str) -> None:
    _, checked = SIG.prepare_inputs(good_inputs())
    with pytest.raises(InvalidOutput, match=message):
        SIG.check_outputs(outputs, checked)


def test_whole_shape_symbol_and_star() -> None:
    sig = Signature([ts("a", "float32", "shape"), ts("b", "float32", "shape"), ts("c", "uint8", ("*", "*"))], [])
    a = np.zeros((2, 5), np.float32)
    sig.prepare_inputs({"a": a, "b": a, "c": np.zeros((1, 9), np.uint8)})
    with pytest.raises(InvalidInput, match=r"input 'b' shape is \(5, 2\), but symbol 'shape' is already \(2, 5\)"):
        sig.prepare_inputs({"a": a, "b": a.T.copy(), "c": np.zeros((1, 9), np.uint8)})
    with pytest.raises(InvalidInput, match="input 'c' has shape"):
        sig.prepare_inputs({"a": a, "b": a, "c": np.zeros(3, np.uint8)})


def test_nested_tensors() -> None:
    sig = Signature([ts("n", "float32", ("count", "*")), ts("k", "int32", ("count",))], [])
    nested = [np.zeros(2, np.float32), np.zeros(5, np.float32), np.zeros(1, np.float32)]
    sig.prepare_inputs({"n": nested, "k": np.zeros(3, np.int32)})
    with pytest.raises(InvalidInput, match=r"input 'k' dimension 0 is 2, but symbol 'count' is already 3"):
        sig.prepare_inputs({"n": nested, "k": np.zeros(2, np.int32)})
    with pytest.raises(InvalidInput, match="input 'n' element 1 has dtype float64"):
        sig.prepare_inputs({"n": [nested[0], np.zeros(1)], "k": np.zeros(2, np.int32)})
    with pytest.raises(InvalidInput, match=r"input 'n' element 0 has shape \(1, 1\), the model declares 1 dimension"):
        sig.prepare_inputs({"n": [np.zeros((1, 1), np.float32)], "k": np.zeros(1, np.int32)})
    sig.prepare_inputs({"n": [], "k": np.zeros(0, np.int32)})
    scalar = Signature([ts("v", "float32", ())], [])
    with pytest.raises(InvalidInput, match="declared a scalar, but a nested tensor"):
        scalar.prepare_inputs({"v": [np.zeros(1, np.float32)]})


def test_strings_and_byte_order() -> None:
    sig = Signature([ts("s", "string", ("n",)), ts("f", "float64", ("n",))], [])
    sig.prepare_inputs({"s": np.array(["é", "longer string"]), "f": np.zeros(2, ">f8")})


def test_undeclared_signature_passes_tensors_through() -> None:
    sig = Signature([], [])
    tensors, _ = sig.prepare_inputs({"anything": np.zeros(3, np.bool_), "nested": [np.zeros(1)]})
    assert set(tensors) == {"anything", "nested"}
    assert sig.check_outputs({"o": np.zeros(1)}, Checked({}, None))["o"].shape == (1,)
    with pytest.raises(InvalidInput, match="must be passed by name"):
        sig.prepare_inputs([np.zeros(1)])
    with pytest.raises(InvalidOutput, match="output 'o' must be a numpy array"):
        sig.check_outputs({"o": 3}, Checked({}, None))
