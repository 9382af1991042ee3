"""The worker API's one word for the member epoch (issue 34: ``generation`` named two
counters). ``ft.generation`` stays one release as an alias of ``ft.epoch`` that warns once."""

from __future__ import annotations

import types
import warnings

import pytest

from ftrun.worker import api


def test_generation_is_epoch_and_warns_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_GENERATION_WARNED", False)
    worker = types.SimpleNamespace(epoch=3)  # the property reads nothing else
    read = api.FaultTolerance.generation.fget
    assert read is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read(worker) == 3
        worker.epoch = 4
        assert read(worker) == 4
    assert [w.category for w in caught] == [FutureWarning]
    assert "use .epoch" in str(caught[0].message)
