"""Host-to-device uploads: the values, dtype and device of ``torch.tensor``, on every device this machine has."""

from __future__ import annotations

import pytest
import torch

from ead_llm.core.transfer import upload

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_upload_gives_the_values_dtype_and_device_of_a_plain_tensor(device: str) -> None:
    values = [[3, 1, 4], [1, 5, 9]]
    for dtype in (torch.long, torch.float32, torch.bool):
        out = upload(values, dtype, device)
        assert out.dtype == dtype and out.device.type == device
        assert torch.equal(out.cpu(), torch.tensor(values, dtype=dtype))
    assert upload([], torch.long, device).shape == (0,)


def test_ragged_values_are_refused_as_torch_refuses_them() -> None:
    with pytest.raises(ValueError, match="expected sequence of length"):
        upload([[1, 2], [3]], torch.long, "cpu")
