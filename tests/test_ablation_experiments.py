"""attnkit/ablation/experiments.py: evaluating settings into a table, with paired bootstrap intervals of the
changes of the main metric."""
import numpy as np

from attnkit.ablation.experiments import Setting, run_settings
from attnkit.interventions import Intervention

from .synthetic import mean_scores


class FakeEvaluate:
    """Each setting's name says how many of 100 examples it gets right."""

    def __init__(self, hits):
        self.hits, self.last_examples, self.calls = hits, None, 0

    def __call__(self, iv):
        k = self.hits[self.calls]
        self.calls += 1
        v = (np.arange(100) < k).astype(float)
        self.last_examples = mean_scores(v)
        return {"accuracy": 100.0 * v.mean()}


def test_run_settings_adds_intervals():
    iv = Intervention(np.zeros((1, 2)))
    table = run_settings("t", [Setting("baseline", iv), Setting("same", iv), Setting("worse", iv)],
                         FakeEvaluate([80, 80, 60]), "accuracy", progress=False, n_boot=300)
    base, same, worse = table.rows
    assert base["delta_accuracy_lo"] == base["delta_accuracy_hi"] == 0.0
    assert same["delta_accuracy_lo"] == same["delta_accuracy_hi"] == 0.0
    assert worse["delta_accuracy_hi"] < 0 < -worse["delta_accuracy_lo"] and worse["delta_accuracy"] == -20.0
    assert worse["delta_accuracy_lo"] < -20 < worse["delta_accuracy_hi"]
    assert "delta_accuracy_lo" in table.to_markdown()
