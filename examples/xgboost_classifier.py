"""An xgboost classifier end to end: train on synthetic rows with missing values, pack the model object (saved as
UBJSON, never pickled), load it, and compare with predict_proba in this process.

    pip install "carton-runtime[xgboost]" scikit-learn   # or, from a checkout: pip install -e ".[xgboost]" scikit-learn
    python examples/xgboost_classifier.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import carton
import numpy as np
import xgboost as xgb


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 6)).astype(np.float32)
    labels = (x[:, 0] + x[:, 1] * x[:, 2] > 0).astype(int)
    x[rng.random(x.shape) < 0.1] = np.nan  # missing values, handled as xgboost does (NaN = missing)
    classifier = xgb.XGBClassifier(n_estimators=50, max_depth=4).fit(x, labels)

    with tempfile.TemporaryDirectory() as tmp:
        # An in-memory model: the xgboost plugin writes model/model.ubj and records model_type = "classifier".
        packed = carton.pack(
            classifier,
            Path(tmp, "classifier.carton"),
            runner_name="xgboost",
            required_framework_version="*",
            model_name="classifier",
        )
        info = carton.get_model_info(packed)
        print(
            f"opts {dict(info.runner.opts)}; input {info.inputs[0].name} {info.inputs[0].shape}, "
            f"output {info.outputs[0].name} {info.outputs[0].shape}"
        )
        with carton.load(packed) as model:
            probabilities = model.infer({"x": x[:5]})["probabilities"]
    print("probabilities =\n", np.round(probabilities, 4))
    print(
        "bit-for-bit equal to predict_proba in this process:",
        np.array_equal(probabilities, classifier.predict_proba(x[:5])),
    )


if __name__ == "__main__":
    main()
