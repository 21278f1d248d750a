"""The one-machine cluster's CPU limits, without making a cluster: the CFS period chosen per share."""


def test_a_cpu_share_gets_a_short_period_the_kernel_accepts():
    from shoal.testbed.shape import cfs_period_us

    assert cfs_period_us(1) == cfs_period_us(0.5) == 5_000  # half a core: 2.5 ms of every 5
    # the kernel's smallest quota is 1 ms: a smaller share stretches the period instead
    assert cfs_period_us(0.05) == 20_000 and round(0.05 * cfs_period_us(0.05)) == 1_000
    assert round(0.01 * cfs_period_us(0.01)) >= 1_000
