"""The chunk kernels' overflowing-key flags: read once at the end of ``deferred_key_checks()``, or
later, when their copy has reached the host (the default outside such a block)."""

import pytest
import torch

from efla.ops import check_keys, deferred_key_checks
from efla.ops.cuda.key_checks import (
    check_flag_later,
    defer_key_check,
    immediate_key_checks,
    raise_earlier_overflows,
    read_each_call,
)


def raised_flag():
    return torch.ones(1, dtype=torch.int32)


def test_outside_a_block_the_caller_reads_the_flag():
    assert defer_key_check(raised_flag()) is False


def test_a_raised_flag_fails_the_block_at_its_end_and_is_reset():
    flag, clean = raised_flag(), torch.zeros(1, dtype=torch.int32)
    reached_end = False
    with pytest.raises(ValueError, match=r"^k: a key's squared norm \|\|k\|\|\^2 overflows float32"), deferred_key_checks():
        assert defer_key_check(clean) and defer_key_check(flag)
        reached_end = True
    assert reached_end and flag.item() == 0 and clean.item() == 0
    assert defer_key_check(flag) is False  # the block is closed


def test_clean_flags_pass_and_blocks_repeat():
    for _ in range(3):
        with deferred_key_checks():
            assert defer_key_check(torch.zeros(1, dtype=torch.int32))


def test_nested_blocks_leave_the_check_to_the_outermost():
    flag = raised_flag()
    with pytest.raises(ValueError), deferred_key_checks():
        with deferred_key_checks():
            defer_key_check(flag)
        assert flag.item() == 1  # the inner block's end read nothing
    assert flag.item() == 0


def test_a_block_failing_without_a_raised_flag_keeps_its_own_error():
    with pytest.raises(KeyError, match="its own"), deferred_key_checks():
        defer_key_check(torch.zeros(1, dtype=torch.int32))
        raise KeyError("its own")


def test_a_block_failing_after_an_overflow_names_the_overflow_as_the_root():
    # the NaN of an overflowing key can make a later layer fail first: the key error is raised,
    # with that failure as its cause, and the flag is reset for later calls
    flag = raised_flag()
    with pytest.raises(ValueError, match="overflows float32") as caught, deferred_key_checks():
        defer_key_check(flag)
        raise ValueError("hidden_states: contains 5 non-finite value(s) (NaN or Inf)")
    assert "non-finite" in str(caught.value.__cause__)
    assert flag.item() == 0
    with deferred_key_checks():
        pass


def test_immediate_checks_inside_a_block_leave_the_flag_to_the_call():
    flag = raised_flag()
    with deferred_key_checks():
        with immediate_key_checks():
            assert defer_key_check(flag) is False
        assert defer_key_check(torch.zeros(1, dtype=torch.int32))  # deferral resumes after it
    assert flag.item() == 1  # never handed over, so never read or reset by the block


def test_flags_are_per_thread():
    import threading

    seen = []
    with deferred_key_checks():
        worker = threading.Thread(target=lambda: seen.append(defer_key_check(raised_flag())))
        worker.start()
        worker.join()
    assert seen == [False]


def test_a_flag_checked_later_raises_at_the_next_read_and_is_reset():
    flag, clean = raised_flag(), torch.zeros(1, dtype=torch.int32)
    check_flag_later(clean)
    raise_earlier_overflows()
    check_flag_later(flag)
    with pytest.raises(ValueError, match="overflowed float32 .* in an earlier chunk call on this thread"):
        raise_earlier_overflows()
    assert flag.item() == 0
    raise_earlier_overflows()  # reset: later reads pass
    check_flag_later(flag)
    check_keys()


def test_check_keys_raises_for_a_flag_checked_later():
    flag = raised_flag()
    check_flag_later(flag)
    with pytest.raises(ValueError, match="in an earlier chunk call"):
        check_keys()
    check_keys()


def test_the_latest_copy_of_a_flag_stands_for_the_calls_before_it():
    flag = torch.zeros(1, dtype=torch.int32)
    check_flag_later(flag)
    flag.fill_(1)  # a later call's kernel sets it
    raise_earlier_overflows()  # the copy on the host is still the clean one
    check_flag_later(flag)
    with pytest.raises(ValueError):
        raise_earlier_overflows()


def test_a_block_read_resets_the_later_copy_too():
    # a flag set in a call outside a block and read at the end of a block (same per-stream flag)
    # raises once, not again at the next later read
    flag = raised_flag()
    check_flag_later(flag)
    with pytest.raises(ValueError, match="overflows float32"), deferred_key_checks():
        defer_key_check(flag)
    raise_earlier_overflows()


def test_each_call_reads_its_own_flag_with_sync_or_immediate_checks(switches):
    switches(EFLA_CHECK_KEYS=None)
    assert not read_each_call()
    with immediate_key_checks():
        assert read_each_call()
    assert not read_each_call()
    switches(EFLA_CHECK_KEYS="sync")
    assert read_each_call()
