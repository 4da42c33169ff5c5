"""Hardware tests run the doctor first (tools/doctor.py): a model test whose device failed an
earlier bring-up stage is skipped with the doctor's reason (the stage, the call, its errno or
status and what to check next) instead of failing somewhere inside a whole model."""
from __future__ import annotations

import pytest

from tools import doctor

SIMULATOR = {"qcom": "KEEL_KGSL", "dsp": "KEEL_FASTRPC", "amd": "KEEL_USB"}
_verdicts: dict[str, str | None] = {}


def doctor_gate(device: str) -> None:
    """Skip with the doctor's reason unless every stage before `<device>.model` passed; the
    doctor runs once per device and session, on the hardware (simulator variable unset)."""
    if device not in _verdicts:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(SIMULATOR[device], raising=False)
            _verdicts[device] = doctor.verdict(device)
    if _verdicts[device]:
        pytest.skip(_verdicts[device])


@pytest.fixture
def doctor_qcom():
    doctor_gate("qcom")


@pytest.fixture
def doctor_dsp():
    doctor_gate("dsp")


@pytest.fixture
def doctor_amd():
    doctor_gate("amd")
