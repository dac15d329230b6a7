"""The feature order has one definition (attnkit/features.py); the C++/CUDA kernels read it through the
generated csrc/generated/feature_codes.h, which csrc/feature_slots.h static_asserts its names against."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from attnkit.features import ALL, CLS, KEEP, NO_INTER, feature_names, num_features

ROOT = Path(__file__).resolve().parent.parent


def test_generated_sources_are_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "generate_kernels.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_generated_codes_follow_features_py():
    text = (ROOT / "csrc" / "generated" / "feature_codes.h").read_text()
    codes = {m[0]: int(m[1]) for m in re.findall(r"constexpr int (\w+) = (-?\d+);", text)}
    names = feature_names(16)
    assert codes["CLS"] == CLS and codes["KEEP"] == KEEP and codes["ALL"] == ALL and codes["NO_INTER"] == NO_INTER
    assert codes["SLOT_SELF"] == names.index("self") and codes["SLOT_WIN_0"] == names.index("win_0")
    rows0 = names.index("win_15") + 1
    assert codes["ROW_ENTROPY"] == names.index("entropy") - rows0
    assert codes["ROW_CLS_ENTROPY"] == names.index("cls_entropy") - rows0
    assert rows0 + codes["NUM_ROW_SLOTS"] == num_features(16)


def test_kernels_use_named_slots():
    # no hard-coded "5 + N" slot arithmetic left in the kernels: they name csrc/feature_slots.h's slots
    for path in list((ROOT / "csrc").rglob("*.cpp")) + list((ROOT / "csrc").rglob("*.cu*")):
        assert not re.search(r"\b5 \+ (N|num_windows)\b", path.read_text()), path
