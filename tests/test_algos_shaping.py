import pytest
import torch

from rollover.algos import overlong_penalty, truncated_mask


def test_overlong_penalty_by_hand():
    # max 20, buffer 4: free up to 16, linear to -1 at 20, -1 beyond
    lengths = torch.tensor([10, 16, 17, 19, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer_len=4), expected)
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer_len=4, penalty=0.5), expected / 2)


def test_overlong_penalty_dapo_values():
    lengths = torch.tensor([16384, 18432, 20480])
    torch.testing.assert_close(
        overlong_penalty(lengths, max_len=20480, buffer_len=4096), torch.tensor([0.0, -0.5, -1.0])
    )


def test_overlong_penalty_rejects_bad_buffers():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=0)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=11)


def test_truncated_mask_zeroes_whole_rows():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    out = truncated_mask(mask, torch.tensor([False, True, False]))
    torch.testing.assert_close(out, torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.float32))
    bool_out = truncated_mask(mask.bool(), torch.tensor([True, False, False]))
    assert bool_out.dtype == torch.bool
    assert bool_out.tolist() == [[False, False, False], [True, True, True], [True, False, False]]
    with pytest.raises(ValueError, match="truncated_B"):
        truncated_mask(mask, torch.tensor([True]))
