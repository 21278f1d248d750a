"""The buffer ZeRO 2/3's collective buffers borrow in turn on CPU (comm/lent_buffer.py): one borrower
at a time, back when its borrower says, grown to the largest request, never lent for another device."""

import torch

from shoal.comm.lent_buffer import LentBuffer


def test_one_borrower_at_a_time_until_it_is_back():
    buf = LentBuffer()
    a = buf.lend((4, 3), torch.float32, torch.device("cpu"))
    assert a.shape == (4, 3) and a.dtype == torch.float32 and buf.holds(a)
    assert buf.lend((4,), torch.float32, "cpu") is None  # out: the caller allocates its own
    assert not buf.holds(torch.empty(12))
    done = {"flag": False}
    buf.back_when(lambda: done["flag"])
    assert buf.lend((4,), torch.float32, "cpu") is None
    done["flag"] = True
    b = buf.lend((6,), torch.bfloat16, "cpu")  # the same bytes, another dtype
    assert b is not None and b.dtype == torch.bfloat16 and b.data_ptr() == a.data_ptr()
    buf.give_back()
    c = buf.lend((100,), torch.float32, "cpu")  # larger: the buffer grows
    assert c is not None and c.numel() == 100 and buf.holds(c) and not buf.holds(a)


def test_never_lent_for_another_device():
    buf = LentBuffer()
    assert buf.lend((4,), torch.float32, torch.device("meta")) is None
    assert buf.lend((4,), torch.float32, "cpu") is not None
