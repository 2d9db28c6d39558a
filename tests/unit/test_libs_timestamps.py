from libs.timestamps import timestamp


def test_seconds_since_the_epoch_become_a_timestamp_to_the_nanosecond():
    stamp = timestamp(1_700_000_000.25)
    assert (stamp.seconds, stamp.nanos) == (1_700_000_000, 250_000_000)
    assert stamp.ToDatetime().timestamp() == 1_700_000_000.25


def test_a_fraction_that_rounds_up_to_a_whole_second_carries():
    stamp = timestamp(41.9999999999)
    assert (stamp.seconds, stamp.nanos) == (42, 0)
