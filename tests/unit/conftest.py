"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import tvm

from dietserve.compile.pipeline import fast_math_passes, legalize_passes
from dietserve.model.bert import BertModel, export_relax
from dietserve.model.checkpoint import Checkpoint
from dietserve.model.presets import resolve_model


@pytest.fixture(scope="session")
def legalized_minilm(tmp_path_factory: pytest.TempPathFactory) -> tvm.IRModule:
    """all-MiniLM-L6-v2 legalized and fused, as the link pass and the tuner's task extraction see
    it: PrimFuncs symbolic in batch and sequence length."""
    checkpoint = Checkpoint.open(resolve_model("default", tmp_path_factory.mktemp("cache"), 0))
    mod, _ = export_relax(BertModel(checkpoint.config, checkpoint.pooling), 8)
    with tvm.target.Target({"kind": "llvm"}):
        return tvm.transform.Sequential([*fast_math_passes(), *legalize_passes()])(mod)
